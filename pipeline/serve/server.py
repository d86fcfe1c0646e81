"""Rank 0's HTTP server: its socket, uvicorn in a thread, and how it stops.

The command (commands/serve.py) runs the scheduler on rank 0's main thread, fed by this server's
`source`; uvicorn serves the app (app.py) in a daemon thread, so every MLX and MPI call stays on
the scheduler's thread. SIGTERM or SIGINT drains: no new requests (503), those in progress finish
for up to `drain_s` seconds, the rest are cancelled, and the source closes, which ends the
scheduler's run. A second signal, a second or more after the first, cancels what is left at once.
An HTTP thread that dies drains at once too, and `stop` then ends the job.
"""

from __future__ import annotations

import errno
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Callable

import uvicorn

from ..cluster.mpi import AbortJob
from ..runtime.requests import QueueSource
from ..util.errors import UserError
from .app import Defaults, ServedModel, Server
from .gateway import Gateway
from .metrics import Metrics

STARTUP_TIMEOUT_S = 60  # for the HTTP server to start listening on its socket
GRACEFUL_HTTP_S = 5  # after the scheduler stops, for responses still being written


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

    def __init__(self, app, sock: socket.socket, on_crash: Callable[[], None]):
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
                raise AbortJob("the HTTP server did not start (see the lines above)")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(GRACEFUL_HTTP_S + 5)


class HTTPServer:
    """Rank 0's server: the routes, the gateway between them and the scheduler (whose requests
    come from `source`), the HTTP thread, and the signals that drain it."""

    def __init__(self, model: ServedModel, defaults: Defaults, sock: socket.socket, host: str, *,
                 api_key: str | None, capacity: int, drain_s: float, busy_seconds: Callable[[], dict[int, float]]):
        """capacity: requests in progress or waiting before a new one is refused (429).
        busy_seconds: each rank's computing time so far, for /metrics."""
        self.model, self.sock, self.host, self.drain_s = model, sock, host, drain_s
        self.source = QueueSource()
        self.gateway = Gateway(self.source, capacity=capacity)
        metrics = Metrics(queue_depth=lambda: self.gateway.waiting,
                          in_flight=lambda: max(0, self.gateway.in_progress - self.gateway.waiting),
                          busy_seconds=busy_seconds)
        self.app = Server(model, defaults, self.gateway, metrics, api_key).app()
        self.http: HTTPThread | None = None
        self.first_signal: float | None = None
        self.http_failed = False

    def start(self, ranks: int) -> None:
        """Take SIGTERM and SIGINT, start the HTTP thread, and say where it listens."""
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        self.http = HTTPThread(self.app, self.sock, self.on_http_crash)
        self.http.start()
        print(f"serving {self.model.id} on {url(self.host, self.sock)} with {ranks} rank{'s' if ranks != 1 else ''}",
              flush=True)

    def stop(self) -> None:
        """Once the scheduler's run is over: the HTTP thread ends (ending the job if it had failed)."""
        self.http.stop()
        if self.http_failed:
            raise AbortJob("the HTTP server stopped unexpectedly (see the lines above)")

    def on_signal(self, signum, _frame) -> None:
        """In the main thread, between the scheduler's steps: start the drain on a thread of its own."""
        now = time.monotonic()
        if self.first_signal is None:
            self.first_signal = now
            print(f"[pipeline] serve: {signal.Signals(signum).name}: taking no new requests; waiting up to "
                  f"{self.drain_s:g} s for the {self.gateway.in_progress} in progress", file=sys.stderr, flush=True)
            threading.Thread(target=self.gateway.drain, args=(self.drain_s,), name="pipeline-drain",
                             daemon=True).start()
        elif now - self.first_signal > 1.0:  # not the same signal arriving twice (mpiexec and a terminal)
            print("[pipeline] serve: second signal: cancelling what is left", file=sys.stderr, flush=True)
            self.gateway.hurry()

    def on_http_crash(self) -> None:
        self.http_failed = True
        threading.Thread(target=self.gateway.drain, args=(0.0,), name="pipeline-drain", daemon=True).start()
