"""pipeline's quantized kernels (pipeline/kernels/qmm_kernels.cpp through pipeline/kernels/qmm.py) against an independent
truth: MLX's affine layout unpacked with numpy (a little-endian bit stream per weight row), dequantized
and multiplied in float64. Then the property batch jobs rely on: a row's result does not depend on the
other rows in the call (count, place, experts), to the bit."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from conftest import REPO
from pipeline.kernels import build, qmm

SCALE_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def quantized(rng, n: int, k: int, bits: int, group_size: int, scale_dtype: str, experts: int = 0):
    shape = (experts, n, k) if experts else (n, k)
    w, scales, biases = mx.quantize(mx.array(rng.standard_normal(shape).astype(np.float32)),
                                    group_size=group_size, bits=bits)
    return w, scales.astype(SCALE_DTYPES[scale_dtype]), biases.astype(SCALE_DTYPES[scale_dtype])


def dequantized_float64(w: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> np.ndarray:
    """The weights in float64 by numpy alone: each row of uint32 words is a little-endian stream of
    `bits`-bit integers, q * scale + bias per group."""
    packed = np.array(w).view(np.uint8)
    stream = np.unpackbits(packed.reshape(-1, packed.shape[-1]), axis=1, bitorder="little")
    k = packed.shape[-1] * 8 // bits
    q = stream.reshape(-1, k, bits).astype(np.int64) @ (1 << np.arange(bits))
    s = np.array(scales.astype(mx.float32), dtype=np.float64).reshape(q.shape[0], -1)
    b = np.array(biases.astype(mx.float32), dtype=np.float64).reshape(q.shape[0], -1)
    out = q * np.repeat(s, group_size, axis=1) + np.repeat(b, group_size, axis=1)
    return out.reshape(*w.shape[:-1], k)


# Float32 error of one output over its float64 value, relative to sum |x_k w_k|: each weight rounds once
# (2^-24), each of 16 lane sums once per 16 inputs, the lanes' tree four times. Measured: at most 3.6e-8
# over the shapes below; a wrong group, nibble or scale is off by order 1.
RELATIVE_TOLERANCE = 1e-7
BLAS_RELATIVE_TOLERANCE = 3e-7  # OpenBLAS's own summation order: measured at most 2.1e-7


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("group_size", (32, 64, 128))
@pytest.mark.parametrize("bits", (2, 3, 4, 5, 6, 8))
def test_product_matches_float64_reference(kernels, bits, group_size, scale_dtype):
    rng = np.random.default_rng(bits * 1000 + group_size)
    n, k = 37, 512  # n: a last block of 1 column; k: one full panel of 512 inputs
    w, scales, biases = quantized(rng, n, k, bits, group_size, scale_dtype)
    x = rng.standard_normal((6, k)).astype(np.float32)
    got = np.array(kernels.quantized_matmul(mx.array(x), w, scales, biases, group_size, bits))
    weights = dequantized_float64(w, scales, biases, bits, group_size)
    want = x.astype(np.float64) @ weights.T
    scale = np.abs(x).astype(np.float64) @ np.abs(weights).T
    assert np.max(np.abs(got - want) / scale) < RELATIVE_TOLERANCE


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (4, 128), (8, 64), (5, 32), (3, 128)])
def test_each_row_rounds_the_same_whatever_shares_the_call(kernels, bits, group_size):
    """Rows 1..N (N = 64, as many as batch jobs pack into one product), in every position: a row's bits
    equal those it gets alone and those it gets among any other rows (4-row tiles, the 1-row path)."""
    rng = np.random.default_rng(7)
    n, k, rows = 45, 640, kernels.invariant_max_rows()  # k: a full and a partial panel
    assert rows >= 64
    w, scales, biases = quantized(rng, n, k, bits, group_size, "bfloat16")
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
    full = np.array(kernels.quantized_matmul(x, w, scales, biases, group_size, bits))
    for r in range(rows):
        alone = np.array(kernels.quantized_matmul(x[r:r + 1], w, scales, biases, group_size, bits))
        assert np.array_equal(alone[0], full[r]), f"row {r} alone differs"
    for count in range(1, rows + 1):
        start = (count * 7) % (rows - count + 1)  # the rows at various places of the call
        part = np.array(kernels.quantized_matmul(x[start:start + count], w, scales, biases, group_size, bits))
        assert np.array_equal(part, full[start:start + count]), f"rows {start}..{start + count} differ"


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32), (5, 128)])
def test_more_rows_go_to_the_blas_and_match_reference(kernels, bits, group_size):
    """A prompt's chunk (more rows than the invariant limit): weights dequantized for the BLAS."""
    rng = np.random.default_rng(11)
    w, scales, biases = quantized(rng, 300, 256, bits, group_size, "float16")  # 300: two panels of 256
    x = rng.standard_normal((kernels.invariant_max_rows() + 9, 256)).astype(np.float32)
    got = np.array(kernels.quantized_matmul(mx.array(x), w, scales, biases, group_size, bits))
    weights = dequantized_float64(w, scales, biases, bits, group_size)
    scale = np.abs(x).astype(np.float64) @ np.abs(weights).T
    assert np.max(np.abs(got - x.astype(np.float64) @ weights.T) / scale) < BLAS_RELATIVE_TOLERANCE


def test_gathered_product_per_expert_row_groups(kernels):
    """Rows choosing experts in any order: each equals the float64 truth of its expert, and the very
    bits of that row alone with its expert's matrix (the dense kernel)."""
    rng = np.random.default_rng(3)
    experts, n, k, rows, bits, group_size = 5, 21, 256, 23, 4, 64
    w, scales, biases = quantized(rng, n, k, bits, group_size, "float16", experts=experts)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    chosen = rng.integers(0, experts, rows).astype(np.uint32)
    got = np.array(kernels.gather_qmm(mx.array(x), w, scales, biases, mx.array(chosen), group_size, bits))
    weights = dequantized_float64(w, scales, biases, bits, group_size)
    for r, e in enumerate(chosen):
        want = weights[e] @ x[r].astype(np.float64)
        scale = np.abs(weights[e]) @ np.abs(x[r]).astype(np.float64)
        assert np.max(np.abs(got[r] - want) / scale) < RELATIVE_TOLERANCE
        alone = np.array(kernels.quantized_matmul(mx.array(x[r:r + 1]), w[int(e)], scales[int(e)], biases[int(e)],
                                                  group_size, bits))
        assert np.array_equal(alone[0], got[r])


def test_gather_qmm_takes_mlx_shapes(kernels):
    """qmm.gather_qmm as the experts call it (tokens x k chosen experts, unsorted and sorted) gives
    MLX's shapes and, within rounding, MLX's values; lazily (nothing runs before mx.eval)."""
    rng = np.random.default_rng(5)
    w, scales, biases = quantized(rng, 24, 128, 4, 32, "float32", experts=6)
    x = mx.array(rng.standard_normal((9, 1, 1, 128)).astype(np.float32))
    indices = mx.array(rng.integers(0, 6, (9, 2)).astype(np.uint32))
    before = build.load().used["pipeline"]
    ours = qmm.gather_qmm(x, w, scales, biases, rhs_indices=indices, group_size=32, bits=4)
    assert build.load().used["pipeline"] == before + 1
    theirs = mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True, group_size=32, bits=4)
    assert ours.shape == theirs.shape == (9, 2, 1, 24)
    assert np.allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-4)
    flat = indices.flatten()
    order = mx.argsort(flat)
    ours = qmm.gather_qmm(x[order // 2], w, scales, biases, rhs_indices=flat[order][:, None], group_size=32, bits=4,
                          sorted_indices=True)
    theirs = mx.gather_qmm(x[order // 2], w, scales, biases, rhs_indices=flat[order][:, None], transpose=True,
                           group_size=32, bits=4, sorted_indices=True)
    assert ours.shape == theirs.shape
    assert np.allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-4)


def test_quantized_matmul_takes_mlx_shapes(kernels):
    """x [batch, tokens, k], as layers call it: MLX's shape and, within rounding, MLX's values."""
    rng = np.random.default_rng(6)
    w, scales, biases = quantized(rng, 24, 128, 8, 128, "bfloat16")
    x = mx.array(rng.standard_normal((2, 3, 128)).astype(np.float32))
    ours = qmm.quantized_matmul(x, w, scales, biases, group_size=128, bits=8)
    theirs = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=128, bits=8)
    assert ours.shape == theirs.shape == (2, 3, 24)
    assert np.allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-4)


def test_batched_matrices_as_deepseek_v4_groups_them(kernels):
    """x [groups, tokens, k] times w [groups, n, k/...] (one matrix per group): MLX's shape and values."""
    rng = np.random.default_rng(8)
    w, scales, biases = quantized(rng, 16, 128, 4, 64, "float32", experts=3)
    x = mx.array(rng.standard_normal((3, 5, 128)).astype(np.float32))
    before = build.load().used["pipeline"]
    ours = qmm.quantized_matmul(x, w, scales, biases, group_size=64, bits=4)
    assert build.load().used["pipeline"] == before + 1
    theirs = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=64, bits=4)
    assert ours.shape == theirs.shape == (3, 5, 16)
    assert np.allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-4)


FALLBACK = """
import mlx.core as mx, numpy as np
from pipeline.kernels import qmm
w, s, b = mx.quantize(mx.random.normal((16, 64)), group_size=32, bits=4)
x = mx.random.normal((3, 64))
ours = qmm.quantized_matmul(x, w, s, b, group_size=32, bits=4)
theirs = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=32, bits=4)
assert np.array_equal(np.array(ours), np.array(theirs))
print(qmm.describe())
"""


def test_refused_cache_falls_back_to_mlx_and_says_so(tmp_path):
    """A cache folder other users may write to: the extension is neither built nor loaded, the
    products are MLX's own (the same bits), and the stats phrase names the reason."""
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    result = subprocess.run([sys.executable, "-c", FALLBACK], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PIPELINE_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    assert "MLX's (refused" in result.stdout and "every user may write to it" in result.stdout
    assert not (cache / "qmm").exists() or not any((cache / "qmm").glob("*.so"))


def test_opting_out_falls_back_to_mlx():
    result = subprocess.run([sys.executable, "-c", FALLBACK], capture_output=True, text=True, timeout=120,
                            env={**os.environ, build.KERNELS_ENV: "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"MLX's ({build.KERNELS_ENV}=0)"


def test_auto_keeps_weights_quantized_where_every_rank_has_the_kernels():
    """--weights-in-memory auto: with room for fp32 copies, ranks dequantize (MLX's kernels are slow)
    unless every rank has pipeline's kernels; fp32 is still fp32."""
    from pipeline.planner.layer_split import plan_weights_in_memory
    from pipeline.planner.weights_bytes import ModelBytes

    def model_bytes(per_layer: int) -> ModelBytes:
        return ModelBytes(layers=[per_layer] * 4, ends=per_layer, fixed_read=[per_layer] * 4, expert_bytes=[0] * 4,
                          experts=[0] * 4, head_read=0, active_params=[0] * 4, head_params=0)

    held, dense_held, memory = model_bytes(10**6), model_bytes(8 * 10**6), [("host", 10**12)] * 2
    assert plan_weights_in_memory("auto", held, dense_held, [2, 2], memory, fixed=True) == ([2, 2], [True, True])
    assert plan_weights_in_memory("auto", held, dense_held, [2, 2], memory, fixed=True,
                                  fast_quantized=[True, True]) == ([2, 2], [False, False])
    assert plan_weights_in_memory("auto", held, dense_held, [2, 2], memory, fixed=True,
                                  fast_quantized=[True, False]) == ([2, 2], [True, True])
    assert plan_weights_in_memory("fp32", held, dense_held, [2, 2], memory, fixed=True,
                                  fast_quantized=[True, True])[1] == [True, True]


def test_missing_python_headers_are_named_with_the_fix(monkeypatch, tmp_path):
    """A fresh Debian has g++ but not Python.h (python3-dev), which nanobind includes: the build is not
    attempted, `auto` does not count on the kernels, and the job's warning line names the package."""
    import sysconfig

    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**paths, "include": str(tmp_path)})
    monkeypatch.setattr(build, "_state", None)
    monkeypatch.delenv(build.KERNELS_ENV, raising=False)
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))  # no extension built yet
    assert "python3-dev" in build.missing_tools() and str(tmp_path / "Python.h") in build.missing_tools()
    assert not build.expected()
    line = build.problem()
    assert line.startswith("pipeline's quantized kernels cannot be built (no Python headers") and "\n" not in line
    with pytest.raises(build.NotBuilt, match="python3-dev"):
        build.build_extension(tmp_path / "never.so")
    (tmp_path / "Python.h").write_text("")
    assert build.missing_tools() == "" and build.problem() == ""


VARIANT_PROBE = r"""
import sys, numpy as np
import pipeline.kernels.blas
import mlx.core as mx
from pathlib import Path
from pipeline.kernels import build
flags = tuple(sys.argv[3:])  # the variant's compiler flags
if sys.argv[1] == "-":
    module = build.load().module
else:
    path = Path(sys.argv[1]) / build.extension_path(flags).name
    build.build_extension(path, flags)
    module = build.load_extension(path, build_if_missing=False)
module.set_threads(2)
rng = np.random.default_rng(0)
out = {"isa": np.array(module.isa()), "int8 isa": np.array(module.int8_isa())}
for bits, group in ((4, 32), (8, 64), (4, 128)):  # int8 products (tests/test_int8_kernels.py)
    w, s, b = mx.quantize(mx.array(rng.standard_normal((48, 640)).astype(np.float32)), group_size=group, bits=bits)
    packed = module.int8_repack(w, s.astype(mx.bfloat16), b.astype(mx.bfloat16), group, bits)
    for rows in (1, 2, 3, 5, 9, 13, 70):
        x = mx.array((rng.standard_normal((rows, 640)) * 4).astype(np.float32))
        out[f"int8 {bits} {group} {rows}"] = np.array(module.int8_matmul(x, *packed, group, bits))
for bits, group in ((4, 32), (8, 64), (5, 128)):
    w, s, b = mx.quantize(mx.array(rng.standard_normal((45, 640)).astype(np.float32)), group_size=group, bits=bits)
    for rows in (1, 2, 3, 5, 9, 13, 17, 64):
        x = mx.array(rng.standard_normal((rows, 640)).astype(np.float32))
        out[f"qmm {bits} {group} {rows}"] = np.array(module.quantized_matmul(x, w, s, b, group, bits))
from pipeline.checkpoints.quants import native_arrays
for qtype, type_id, block, header in (("IQ4_NL", 20, 32, 2), ("IQ4_XS", 23, 256, 8)):  # GGUF blocks (gguf_kernels.cpp)
    raw = rng.integers(0, 256, (32, 1024 // block, header + block // 2), dtype=np.uint8)
    raw[..., :2] = rng.uniform(1e-3, 1e-2, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    codes, block_scales = (mx.array(a) for a in native_arrays(raw.reshape(32, -1), qtype))
    for rows in (1, 2, 3, 5, 70):
        x = mx.array(rng.standard_normal((rows, 1024)).astype(np.float32))
        for int8 in (False, True):
            out[f"{'int8 ' if int8 else ''}gguf {qtype} {rows}"] = np.array(module.gguf_matmul(x, codes, block_scales,
                                                                                                type_id, int8))
# a tied 8-bit embedding's head read in place (int8_kernels.cpp): GGUF's Q8_0 blocks, MLX's 8-bit layout
raw8 = rng.integers(0, 256, (40, 640 // 32, 34), dtype=np.uint8)
raw8[..., :2] = rng.uniform(1e-3, 1e-2, raw8.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw8.shape[:2], 2)
w8 = mx.array(rng.integers(0, 256, (48, 640), dtype=np.uint8).view(np.uint32))
s8, b8 = (mx.array(rng.uniform(lo, hi, (48, 10)).astype(np.float32)).astype(mx.bfloat16) for lo, hi in ((1e-3, 1e-2), (-1, 1)))
for rows in (1, 2, 3, 5, 9, 70):
    x = mx.array(rng.standard_normal((rows, 640)).astype(np.float32))
    out[f"int8 q8_0 blocks {rows}"] = np.array(module.gguf_q8_0_matmul(x, mx.array(raw8.reshape(40, -1)), 8, True))
    out[f"int8 rows 8-bit {rows}"] = np.array(module.int8_rows_matmul(x, w8, s8, b8, 64))
fp8 = mx.array(rng.integers(0, 126, size=(256, 384), dtype=np.uint8))
scales = mx.array(rng.uniform(0.01, 1, (2, 3)).astype(np.float32))
for bits in (3, 4, 8):
    for i, a in enumerate(module.requantize(fp8, scales, bits, 64, mx.float32)):
        out[f"requantize {bits} {i}"] = np.array(a)
np.savez(sys.argv[2], **out)
"""


def variant_and_native(tmp_path, flags: tuple[str, ...]):
    """The probe's outputs from a build with `flags` (built into tmp_path, ~20 s) and from this CPU's."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for where, out in ((str(tmp_path), tmp_path / "variant.npz"), ("-", tmp_path / "native.npz")):
        result = subprocess.run([sys.executable, "-c", VARIANT_PROBE, where, str(out), *flags], capture_output=True,
                                text=True, timeout=300, env=env, cwd=REPO)
        assert result.returncode == 0, result.stderr
    return np.load(tmp_path / "variant.npz"), np.load(tmp_path / "native.npz")


def assert_same_bits(variant, native, prefix: str = "") -> None:
    keys = [key for key in native.files if "isa" not in key and key.startswith(prefix)]
    assert keys
    for key in keys:
        assert np.array_equal(variant[key].view(np.uint8), native[key].view(np.uint8)), key


@pytest.mark.skipif(build.missing_tools() != "" or os.environ.get(build.KERNELS_ENV) is not None,
                    reason="no kernels here")
def test_avx2_build_gives_the_same_bits(kernels, tmp_path):
    """A CPU without AVX-512 gets the AVX2 build (two 8-lane halves per 16-lane vector): every product
    path (1 row, 2-12 rows in registers, 6- and 4-row tiles, the sgemm path), the re-quantization
    kernel and the int8 products (vpmaddubsw in two halves) must give the AVX-512 build's bits."""
    if kernels.isa() != "AVX-512":
        pytest.skip("this CPU has no AVX-512: nothing to compare the AVX2 build with")
    avx2, native = variant_and_native(tmp_path, ("-mno-avx512f",))
    assert str(avx2["isa"]) == "AVX2" and str(native["isa"]) == "AVX-512" and str(avx2["int8 isa"]) == "AVX2"
    assert_same_bits(avx2, native)
