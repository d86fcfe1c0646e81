"""TTFT of a long prompt with --tensor-parallel T: cold, and from the prompt cache on disk after a restart.

For each run: a fresh --prompt-cache-dir; a server (mpiexec -n RANKS serve --tensor-parallel T) answers a
prompt of --tokens random token ids cold and stops (its entry written by each member); a restarted server
answers the prompt extended by 20 tokens, its first request, from disk. The TTFT of each is the server's
own (its per-request stderr line: from the request's arrival to its first token). Prints one line per run
and the medians, with the load average:

    python benchmarks/prompt_cache_tensor_parallel.py [--model DIR] [--ranks 2] [--tensor-parallel 2]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class Server:
    def __init__(self, ranks: int, *args: str):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(["mpiexec", "-n", str(ranks), sys.executable, "-m", "pipeline", "serve",
                                      "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=REPO, env=env)
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        line = self.proc.stdout.readline()
        m = re.fullmatch(r"serving \S+ on http://127\.0\.0\.1:(\d+) with \d+ ranks?\n", line)
        if not m:
            self.proc.kill()
            raise SystemExit(f"the server did not start: {line!r}\n{''.join(self.err)}")
        self.port = int(m.group(1))

    def complete(self, prompt: list[int]) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1800)
        conn.request("POST", "/v1/completions", json.dumps({"model": "default", "prompt": prompt, "max_tokens": 4,
                                                            "temperature": 0}), {"content-type": "application/json"})
        body = json.loads(conn.getresponse().read())
        conn.close()
        return body

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(300)
        return "".join(self.err)


def ttft(stderr: str) -> float:
    return float(re.findall(r"TTFT ([0-9.]+) s", stderr)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the runtime's default model)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    model = ["--model", args.model] if args.model else []
    rng = random.Random(0)
    prompt = [rng.randrange(3, 10000) for _ in range(args.tokens)]
    turn = prompt + [rng.randrange(3, 10000) for _ in range(20)]
    cold, warm = [], []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as folder:
            flags = [*model, "--tensor-parallel", str(args.tensor_parallel), "--prompt-cache-dir", folder]
            first = Server(args.ranks, *flags)
            first.complete(prompt)
            cold.append(ttft(first.stop()))
            second = Server(args.ranks, *flags)
            cached = second.complete(turn)["usage"]["prompt_tokens_details"]["cached_tokens"]
            err = second.stop()
            warm.append(ttft(err))
            read = re.findall(r"read in ([0-9.]+) s", err)
            print(f"run {run}: TTFT cold {cold[-1]:.2f} s ({args.tokens} tokens), restored from disk {warm[-1]:.2f} s "
                  f"({cached} cached, rank 0 read {read[0] if read else '?'} s), load {os.getloadavg()[0]:.1f}",
                  flush=True)
    print(f"prompt cache on disk, T = {args.tensor_parallel} on {args.ranks} ranks, {args.tokens} tokens: TTFT cold "
          f"{statistics.median(cold):.2f} s, restored {statistics.median(warm):.2f} s "
          f"({statistics.median(cold) / statistics.median(warm):.1f}x), load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
