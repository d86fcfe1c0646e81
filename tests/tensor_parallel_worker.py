"""Run under mpiexec by tests/test_tensor_parallel.py and tests/test_tensor_parallel_mlx.py: one stage of
`--tensor-parallel T` over all ranks (T = the ranks) over the given transport (mpi, the default, or mlx:
MLX's ring on loopback), a token list through it, and rank 0 saves the logits of every position (the head
split by vocabulary), of the whole prompt at once then token by token through the KV cache, as
[2, tokens, vocab] float32.

    mpiexec -n T python tests/tensor_parallel_worker.py FOLDER OUT.npy ID,ID,... [mpi|mlx]
"""

from __future__ import annotations

import sys
from pathlib import Path

import pipeline  # noqa: F401 -- first, as a real run (BLAS binding)

import mlx.core as mx
import numpy as np
from mpi4py import MPI

from pipeline.runtime.job import load_stage, plan_job
from pipeline.runtime.settings import WeightSettings
from pipeline.runtime.tensor_group import follow_leader, form_group, stop_mates


def main() -> None:
    folder, out, ids = Path(sys.argv[1]), Path(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")]
    transport = sys.argv[4] if len(sys.argv) > 4 else "mpi"
    comm = MPI.COMM_WORLD
    t = comm.Get_size()
    group = form_group(comm, t, transport, watchdog=60, mlx_backend="ring")
    settings = WeightSettings(model=folder, tensor_parallel=t, int8_activations=False)
    plan = plan_job(settings, comm)
    stage = load_stage(settings, plan, comm.Get_rank(), progress=False, group=group)
    if comm.Get_rank() != 0:
        follow_leader(stage, group)
        return
    model = stage.model

    def logits(tokens: list[int], seq: int) -> np.ndarray:
        hidden = stage.run_layers(model.embed(mx.array([tokens])), [seq])
        return np.array(model.logits(hidden).astype(mx.float32))[0]

    whole = logits(ids, 0)
    incremental = np.concatenate([logits([token], 1) for token in ids])
    stage.release([0, 1])
    stop_mates(group)
    np.save(out, np.stack([whole, incremental]))


if __name__ == "__main__":
    main()
