"""One --tensor-parallel rank's decode step alone (no partner, no sums: each layer's partial output taken
as the total, so the text is wrong and only the times count), against the whole model (T = 1) in the
same process kind: per token, the time to build the layers' graph in Python and the time MLX takes to
evaluate it, and optionally a cProfile of the build.

    taskset -c 0 python benchmarks/tp_rank_profile.py [--model llama-1b|default|FOLDER] [--size 2]
        [--member 0] [--tokens 32] [--context 64] [--profile] [--repeat 3]

One thread (OPENBLAS_NUM_THREADS=1 and the kernels' set_threads(1)); the model held quantized, int8
products where this machine has them (as generate holds it). Layers only: no embedding lookup in the
timed part, no LM head.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ["PIPELINE_VOCAB_SPLIT"] = "0"  # the head is not timed; no group to split it over

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

sys.path.insert(0, str(common.REPO))
import pipeline  # noqa: E402,F401

import mlx.core as mx  # noqa: E402
from mpi4py import MPI  # noqa: E402

from pipeline.kernels import qmm  # noqa: E402
from pipeline.runtime.job import load_stage, plan_job  # noqa: E402
from pipeline.runtime.settings import WeightSettings  # noqa: E402
from pipeline.runtime.tensor_group import Group  # noqa: E402


class AloneMember(Group):
    """A member that leads no mates (load_stage gives a leader a stage that sends its mates commands)."""

    @property
    def leads(self) -> bool:
        return False


def model_folder(name: str) -> Path:
    if name == "llama-1b":
        return common.llama_1b()
    if name == "default":
        return common.default_model()
    return Path(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--size", type=int, default=2, help="T (1: the whole model)")
    parser.add_argument("--member", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=64, help="positions in the cache before decoding")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of --tokens; the best round's medians")
    parser.add_argument("--profile", action="store_true", help="cProfile the build of one round")
    parser.add_argument("--start-at", type=float, default=0.0,
                        help="time.time() to start decoding at, after loading (two members at once)")
    args = parser.parse_args()

    folder = model_folder(args.model)
    settings = WeightSettings(model=folder, weights_in_memory="quantized")
    comm = MPI.COMM_WORLD
    plan = plan_job(settings, comm)
    group = AloneMember(size=args.size, stage=0, member=args.member) if args.size > 1 else None
    stage = load_stage(settings, plan, 0, progress=False, group=group)
    qmm.set_threads(1)
    model = stage.model
    token = model.embed(mx.array([[1]]))
    prompt = model.embed(mx.array([list(range(2, 2 + args.context))]))
    mx.eval(token, prompt)
    stage.run_layers(prompt, [0])
    while time.time() < args.start_at:
        time.sleep(0.001)

    rounds = []
    for r in range(args.repeat + 1):
        seq = r + 1
        stage.fork([seq], [0], [args.context])
        builds, evals = [], []
        profiler = cProfile.Profile() if args.profile and r == args.repeat else None
        for _ in range(args.tokens):
            t0 = time.perf_counter()
            if profiler:
                profiler.enable()
            hidden = stage.run_layers(token, [seq], evaluate=False, last_only=True)
            if profiler:
                profiler.disable()
            t1 = time.perf_counter()
            mx.eval(hidden)
            t2 = time.perf_counter()
            builds.append(t1 - t0)
            evals.append(t2 - t1)
        stage.release([seq])
        if r:  # round 0: warm-up
            builds.sort(), evals.sort()
            rounds.append((builds[len(builds) // 2] * 1e3, evals[len(evals) // 2] * 1e3))
        if profiler:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    build, evaluate = min(rounds, key=lambda x: x[0] + x[1])
    print(f"{args.model} T={args.size} member {args.member}: build {build:.2f} ms, eval {evaluate:.2f} ms, "
          f"total {build + evaluate:.2f} ms a token (best of {args.repeat} rounds' medians; rounds "
          f"{', '.join(f'{b:.1f}+{e:.1f}' for b, e in rounds)}); products: {qmm.describe()}; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
