"""Batch throughput: `pipeline batch` on 1 rank vs N ranks (default 1 and 2), same requests.

32 chat requests of up to 64 new tokens each on the default model (SmolLM2-135M-Instruct), greedy,
every run a fresh `mpiexec` job with one BLAS thread per rank (OPENBLAS_NUM_THREADS=1), so on a
2-core machine each rank has a core of its own and 1 rank vs 2 ranks compares one core with two.
Prints generated tok/s (tokens over the scheduling time, model load excluded; the job's whole
wall time beside it), the ratio to 1 rank, each rank's idle share and the pipeline bubble from
the job's own summary, and whether every rank count produced the same texts.

    python benchmarks/batch_throughput.py [--ranks 1,2] [--requests 32] [--max-tokens 64] [--runs 1]
        [--no-warmup] [--packed] [--microbatches M[,M...]] [--split S] [--trace-dir DIR] [--json FILE] [--save]

--save writes benchmarks/results/batch_throughput.json (machine, versions, commit; README table
via report.py).

--packed also runs `--packed-matmuls` and counts the texts that differ from the exact runs.
A warm-up round runs every configuration once first and is kept out of the figures; the measured
rounds alternate the order of the configurations (1 then 2 ranks, then 2 then 1, ...).
Measure on an idle machine: the load average before each run is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow of winter", "a city under the sea", "an old clock",
          "a dragon who cannot fly", "a library at midnight", "a train across the desert", "a garden on Mars",
          "a detective cat", "the last bookshop", "a volcano island", "a paper boat", "a mountain village",
          "a time traveller's diary", "a quiet forest"]
TASKS = ["Write a short story about {}.", "Describe {} in vivid detail, in one paragraph."]

SUMMARY = re.compile(r"\[pipeline\] batch: (\d+) done, (\d+) error records, (\d+) tokens generated in ([\d.]+) s: "
                     r"([\d.]+) tok/s")
RANK = re.compile(r"\[pipeline\] rank (\d+).*: compute ([\d.]+) s, waiting to receive ([\d.]+) s, sending ([\d.]+) s, "
                  r"idle ([\d.]+)%")
BUBBLE = re.compile(r"pipeline bubble ([\d.]+)%")
SPLIT = re.compile(r"layers per rank ([\d,]+)")


def requests(count: int, max_tokens: int) -> list[dict]:
    prompts = [task.format(topic) for task in TASKS for topic in TOPICS]
    return [{"id": i, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens} for i in range(count)]


def run(ranks: int, inp: Path, out: Path, *extra: str) -> dict:
    out.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, "-m", "pipeline", "batch", "--input", str(inp),
                             "--output", str(out), "--quiet", *extra], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=3600)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{ranks} rank(s) failed:\n{result.stderr}")
    m = SUMMARY.search(result.stderr)
    idle = {int(r[0]): float(r[4]) for r in RANK.findall(result.stderr)}
    texts = {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}
    split = SPLIT.search(result.stderr)
    return {"ranks": ranks, "tokens": int(m[3]), "schedule_s": float(m[4]), "tok_s": float(m[5]), "job_wall_s": wall,
            "idle_percent": idle, "bubble_percent": float(BUBBLE.search(result.stderr)[1]), "load_before": load,
            "texts": texts, "stderr": result.stderr, "split": split[1] if split else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2", help="rank counts to compare, the first is the baseline (default 1,2)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=1, help="rounds, each running every rank count once, in "
                                                                "alternating order (default 1)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the warm-up round that runs every configuration once before the measured rounds")
    parser.add_argument("--microbatches", default=None,
                        help="--microbatches for the multi-rank runs; a comma list runs each (default: the command's)")
    parser.add_argument("--packed", action="store_true", help="also run with --packed-matmuls")
    parser.add_argument("--trace-dir", type=Path, default=None, help="write each run's --trace here")
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures to this file")
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: the default model)")
    parser.add_argument("--split", default=None, help="--split for the multi-rank runs (default: the command's)")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/batch_throughput.json")
    args = parser.parse_args()
    rank_counts = [int(r) for r in args.ranks.split(",")]
    modes = {"exact": ()} | ({"packed": ("--packed-matmuls",)} if args.packed else {})
    variants = [None] if args.microbatches is None else [int(m) for m in args.microbatches.split(",")]
    configs = [(ranks, m) for ranks in rank_counts for m in (variants if ranks > 1 else [None])]

    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "requests.jsonl"
        inp.write_text("".join(json.dumps(r) + "\n" for r in requests(args.requests, args.max_tokens)))
        runs = []
        # Round -1 is a warm-up (page cache, the BLAS shim's build, CPU clocks), kept out of the figures;
        # odd rounds run the configurations in reverse, so neither rank count always runs first.
        for round_ in range(-1 if args.warmup else 0, args.runs):
            for mode, flags in modes.items():
                for ranks, micro in (configs if round_ % 2 == 0 else configs[::-1]):
                    extra = [*flags, *(["--model", str(args.model)] if args.model else []),
                             *(["--microbatches", str(micro)] if micro else []),
                             *(["--split", args.split] if args.split and ranks > 1 else [])]
                    if args.trace_dir:
                        args.trace_dir.mkdir(parents=True, exist_ok=True)
                        extra += ["--trace", str(args.trace_dir / f"batch-{mode}-{ranks}ranks-m{micro or ranks}-{round_}.json")]
                    r = run(ranks, inp, Path(tmp) / f"out-{mode}-{ranks}.jsonl", *extra)
                    r["mode"], r["round"], r["microbatches"] = mode, round_, micro or ranks
                    if round_ >= 0:
                        runs.append(r)
                    print(f"{'warm-up' if round_ < 0 else f'round {round_}'} {mode:6s} {ranks} rank(s), {micro or ranks} micro-batches: {r['tokens']} tokens, "
                          f"{r['tok_s']:.1f} tok/s "
                          f"(schedule {r['schedule_s']:.1f} s, job {r['job_wall_s']:.1f} s), bubble "
                          f"{r['bubble_percent']:.1f}%, idle per rank {r['idle_percent']}, load before "
                          f"{r['load_before']:.2f}", flush=True)

    print()
    print(f"{args.requests} requests, up to {args.max_tokens} new tokens each, greedy, OPENBLAS_NUM_THREADS=1")
    print(f"{'mode':7s} {'ranks':>5s} {'mbs':>4s} {'tok/s':>8s} {'ratio':>6s} {'bubble':>7s}  idle per rank")
    table = []
    for mode in modes:
        base = statistics.median(r["tok_s"] for r in runs if r["mode"] == mode and r["ranks"] == rank_counts[0])
        for ranks, micro in configs:
            mine = [r for r in runs if r["mode"] == mode and r["ranks"] == ranks and r["microbatches"] == (micro or ranks)]
            tps = statistics.median(r["tok_s"] for r in mine)
            bubble = statistics.median(r["bubble_percent"] for r in mine)
            idle = {k: statistics.median(r["idle_percent"][k] for r in mine) for k in mine[0]["idle_percent"]}
            table.append({"mode": mode, "ranks": ranks, "microbatches": micro or ranks, "split": mine[0]["split"],
                          "tok_s": common.summary([r["tok_s"] for r in mine]), "ratio": tps / base,
                          "bubble_percent": bubble, "idle_percent": idle})
            print(f"{mode:7s} {ranks:5d} {micro or ranks:4d} {tps:8.1f} {tps / base:5.2f}x {bubble:6.1f}%  "
                  + ", ".join(f"r{k} {v:.1f}%" for k, v in sorted(idle.items())) + f"  split {mine[0]['split']}")
    reference = next(r["texts"] for r in runs if r["mode"] == "exact")
    identical = {}
    for mode in modes:
        same = all(r["texts"] == reference for r in runs if r["mode"] == mode)
        differing = max(sum(r["texts"][i] != reference[i] for i in reference) for r in runs if r["mode"] == mode)
        identical[mode] = same
        print(f"{mode}: texts {'identical to' if same else f'{differing} of {len(reference)} differ from'} "
              f"the first exact run, over every rank count and round")
    for r in runs:
        r.pop("texts"), r.pop("stderr")
    payload = {"requests": args.requests, "max_tokens": args.max_tokens, "table": table,
               "texts_identical_over_runs": identical, "runs_detail": runs}
    if args.json:
        args.json.write_text(json.dumps(payload, indent=1))
    if args.save:
        path = common.write_json("batch_throughput", common.record(
            "batch_throughput", "pipeline batch on 1 vs 2 one-core ranks, default model",
            runs=args.runs, load_after=common.load_average(), **payload))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
