"""Every benchmark, one after another, at one clean commit, then the tables (report.py).

The tables in benchmarks/README.md must come from one commit with no uncommitted changes to code,
measured on a quiet machine: this runs each benchmark with the arguments below, refuses a tree
with uncommitted changes (results aside), stops at the first failure (its output is above), and
prints the wall time of each step. Leave the machine alone while it runs.

    python benchmarks/run_all.py [--runs N] [--only NAME,...] [--skip NAME,...] [--list] [--dry-run]

--runs overrides each step's own run count (most default to 2 here, which fits all of them in
about 100 minutes on a 2-core machine; 5 gives tighter spreads in about four hours).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# name, script and arguments, its runs here (None: the script takes no --runs), minutes at those runs
STEPS = [
    ("single", ["bench_single.py"], 2, 20),
    ("batch_throughput", ["batch_throughput.py", "--save"], 3, 5),
    ("batch", ["bench_batch.py"], 2, 7),
    ("mlx_pipeline", ["bench_mlx_pipeline.py"], 2, 7),
    ("mlx_pipeline_batch", ["bench_mlx_pipeline_batch.py"], 2, 5),
    ("hop", ["bench_hop.py"], 3, 3),
    ("memory", ["bench_memory.py"], 2, 6),
    ("roofline", ["bench_roofline.py"], 2, 5),
    ("vs_llamacpp", ["vs_llamacpp.py", "--warmup", "0", "--prompt-tokens", "256", "--new-tokens", "64",
                     "--batch-new", "32", "--models", "smollm2,llama-1b-q4_0"], 2, 9),
    ("load_speed", ["load_speed.py"], 2, 10),
    ("gguf_load", ["gguf_load.py", "--skip-big"], 2, 3),
    ("speculative", ["speculative.py"], 3, 15),
    ("serve_load", ["serve_load.py", "--multi-turn"], 2, 15),
    ("moe_memory", ["moe_memory.py"], None, 2),
    ("int8_accuracy", ["int8_accuracy.py"], None, 1),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=None, help="runs for every step that takes --runs")
    parser.add_argument("--only", default="", help="comma-separated step names")
    parser.add_argument("--skip", default="", help="comma-separated step names")
    parser.add_argument("--list", action="store_true", help="print the steps and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()

    names = [name for name, *_ in STEPS]
    only, skip = [n for n in args.only.split(",") if n], [n for n in args.skip.split(",") if n]
    for name in only + skip:
        if name not in names:
            raise SystemExit(f"error: no benchmark step {name!r}; the steps are {', '.join(names)}")
    steps = [s for s in STEPS if (not only or s[0] in only) and s[0] not in skip]
    commands = []
    for name, script, runs, minutes in steps:
        runs = args.runs if args.runs is not None and runs is not None else runs
        cmd = [sys.executable, str(common.REPO / "benchmarks" / script[0]), *script[1:]]
        commands.append((name, cmd + (["--runs", str(runs)] if runs is not None else []), minutes))
    if args.list or args.dry_run:
        for name, cmd, minutes in commands:
            print(f"{name:20s} ~{minutes:3d} min  {' '.join(cmd[1:])}")
        print(f"{'':20s} ~{sum(m for *_, m in commands):3d} min in all (at the default runs)")
        return

    git = common.git_commit()
    if git["dirty"]:
        raise SystemExit("error: the tree has uncommitted changes to code; commit them first, "
                         "so that the tables come from one clean commit")
    print(f"benchmarks at commit {git['commit'][:8]}: {len(commands)} steps, "
          f"about {sum(m for *_, m in commands)} min; leave the machine alone", flush=True)
    took = []
    for name, cmd, _ in commands:
        print(f"\n=== {name} ({time.strftime('%H:%M:%S')}): {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        if subprocess.run(cmd, cwd=common.REPO).returncode != 0:
            raise SystemExit(f"error: benchmark step {name} failed (its output is above); "
                             f"rerun the rest with --only or --skip")
        took.append((name, time.perf_counter() - start))
        if common.git_commit()["commit"] != git["commit"]:
            raise SystemExit(f"error: HEAD moved during the run (after {name}); the tables would mix commits")
        if name == "single":  # a full rerun supersedes the targeted reruns (bench_single.py --name ...)
            for extra in common.RESULTS.glob("single_*.*"):
                extra.unlink()
    subprocess.run([sys.executable, str(common.REPO / "benchmarks" / "report.py")], cwd=common.REPO, check=True)
    for name, seconds in took:
        print(f"{name:20s} {seconds / 60:6.1f} min")


if __name__ == "__main__":
    main()
