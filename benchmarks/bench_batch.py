"""2b. Batch jobs: `pipeline batch` on 1 and 2 ranks against mlx-lm's `batch_generate`, same
prompts (the same chat-templated token ids), greedy, same max tokens, one BLAS thread per rank
(OPENBLAS_NUM_THREADS=1: on 2 cores, 2 ranks have a core each) and mlx-lm's one process with as
many BLAS threads as there are cores: each side has the whole machine (1 rank: one core).

Contenders, interleaved run by run:
  pipeline batch, 1 rank            weights auto (fp32 here), OpenBLAS + the batch-invariant shim
  pipeline batch, 2 ranks
  pipeline batch, 2 ranks, per-sequence   PIPELINE_BLAS_SHIM=0: each sequence's products on their own
  mlx-lm batch_generate             after `import pipeline` (our BLAS set-up), fp32 weights: its best
  mlx-lm batch_generate, OpenBLAS   OpenBLAS loaded first, weights as in the folder (4-bit)
Throughput = generated tokens / time from the first prompt in to the last token out (load excluded).

    python benchmarks/bench_batch.py [--runs 5] [--requests 16] [--max-tokens 32]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow of winter", "a city under the sea", "an old clock",
          "a dragon who cannot fly", "a library at midnight", "a train across the desert"]
SUMMARY = re.compile(r"\[pipeline\] batch: (\d+) done, (\d+) error records, (\d+) tokens generated in ([\d.]+) s: "
                     r"([\d.]+) tok/s")
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1"}
ALL_CORES = {"OPENBLAS_NUM_THREADS": str(len(os.sched_getaffinity(0)))}  # mlx-lm: the cores our ranks use together


def prompts(count: int) -> list[str]:
    tasks = ["Write a short story about {}.", "Describe {} in vivid detail, in one paragraph."]
    texts = [t.format(topic) for t in tasks for topic in TOPICS]
    return [texts[i % len(texts)] for i in range(count)]


def write_inputs(folder: Path, texts: list[str], ids: list[list[int]], max_tokens: int) -> tuple[Path, Path]:
    """The same requests for both sides: JSONL for `pipeline batch`, token ids for mlx-lm."""
    requests, ids_file = folder / "requests.jsonl", folder / "ids.json"
    requests.write_text("".join(json.dumps({"id": i, "prompt": t, "max_tokens": max_tokens}) + "\n"
                                for i, t in enumerate(texts)))
    ids_file.write_text(json.dumps(ids))
    return requests, ids_file


def run_batch(ranks: int, model: Path, requests: Path, max_tokens: int, *extra: str, env: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        start = time.perf_counter()
        proc = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, "-m", "pipeline", "batch", "--model",
                               str(model), "--input", str(requests), "--output", str(out), "--quiet", "--max-tokens",
                               str(max_tokens), *extra], capture_output=True, text=True, cwd=common.REPO,
                              env=common.env_with_repo(**ONE_THREAD, **(env or {})), timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        m = SUMMARY.search(proc.stderr)
        texts = {r["id"]: r.get("text") for r in map(json.loads, out.read_text().splitlines())}
    return {"tokens": int(m[3]), "seconds": float(m[4]), "tok_s": float(m[5]), "wall_s": time.perf_counter() - start,
            "texts": [texts[i] for i in sorted(texts)]}


def run_mlx_lm_batch(model: Path, ids_file: Path, max_tokens: int, **flags) -> dict:
    cmd = [sys.executable, str(common.REPO / "benchmarks" / "_mlx_lm_batch_run.py"), "--model", str(model),
           "--prompts", str(ids_file), "--max-tokens", str(max_tokens)]
    if flags.get("pipeline_blas"):
        cmd.append("--pipeline-blas")
    if flags.get("openblas"):
        cmd += ["--blas", common.OPENBLAS]
    if flags.get("dense"):
        cmd.append("--dense")
    env = common.env_with_repo(**ALL_CORES, **({} if flags.get("pipeline_blas") else {"PIPELINE_BLAS": "bundled"}))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.REPO, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - start
    return out


def main() -> None:
    parser = common.arguments(__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    sys.path.insert(0, str(common.REPO))
    from pipeline.checkpoints.tokenizer import Tokenizer

    model = common.default_model()
    texts = prompts(args.requests)
    tokenizer = Tokenizer.from_folder(model)
    ids = [tokenizer.prompt_ids(t) for t in texts]
    with tempfile.TemporaryDirectory() as tmp:
        requests, ids_file = write_inputs(Path(tmp), texts, ids, args.max_tokens)
        print(f"{args.requests} requests, {sum(map(len, ids))} prompt tokens, up to {args.max_tokens} new each; "
              f"load {common.load_average()}", flush=True)
        runs = common.interleave({
            "pipeline batch, 1 rank": lambda: run_batch(1, model, requests, args.max_tokens),
            "pipeline batch, 2 ranks": lambda: run_batch(2, model, requests, args.max_tokens),
            "pipeline batch, 2 ranks, per-sequence": lambda: run_batch(2, model, requests, args.max_tokens,
                                                                       env={"PIPELINE_BLAS_SHIM": "0"}),
            "mlx-lm batch_generate, our BLAS + fp32 weights": lambda: run_mlx_lm_batch(
                model, ids_file, args.max_tokens, pipeline_blas=True, dense=True),
            "mlx-lm batch_generate, OpenBLAS": lambda: run_mlx_lm_batch(model, ids_file, args.max_tokens, openblas=True),
        }, args.runs, args.warmup)
    stats = {c: common.summarize_runs(rs, ["tok_s", "seconds"]) for c, rs in runs.items()}
    tps = {c: s["tok_s"]["median"] for c, s in stats.items()}
    base = "pipeline batch, 1 rank"
    ratios = {f"{c} / {base}": v / tps[base] for c, v in tps.items() if c != base}
    mine = "pipeline batch, 2 ranks"
    ratios.update({f"{mine} / {c}": tps[mine] / tps[c] for c in tps if c.startswith("mlx-lm")})
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    reference = runs[base][0]["texts"]
    same = {c: sum(a.strip() == b.strip() for a, b in zip(rs[0]["texts"], reference)) for c, rs in runs.items()}
    for rs in runs.values():
        for r in rs:
            r.pop("texts", None)
    payload = common.record("batch", "2b: pipeline batch on 1 and 2 one-core ranks vs mlx-lm batch_generate",
                            runs=args.runs, warmup=args.warmup, requests=args.requests, max_tokens=args.max_tokens,
                            prompt_tokens=sum(map(len, ids)), load_after=common.load_average(), stats=stats,
                            ratios=ratios, texts_equal_to_1_rank=same, runs_detail=runs,
                            mlx_lm_threads=int(ALL_CORES["OPENBLAS_NUM_THREADS"]))
    path = common.write_json("batch", payload)
    fig, axes = common.figure(1, width=7)
    common.bars(axes[0], f"2b batch: {args.requests} requests x {args.max_tokens} tokens, 1 BLAS thread per process",
                ["generated tok/s"], {c: [s["tok_s"]] for c, s in stats.items()}, "tok/s")
    common.save(fig, common.RESULTS / "batch.png", axes[0])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
