"""2d. Per-hop overhead per token: pipeline's message transport against a raw mpi4py ping-pong
of the same bytes, two ranks on this host (MPICH shared memory).

  microbenchmark  `_hop_worker.py` round trips 0 -> 1 -> 0 of a FORWARD message of
                  [1, tokens, hidden] fp32 (MpiTransport: header with the sequence layout, payload,
                  mx<->numpy) vs blocking Send/Recv of the payload alone; per hop = round trip / 2.
                  Hidden sizes of SmolLM2 (576), Llama-3.2-1B (2048) and DeepSeek V3 (7168);
                  1 token (decode) and 16 tokens (a batch step).
  in situ         decode seconds per token of the default model on 2 ranks minus on 1 rank, both
                  with one BLAS thread per rank, halved (2 hops per token): an upper bound on what a
                  hop costs inside the real ring, since it also holds what 2 ranks lose besides the
                  hops (one rank overlaps building the next step's graph with computing this one;
                  a ring cannot, and each rank evaluates its own graph).

    python benchmarks/bench_hop.py [--runs 5] [--iters 2000]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SIZES = [(576, 1), (2048, 1), (7168, 1), (2048, 16), (7168, 16)]


def hop(mode: str, hidden: int, tokens: int, iters: int) -> dict:
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(common.REPO / "benchmarks" / "_hop_worker.py"),
                           mode, str(hidden), str(tokens), str(iters)], capture_output=True, text=True,
                          env=common.env_with_repo(), timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["per_hop_us"] = out.pop("per_hop_s") * 1e6
    return out


def main() -> None:
    parser = common.arguments(__doc__, warmup=False)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--in-situ-tokens", type=int, default=64)
    args = parser.parse_args()

    micro = {}
    for hidden, tokens in SIZES:
        label = f"h{hidden} x{tokens}"
        print(f"{label}: {hidden * tokens * 4} bytes; load {common.load_average()}", flush=True)
        runs = common.interleave({mode: (lambda m=mode: hop(m, hidden, tokens, args.iters))
                                  for mode in ("raw", "transport")}, args.runs, warmup=1)
        stats = {mode: common.summarize_runs(rs, ["per_hop_us"])["per_hop_us"] for mode, rs in runs.items()}
        micro[label] = {"hidden": hidden, "tokens": tokens, "bytes": hidden * tokens * 4, "stats": stats,
                        "ratio": stats["transport"]["median"] / stats["raw"]["median"],
                        "overhead_us": stats["transport"]["median"] - stats["raw"]["median"]}
        print(f"  transport / raw = {micro[label]['ratio']:.2f}x", flush=True)

    model = common.default_model()
    text, ids = common.prompt_of(model, 32)
    one_thread = {"OPENBLAS_NUM_THREADS": "1"}
    runs = common.interleave({
        f"{n} rank{'s' if n > 1 else ''}": (lambda n=n: common.run_pipeline(
            n, model, text, args.in_situ_tokens, "--weights-in-memory", "fp32", env=one_thread))
        for n in (1, 2)}, args.runs, warmup=1)
    per_token = {name: common.summary([1 / r["decode_tps"] * 1e3 for r in rs]) for name, rs in runs.items()}
    in_situ_us = (per_token["2 ranks"]["median"] - per_token["1 rank"]["median"]) / 2 * 1e3
    raw576 = micro["h576 x1"]["stats"]["raw"]["median"]
    in_situ = {"model": str(model), "decode_ms_per_token": per_token, "per_hop_us": in_situ_us,
               "ratio_to_raw": in_situ_us / raw576, "runs": runs}
    print(f"in situ: {in_situ_us:.1f} us per hop ({in_situ_us / raw576:.1f}x raw)")

    payload = common.record("hop", "2d: per-hop overhead per token vs raw mpi4py ping-pong",
                            runs=args.runs, iters=args.iters, load_after=common.load_average(),
                            micro=micro, in_situ=in_situ)
    path = common.write_json("hop", payload)
    plot(payload)
    print(f"wrote {path}")


def plot(payload: dict) -> None:
    labels = list(payload["micro"])
    fig, axes = common.figure(2, width=5.5)
    series = {mode: [payload["micro"][l]["stats"][mode] for l in labels] for mode in ("raw", "transport")}
    common.bars(axes[0], "per hop, 2 ranks on one host (us)", labels, series, "microseconds", log=True)
    situ = payload["in_situ"]["decode_ms_per_token"]
    common.bars(axes[1], "in situ: decode ms/token, SmolLM2, 1 BLAS thread/rank", list(situ),
                {"ms/token": [situ[k] for k in situ]}, "ms per token")
    fig.suptitle(f"2d hop overhead (median, min-max of {payload['runs']} runs)", fontsize=10)
    common.save(fig, common.RESULTS / "hop.png", axes[0])


if __name__ == "__main__":
    main()
