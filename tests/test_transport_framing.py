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
if comm.rank == 0:
    for ids, lengths, h in cases:
        t.send_message(1, Kind.FORWARD, ids, lengths, h)
        t.send_message(1, Kind.RELEASE, ids[:2])
    t.send_message(1, Kind.STOP)
else:
    for ids, lengths, h in cases:
        m = t.recv_message(0)
        assert m.kind == Kind.FORWARD and m.seq_ids == ids and m.lengths == lengths, (m.seq_ids, m.lengths)
        assert m.hidden.dtype == h.dtype and m.hidden.shape == h.shape
        assert mx.array_equal(m.hidden, h).item()
        r = t.recv_message(0)
        assert r.kind == Kind.RELEASE and r.seq_ids == ids[:2] and r.hidden is None
    assert t.recv_message(0).kind == Kind.STOP
    print("ok")
"""


def test_framing_round_trips_every_layout():
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
