"""Run under mpiexec by tests/test_tensor_parallel_head.py: one stage of `--tensor-parallel T` over all
ranks (T = the ranks), whose LM head is split by vocabulary. Rank 0 runs a token list through the
layers and saves (npz) the final hidden states of every position (before the norm), the head's logits
of every entry (the slices gathered), the combined summary (greedy tokens, logsumexp, top entries) and
tokens sampled with a fixed seed from the gathered logits.

    mpiexec -n T python tests/tensor_parallel_head_worker.py FOLDER|default OUT.npz ID,ID,... TOP [ROWS.npz]

With ROWS.npz (another run's output) its hidden states go through this run's head instead: T = 1 then
gives the unsplit head's figures on exactly the rows a split head saw.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pipeline  # noqa: F401 -- first, as a real run (BLAS binding)

import mlx.core as mx
import numpy as np
from mpi4py import MPI

from pipeline.runtime.job import load_stage, plan_job
from pipeline.runtime.requests import SamplingParams
from pipeline.runtime.sampling import Sampler
from pipeline.runtime.settings import WeightSettings
from pipeline.runtime.tensor_group import follow_leader, form_group, stop_mates

SAMPLING = dict(temperature=0.8, top_p=0.9, top_k=20, seed=1234)


def main() -> None:
    folder = None if sys.argv[1] == "default" else Path(sys.argv[1])
    out, ids, top = Path(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")], int(sys.argv[4])
    comm = MPI.COMM_WORLD
    t = comm.Get_size()
    group = form_group(comm, t, watchdog=60)
    settings = WeightSettings(model=folder, tensor_parallel=t, int8_activations=None if folder is None else False)
    plan = plan_job(settings, comm)
    stage = load_stage(settings, plan, comm.Get_rank(), progress=False, group=group)
    if comm.Get_rank() != 0:
        follow_leader(stage, group)
        return
    model = stage.model
    assert (model.vocab_split is not None) == (t > 1)
    if len(sys.argv) > 5:
        rows = mx.array(np.load(sys.argv[5])["rows"]).astype(model.norm.weight.dtype)
        stage.run_layers(model.embed(mx.array([ids[:1]])), [0])  # (so release below has a sequence)
    else:
        rows = stage.run_layers(model.embed(mx.array([ids])), [0])[0]  # [tokens, hidden]
    logits = model.logits(rows).astype(mx.float32)
    combined = model.head_summary(rows, top)
    sampler = Sampler(SamplingParams(**SAMPLING))
    sampled = [sampler(logits[j], []) for j in range(logits.shape[0])]
    stage.release([0])
    stop_mates(group)
    np.savez(out, rows=np.array(rows.astype(mx.float32)), logits=np.array(logits), tokens=combined.tokens,
             max=combined.max, logsumexp=combined.logsumexp, top_ids=combined.top_ids,
             top_values=combined.top_values, sampled=np.array(sampled))


if __name__ == "__main__":
    main()
