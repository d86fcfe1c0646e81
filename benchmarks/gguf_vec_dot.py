"""One-row (decode) products of the GGUF types held in their own blocks, and the tied Q8_0 head, per call, against
this machine's memcpy bandwidth (issue 37's "a one-row product at memory bandwidth"). No llama.cpp, no pytest.

    python benchmarks/gguf_vec_dot.py [--types Q6_K,IQ4_NL,...] [--threads 1] [--reps 7] [--json out.json]
                                      [--rows 1] [--streamed]

Each type: a 576 x 1536 matrix (SmolLM2's ffn_down: n = 576 outputs, k = 1536 inputs) of random block bytes (the
speed of the integer paths does not depend on the values), one row of x, `--calls` independent products evaluated
together (so MLX's per-evaluation cost is shared), the least CPU time per product over `--reps` repeats (CPU time:
the process's, so that other users of the cores count less than in wall time; 1 thread). GB/s: the matrix's bytes
in its blocks over that time; the memcpy figure: numpy copying 64 MiB, bytes read per second. The Q8_0 head:
SmolLM2's tied embedding (49152 x 576) from the file's blocks (gguf_q8_0_matmul), from MLX's 8-bit layout read in
place (int8_rows_matmul) and from the int8 copy those replace (int8_matmul), 1 and 4 rows. Prints a table; states
the load average before and after. --rows R: R rows of x a product (a batch's or a prompt's products), the times
per product. --streamed: each type's int8 product on one row over 64 MiB of distinct matrices (each read from
memory, as a model's layers are between tokens; the matrices in cache above), one product at a time, wall time
per product (best of --reps): what decode pays. Q4_0, Q4_1, Q8_0 (not in the default list): held as MLX's 4/8-bit
layout, int8 products on its int8 repack (int8_matmul), as GGUF files of those types load with int8 activations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mlx.core as mx  # noqa: E402

from pipeline.checkpoints import quants  # noqa: E402
from pipeline.kernels import build, qmm  # noqa: E402

# type -> bytes per 256 values (block size, type size: gguf's GGML_QUANT_SIZES, scaled to 256 values)
ROW_BYTES = {"Q6_K": 210, "IQ4_NL": 144, "IQ4_XS": 136, **{t: b for t, (_, b) in quants.BLOCKS.items()}}
# held as MLX's 5-bit codes and float16 d (and m): int8 products gguf_q5_kernels.cpp, float ones qmm_kernels.cpp's
Q5_TYPES = {"Q5_0": (6, 176), "Q5_1": (7, 192)}
ROW_BYTES.update({t: b for t, (_, b) in Q5_TYPES.items()})
# held as MLX's 4/8-bit affine layout (quants.decode_exact): int8 products int8_kernels.cpp's int8_matmul on the int8
# repack (block_tile), float ones qmm_kernels.cpp's quantized_matmul; not in the default list (--types Q4_0,...)
MLX_TYPES = {"Q4_0": (4, 144), "Q4_1": (4, 160), "Q8_0": (8, 272)}
ROW_BYTES.update({t: b for t, (_, b) in MLX_TYPES.items()})
DEFAULT_TYPES = ("Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                 "IQ1_S", "IQ1_M", "TQ2_0", "TQ1_0", "Q5_0", "Q5_1")


def memcpy_gbps(reps: int) -> float:
    a = np.ones(64 << 20, np.uint8)
    b = np.empty_like(a)
    best = min(_cpu(lambda: np.copyto(b, a)) for _ in range(reps))
    return a.nbytes / best / 1e9


def _cpu(f) -> float:
    t = time.process_time()
    f()
    return time.process_time() - t


def random_raw(rng, qtype: str, n: int, k: int) -> np.ndarray:
    """Random block bytes: the integer paths' speed does not depend on them (nor the float path's on a NaN scale);
    Q5_0 / Q5_1: gguf's quantizer's blocks of random floats (held as MLX's layout, whose d must be finite)."""
    if qtype in Q5_TYPES or qtype in MLX_TYPES:
        import gguf

        w = rng.standard_normal((n, k)).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    return rng.integers(0, 256, (n, k // 256 * ROW_BYTES[qtype]), dtype=np.uint8)


def product(qtype: str, raw: np.ndarray, int8: bool):
    """f(x) -> the lazy product of x with the held arrays of `raw` (the loader's: quants.native_arrays)."""
    if qtype in Q5_TYPES:  # as the loader holds them (qmm.hold_symmetric / hold_half): the file's bytes
        codes, d, m = (mx.array(a) for a in quants.decode_exact(raw, qtype))
        if qtype == "Q5_0":
            m = mx.zeros((raw.shape[0], 0), mx.float16)
        mx.eval(codes, d, m)
        kernels = build.load().module
        if int8:
            return lambda x: kernels.gguf_q5_matmul(x, codes, d, m, Q5_TYPES[qtype][0])
        return lambda x: kernels.quantized_matmul(x, codes, d, m, 32, 5)
    if qtype in MLX_TYPES:  # as the loader holds them with int8 activations (checkpoints/int8_repack.py)
        bits, kernels = MLX_TYPES[qtype][0], build.load().module
        held = [mx.array(a) for a in quants.decode_exact(raw, qtype)]
        if int8:
            packed = kernels.int8_repack(*held, 32, bits)
            mx.eval(*packed)
            return lambda x: kernels.int8_matmul(x, *packed, 32, bits)
        mx.eval(*held)
        return lambda x: kernels.quantized_matmul(x, *held, 32, bits)
    arrays = [mx.array(a) for a in quants.native_arrays(raw, qtype)]
    mx.eval(*arrays)
    if qtype in quants.BLOCKS:
        return lambda x: qmm.gguf_blocks_matmul(x, arrays[0], quants.BLOCKS[qtype][0], int8)
    codes, scales, *d = arrays
    return lambda x: qmm.gguf_matmul(x, codes, scales, int8, d[0] if d else None)


def streamed(qtype: str, n: int, k: int, reps: int, rng) -> float:
    """Wall seconds per one-row int8 product over 64 MiB of distinct matrices, one evaluation each."""
    count = max(2, (64 << 20) // random_raw(rng, qtype, 1, k).nbytes // n)
    fs = [product(qtype, random_raw(rng, qtype, n, k), True) for _ in range(count)]
    x = mx.array(rng.standard_normal((1, k)).astype(np.float32))
    mx.eval(x)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for f in fs:
            mx.eval(f(x))
        best = min(best, time.perf_counter() - t)
    return best / len(fs)


def per_call(f, k: int, rows: int, calls: int, reps: int, rng) -> float:
    xs = [mx.array(rng.standard_normal((rows, k)).astype(np.float32)) for _ in range(calls)]
    mx.eval(*xs)
    mx.eval(*[f(x) for x in xs[:2]])  # warm
    return min(_cpu(lambda: mx.eval(*[f(x) for x in xs])) for _ in range(reps)) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default=",".join(DEFAULT_TYPES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--no-head", action="store_true")
    p.add_argument("--rows", type=int, default=1, help="rows of x a product (default 1: decode)")
    p.add_argument("--streamed", action="store_true", help="also one-row int8 products over 64 MiB of distinct matrices")
    p.add_argument("--json")
    args = p.parse_args()
    state = build.load()
    if state.module is None:
        sys.exit(f"pipeline's kernels are not built: {state.why_not}")
    m = state.module
    qmm.set_threads(args.threads)
    rng = np.random.default_rng(0)
    load = [os.getloadavg()[0]]
    bandwidth = memcpy_gbps(args.reps)
    print(f"load {load[0]:.2f}; memcpy {bandwidth:.1f} GB/s read (64 MiB, 1 thread); {args.threads} kernel thread(s), "
          f"{m.isa()} / {m.int8_isa()}")
    results = {"memcpy_gbps": bandwidth, "threads": args.threads, "types": {}, "head": {}}
    n, k = 576, 1536
    print(f"{args.rows} row(s) of x a product" + ("; streamed: one row over 64 MiB of distinct matrices" if args.streamed else ""))
    print(f"{'type':8} {'MB':>6} {'int8 us':>8} {'GB/s':>6} {'float us':>9} {'GB/s':>6}" +
          (f" {'streamed us':>11} {'GB/s':>6}" if args.streamed else ""))
    for qtype in [t for t in args.types.split(",") if t]:
        raw = random_raw(rng, qtype, n, k)
        row = {}
        for int8 in (True, False):
            us = per_call(product(qtype, raw, int8), k, args.rows, args.calls, args.reps, rng) * 1e6
            row["int8" if int8 else "float"] = us
        if args.streamed:
            row["streamed"] = streamed(qtype, n, k, args.reps, rng) * 1e6
        results["types"][qtype] = row | {"bytes": raw.nbytes, "rows": args.rows}
        print(f"{qtype:8} {raw.nbytes / 1e6:6.3f} {row['int8']:8.1f} {raw.nbytes / row['int8'] / 1e3:6.1f} "
              f"{row['float']:9.1f} {raw.nbytes / row['float'] / 1e3:6.1f}" +
              (f" {row['streamed']:11.1f} {raw.nbytes / row['streamed'] / 1e3:6.1f}" if args.streamed else ""))
    if not args.no_head:
        import gguf

        n, k = 49152, 576
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        b = blocks.reshape(n, -1, 34)
        d = b[..., :2].copy().view(np.float16)[..., 0]
        u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(n, -1)
        mlx8 = (mx.array(u.view(np.uint32)), mx.array(d), mx.array((d.astype(np.float32) * -128).astype(np.float16)))
        copy = m.int8_repack(*mlx8, 32, 8)
        held = mx.array(blocks)
        mx.eval(held, *mlx8, *copy)
        ways = {"Q8_0 blocks": lambda x: m.gguf_q8_0_matmul(x, held, 8, True),
                "MLX 8-bit in place": lambda x: m.int8_rows_matmul(x, *mlx8, 32),
                "int8 copy (before)": lambda x: m.int8_matmul(x, *copy, 32, 8)}
        print(f"head {n} x {k} (Q8_0 {blocks.nbytes / 1e6:.1f} MB; the int8 copy {sum(a.nbytes for a in copy) / 1e6:.1f} "
              "MB beside the embedding before)")
        for rows in (1, 4):
            for name, f in ways.items():
                us = per_call(f, k, rows, 5, args.reps, rng) * 1e6
                results["head"][f"{name}, {rows} rows"] = us
                print(f"  {rows} row{'s' if rows > 1 else ' '} {name:20} {us:9.0f} us  {blocks.nbytes / us / 1e3:5.1f} GB/s")
    load.append(os.getloadavg()[0])
    results["load"] = load
    print(f"load after {load[1]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
