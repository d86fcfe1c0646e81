"""The engine: a job's set-up (job.py: plan, load a rank's stage, transport), one rank's stage in
the ring (stage.py), one stream's prefill and decode (engine.py), the batch scheduler and the
followers' loop (scheduler.py), sampling, speculative drafts, the prefix cache, the LM head shared
between ranks (head_share.py) and per-rank traces (trace.py). It knows nothing of HTTP, files of
results or argparse."""
