"""Run under mpiexec by tests/test_group_sum.py: one --tensor-parallel group of all ranks, its sums.

    mpiexec -n T python tests/group_sum_worker.py exact OUT.npz
        chained sums of known float32 partials (mixed magnitudes: the order of the adds shows), built
        into one graph and evaluated once, and a router's choices from the first member (each member's
        own where the members are alike: kernels/group_sum.py); rank 0 saves every member's partials
        and results.
    mpiexec -n T python tests/group_sum_worker.py hang MEMBER WATCHDOG
        member MEMBER stops itself (SIGSTOP) before the first sum; the others wait in it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pipeline  # noqa: F401 -- first, as a real run (BLAS binding)

import mlx.core as mx
import numpy as np
from mpi4py import MPI

from pipeline.cluster.mpi import abort_on_unhandled_exception
from pipeline.runtime.tensor_group import form_group

SHAPES = [(1, 1, 576), (1, 7, 144), (3, 5), (2048,)]


def partial(member: int, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(1000 * member + len(shape) + shape[-1])
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 4, shape)).astype(np.float32)


def main() -> None:
    comm = MPI.COMM_WORLD
    abort_on_unhandled_exception(comm)
    mode, rank, t = sys.argv[1], comm.Get_rank(), comm.Get_size()
    watchdog = float(sys.argv[3]) if mode == "hang" else 60.0
    group = form_group(comm, t, watchdog=watchdog)
    gsum = group.group_sum
    kind = "in-graph" if getattr(gsum, "in_graph", False) else "python"
    if mode == "hang":
        if rank == int(sys.argv[2]):
            print(f"member {rank} stops ({kind}) at {time.monotonic()}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        out = gsum(mx.array(partial(rank, SHAPES[0])))
        mx.eval(out)
        print("the sum returned without the stopped member", file=sys.stderr, flush=True)
        return
    # each sum's input depends on the one before (a layer's residual): one graph, evaluated once
    results, x = [], None
    for i, shape in enumerate(SHAPES):
        mine = mx.array(partial(rank, shape))
        if x is not None and x.size == mine.size:
            mine = mine + x.reshape(mine.shape) * 0  # a dependency, the same values
        x = gsum(mine)
        results.append(x)
    halves = gsum(mx.array(partial(rank, (4, 8))).astype(mx.bfloat16))  # bfloat16 partials: summed in float32
    choices = gsum.from_first(mx.array(np.arange(8, dtype=np.uint32) * (rank + 1)).reshape(1, 8))
    mx.eval(results, halves, choices)
    got = {f"sum{i}": np.array(r) for i, r in enumerate(results)}
    got["halves"] = np.array(halves.astype(mx.float32))
    got["choices"] = np.array(choices)
    every = comm.gather(got, root=0)
    alike = comm.allgather(gsum.alike)
    assert len(set(alike)) == 1, alike  # every member of the group decided the same
    alike = alike[0]
    if rank == 0:
        arrays = {f"m{m}_{k}": v for m, g in enumerate(every) for k, v in g.items()}
        for m in range(t):
            for i, shape in enumerate(SHAPES):
                arrays[f"m{m}_partial{i}"] = partial(m, shape)
            arrays[f"m{m}_halves_partial"] = np.array(mx.array(partial(m, (4, 8))).astype(mx.bfloat16).astype(mx.float32))
        arrays["kind"] = np.array(kind)
        arrays["calls"] = np.array(gsum.calls)
        arrays["alike"] = np.array(alike)
        np.savez(sys.argv[2], **arrays)


if __name__ == "__main__":
    main()
