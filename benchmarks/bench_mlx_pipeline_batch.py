"""2c, batch half. Two ranks, a batch of requests: `mpiexec -n 2 python -m pipeline batch` against
mlx-lm's own pipeline mode running `batch_generate` (`sharded_load(pipeline_group=...)`, launched with
`mlx.launch --backend ring -n 2`), on the random Qwen2-0.5B-shaped 4-bit model of
bench_mlx_pipeline.py. One BLAS thread per rank (each rank a core of its own on 2 cores).

Contenders, interleaved run by run (same prompts as token ids, greedy, same new-token budget):
  pipeline batch, 2 ranks                   as shipped (weights auto -> fp32, OpenBLAS + shim)
  mlx-lm pipeline batch+OpenBLAS+fp32 weights   mlx-lm's fastest set-up on this CPU (see 2c)
  mlx-lm pipeline batch                     as installed (bundled reference BLAS, 4-bit weights)
Throughput = generated tokens / time from the first prompt in to the last token out (load excluded).

    python benchmarks/bench_mlx_pipeline_batch.py [--runs 5] [--requests 8] [--max-tokens 24]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_batch import prompts, run_batch, write_inputs  # noqa: E402
from bench_mlx_pipeline import qwen2_05b, run_mlx_lm_pipeline  # noqa: E402

KEYS = ["tok_s", "seconds"]


def main() -> None:
    parser = common.arguments(__doc__)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    model = qwen2_05b()
    texts = prompts(args.requests)
    ids = [common.prompt_ids(model, t) for t in texts]
    with tempfile.TemporaryDirectory() as tmp:
        requests, ids_file = write_inputs(Path(tmp), texts, ids, args.max_tokens)
        print(f"{model}: {args.requests} requests, {sum(map(len, ids))} prompt tokens, up to {args.max_tokens} new "
              f"each; load {common.load_average()}", flush=True)
        theirs = lambda **kw: lambda: run_mlx_lm_pipeline(model, [], args.max_tokens, prompts=ids_file,  # noqa: E731
                                                          **kw)
        runs = common.interleave({
            "pipeline batch, 2 ranks": lambda: run_batch(2, model, requests, args.max_tokens, "--no-chat-template"),
            "mlx-lm pipeline batch+OpenBLAS+fp32 weights": theirs(openblas=True, dense=True),
            "mlx-lm pipeline batch": theirs(openblas=False, dense=False),
        }, args.runs, args.warmup)
    stats = {c: common.summarize_runs(rs, KEYS) for c, rs in runs.items()}
    tps = {c: s["tok_s"]["median"] for c, s in stats.items()}
    ours = "pipeline batch, 2 ranks"
    ratios = {f"{ours} / {c}": tps[ours] / tps[c] for c in tps if c != ours}
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    reference = runs[ours][0]["texts"]
    same = {c: sum(common.same_text(a, b) for a, b in zip(rs[0]["texts"], reference)) for c, rs in runs.items()}
    for rs in runs.values():
        for r in rs:
            r.pop("texts", None)
    payload = common.record(
        "mlx_pipeline_batch", "2c, batch: two ranks, a batch of requests: pipeline batch vs mlx-lm's pipeline "
        "mode with batch_generate (mlx.launch ring)", runs=args.runs, warmup=args.warmup,
        load_after=common.load_average(), folder=str(model), parameters=common.param_count(model),
        requests=args.requests, prompt_tokens=sum(map(len, ids)), max_tokens=args.max_tokens,
        same_text_as_pipeline=same, stats=stats, ratios=ratios, runs_detail=runs)
    path = common.write_json("mlx_pipeline_batch", payload)
    common.bar_chart(common.RESULTS / "mlx_pipeline_batch.png",
                     f"2c batch: {args.requests} requests x {args.max_tokens} new tokens, 2 ranks, random Qwen2-0.5B "
                     f"(median, min-max of {args.runs} runs)", ["2 ranks"],
                     {c: [s["tok_s"]] for c, s in stats.items()}, "generated tok/s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
