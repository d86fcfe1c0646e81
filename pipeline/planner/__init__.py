"""What a model needs before anything is loaded, from config.json alone (no MLX): per-family tensor
shapes, bytes as held in memory, the cluster speed model and the report of `pipeline plan`
(plan.py), a rank's bytes counted one way for plan, preflight and the stats line (memory.py),
layer ranges per rank (partition.py), and real published configs (configs/)."""
