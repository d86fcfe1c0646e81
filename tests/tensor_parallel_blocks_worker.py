"""Run under mpiexec by tests/test_tensor_parallel_blocks.py: one stage of `--tensor-parallel T` over all ranks
(T = the ranks) on a GGUF file, a token list through it; rank 0 saves the logits of every position, of the whole
prompt at once then token by token through the KV cache, as [2, tokens, vocab] float32.

    INT8=0|1 PLANT=|block EXPERTS=|1 mpiexec -n T python tests/tensor_parallel_blocks_worker.py FILE OUT.npy ID,ID,...

INT8: the products' activations rounded to int8 (--int8-activations) or not; EXPERTS=1: --expert-parallel. PLANT=block: a planted bug, every
member's input columns of a matrix held in its GGUF blocks one block off (the last member's one block early, the
others' one block late), as a cut that misreads the blocks' byte offsets would take them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pipeline  # noqa: F401 -- first, as a real run (BLAS binding)

import mlx.core as mx
import numpy as np
from mpi4py import MPI

from pipeline.models import tensor_parallel as tp
from pipeline.runtime.job import load_stage, plan_job
from pipeline.runtime.settings import WeightSettings
from pipeline.runtime.tensor_group import follow_leader, form_group, stop_mates

right = tp._columns


def planted(module, array, part, columns, in_features):
    block = None if part in ("bias", "ggml_type") else tp.block_values(array, part, in_features)
    if block is None or array.dtype in (mx.float32, mx.float16, mx.bfloat16) or block == in_features // array.shape[-1]:
        return right(module, array, part, columns, in_features)  # (MLX's own groups: as they are)
    step = block if columns[1] < in_features else -block
    return right(module, array, part, (columns[0] + step, columns[1] + step), in_features)


def main() -> None:
    path, out, ids = Path(sys.argv[1]), Path(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")]
    if os.environ.get("PLANT") == "block":
        tp._columns = planted
    comm = MPI.COMM_WORLD
    t = comm.Get_size()
    group = form_group(comm, t, watchdog=60)
    settings = WeightSettings(model=path, tensor_parallel=t, int8_activations=os.environ.get("INT8") == "1",
                              expert_parallel=os.environ.get("EXPERTS") == "1")
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
