"""2f. Roofline: weight bytes read per decoded token divided by the time per token, against this
machine's measured memory read bandwidth.

Decoding one token reads every weight of the model once (all layers, the final norm and the LM
head: for tied embeddings the whole embedding matrix) plus the KV cache so far, so decode tok/s
can be at most bandwidth / bytes per token. Measured here:

  bandwidth  numpy `sum` over a 512 MiB fp32 array: one process, and one process per core at once
             (aggregate); also MLX's fp32 matvec (1 x 8192 @ 8192 x 16384, 512 MiB) under the BLAS
             pipeline loads (MLX calls sgemm even for one row), i.e. what our decode kernel reaches,
             and numpy's matvec of the same size (numpy's newer bundled OpenBLAS, sgemv)
  decode     `pipeline generate`, 1 rank, weights fp32 (OpenBLAS) and quantized (MLX's kernel), on the
             default SmolLM2 and the random Llama-1B

    python benchmarks/bench_roofline.py [--runs 5]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MODELS = {"smollm2": (common.default_model, 32, 64), "llama-1b": (common.llama_1b, 16, 24)}

SUM = """
import json, time, numpy as np
a = np.ones(2**27, dtype=np.float32); a.sum()
t = time.perf_counter(); n = 10
for _ in range(n): a.sum()
print(json.dumps(a.nbytes * n / (time.perf_counter() - t) / 1e9))
"""
MATVEC = """
import json, time, pipeline, mlx.core as mx
w = mx.random.normal((8192, 16384)); x = mx.random.normal((1, 8192)); mx.eval(w, x, x @ w)
t = time.perf_counter(); n = 10
for _ in range(n): mx.eval(x @ w)
print(json.dumps(w.nbytes * n / (time.perf_counter() - t) / 1e9))
"""

NUMPY_MATVEC = """
import json, time, numpy as np
w = np.random.default_rng(0).standard_normal((16384, 8192), dtype=np.float32); x = np.ones(8192, np.float32); w @ x
t = time.perf_counter(); n = 10
for _ in range(n): w @ x
print(json.dumps(w.nbytes * n / (time.perf_counter() - t) / 1e9))
"""


def python_gbps(code: str, procs: int = 1) -> float:
    ps = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=common.env_with_repo())
          for _ in range(procs)]
    return sum(json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in ps)


def bytes_per_token(folder: Path, dense: bool, context: int) -> dict:
    sys.path.insert(0, str(common.REPO))
    from pipeline.models.config import ModelConfig
    from pipeline.planner.weights_bytes import model_bytes_of
    from pipeline.checkpoints.safetensors_checkpoint import Checkpoint

    config, checkpoint = ModelConfig.from_folder(folder), Checkpoint(folder)
    held = model_bytes_of(config, folder, dense=dense)
    per_layer, ends = held.layers, held.ends
    if not config.tie_word_embeddings:  # the embedding lookup reads one row, the head all of its own
        embed = {n: i for n, i in checkpoint.tensors.items() if n.startswith("model.embed_tokens.")}
        ends -= sum(i.nbytes for i in embed.values()) * (4 if dense else 1)  # approximate
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * context
    return {"weights": sum(per_layer) + ends, "kv_cache": kv, "total": sum(per_layer) + ends + kv}


def main() -> None:
    parser = common.arguments(__doc__, warmup=False)
    args = parser.parse_args()
    cores = os.cpu_count() or 1

    print(f"bandwidth; load {common.load_average()}", flush=True)
    bw_runs = common.interleave({
        "numpy sum, 1 process": lambda: {"gbps": python_gbps(SUM)},
        f"numpy sum, {cores} processes": lambda: {"gbps": python_gbps(SUM, cores)},
        "MLX fp32 matvec + BLAS": lambda: {"gbps": python_gbps(MATVEC)},
        "numpy fp32 matvec (its own OpenBLAS: sgemv)": lambda: {"gbps": python_gbps(NUMPY_MATVEC)},
    }, args.runs, warmup=1)
    bandwidth = {k: common.summary([r["gbps"] for r in rs]) for k, rs in bw_runs.items()}
    machine_bw = max(v["median"] for k, v in bandwidth.items() if k.startswith("numpy"))
    one_core_bw = bandwidth["numpy sum, 1 process"]["median"]

    results = {}
    for name, (factory, prompt_tokens, new_tokens) in MODELS.items():
        model = factory()
        text, ids = common.prompt_of(model, prompt_tokens)
        print(f"{name}: load {common.load_average()}", flush=True)
        runs = common.interleave({
            mode: (lambda mode=mode: common.run_pipeline(1, model, text, new_tokens, "--weights-in-memory", mode))
            for mode in ("fp32", "quantized")}, args.runs, warmup=1)
        modes = {}
        for mode, rs in runs.items():
            nbytes = bytes_per_token(model, mode == "fp32", len(ids) + new_tokens // 2)
            decode = common.summary([r["decode_tps"] for r in rs])
            achieved = nbytes["total"] * decode["median"] / 1e9
            modes[mode] = {"bytes_per_token": nbytes, "decode_tps": decode, "achieved_gbps": achieved,
                           "fraction_of_machine_bw": achieved / machine_bw,
                           "fraction_of_one_core_bw": achieved / one_core_bw,
                           "roofline_tps": machine_bw * 1e9 / nbytes["total"]}
            print(f"  {mode}: {nbytes['total'] / 2**20:.0f} MiB/token x {decode['median']:.2f} tok/s = "
                  f"{achieved:.2f} GB/s = {achieved / machine_bw:.0%} of {machine_bw:.1f} GB/s", flush=True)
        results[name] = {"folder": str(model), "prompt_tokens": len(ids), "new_tokens": new_tokens,
                         "modes": modes, "runs": runs}

    payload = common.record("roofline", "2f: weight bytes per decoded token / time vs measured read bandwidth",
                            runs=args.runs, load_after=common.load_average(), bandwidth_gbps=bandwidth,
                            machine_bandwidth_gbps=machine_bw, models=results)
    path = common.write_json("roofline", payload)
    plot(payload)
    print(f"wrote {path}")


def plot(payload: dict) -> None:
    fig, axes = common.figure(2, width=5.5)
    bw = payload["bandwidth_gbps"]
    common.bars(axes[0], "read bandwidth (GB/s)", list(bw), {"GB/s": [bw[k] for k in bw]}, "GB/s")
    axes[0].tick_params(axis="x", labelsize=6)
    models = list(payload["models"])
    series = {}
    for mode in ("fp32", "quantized"):
        series[f"decode, weights {mode}"] = [
            {"n": 1, "median": payload["models"][m]["modes"][mode]["achieved_gbps"],
             "min": payload["models"][m]["modes"][mode]["bytes_per_token"]["total"]
             * payload["models"][m]["modes"][mode]["decode_tps"]["min"] / 1e9,
             "max": payload["models"][m]["modes"][mode]["bytes_per_token"]["total"]
             * payload["models"][m]["modes"][mode]["decode_tps"]["max"] / 1e9} for m in models]
    common.bars(axes[1], "bytes read per token x decode tok/s (GB/s)", models, series, "GB/s")
    axes[1].axhline(payload["machine_bandwidth_gbps"], color="red", ls="--", lw=1, label="machine read bandwidth")
    fig.suptitle("2f roofline (median, min-max)", fontsize=10)
    common.save(fig, common.RESULTS / "roofline.png", axes[1])


if __name__ == "__main__":
    main()
