"""Per-call time of a decode step's gathered expert product with int8 activations (qmm.gather_qmm): x's one
row and a row index per (token, expert) pair (each row rounded to int8 once) against the old form, the row
broadcast to every pair and materialized (rounded once per pair), through the same kernel. Shapes of the MoE
benchmark model (qwen3-moe-2b: hidden 2048, 64 experts of 256 features, top 8; --tensor-parallel 2 slices
each expert to 128): 1 token x 8 distinct experts, and 8 pairs x one expert (the profiler's case); then a
whole layer's experts for 1 token (SwitchGLU: now gate and up in one call with the SwiGLU, int8_gather_swiglu)
against the old calls (materialized rows, gate and up apart, the activation, down).

    python benchmarks/gather_rows.py [--calls 300] [--rounds 5] [--threads N]

Rounds interleave old and new; each figure is the median over rounds of the mean us per call (and the fastest
round's, steadier on a loaded host). The last line:
`HEADLINE: decode gathered product (n=128) new X us vs old Y us (R x)`. The machine's load is printed before
and after (a shared 2-core host: compare only figures from one run)."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pipeline.checkpoints.int8_repack import use_int8
from pipeline.kernels import build, qmm
from pipeline.models.experts import SwitchGLU


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="the kernels' threads (0: as loaded; a rank of "
                        "--tensor-parallel 2 has 1)")
    args = parser.parse_args()
    kernels = build.load().module
    if kernels is None:
        raise SystemExit("the kernels' extension did not build: nothing to measure")
    if args.threads:
        kernels.set_threads(args.threads)
    print(f"kernels' threads: {kernels.threads()}")
    print(f"load before: {os.getloadavg()}")
    rng = np.random.default_rng(0)
    k, experts, top = 2048, 64, 8
    headline = None
    for n in (128, 256):
        w, s, b = mx.quantize(mx.array(rng.standard_normal((experts, n, k)).astype(np.float32)), group_size=64, bits=4)
        packed = kernels.int8_repack(w, s.astype(mx.float16), b.astype(mx.float16), 64, 4)
        mx.eval(*packed)
        for label, chosen in (("1 token x 8 experts", rng.permutation(experts)[:top]), ("8 pairs x 1 expert", [5] * top)):
            x = mx.array(rng.standard_normal((1, 1, 1, k)).astype(np.float32))
            idx = mx.array(np.array(chosen, np.uint32)[None])
            mx.eval(x, idx)

            def new():
                return qmm.gather_qmm(x, *packed, rhs_indices=idx, group_size=64, bits=4, int8=True)

            def old():
                flat = mx.broadcast_to(x, (1, top, 1, k)).reshape(-1, k)
                return kernels.int8_gather_qmm(flat, *packed, idx.reshape(-1), 64, 4).reshape(1, top, 1, n)

            assert np.array_equal(np.array(new()), np.array(old()))
            times = {"old": [], "new": []}
            if args.threads:
                kernels.set_threads(args.threads)  # loading the package may have set the rank's count
            for _ in range(args.rounds):
                for name, f in (("old", old), ("new", new)):
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        mx.eval(f())
                    times[name].append((time.perf_counter() - start) / args.calls * 1e6)
            o, nw = statistics.median(times["old"]), statistics.median(times["new"])
            print(f"n={n} {label}: old {o:.1f} us, new {nw:.1f} us per call ({o / nw:.2f}x; fastest rounds "
                  f"{min(times['old']):.1f} vs {min(times['new']):.1f}; rounds old "
                  f"{[round(t, 1) for t in times['old']]} new {[round(t, 1) for t in times['new']]})")
            if n == 128 and headline is None:
                headline = f"HEADLINE: decode gathered product (n=128, {label}) new {nw:.1f} us vs old {o:.1f} us ({o / nw:.2f}x)"
    for n in (256, 128):  # a whole layer's experts, 1 token: gate and up (fused now), SwiGLU, down
        layer = SwitchGLU(k, n, experts)
        nn.quantize(layer, group_size=64, bits=4)
        use_int8(layer)
        mx.eval(layer.parameters())
        x = mx.array(rng.standard_normal((1, k)).astype(np.float32))
        idx = mx.array(rng.permutation(experts)[:top][None].astype(np.uint32))
        g, u, d = layer.gate_proj, layer.up_proj, layer.down_proj

        def layer_old():  # each pair's own copy of the row, gate and up apart, then the activation and down
            flat = mx.broadcast_to(x[:, None, None, :], (1, top, 1, k)).reshape(-1, k)
            pairs = idx.reshape(-1)
            gate, up = (kernels.int8_gather_qmm(flat, m.weight, m.scales, m.biases, pairs, 64, 4) for m in (g, u))
            h = nn.silu(gate) * up
            return kernels.int8_gather_qmm(h, d.weight, d.scales, d.biases, pairs, 64, 4).reshape(1, top, k)

        def layer_new():
            return layer(x, idx)

        assert np.array_equal(np.array(layer_new()), np.array(layer_old()))
        times = {"old": [], "new": []}
        if args.threads:
            kernels.set_threads(args.threads)
        for _ in range(args.rounds):
            for name, f in (("old", layer_old), ("new", layer_new)):
                start = time.perf_counter()
                for _ in range(args.calls):
                    mx.eval(f())
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
        o, nw = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"SwitchGLU decode step, {experts} experts of {n}: old {o:.1f} us, new {nw:.1f} us per layer "
              f"({o / nw:.2f}x; fastest rounds {min(times['old']):.1f} vs {min(times['new']):.1f})")
    print(f"load after: {os.getloadavg()}")
    print(headline)


if __name__ == "__main__":
    main()
