"""2c. Two ranks, single stream: `mpiexec -n 2 python -m pipeline generate` against mlx-lm's own
pipeline mode (`PipelineMixin.pipeline` through `mlx_lm.utils.sharded_load`, launched with
`mlx.launch --backend ring -n 2`) on a family both can split: a random Qwen2-0.5B-shaped model
(24 layers, hidden 896, GQA 14/2, tied embeddings, SmolLM2's vocabulary; 4-bit group 64, bf16
scales, two shards with an index as sharded_load requires), made once under
$PIPELINE_CACHE/bench-models.

Contenders, interleaved run by run:
  pipeline                       2 ranks as shipped (OpenBLAS, 1 thread per rank, weights auto -> fp32)
  pipeline quantized             --weights-in-memory quantized
  mlx-lm pipeline                as installed (bundled reference BLAS)
  mlx-lm pipeline+OpenBLAS       OpenBLAS loaded first, OPENBLAS_NUM_THREADS=1 per rank
  mlx-lm pipeline+OpenBLAS+fp32 weights
mlx-lm's floats are cast to fp32 as in 2a. The batch half of 2c: bench_mlx_pipeline_batch.py.

    python benchmarks/bench_mlx_pipeline.py [--runs 5]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

QWEN2_05B = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64, hidden_act="silu",
                 rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                 torch_dtype="bfloat16")
KEYS = ["prefill_tps", "decode_tps", "ttft_s"]


def qwen2_05b() -> Path:
    return common.random_model("qwen2-0.5b-4bit", QWEN2_05B, shards=2)


def run_mlx_lm_pipeline(model: Path, ids: list[int], new_tokens: int, *, openblas: bool, dense: bool,
                        ranks: int = 2, prompts: Path | None = None) -> dict:
    """One mlx-lm pipeline-mode job: `ids` through stream_generate, or the batch in the JSON file
    `prompts` through batch_generate."""
    launcher = shutil.which("mlx.launch")
    cmd = [launcher, "--backend", "ring", "-n", str(ranks)]
    if openblas:
        cmd += ["--env", "OPENBLAS_NUM_THREADS=1"]
    cmd += [sys.executable, str(common.REPO / "benchmarks" / "_mlx_lm_pipeline_run.py"), "--model", str(model),
            "--max-tokens", str(new_tokens)]
    cmd += ["--prompts", str(prompts)] if prompts else ["--prompt-ids", ",".join(map(str, ids))]
    if openblas:
        cmd += ["--blas", common.OPENBLAS]
    if dense:
        cmd.append("--dense")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.REPO, env=common.env_with_repo(),
                          timeout=1800)
    lines = [l for l in proc.stdout.splitlines() + proc.stderr.splitlines() if l.startswith("{")]
    if not lines:
        raise RuntimeError(f"mlx-lm pipeline run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1])
    out["wall_s"] = time.perf_counter() - start
    return out


def main() -> None:
    parser = common.arguments(__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    model = qwen2_05b()
    text, ids = common.prompt_of(model, args.prompt_tokens)
    print(f"{model} ({common.param_count(model) / 1e9:.3f} B parameters), prompt {len(ids)} tokens, "
          f"{args.new_tokens} new; load {common.load_average()}", flush=True)
    pipe = lambda *extra: lambda: common.run_pipeline(2, model, text, args.new_tokens, *extra)  # noqa: E731
    theirs = lambda **kw: lambda: run_mlx_lm_pipeline(model, ids, args.new_tokens, **kw)  # noqa: E731
    runs = common.interleave({
        "pipeline": pipe(),
        "pipeline quantized": pipe("--weights-in-memory", "quantized"),
        "mlx-lm pipeline": theirs(openblas=False, dense=False),
        "mlx-lm pipeline+OpenBLAS": theirs(openblas=True, dense=False),
        "mlx-lm pipeline+OpenBLAS+fp32 weights": theirs(openblas=True, dense=True),
    }, args.runs, args.warmup)
    stats = {c: common.summarize_runs(rs, KEYS) for c, rs in runs.items()}
    decode = {c: s["decode_tps"]["median"] for c, s in stats.items()}
    prefill = {c: s["prefill_tps"]["median"] for c, s in stats.items()}
    ratios = {f"{what} pipeline / {c}": table["pipeline"] / table[c]
              for what, table in (("decode", decode), ("prefill", prefill))
              for c in table if c.startswith("mlx-lm")}
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    texts = {c: rs[0]["text"] for c, rs in runs.items()}
    payload = common.record(
        "mlx_pipeline", "2c: two ranks, single stream: pipeline vs mlx-lm's pipeline mode (mlx.launch ring)",
        runs=args.runs, warmup=args.warmup, load_after=common.load_average(), folder=str(model),
        parameters=common.param_count(model), prompt_tokens=len(ids), new_tokens=args.new_tokens,
        same_text_as_pipeline={c: common.same_text(t, texts["pipeline"]) for c, t in texts.items()},
        stats=stats, ratios=ratios, runs_detail=runs)
    path = common.write_json("mlx_pipeline", payload)
    plot(payload)
    print(f"wrote {path}")


def plot(payload: dict) -> None:
    names = list(payload["stats"])
    fig, axes = common.figure(3, width=4.5)
    for ax, (key, label, log) in zip(axes, (("prefill_tps", "prefill tok/s", True), ("decode_tps", "decode tok/s", False),
                                            ("ttft_s", "time to first token (s)", True))):
        common.bars(ax, label, ["2 ranks"], {c: [payload["stats"][c][key]] for c in names}, label, log=log)
    fig.suptitle(f"2c two ranks, single stream, random Qwen2-0.5B 4-bit (median, min-max of {payload['runs']} runs)",
                 fontsize=10)
    common.save(fig, common.RESULTS / "mlx_pipeline.png", axes[1])


if __name__ == "__main__":
    main()
