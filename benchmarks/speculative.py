"""Speculative decoding: decode tok/s of `pipeline generate --draft ngram` against `--draft none`.

Two kinds of prompts, through the model's chat template, greedy:
  (a) copy-heavy: repeat, correct or edit a given text (what prompt lookup is for)
  (b) open questions (nothing to look up: drafting must cost next to nothing)
Contenders, interleaved run by run, each a fresh process, on the default model (SmolLM2-135M):
  pipeline 1 rank / 2 ranks, --draft none and --draft ngram (acceptance and tokens per trip beside)
  mlx-lm+pipeline BLAS+fp32 weights: mlx-lm's stream_generate with exactly our BLAS set-up, in one
      process using the same cores (no draft: mlx-lm's speculation needs a smaller draft model with
      the same tokenizer, and none exists for SmolLM2-135M; llama.cpp's lookup decoding needs a
      build from source, see vs_llamacpp.py, so it is not run here)
Greedy texts must be identical with and without drafts; the JSON keeps every run.

    python benchmarks/speculative.py [--runs 3] [--max-tokens 96]
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog near the river bank. Pipeline parallel inference splits a "
        "model's layers across several machines, and hidden states travel from one to the next.")
PROMPTS = {
    "copy": [
        f"Repeat this text exactly, word for word: {TEXT}",
        "Correct the spelling mistakes in this text and return the corrected text only: The quik brown fox "
        "jumpd over the lazzy dog neer the rivr bank. Pipline paralel inferense splits a modle's layers acros "
        "several machins.",
        "Rewrite this Python function with type hints and return only the code:\n"
        "def add_all(values, start):\n    total = start\n    for value in values:\n        total = total + value\n"
        "    return total\n",
    ],
    "open": [
        "What is the capital of France? Answer in two sentences.",
        "Explain why the sky is blue.",
        "Write a short poem about autumn.",
    ],
}
DRAFT = re.compile(r"speculative: drafted (\d+), accepted (\d+) \((\d+)%\), ([\d.]+) tokens per trip")


def run_pipeline(ranks: int, model: Path, prompt: str, max_tokens: int, draft: str) -> dict:
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "pipeline", "generate", "--model", str(model),
           "--prompt", prompt, "--max-tokens", str(max_tokens), "--draft", draft]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.REPO, env=common.env_with_repo(),
                          timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    out = common.parse_stats(proc.stderr)
    m = DRAFT.search(proc.stderr)
    if m:
        out.update(drafted=int(m.group(1)), accepted=int(m.group(2)), acceptance=int(m.group(3)) / 100,
                   tokens_per_trip=float(m.group(4)))
    out["wall_s"] = time.perf_counter() - start
    out["text"] = proc.stdout.rstrip("\n")
    return out


def main() -> None:
    parser = common.arguments(__doc__)
    parser.set_defaults(runs=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    model = common.default_model()
    sys.path.insert(0, str(common.REPO))
    from pipeline.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(model)
    results = {}
    for kind, prompts in PROMPTS.items():
        for i, prompt in enumerate(prompts):
            ids = tokenizer.prompt_ids(prompt)
            contenders = {
                f"pipeline {n} rank{'s' * (n > 1)}, draft {d}":
                    (lambda n=n, d=d: run_pipeline(n, model, prompt, args.max_tokens, d))
                for n in (1, 2) for d in ("none", "ngram")}
            contenders["mlx-lm+pipeline BLAS+fp32 weights"] = lambda: common.run_mlx_lm(
                model, ids, args.max_tokens, openblas=False, dense=True, pipeline_blas=True)
            print(f"{kind} {i}: {prompt[:60]!r} ({len(ids)} tokens); load {common.load_average()}", flush=True)
            runs = common.interleave(contenders, args.runs, args.warmup)
            texts = {c: rs[0].get("text") for c, rs in runs.items()}
            for n in (1, 2):
                plain = f"pipeline {n} rank{'s' * (n > 1)}, draft none"
                assert texts[plain.replace("none", "ngram")] == texts[plain], (kind, i, n)
            results[f"{kind} {i}"] = {
                "kind": kind, "prompt": prompt, "prompt_tokens": len(ids),
                "stats": {c: common.summarize_runs(rs, ["decode_tps", "acceptance", "tokens_per_trip"])
                          for c, rs in runs.items()},
                "runs": runs}

    summary = {}
    for kind in PROMPTS:
        for n in (1, 2):
            base = f"pipeline {n} rank{'s' * (n > 1)}, draft "
            speedups = [r["stats"][base + "ngram"]["decode_tps"]["median"] / r["stats"][base + "none"]["decode_tps"]["median"]
                        for r in results.values() if r["kind"] == kind]
            acceptance = [r["stats"][base + "ngram"]["acceptance"]["median"] for r in results.values() if r["kind"] == kind]
            summary[f"{kind}, {n} rank{'s' * (n > 1)}: ngram / none decode"] = {
                "per_prompt": speedups, "mean": sum(speedups) / len(speedups),
                "acceptance_per_prompt": acceptance}
            print(f"{kind}, {n} ranks: ngram/none decode {', '.join(f'{s:.2f}x' for s in speedups)} "
                  f"(acceptance {', '.join(f'{a:.0%}' for a in acceptance if a is not None)})", flush=True)
    payload = common.record("speculative", "speculative decoding: --draft ngram vs none, copy-heavy and open prompts",
                            runs=args.runs, warmup=args.warmup, max_tokens=args.max_tokens,
                            load_after=common.load_average(), summary=summary, prompts=results)
    path = common.write_json("speculative", payload)
    plot(payload)
    print(f"wrote {path}")


def plot(payload: dict) -> None:
    prompts = list(payload["prompts"])
    names = list(payload["prompts"][prompts[0]]["stats"])
    fig, axes = common.figure(1, width=11)
    series = {c: [payload["prompts"][p]["stats"][c]["decode_tps"] for p in prompts] for c in names}
    common.bars(axes[0], "decode tok/s", prompts, series, "decode tok/s")
    fig.suptitle(f"speculative decoding, default model ({payload['machine']['cores']} cores; median, min-max of "
                 f"{payload['runs']} runs)", fontsize=10)
    common.save(fig, common.RESULTS / "speculative.png", axes[0])


if __name__ == "__main__":
    main()
