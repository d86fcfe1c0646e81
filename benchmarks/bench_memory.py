"""2e. Peak RSS per rank against the bytes of weights it owns.

For each model (default SmolLM2, random Llama-1B), 1 and 2 ranks, and --weights-in-memory
quantized / fp32: run `pipeline generate` (short prompt, a few tokens), take each rank's peak RSS
from the stats line, and divide by the bytes that rank owns: its layers (and on rank 0 the
embedding, final norm and head) as they live in memory, from the same split `generate` makes.
Also measured: the RSS of a process that has only imported the runtime (Python, MLX, mpi4py,
tokenizers): the part of RSS that is not weights.

    python benchmarks/bench_memory.py [--runs 5]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MODELS = {"smollm2": common.default_model, "llama-1b": common.llama_1b}
BASELINE = ("import resource, json, pipeline, mlx.core as mx, mlx.nn, mpi4py.MPI, tokenizers, jinja2\n"
            "from pipeline import commands\nfrom pipeline.runtime import engine, stage\n"
            "mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))\n"
            "print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))")


def owned_bytes(folder: Path, ranks: int, mode: str) -> list[int]:
    """Bytes of weights each rank holds, split exactly as `plan_job` splits them."""
    sys.path.insert(0, str(common.REPO))
    from pipeline.models.config import ModelConfig
    from pipeline.planner.layer_split import plan_weights_in_memory
    from pipeline.planner.memory import rank_bytes
    from pipeline.planner.partition import balanced_counts, layer_ranges
    from pipeline.planner.weights_bytes import model_bytes_of
    from pipeline.checkpoints.safetensors_checkpoint import Checkpoint
    from pipeline.checkpoints.tensor_names import layer_nbytes

    config = ModelConfig.from_folder(folder)
    per_layer, ends = layer_nbytes(Checkpoint(folder), config.num_hidden_layers)
    counts = balanced_counts(per_layer, ranks, rank0_extra_bytes=ends)
    held, dense = (model_bytes_of(config, folder, dense=d) for d in (False, True))
    if mode == "fp32":
        counts, _ = plan_weights_in_memory("fp32", held, dense, counts, None, fixed=False)
    mb = dense if mode == "fp32" else held
    return [rank_bytes(mb.layers, mb.ends, [], span, r, ranks).weights for r, span in enumerate(layer_ranges(counts))]


def baseline() -> dict:
    proc = subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True,
                          env=common.env_with_repo(), timeout=120)
    return {"rss": json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = common.arguments(__doc__, warmup=False)
    args = parser.parse_args()

    base = common.summary([r["rss"] for r in common.interleave({"baseline": baseline}, args.runs, 0)["baseline"]])
    print(f"runtime baseline RSS {base['median'] / 2**20:.0f} MiB")
    results = {}
    for name, factory in MODELS.items():
        model = factory()
        text, _ = common.prompt_of(model, 8)
        contenders = {}
        for ranks in (1, 2):
            for mode in ("quantized", "fp32"):
                contenders[f"{ranks} rank{'s' if ranks > 1 else ''} {mode}"] = (
                    lambda ranks=ranks, mode=mode: common.run_pipeline(ranks, model, text, 4, "--weights-in-memory",
                                                                       mode))
        print(f"{name}: load {common.load_average()}", flush=True)
        runs = common.interleave(contenders, args.runs, warmup=0)
        configs = {}
        for label, rs in runs.items():
            ranks, mode = int(label.split()[0]), label.split()[-1]
            owned = owned_bytes(model, ranks, mode)
            per_rank = []
            for r in range(ranks):
                rss = common.summary([run["peak_rss"][r] for run in rs])
                per_rank.append({"owned_bytes": owned[r], "peak_rss": rss, "ratio": rss["median"] / owned[r],
                                 "ratio_above_baseline": (rss["median"] - base["median"]) / owned[r]})
            configs[label] = {"ranks": ranks, "mode": mode, "per_rank": per_rank,
                              "weights_reported": rs[0]["weights"]}
            print(f"  {label}: " + ", ".join(
                f"r{r} {p['peak_rss']['median'] / 2**20:.0f} MiB / {p['owned_bytes'] / 2**20:.0f} MiB owned = "
                f"{p['ratio']:.2f}x" for r, p in enumerate(per_rank)), flush=True)
        results[name] = {"folder": str(model), "parameters": common.param_count(model), "configs": configs,
                         "runs": runs}

    payload = common.record("memory", "2e: peak RSS per rank vs the bytes of weights it owns", runs=args.runs,
                            baseline_rss=base, load_after=common.load_average(), models=results)
    path = common.write_json("memory", payload)
    plot(payload)
    print(f"wrote {path}")


def plot(payload: dict) -> None:
    import numpy as np

    models = list(payload["models"])
    fig, axes = common.figure(len(models), width=6)
    for ax, name in zip(axes, models):
        configs = payload["models"][name]["configs"]
        labels, owned, rss, lo, hi = [], [], [], [], []
        for label, c in configs.items():
            for r, p in enumerate(c["per_rank"]):
                labels.append(f"{label}\nr{r}")
                owned.append(p["owned_bytes"] / 2**20)
                rss.append(p["peak_rss"]["median"] / 2**20)
                lo.append((p["peak_rss"]["median"] - p["peak_rss"]["min"]) / 2**20)
                hi.append((p["peak_rss"]["max"] - p["peak_rss"]["median"]) / 2**20)
        x = np.arange(len(labels))
        ax.bar(x - 0.2, owned, 0.4, label="weights owned")
        ax.bar(x + 0.2, rss, 0.4, yerr=[lo, hi], capsize=3, label="peak RSS")
        for xi, o, r in zip(x, owned, rss):
            ax.annotate(f"{r / o:.2f}x", (xi + 0.2, r), ha="center", va="bottom", fontsize=7)
        ax.axhline(payload["baseline_rss"]["median"] / 2**20, color="gray", ls=":", lw=1, label="runtime baseline")
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_ylabel("MiB")
        ax.set_title(name, fontsize=9)
    fig.suptitle("2e peak RSS per rank vs owned weight bytes (median of "
                 f"{payload['runs']} runs; label: RSS/owned)", fontsize=10)
    common.save(fig, common.RESULTS / "memory.png", axes[0])


if __name__ == "__main__":
    main()
