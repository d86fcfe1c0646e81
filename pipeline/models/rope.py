"""Rotary position embedding (RoPE) over a head's first `dims` features, and its scalings:
linear, Llama 3.1's frequency-dependent stretch, and YaRN (its attention factor: yarn_mscale)."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..kernels import layer_kernels
from ..util.errors import UserError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# The rotation is compiled as layers.py's RMSNorm is (see the note there): one fused kernel doing
# mx.fast.rope's CPU operations in the same order and type, so results stay bit-identical.


@lru_cache(maxsize=None)
def _compiled_rotation(dims: int, traditional: bool, attention_factor: float) -> Callable:
    """The rotation half of mx.fast.rope's CPU code, given each token's cos and sin."""
    def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        if traditional:
            x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        else:
            x1, x2 = x[..., :dims // 2], x[..., dims // 2:dims]
        parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
        if traditional:
            parts = [mx.concatenate([p[..., None] for p in parts], axis=-1).reshape(*x.shape[:-1], dims)]
        if dims < x.shape[-1]:
            parts.append(x[..., dims:])
        out = mx.concatenate(parts, axis=-1)
        return out * attention_factor if attention_factor != 1.0 else out
    return mx.compile(rotate)


class RoPE(nn.Module):
    """Rotary position embedding over the first `dims` features.

    `traditional=False` rotates the two halves of the features (the rotate-half layout of
    Hugging Face Llama checkpoints); `traditional=True` rotates interleaved pairs (DeepSeek).
    """

    def __init__(self, dims: int, base: float, scaling: dict | None, traditional: bool = False,
                 max_position_embeddings: int = 4096):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.position_scale = 1.0
        self.attention_factor = 1.0  # YaRN scales cos and sin, i.e. the rotated features
        rope_type = (scaling or {}).get("rope_type", "default")
        inv_freq = 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
        if rope_type == "linear":
            self.position_scale = 1.0 / float(scaling["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(dims, base, scaling, max_position_embeddings)
        elif rope_type != "default":
            raise UserError(f"rope scaling type {rope_type!r} is not supported for this model "
                            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        # mx.fast.rope takes periods (1/inv_freq) through `freqs`.
        self._periods = 1.0 / inv_freq
        self._frequencies_key = (dims, self.position_scale, tuple(self._periods.tolist()))

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """x: [tokens, heads, 1, features] (mx.fast.rope's [B, N, T, D] with the tokens as B), each
        token at its own position `offset[i]`; or x: [B, N, T, D] and an int offset."""
        if not isinstance(offset, mx.array) or offset.size != x.shape[0] or x.shape[2] != 1:
            x = mx.fast.rope(x, self.dims, traditional=self.traditional, base=None,
                             scale=self.position_scale, offset=offset, freqs=self._periods)
            return x * self.attention_factor if self.attention_factor != 1.0 else x
        cos, sin = self._angles(offset, x.dtype)
        return _compiled_rotation(self.dims, self.traditional, self.attention_factor)(x, cos, sin)

    def rotate(self, parts: list[mx.array], offset: mx.array) -> mx.array:
        """parts: [tokens, heads_i, features] arrays (a token's queries, its keys), token t at position
        offset[t]: their rotations side by side, [tokens, sum(heads_i), features]. One operation
        with pipeline's kernel (layer_kernels.py); else MLX's, through __call__."""
        kernel = layer_kernels.kernel(parts[0])
        if kernel is not None and all(p.dtype == mx.float32 for p in parts):
            cos, sin = self._angles(offset, mx.float32)
            return kernel.rope(parts, cos, sin, self.dims, self.traditional, self.attention_factor)
        x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
        return self(x[:, :, None], offset=offset)[:, :, 0]

    def _angles(self, offset: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """cos and sin of each token's angles, [tokens, 1, 1, dims / 2], as mx.fast.rope's CPU code
        computes them (so the rotation is bit for bit mx.fast.rope's). Computed once per step for
        all layers: positions() hands every layer the same offsets array, and the layers' RoPEs
        with the same frequencies share `_ANGLES`."""
        key = (self._frequencies_key, id(offset), dtype)
        if key not in _ANGLES:
            if len(_ANGLES) >= 16:
                _ANGLES.pop(next(iter(_ANGLES)))
            positions = (mx.zeros((1,), mx.float32) + offset.reshape(-1, 1, 1)) * mx.array(self.position_scale, mx.float32)
            theta = positions[..., None] * mx.reciprocal(self._periods)
            _ANGLES[key] = (offset, mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype))  # offset: keeps its id unique
        return _ANGLES[key][1:]


_ANGLES: dict[tuple, tuple[mx.array, mx.array, mx.array]] = {}  # RoPE._angles' last few


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dims: int, base: float, s: dict, max_position_embeddings: int) -> tuple[mx.array, float]:
    """YaRN (arXiv 2309.00071): interpolate low frequencies by `factor`, keep high ones, blend
    linearly between the dimensions that turn beta_slow and beta_fast times over the original
    context."""
    factor = float(s["factor"])
    original = float(s.get("original_max_position_embeddings") or max_position_embeddings)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate it
    pos_freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(inv_freq: mx.array, s: dict) -> mx.array:
    """Llama 3.1's frequency-dependent stretch: long wavelengths are slowed by `factor`, short
    ones kept, and the band between interpolated smoothly."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_context = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = mx.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return mx.where(is_medium, smoothed, scaled)
