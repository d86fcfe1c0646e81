"""`python -m pipeline ping`: hidden-state-sized messages around the ring of ranks.

Checks that every link carries data intact with the chosen transport, times the round trip,
and measures what a rank costs while it idles in receive (its process CPU time against the
wall time it waited), which is what a rank does most of the time in a pipeline.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

from . import flags
from ..util.errors import UserError
from ..cluster.mpi import AbortJob


def add_parser(commands) -> None:
    ping = commands.add_parser("ping", help="time messages around the ring of ranks (checks the links)",
                               description="Send hidden-state-sized messages around the ring 0 -> 1 -> ... -> 0 "
                                           "with the chosen transport; report the round-trip time, and each "
                                           "rank's CPU use while it waited.")
    ping.add_argument("--rounds", type=int, default=20, help="messages sent around the ring (default 20)")
    ping.add_argument("--floats", type=int, default=7168,
                      help="float32 values per message (default 7168: one token of Kimi K2's hidden state)")
    ping.add_argument("--pause", type=float, default=0.0,
                      help="seconds rank 0 waits between rounds while the others idle in receive")
    flags.add_cluster_args(ping)


def validate(args: argparse.Namespace) -> None:
    flags.validated_cluster_args(args)
    if args.rounds < 1 or args.floats < 1 or not 0 <= flags.finite(args.pause, "--pause"):
        raise UserError("ping needs --rounds >= 1, --floats >= 1 and --pause >= 0")


def run(args: argparse.Namespace, comm) -> int:
    # Imported here, not above: cli imports every command's module to build its parser, and these load
    # MLX, which `pipeline plan` must not (it reads config.json only; start-up time).
    import mlx.core as mx

    from ..cluster.transport import Kind
    from ..runtime.job import make_transport

    transport = make_transport(flags.transport_settings(args), comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    processes = comm.gather((socket.gethostname(), os.getpid()), root=0)
    if rank == 0:
        print(_table(["rank", "host", "pid"], [[r, h, p] for r, (h, p) in enumerate(processes)]), flush=True)
    if size == 1:
        if rank == 0:
            print("ping: a single rank has no links to test")
        return 0

    waited = cpu = 0.0

    def receive(source: int):
        nonlocal waited, cpu
        wall0, cpu0 = time.monotonic(), time.process_time()
        message = transport.recv_message(source)
        waited += time.monotonic() - wall0
        cpu += time.process_time() - cpu0
        return message

    nxt, prev = (rank + 1) % size, (rank - 1) % size
    round_trips = []
    if rank == 0:
        payload = mx.random.normal((1, 1, args.floats), key=mx.random.key(0))
        mx.eval(payload)
        for i in range(args.rounds):
            if args.pause and i:
                time.sleep(args.pause)
            start = time.perf_counter()
            transport.send_message(nxt, Kind.FORWARD, [0], [1], payload)
            back = receive(prev).hidden
            round_trips.append(time.perf_counter() - start)
            if not mx.array_equal(back, payload).item():
                raise AbortJob(f"ping: the message came back changed after round {i + 1}: a link corrupts data")
        transport.send_message(nxt, Kind.STOP)
    else:
        while True:
            message = receive(prev)
            if message.kind == Kind.STOP:
                if nxt != 0:
                    transport.send_message(nxt, Kind.STOP)
                break
            transport.send_message(nxt, message.kind, message.seq_ids, message.tokens, message.hidden)

    waits = comm.gather((waited, cpu), root=0)
    if rank == 0:
        ms = sorted(t * 1000 for t in round_trips)
        kib = args.floats * 4 / 1024
        print(f"ping: {args.rounds} rounds of {kib:.1f} KiB around {size} ranks over {args.transport}: "
              f"round trip min {ms[0]:.3f} ms, median {statistics.median(ms):.3f} ms, max {ms[-1]:.3f} ms "
              f"({statistics.median(ms) / size:.3f} ms per hop)")
        rows = [[r, processes[r][0], f"{w:.2f}", f"{c:.2f}", f"{100 * c / w:.1f}%" if w > 0 else "-"]
                for r, (w, c) in enumerate(waits)]
        print(_table(["rank", "host", "waited s", "CPU s", "CPU while waiting"], rows), flush=True)
    return 0


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)
