"""`serve`: an OpenAI-compatible HTTP server on rank 0 over the continuous-batching ring.

Rank 0 loads its layers once, runs the HTTP server (serve/server.py: uvicorn in a thread, the
drain on SIGTERM or SIGINT) and the scheduler on its main thread, fed by the requests the server
hands it; the other ranks follow the ring as in `batch`. While no request is in flight, rank 0
sends heartbeats round the ring, so an idle server never trips the --watchdog. mpiexec and Slurm
signal every rank: the other ranks ignore the signal and wait for rank 0's STOP, and every rank
exits 0. This module holds the flags, their checks, and the wiring.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from . import flags
from ..cluster import mpi
from ..util.errors import UserError

# Chats and agents re-send their history with every turn: a server keeps finished sequences'
# caches by default (batch, whose prompts rarely share a prefix, does not).
PREFIX_CACHE_GB = 4.0
# scancel sends SIGTERM, then SIGKILL KillWait seconds later (30 by default): the drain ends well
# before, leaving time for STOP round the ring and every rank's exit.
DRAIN_S = 20.0
# A request's body: ~4M tokens of text, far past any context, yet a bounded share of rank 0's memory
MAX_REQUEST_MB = 16.0


def add_parser(commands) -> None:
    serve = commands.add_parser(
        "serve", help="serve the model over HTTP: OpenAI's chat completions and completions API",
        description="Run with `mpiexec -n N python -m pipeline serve`. The model loads once; rank 0 answers "
                    "POST /v1/chat/completions and /v1/completions (streaming or not), GET /v1/models, /health "
                    "and /metrics, and decodes every request in flight together, as `batch` does. A request "
                    "without max_tokens gets the rest of the context, up to --max-tokens. SIGTERM or SIGINT "
                    "drains: no new requests, those in progress finish (up to --drain seconds), every rank "
                    "exits 0.")
    flags.add_model_arg(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this host only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port, "
                                                              "which the ready line names)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every /v1 request (default: the "
                            "PIPELINE_API_KEY environment variable; none if unset)")
    serve.add_argument("--model-name", default=None, metavar="NAME",
                       help="the model's id in /v1/models and responses (default: the model folder's name); "
                            "requests may also name it 'default'")
    flags.add_engine_args(serve)
    flags.add_prefix_cache_arg(serve, default_gb=PREFIX_CACHE_GB)
    flags.add_prompt_cache_dir_args(serve)
    serve.add_argument("--max-queue", type=int, default=256,
                       help="most requests waiting for a place beyond --max-batch; more are answered 429 with "
                            "Retry-After (default 256)")
    serve.add_argument("--max-request-mb", type=float, default=MAX_REQUEST_MB, metavar="MB",
                       help="refuse a request whose body is larger (413), as soon as its Content-Length or the "
                            f"bytes read say so, without reading the rest (default {MAX_REQUEST_MB:g}; 1 MB = "
                            "2^20 bytes). A prompt under it that cannot fit the context is refused (400) before "
                            "it is all tokenized")
    serve.add_argument("--drain", type=float, default=DRAIN_S, metavar="SECONDS",
                       help="on SIGTERM or SIGINT, how long requests in progress may take to finish before "
                            f"they are cancelled (default {DRAIN_S:g}: inside Slurm's default KillWait of 30 s, "
                            "after which scancel sends SIGKILL)")
    flags.add_sampling_args(serve, per_request=True)
    flags.add_draft_args(serve)
    flags.add_weights_args(serve)
    flags.add_cluster_args(serve, transports=False)
    flags.add_tensor_parallel_arg(serve)


def validate(args: argparse.Namespace) -> None:
    flags.validated_scheduler_job_args(args)
    flags.validated_tensor_parallel_arg(args)
    flags.validated_prompt_cache_dir_args(args)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be 0 to 65535 (0: any free port), got {args.port}")
    if args.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {args.max_queue}")
    flags.finite(args.max_request_mb, "--max-request-mb")
    if args.max_request_mb <= 0:
        raise UserError(f"--max-request-mb must be > 0, got {args.max_request_mb:g}")
    flags.finite(args.drain, "--drain")
    if args.drain < 0:
        raise UserError(f"--drain must be >= 0 seconds, got {args.drain:g}")
    if args.api_key is None:
        args.api_key = os.environ.get("PIPELINE_API_KEY") or None
    elif not args.api_key.strip():
        raise UserError("--api-key is empty: give a key, or leave the flag out to serve without one")
    if args.model_name is not None and not args.model_name.strip():
        raise UserError("--model-name is empty")


def run(args: argparse.Namespace, comm) -> int:
    # Here, not at the top: every command's module is imported to build the parser, and these load MLX
    from ..runtime.job import head_split, load_ring_stage, plan_ring_job, prefix_cache, prompt_cache
    from ..runtime.rank_figures import group_sums_label, per_rank, rank_figures, rss_label
    from ..runtime.scheduler import Scheduler, follow, stop_followers
    from ..runtime.tensor_group import follow_leader, stop_mates
    from ..checkpoints.tokenizer import Tokenizer
    from ..runtime.trace import COMPUTE, Timeline, summary_lines
    from ..serve.app import Defaults, ServedModel
    from ..serve.limits import MB  # as the app: starlette and pydantic are slow to import for every command
    from ..serve.server import HTTPServer, listen

    rank, size = comm.Get_rank(), comm.Get_size()
    settings = flags.job_settings(args)
    job = plan_ring_job(settings, comm)

    def prepare():
        """Rank 0, before any weights are read: the port taken, the tokenizer loaded."""
        if rank != 0:
            return None
        return listen(args.host, args.port), Tokenizer.from_folder(job.plan.folder)

    prepared = mpi.checkpoint(comm, prepare)
    stored = prompt_cache(settings, job, comm)  # --prompt-cache-dir: each rank's files, before the weights
    stage = load_ring_stage(settings, job, comm, progress=rank == 0)
    timeline = Timeline(rank)
    if rank == 0:
        sock, tokenizer = prepared
        engine = dict(max_batch=args.max_batch, microbatches=job.microbatches, group_rows=job.group_rows,
                      head_split=head_split(settings.ring, job), prefix_cache=prefix_cache(settings, job),
                      draft=flags.draft_settings(args), stored=stored and stored.index,
                      store=stored and stored.store)
        config = job.plan.config
        model = ServedModel(args.model_name or job.plan.folder.name, tokenizer, config.max_position_embeddings,
                            config.vocab_size)
        server = HTTPServer(model, Defaults(args.sampling, list(args.stop), args.max_tokens,
                                                   int(args.max_request_mb * MB)), sock, args.host,
                            api_key=args.api_key, capacity=args.max_batch + args.max_queue, drain_s=args.drain,
                            busy_seconds=lambda: {0: timeline.totals[COMPUTE]})
        comm.Barrier()
        timeline.restart()
        server.start(size)
        # Heartbeats well inside the watchdog, so the other ranks never take an idle rank 0 for a dead one
        heartbeat = args.watchdog / 4 if args.watchdog else None
        scheduler = Scheduler(stage, job.transport, tokenizer, server.source, timeline=timeline,
                              heartbeat_s=heartbeat, **engine)
        stats = scheduler.run()
        server.stop()
        stop_followers(job.transport, timeline)
        stop_mates(job.group)
    else:
        # mpiexec and Slurm signal every rank; rank 0 alone decides, and sends STOP when done
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        comm.Barrier()
        timeline.restart()
        if job.group.leads:
            follow(stage, job.transport, timeline, job.group_rows, store=stored and stored.store)
            stop_mates(job.group)
        else:
            follow_leader(stage, job.group, store=stored and stored.store)
    if stored is not None:
        stored.store.close()  # the writes still queued
    timeline.finish()

    summaries = comm.gather(timeline.summary(), root=0)
    summaries = summaries and summaries[::job.group.size]  # the ring's ranks: the stage leaders
    figures = comm.gather(rank_figures(stage, group_sum_ms=job.group.ms_per_step(stage)), root=0)
    if rank == 0:
        hosts = [f.host for f in figures]
        print(f"[pipeline] serve: {stats.done} requests done, {stats.errors} failed, {stats.generated_tokens} tokens "
              f"generated (prompts {stats.prompt_tokens} tokens) in {stats.wall_s:.1f} s; layers per rank "
              f"{','.join(str(end - start) for start, end in job.plan.ranges)}; weights "
              f"{per_rank([f.weights for f in figures])}, BLAS {per_rank([f.blas for f in figures])}, peak RSS "
              f"{rss_label(figures, kv_cache=False)}{cache_label(engine['prefix_cache'], stored)}"
              f"{group_sums_label(figures)}",
              file=sys.stderr)
        for line in summary_lines(summaries, hosts if len(set(hosts)) > 1 else None):
            print(line, file=sys.stderr)
        sys.stderr.flush()
    return 0


def cache_label(cache, stored=None) -> str:
    """The prefix cache's part of the closing line (none without a cache), and the disk's (--prompt-cache-dir)."""
    if cache is None:
        return ""
    label = f"; prefix cache: {cache.hits} of {cache.lookups} requests hit, {cache.reused_tokens} prompt tokens reused"
    if stored is not None and stored.index is not None:
        index = stored.index
        store = stored.store
        label += (f"; from disk: {index.loads} requests, {index.loaded_tokens} prompt tokens"
                  f"{f', {index.failed} failed' if index.failed else ''} (read in {index.load_s:.2f} s), "
                  f"{len(index)} entries stored; rank 0 wrote {store.written} files, {store.written_bytes / 1e6:.0f} MB "
                  f"({index.save_s:.3f} s on the scheduler's thread, {store.write_s:.2f} s in the writer's)")
    return label
