"""2a. One rank, batch 1: prefill tok/s, decode tok/s and time to first token of
`pipeline generate` against mlx-lm's `stream_generate` on the same model folder.

Contenders, interleaved run by run, each run a fresh process:
  pipeline                      `mpiexec -n 1 python -m pipeline generate` as shipped (OpenBLAS loaded,
                                --weights-in-memory auto, which picks fp32 here)
  pipeline quantized            the same with --weights-in-memory quantized
  pipeline netlib               (SmolLM2 only) PIPELINE_BLAS=bundled: MLX's bundled reference BLAS
  mlx-lm                        mlx_lm.load + stream_generate as installed (bundled reference BLAS)
  mlx-lm+OpenBLAS               the same with OpenBLAS loaded into the process first
  mlx-lm+OpenBLAS+fp32 weights  and its quantized layers dequantized to fp32 after loading
  mlx-lm+pipeline BLAS+fp32 weights  `import pipeline` first (OpenBLAS, threads and the
                                BLAS shim exactly as ours), fp32 weights: the same kernels
                                as pipeline, so only the runtimes differ
mlx-lm's floats are cast to fp32 (pipeline's activation dtype; in fp16/bf16 MLX's CPU kernels are
20x slower, see `--as-published` in _mlx_lm_run.py). Same prompt token ids, greedy, same counts.

Models: the default SmolLM2-135M-Instruct folder, and a random Llama-3.2-1B-shaped model (4-bit,
group 64, bf16 scales, made once under $PIPELINE_CACHE/bench-models, never committed).

    python benchmarks/bench_single.py [--runs 5] [--models smollm2,llama-1b]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MODELS = {
    # name: (folder factory, prompt tokens, new tokens)
    "smollm2": (common.default_model, 128, 32),
    "llama-1b": (common.llama_1b, 64, 16),
}
KEYS = ["prefill_tps", "decode_tps", "ttft_s", "peak_rss_mib"]


def contenders(model: Path, name: str, text: str, ids: list[int], new_tokens: int) -> dict:
    pipe = lambda *extra, env=None: lambda: common.run_pipeline(1, model, text, new_tokens, *extra, env=env)  # noqa: E731
    mlx = lambda **kw: lambda: common.run_mlx_lm(model, ids, new_tokens, **kw)  # noqa: E731
    out = {
        "pipeline": pipe(),
        "pipeline quantized": pipe("--weights-in-memory", "quantized"),
        "mlx-lm": mlx(openblas=False, dense=False, env={"PIPELINE_BLAS": "bundled"}),
        "mlx-lm+OpenBLAS": mlx(openblas=True, dense=False),
        "mlx-lm+OpenBLAS+fp32 weights": mlx(openblas=True, dense=True),
        "mlx-lm+pipeline BLAS+fp32 weights": mlx(openblas=False, dense=True, pipeline_blas=True),
    }
    if name == "smollm2":
        out["pipeline netlib"] = pipe(env={"PIPELINE_BLAS": "bundled"})
    return out


def main() -> None:
    parser = common.arguments(__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--contenders", default=None,
                        help="comma-separated subset of the contenders (default all; ratios need 'pipeline' and the "
                             "mlx-lm ones)")
    parser.add_argument("--name", default="single", help="results/NAME.json and .png (default single)")
    args = parser.parse_args()

    results = {}
    for name in args.models.split(","):
        factory, prompt_tokens, new_tokens = MODELS[name]
        model = factory()
        text, ids = common.prompt_of(model, prompt_tokens)
        print(f"{name}: {model} ({common.param_count(model) / 1e9:.3f} B parameters), prompt {len(ids)} tokens, "
              f"{new_tokens} new tokens; load {common.load_average()}", flush=True)
        chosen = contenders(model, name, text, ids, new_tokens)
        if args.contenders:
            chosen = {c: f for c, f in chosen.items() if c in args.contenders.split(",")}
        runs = common.interleave(chosen, args.runs, args.warmup)
        for rs in runs.values():
            for r in rs:
                r["peak_rss_mib"] = max(r["peak_rss"]) / 2**20
        texts = {c: rs[0]["text"] for c, rs in runs.items()}
        stats = {c: common.summarize_runs(rs, KEYS) for c, rs in runs.items()}
        decode = {c: s["decode_tps"]["median"] for c, s in stats.items()}
        prefill = {c: s["prefill_tps"]["median"] for c, s in stats.items()}
        ratios = {f"{what} pipeline / {c}": table["pipeline"] / table[c]
                  for what, table in (("decode", decode), ("prefill", prefill)) for c in table
                  if c.startswith("mlx-lm") and "pipeline" in table}
        results[name] = {
            "folder": str(model), "parameters": common.param_count(model), "prompt_tokens": len(ids),
            "new_tokens": new_tokens,
            "generated": {c: rs[0]["generated"] for c, rs in runs.items()},
            "same_text_as_pipeline": {c: common.same_text(t, texts["pipeline"]) for c, t in texts.items()},
            "stats": stats,
            "ratios": ratios,
            "runs": runs,
        }
        for key, value in results[name]["ratios"].items():
            print(f"  {key}: {value:.2f}x", flush=True)

    payload = common.record(args.name, "2a: one rank, batch 1, pipeline generate vs mlx-lm stream_generate",
                            runs=args.runs, warmup=args.warmup, load_after=common.load_average(), models=results)
    path = common.write_json(args.name, payload)
    plot(payload)
    print(f"wrote {path}")


def plot(payload: dict) -> None:
    models = list(payload["models"])
    names = []
    for m in models:
        for c in payload["models"][m]["stats"]:
            if c not in names:
                names.append(c)
    fig, axes = common.figure(3, width=5.5)
    for ax, (key, label, log) in zip(axes, (("prefill_tps", "prefill tok/s", True),
                                            ("decode_tps", "decode tok/s", False),
                                            ("ttft_s", "time to first token (s)", True))):
        series = {c: [payload["models"][m]["stats"].get(c, {}).get(key) for m in models] for c in names}
        common.bars(ax, label, models, series, label, log=log)
    fig.suptitle(f"2a single rank, batch 1 ({payload['machine']['cores']} cores; median, min-max of "
                 f"{payload['runs']} runs)", fontsize=10)
    common.save(fig, common.RESULTS / f"{payload['benchmark']}.png", axes[1])


if __name__ == "__main__":
    main()
