"""Message framing over real MPI: payloads inline in the header's message or apart, sequence
layouts inline or apart, every wire dtype, all arrive intact and in order."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

SCRIPT = r"""
import numpy as np, mlx.core as mx
from mpi4py import MPI
from pipeline.cluster.transport import Kind, MpiTransport
comm = MPI.COMM_WORLD
t = MpiTransport(comm)
t.inline_bytes = 4096
cases = []
for seqs, tokens, hidden, dtype in [(1, 1, 64, mx.float32), (1, 1, 1024, mx.float32), (1, 1, 1025, mx.float32),
                                    (40, 40, 16, mx.float32), (3, 7, 32, mx.bfloat16), (2, 5, 300, mx.float16),
                                    (28, 28, 8, mx.float32), (29, 29, 8, mx.float32)]:
    ids, lengths = list(range(100, 100 + seqs)), [tokens // seqs] * (seqs - 1) + [tokens - tokens // seqs * (seqs - 1)]
    cases.append((ids, lengths, mx.random.normal((1, tokens, hidden), key=mx.random.key(tokens * hidden)).astype(dtype)))
# Each kind's own fields, their layouts inline (up to 28 FORWARD sequences, 18 FORKs) or apart.
many = list(range(200, 240))
if comm.rank == 0:
    for ids, lengths, h in cases:
        t.send_message(1, Kind.FORWARD, ids, lengths, h)
        t.send_message(1, Kind.RELEASE, ids[:2])
    for n in (3, 40):
        every = [i % 2 == 0 for i in range(n)]
        t.send_message(1, Kind.FORWARD, many[:n], [1] * n, mx.zeros((1, n, 4)), every_position=every, rewind=2)
        t.send_message(1, Kind.REWIND, many[:n], dropped=list(range(n)))
    for n in (18, 19):
        t.send_message(1, Kind.FORK, many[:n], kept_ids=many[n:2 * n], prefix=[7] * n)
    t.send_message(1, Kind.STOP)
else:
    for ids, lengths, h in cases:
        m = t.recv_message(0)
        assert m.kind == Kind.FORWARD and m.seq_ids == ids and m.tokens == lengths, (m.seq_ids, m.tokens)
        assert m.every_position == [False] * len(ids)
        assert m.hidden.dtype == h.dtype and m.hidden.shape == h.shape
        assert mx.array_equal(m.hidden, h).item()
        r = t.recv_message(0)
        assert r.kind == Kind.RELEASE and r.seq_ids == ids[:2] and r.hidden is None
    for n in (3, 40):
        m = t.recv_message(0)
        assert m.tokens == [1] * n and m.every_position == [i % 2 == 0 for i in range(n)] and m.rewind == 2
        r = t.recv_message(0)
        assert r.kind == Kind.REWIND and r.seq_ids == many[:n] and r.dropped == list(range(n))
    for n in (18, 19):
        f = t.recv_message(0)
        assert f.kind == Kind.FORK and f.seq_ids == many[:n] and f.kept_ids == many[n:2 * n] and f.prefix == [7] * n
    assert t.recv_message(0).kind == Kind.STOP
    print("ok")
"""


def test_framing_round_trips_every_layout():
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
