"""`serve`: an OpenAI-compatible HTTP server on rank 0 over the continuous-batching ring.

Rank 0 loads its layers once, runs the HTTP server (pipeline/serve/, uvicorn) in a thread, and
the scheduler on its main thread, fed by the requests the server hands it; the other ranks follow
the ring as in `batch`. While no request is in flight, rank 0 sends heartbeats round the ring, so
an idle server never trips the --watchdog.

SIGTERM or SIGINT (mpiexec and Slurm pass them to every rank): rank 0 stops taking requests (503),
lets those in progress finish for up to --drain seconds, cancels the rest, stops the ring, and every
rank exits 0. The other ranks ignore the signal and wait for rank 0's STOP. A second signal on
rank 0, a second or more after the first, cancels what is left at once.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
import threading
import time
import traceback

from . import flags
from ..cluster import mpi
from ..util.errors import UserError

STARTUP_TIMEOUT_S = 60  # for the HTTP server to start listening on its socket
# Chats and agents re-send their history with every turn: a server keeps finished sequences'
# caches by default (batch, whose prompts rarely share a prefix, does not).
PREFIX_CACHE_GB = 4.0
GRACEFUL_HTTP_S = 5  # after the scheduler stops, for responses still being written


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
    serve.add_argument("--max-queue", type=int, default=256,
                       help="most requests waiting for a place beyond --max-batch; more are answered 429 with "
                            "Retry-After (default 256)")
    serve.add_argument("--drain", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM or SIGINT, how long requests in progress may take to finish before "
                            "they are cancelled (default 30)")
    flags.add_sampling_args(serve, per_request=True)
    flags.add_draft_args(serve)
    flags.add_weights_args(serve)
    flags.add_cluster_args(serve, transports=False)


def validate(args: argparse.Namespace) -> None:
    flags.validated_scheduler_job_args(args)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be 0 to 65535 (0: any free port), got {args.port}")
    if args.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {args.max_queue}")
    flags.finite(args.drain, "--drain")
    if args.drain < 0:
        raise UserError(f"--drain must be >= 0 seconds, got {args.drain:g}")
    if args.api_key is None:
        args.api_key = os.environ.get("PIPELINE_API_KEY") or None
    elif not args.api_key.strip():
        raise UserError("--api-key is empty: give a key, or leave the flag out to serve without one")
    if args.model_name is not None and not args.model_name.strip():
        raise UserError("--model-name is empty")


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound here so that a port in use is one clear error before
    any weights are read (uvicorn would exit its thread with a log line)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UserError(f"--host {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = ": another program is using it; choose another --port" if e.errno == errno.EADDRINUSE else ""
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return sock


def url(host: str, sock: socket.socket) -> str:
    """Where to reach the server: a wildcard address is named by this host's name."""
    port = sock.getsockname()[1]
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class HTTPThread:
    """uvicorn serving the app on `sock` in a daemon thread; no signal handlers of its own."""

    def __init__(self, app, sock: socket.socket, on_crash):
        import uvicorn

        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", loop="asyncio",
                                http="h11", ws="none", timeout_graceful_shutdown=GRACEFUL_HTTP_S)
        self.server = uvicorn.Server(config)
        self.sock = sock
        self.on_crash = on_crash
        self.thread = threading.Thread(target=self._run, name="pipeline-http", daemon=True)

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException:  # noqa: BLE001 -- reported, then the job ends (see on_crash)
            traceback.print_exc()
        if not self.server.should_exit:
            self.on_crash()

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise mpi.AbortJob("the HTTP server did not start (see the lines above)")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(GRACEFUL_HTTP_S + 5)


def run(args: argparse.Namespace, comm) -> int:
    from ..runtime.job import head_split, load_ring_stage, per_rank, plan_ring_job, prefix_cache, rank_figures, rss_label
    from ..runtime.scheduler import follow, stop_followers
    from ..checkpoints.tokenizer import Tokenizer
    from ..runtime.trace import Timeline, summary_lines

    rank, size = comm.Get_rank(), comm.Get_size()
    job = plan_ring_job(args, comm)

    def prepare():
        """Rank 0, before any weights are read: the port taken, the tokenizer loaded."""
        if rank != 0:
            return None
        return listen(args.host, args.port), Tokenizer.from_folder(job.plan.folder)

    prepared = mpi.checkpoint(comm, prepare)
    stage = load_ring_stage(args, job, comm, progress=rank == 0)
    timeline = Timeline(rank)
    if rank == 0:
        sock, tokenizer = prepared
        server = RankZero(args, job.plan, stage, job.transport, tokenizer, timeline, sock,
                          engine=dict(max_batch=args.max_batch, microbatches=job.microbatches,
                                      group_rows=job.group_rows, head_split=head_split(args, job),
                                      prefix_cache=prefix_cache(args, job), draft=flags.draft_settings(args)))
        comm.Barrier()
        timeline.restart()
        stats = server.serve(size)
        stop_followers(job.transport, timeline)
    else:
        # mpiexec and Slurm signal every rank; rank 0 alone decides, and sends STOP when done
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        comm.Barrier()
        timeline.restart()
        follow(stage, job.transport, timeline, job.group_rows)
    timeline.finish()

    summaries = comm.gather(timeline.summary(), root=0)
    figures = comm.gather(rank_figures(stage), root=0)
    if rank == 0:
        hosts = [f[0] for f in figures]
        print(f"[pipeline] serve: {stats.done} requests done, {stats.errors} failed, {stats.generated_tokens} tokens "
              f"generated (prompts {stats.prompt_tokens} tokens) in {stats.wall_s:.1f} s; layers per rank "
              f"{','.join(str(end - start) for start, end in job.plan.ranges)}; weights "
              f"{per_rank([f[2] for f in figures])}, BLAS {per_rank([f[3] for f in figures])}, peak RSS "
              f"{rss_label(figures, kv_cache=False)}{server.cache_label()}",
              file=sys.stderr)
        for line in summary_lines(summaries, hosts if len(set(hosts)) > 1 else None):
            print(line, file=sys.stderr)
        sys.stderr.flush()
    return 0


class RankZero:
    """Rank 0 of a server: the HTTP thread, the gateway between it and the scheduler, the signals."""

    def __init__(self, args, plan, stage, transport, tokenizer, timeline, sock, engine: dict):
        from ..runtime.requests import QueueSource
        from ..serve.app import Defaults, ServedModel, Server
        from ..serve.gateway import Gateway
        from ..serve.metrics import Metrics
        from ..runtime.trace import COMPUTE

        self.args, self.stage, self.transport, self.tokenizer = args, stage, transport, tokenizer
        self.timeline, self.sock, self.engine = timeline, sock, engine
        self.name = args.model_name or plan.folder.name
        self.source = QueueSource()
        self.gateway = Gateway(self.source, capacity=args.max_batch + args.max_queue)
        metrics = Metrics(queue_depth=lambda: self.gateway.waiting,
                          in_flight=lambda: max(0, self.gateway.in_progress - self.gateway.waiting),
                          busy_seconds=lambda: {0: timeline.totals[COMPUTE]})
        model = ServedModel(self.name, tokenizer, plan.config.max_position_embeddings, plan.config.vocab_size)
        defaults = Defaults(args.sampling, list(args.stop), args.max_tokens)
        self.app = Server(model, defaults, self.gateway, metrics, args.api_key).app()
        self.first_signal: float | None = None
        self.http_failed = False

    def on_signal(self, signum, _frame) -> None:
        """In the main thread, between the scheduler's steps: start the drain on a thread of its own."""
        now = time.monotonic()
        if self.first_signal is None:
            self.first_signal = now
            print(f"[pipeline] serve: {signal.Signals(signum).name}: taking no new requests; waiting up to "
                  f"{self.args.drain:g} s for the {self.gateway.in_progress} in progress", file=sys.stderr, flush=True)
            threading.Thread(target=self.gateway.drain, args=(self.args.drain,), name="pipeline-drain",
                             daemon=True).start()
        elif now - self.first_signal > 1.0:  # not the same signal arriving twice (mpiexec and a terminal)
            print("[pipeline] serve: second signal: cancelling what is left", file=sys.stderr, flush=True)
            self.gateway.hurry()

    def cache_label(self) -> str:
        cache = self.engine["prefix_cache"]
        if cache is None:
            return ""
        return f"; prefix cache: {cache.hits} of {cache.lookups} requests hit, {cache.reused_tokens} prompt tokens reused"

    def on_http_crash(self) -> None:
        self.http_failed = True
        threading.Thread(target=self.gateway.drain, args=(0.0,), name="pipeline-drain", daemon=True).start()

    def serve(self, ranks: int):
        from ..runtime.scheduler import Scheduler

        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        http = HTTPThread(self.app, self.sock, self.on_http_crash)
        http.start()
        print(f"serving {self.name} on {url(self.args.host, self.sock)} with {ranks} rank{'s' if ranks != 1 else ''}",
              flush=True)
        # Heartbeats well inside the watchdog, so the other ranks never take an idle rank 0 for a dead one
        heartbeat = self.args.watchdog / 4 if self.args.watchdog else None
        scheduler = Scheduler(self.stage, self.transport, self.tokenizer, self.source, timeline=self.timeline,
                              heartbeat_s=heartbeat, **self.engine)
        stats = scheduler.run()
        http.stop()
        if self.http_failed:
            raise mpi.AbortJob("the HTTP server stopped unexpectedly (see the lines above)")
        return stats
