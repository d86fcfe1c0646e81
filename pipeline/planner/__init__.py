"""What a model needs before anything is loaded, from config.json alone (no MLX): per-family tensor
shapes (shapes.py), how the checkpoint stores them (stored_formats.py), bytes as held in memory
(weights_bytes.py), a rank's bytes counted one way for plan, preflight and the stats line
(memory.py), layer ranges per rank (partition.py), the cluster speed model (speed.py), the layouts of
stages x tensor-parallel ranks (layouts.py) with their fitted terms (cluster_costs.py) and the fit
recomputed from the published figures (calibration.py), the text `pipeline plan` prints (report.py), the fit check of `generate --host-memory` (host_memory.py), and
the config a --model names, real published ones included (config_files.py, configs/). The job and
`preflight` take their one layer split from layer_split.py."""
