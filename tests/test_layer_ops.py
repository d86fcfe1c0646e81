"""The compiled pieces of a layer (models/base.py) against the MLX operations they replace:
bit for bit, so that compiling them changed no result (greedy texts stay what they were)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from pipeline.models import base

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7},  # attention factor != 1
}


def fast_rope(rope: base.RoPE, x: mx.array, offset) -> mx.array:
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
    rope = base.RoPE(dims, 10000.0, SCALINGS[scaling], traditional=traditional, max_position_embeddings=163840)
    rng = np.random.default_rng(0)
    for tokens, heads in ((1, 12), (5, 3), (70, 4)):
        x = mx.array(rng.normal(0, 4, (tokens, heads, 1, features)).astype(np.float32)).astype(dtype)
        offset = mx.array(rng.integers(0, 100_000, tokens), dtype=mx.int32)
        assert_identical(rope(x, offset), fast_rope(rope, x, offset))
    x = mx.array(rng.normal(0, 4, (1, 2, 7, features)).astype(np.float32)).astype(dtype)
    assert_identical(rope(x, 3), fast_rope(rope, x, 3))  # a run of positions from an int offset


def test_layers_of_a_step_share_the_angles():
    """Every layer's RoPE of a step reads the same cos/sin arrays (computed once), yet a token at
    another position in another step gets its own."""
    ropes = [base.RoPE(64, 10000.0, None) for _ in range(3)]
    caches = [base.KVCache()]
    caches[0].offset = 9
    offsets = [base.positions([2], caches) for _ in ropes]
    assert all(o is offsets[0] for o in offsets)
    angles = [rope._angles(offsets[0], mx.float32) for rope in ropes]
    assert all(a[0] is angles[0][0] for a in angles)
    caches[0].offset = 11
    moved = base.positions([2], caches)
    assert moved.tolist() == [11, 12] and ropes[0]._angles(moved, mx.float32)[0] is not angles[0][0]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_rms_norm_and_swiglu_equal_mlx(dtype):
    rng = np.random.default_rng(1)
    norm = base.RMSNorm(96, eps=1e-5)
    norm.weight = mx.array(rng.normal(1, 0.3, 96).astype(np.float32)).astype(dtype)
    for rows in (1, 3, 64):
        x = mx.array(rng.normal(0, 3, (1, rows, 96)).astype(np.float32)).astype(dtype)
        assert_identical(norm(x), nn.RMSNorm.__call__(norm, x))
        gate, up = (mx.array(rng.normal(0, 3, (rows, 160)).astype(np.float32)).astype(dtype) for _ in range(2))
        assert_identical(base.swiglu(gate, up), nn.silu(gate) * up)
