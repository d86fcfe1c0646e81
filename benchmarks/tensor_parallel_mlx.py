"""--tensor-parallel 2 over MLX's distributed group (`--transport mlx`, MLX's TCP ring on loopback here)
vs over MPI (`--transport mpi`, the in-graph group sum where it builds): single-stream decode of
benchmarks' llama-1b (random Llama-3.2-1B-shaped, MLX 4-bit g64, held quantized), 2 one-core ranks,
greedy, a raw prompt, interleaved run by run (mpi mlx mpi mlx ...; a warm-up pair kept apart). Both
must write the same text (checked). Prints one line: the median decode tok/s of each, their ratio, the
group sums' ms/token each rank reported, and the load average. First, one line of the bare exchange
on 2 ranks: microseconds per gather of 576 and 4608 float32s, MLX's ring `all_gather` (TCP, even on one
host) vs MPI's `Iallgather` polled (shared memory on one host), 300 of each, interleaved in 3 rounds.

    python benchmarks/tensor_parallel_mlx.py [--runs 3] [--warmup 1] [--tokens 32] [--model FOLDER] [--no-decode]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SUMS = re.compile(r"group sums ([\d.]+) ms/token")
PROMPT = "The capital of France is"


def run(model: Path, transport: str, tokens: int) -> dict:
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "pipeline", "generate", "--model", str(model), "--prompt",
           PROMPT, "--no-chat-template", "--max-tokens", str(tokens), "--weights-in-memory", "quantized",
           "--tensor-parallel", "2", "--transport", transport]
    load = os.getloadavg()[0]
    job = subprocess.run(cmd, capture_output=True, text=True, cwd=common.REPO, timeout=900)
    if job.returncode:
        raise SystemExit(f"{transport}: exit {job.returncode}: {job.stderr[-2000:]}")
    stats = common.parse_stats(job.stderr)
    sums = SUMS.search(job.stderr)
    return {"transport": transport, "decode_tps": stats["decode_tps"], "load": load, "text": job.stdout,
            "sums_ms": float(sums.group(1)) if sums else None}


def gather_worker() -> None:
    """Under mpiexec -n 2: the bare exchange (see the module docstring); rank 0 prints one line."""
    import json
    import socket
    import tempfile
    import time

    import pipeline  # noqa: F401 -- first, as a real run (BLAS binding)

    import mlx.core as mx
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    hosts = comm.allgather(endpoint)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[h] for h in hosts], f)
    os.environ["MLX_HOSTFILE"], os.environ["MLX_RANK"] = f.name, str(rank)
    group = mx.distributed.init(strict=True, backend="ring")
    os.unlink(f.name)
    calls, line = 300, []
    for n in (576, 4608):
        x = mx.random.normal((1, n))
        mx.eval(x)
        xn, out = np.array(x), np.empty((2, n), np.float32)
        took = {"mlx": [], "mpi": []}
        for _ in range(3):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(calls):
                mx.eval(mx.distributed.all_gather(x, group=group, stream=mx.cpu))
            took["mlx"].append((time.perf_counter() - start) / calls * 1e6)
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(calls):
                request = comm.Iallgather(xn, out)
                while not request.Test():
                    pass
            took["mpi"].append((time.perf_counter() - start) / calls * 1e6)
        line.append(f"{n} floats: mlx ring all_gather {statistics.median(took['mlx']):.0f} us, "
                    f"mpi Iallgather {statistics.median(took['mpi']):.0f} us")
    if rank == 0:
        print(f"gather on 2 ranks (medians of 3 x {calls}): " + "; ".join(line) +
              f"; load {os.getloadavg()[0]:.1f}", flush=True)


def main() -> None:
    if sys.argv[1:] == ["--gather-worker"]:
        gather_worker()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, default=None, help="default: benchmarks' llama-1b (made once)")
    parser.add_argument("--no-decode", action="store_true", help="the bare exchange's line only")
    args = parser.parse_args()
    job = subprocess.run(["mpiexec", "-n", "2", sys.executable, __file__, "--gather-worker"], capture_output=True,
                         text=True, cwd=common.REPO, timeout=600)
    print(job.stdout.strip() or f"gather: exit {job.returncode}: {job.stderr[-1000:]}", flush=True)
    if args.no_decode:
        return
    model = args.model or common.llama_1b()
    results = {"mpi": [], "mlx": []}
    for i in range(args.warmup + args.runs):
        for transport in ("mpi", "mlx"):
            r = run(model, transport, args.tokens)
            print(f"# run {i}{' (warm-up)' if i < args.warmup else ''} {transport}: decode {r['decode_tps']:.1f} "
                  f"tok/s, group sums {r['sums_ms']} ms/token, load {r['load']:.1f}", flush=True)
            if i >= args.warmup:
                results[transport].append(r)
    texts = {r["text"] for rs in results.values() for r in rs}
    mpi = statistics.median(r["decode_tps"] for r in results["mpi"])
    mlx = statistics.median(r["decode_tps"] for r in results["mlx"])
    loads = [r["load"] for rs in results.values() for r in rs]
    print(f"decode T=2 llama-1b: mlx {mlx:.1f} vs mpi {mpi:.1f} tok/s (mlx/mpi {mlx / mpi:.2f}x; medians of "
          f"{args.runs}); group sums mlx {statistics.median(r['sums_ms'] for r in results['mlx']):.1f} vs mpi "
          f"{statistics.median(r['sums_ms'] for r in results['mpi']):.1f} ms/token; same text: {len(texts) == 1}; "
          f"load {min(loads):.1f}-{max(loads):.1f}")


if __name__ == "__main__":
    main()
