"""The compiled pieces of a layer (models/layers.py, models/rope.py) against the MLX operations
they replace: bit for bit, so that compiling them changed no result (greedy texts stay what they
were). pipeline's RoPE kernel (layer_kernels.cpp) is bit for bit MLX's rope too; its RMSNorm kernel
sums in its own order, so it is held to a float64 reference and to rounding each row the same
whatever shares the call."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from pipeline.kernels import layer_kernels
from pipeline.models.cache import KVCache
from pipeline.models.layers import RMSNorm, swiglu
from pipeline.models.packing import positions
from pipeline.models.rope import RoPE

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7},  # attention factor != 1
}


def fast_rope(rope: RoPE, x: mx.array, offset) -> mx.array:
    """What RoPE computed before it was compiled: MLX's own rope, then YaRN's factor."""
    out = mx.fast.rope(x, rope.dims, traditional=rope.traditional, base=None, scale=rope.position_scale,
                       offset=offset, freqs=rope._periods)
    return out * rope.attention_factor if rope.attention_factor != 1.0 else out


def assert_identical(got: mx.array, want: mx.array) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert mx.array_equal(got, want).item(), f"differs by up to {diff}"


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("traditional", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("dims, features", [(64, 64), (32, 96)], ids=["whole", "partial"])
def test_rope_equals_mlx_rope(dtype, traditional, scaling, dims, features):
    rope = RoPE(dims, 10000.0, SCALINGS[scaling], traditional=traditional, max_position_embeddings=163840)
    rng = np.random.default_rng(0)
    for tokens, heads in ((1, 12), (5, 3), (70, 4)):
        x = mx.array(rng.normal(0, 4, (tokens, heads, 1, features)).astype(np.float32)).astype(dtype)
        offset = mx.array(rng.integers(0, 100_000, tokens), dtype=mx.int32)
        assert_identical(rope(x, offset), fast_rope(rope, x, offset))
        # the layers' call: q and k of each token in one rotation (pipeline's kernel for float32)
        q, k = x[:, : heads // 2 + 1, 0], x[:, heads // 2 + 1:, 0]
        assert_identical(rope.rotate([q, k], offset), fast_rope(rope, x, offset)[:, :, 0])
    x = mx.array(rng.normal(0, 4, (1, 2, 7, features)).astype(np.float32)).astype(dtype)
    assert_identical(rope(x, 3), fast_rope(rope, x, 3))  # a run of positions from an int offset


def test_layers_of_a_step_share_the_angles():
    """Every layer's RoPE of a step reads the same cos/sin arrays (computed once), yet a token at
    another position in another step gets its own."""
    ropes = [RoPE(64, 10000.0, None) for _ in range(3)]
    caches = [KVCache()]
    caches[0].offset = 9
    offsets = [positions([2], caches) for _ in ropes]
    assert all(o is offsets[0] for o in offsets)
    angles = [rope._angles(offsets[0], mx.float32) for rope in ropes]
    assert all(a[0] is angles[0][0] for a in angles)
    caches[0].offset = 11
    moved = positions([2], caches)
    assert moved.tolist() == [11, 12] and ropes[0]._angles(moved, mx.float32)[0] is not angles[0][0]


def test_swiglu_equals_mlx():
    rng = np.random.default_rng(1)
    for dtype in (mx.float32, mx.bfloat16):
        for rows in (1, 3, 64):
            gate, up = (mx.array(rng.normal(0, 3, (rows, 160)).astype(np.float32)).astype(dtype) for _ in range(2))
            assert_identical(swiglu(gate, up), nn.silu(gate) * up)


def test_rms_norm_equals_mlx_where_compiled(monkeypatch):
    """bfloat16 activations, or the kernels turned off: MLX's rms_norm compiled, bit for bit."""
    rng = np.random.default_rng(1)
    for dtype, kernels in ((mx.bfloat16, "1"), (mx.float32, "0")):
        monkeypatch.setenv(layer_kernels.ENV, kernels)
        norm = RMSNorm(96, eps=1e-5)
        norm.weight = mx.array(rng.normal(1, 0.3, 96).astype(np.float32)).astype(dtype)
        for rows in (1, 3, 64):
            x = mx.array(rng.normal(0, 3, (1, rows, 96)).astype(np.float32)).astype(dtype)
            assert_identical(norm(x), nn.RMSNorm.__call__(norm, x))


# Error of the kernel's RMSNorm over float64, relative to |x * weight| / rms: the sum of squares rounds
# once per 16 features per lane and 4 times over the lanes, the scale twice, the product twice.
# Measured: at most 2.4e-7; a mean over n - 1 or a dropped tail is off by 1e-3 or more.
RMS_TOLERANCE = 3e-7


def test_rms_norm_kernel_matches_float64_and_rounds_each_row_alone(kernels, monkeypatch):
    monkeypatch.delenv(layer_kernels.ENV, raising=False)
    rng = np.random.default_rng(2)
    for n in (96, 576, 100):  # 100: a tail past the 16-lane vectors
        norm = RMSNorm(n, eps=1e-5)
        weight = rng.normal(1, 0.3, n).astype(np.float32)
        norm.weight = mx.array(weight)
        x = rng.normal(0, 3, (64, n)).astype(np.float32)
        x[5] *= 1e-3  # a row where eps matters
        got = np.array(norm(mx.array(x)))
        x64 = x.astype(np.float64)
        rms = np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5)
        want = x64 / rms * weight
        assert np.max(np.abs(got - want) / (np.abs(x64 * weight) / rms + 1e-30)) < RMS_TOLERANCE
        for r in (0, 5, 63):  # each row alone, and among others at another place
            assert np.array_equal(np.array(norm(mx.array(x[r:r + 1])))[0], got[r])
        assert np.array_equal(np.array(norm(mx.array(x[::-1].copy())))[::-1], got)
