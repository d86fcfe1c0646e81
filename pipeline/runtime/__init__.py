"""The engine: a job's settings (settings.py: frozen records a command builds from its flags), its
set-up (job.py: plan, load a rank's stage, transport), one rank's stage in the ring (stage.py), one
stream's prefill and decode (engine.py), the batch scheduler and the followers' loop
(scheduler.py) with the request and event types front-ends hand it and get back (requests.py: no
MLX, the only part serve/ imports), sampling (sampling.py), speculative drafts (speculative.py), the
prefix cache (prefix_cache.py), the LM head shared between ranks (head_share.py), per-rank traces
(trace.py) and each rank's figures for the closing stats line (rank_figures.py). It knows nothing
of HTTP, files of results or argparse."""
