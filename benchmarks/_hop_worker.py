"""Run under `mpiexec -n 2`: round trips rank 0 -> 1 -> 0 of one hidden-state message, printing
rank 0's mean seconds per hop as JSON.

  raw        mpi4py blocking Send/Recv of the payload bytes: the floor
  transport  pipeline's MpiTransport.send_message/recv_message of a FORWARD message carrying the
             same hidden states as an mx.array (header, sequence layout, payload; mx<->numpy), as
             rank 0 and the serving ranks do per token
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def main() -> None:
    mode, hidden, tokens, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    peer = 1 - rank
    warmup = max(10, iters // 10)
    if mode == "raw":
        buf = np.random.default_rng(0).standard_normal((1, tokens, hidden), dtype=np.float32)

        def round_trip():
            if rank == 0:
                comm.Send(buf, dest=peer)
                comm.Recv(buf, source=peer)
            else:
                comm.Recv(buf, source=peer)
                comm.Send(buf, dest=peer)
    else:
        import mlx.core as mx

        from pipeline.cluster.transport import Kind, MpiTransport

        transport = MpiTransport(comm)
        hidden_states = mx.random.normal((1, tokens, hidden))
        mx.eval(hidden_states)

        def round_trip():
            if rank == 0:
                transport.send_message(peer, Kind.FORWARD, [0], [tokens], hidden_states)
                message = transport.recv_message(peer)
                mx.eval(message.hidden)
            else:
                message = transport.recv_message(peer)
                transport.send_message(peer, Kind.FORWARD, message.seq_ids, message.tokens, message.hidden)

    for _ in range(warmup):
        round_trip()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        round_trip()
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"per_hop_s": elapsed / iters / 2, "bytes": tokens * hidden * 4}))


if __name__ == "__main__":
    main()
