"""Re-quantization at load in one pass (requantize_kernels.cpp): bit for bit mx.quantize of the values
MLX's own graph makes (FP8 bytes decoded by mx.from_fp8 times their 128x128 block scale, cast to the
held dtype), for every bit width, group size, held dtype and source dtype. The loader's use of it is
checked against torch's dequantization in test_loading.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from pipeline.checkpoints.format_adapters import dequantize_fp8

BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
HELD = (mx.float32, mx.bfloat16)


def assert_same(got, want, what: str) -> None:
    for part, g, w in zip(("weight", "scales", "biases"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what} {part}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        differ = int(mx.sum(g.view(mx.uint8) != w.view(mx.uint8)).item()) if g.size else 0
        assert differ == 0, f"{what} {part}: {differ} bytes differ"


def fp8_matrix(rows: int, cols: int, rng) -> mx.array:
    """Random e4m3 bytes without the two NaNs, with every other byte value (subnormals, both zeros) present."""
    raw = rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
    raw.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3F
    return mx.array(raw)


def special_groups(cols: int, rng) -> np.ndarray:
    """Rows whose groups take the rule's every branch: all zero (scale 1e-7), constant (q0 of the edge),
    larger |min| or larger |max|, tiny and huge magnitudes."""
    rows = [np.zeros(cols), np.full(cols, 0.37), np.full(cols, -2.5), rng.standard_normal(cols) - 3,
            rng.standard_normal(cols) + 3, rng.standard_normal(cols) * 1e-30, rng.standard_normal(cols) * 1e30]
    return np.stack(rows).astype(np.float32)


def test_fp8_bytes_requantize_as_mlx_would(kernels):
    rng = np.random.default_rng(0)
    rows, cols = 200, 320  # partial 128x128 blocks in both directions
    w = fp8_matrix(rows, cols, rng)
    scales = mx.array(rng.uniform(1e-3, 2.0, size=(2, 3)).astype(np.float32))
    for held in HELD:
        for bits in BITS:
            for group in GROUPS:
                if cols % group:
                    continue
                got = kernels.requantize(w, scales, bits, group, held)
                want = mx.quantize(dequantize_fp8(w, scales, held), group_size=group, bits=bits)
                assert_same(got, want, f"fp8 -> {held} {bits}-bit group {group}")


@pytest.mark.parametrize("source", [mx.float32, mx.bfloat16, mx.float16])
def test_float_weights_requantize_as_mlx_would(kernels, source):
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.standard_normal((33, 384)).astype(np.float32) * 0.05, special_groups(384, rng)])
    if source == mx.float16:
        values = np.clip(values, -6e4, 6e4)
    w = mx.array(values).astype(source)
    for held in HELD:
        for bits in BITS:
            for group in GROUPS:
                got = kernels.requantize(w, None, bits, group, held)
                want = mx.quantize(w.astype(held), group_size=group, bits=bits)
                assert_same(got, want, f"{source} -> {held} {bits}-bit group {group}")


def test_stacked_and_strided_inputs(kernels):
    """A 3-D stack (experts) and a transposed view quantize as their row-contiguous values would."""
    rng = np.random.default_rng(2)
    stack = mx.array(rng.standard_normal((3, 64, 128)).astype(np.float32))
    assert_same(kernels.requantize(stack, None, 4, 64, mx.float32), mx.quantize(stack, group_size=64, bits=4), "stack")
    view = mx.array(rng.standard_normal((128, 96)).astype(np.float32)).T
    assert_same(kernels.requantize(view, None, 8, 32, mx.float32), mx.quantize(view, group_size=32, bits=8), "view")


def test_bad_arguments_are_refused(kernels):
    w = mx.zeros((128, 128), mx.uint8)
    with pytest.raises(ValueError, match="128x128 block"):
        kernels.requantize(w, mx.ones((2, 1)), 4, 64, mx.float32)
    with pytest.raises(ValueError, match="bits"):
        kernels.requantize(mx.zeros((4, 64)), None, 7, 64, mx.float32)
    with pytest.raises(ValueError, match="whole groups"):
        kernels.requantize(mx.zeros((4, 48)), None, 4, 32, mx.float32)


@pytest.mark.parametrize("scale_range", [3, 6e-5, 20000])  # ordinary, fp16 subnormals, biases past fp16 (Q4_0, Q8_0)
@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_gguf_blocks_repack_as_numpy_does(kernels, ggml_type, scale_range):
    """The one-pass repacking of GGUF rows equals quants.py's numpy decoding (itself checked against
    gguf's own dequantizer in test_gguf_inplace.py), on random blocks with finite fp16 scales, over
    several rows of several blocks each, 8 rows at once and 1 row alone: the same codes, and the same
    scales and biases, fp16 where numpy holds them so (float32 where a bias would overflow fp16)."""
    from pipeline.checkpoints import quants

    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144}[ggml_type]
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(8, 3, size), dtype=np.uint8)
    halves = 2 if ggml_type in ("Q4_1", "Q4_K") else 1
    scales = rng.uniform(-scale_range, scale_range, size=(8, 3, halves))
    raw[..., : 2 * halves] = scales.astype(np.float16).view(np.uint8)
    raw = raw.reshape(8, -1)
    for rows in (raw, raw[5:6]):
        want = quants.decode_exact(rows, ggml_type)
        got = quants.decode_exact(rows, ggml_type, kernels)
        if ggml_type in quants.FP16_SCALES:  # the case each range is for
            assert want[1].dtype == (np.float32 if scale_range > 8188 and ggml_type != "Q4_1" else np.float16)
        for part, g, w in zip(("weight", "scales", "biases"), got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, part
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=f"{ggml_type} {part}")
