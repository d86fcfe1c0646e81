"""Building blocks shared by the model families: RoPE variants, the KV cache, attention, MLP,
and `TransformerSlice`, the part of a model one rank holds."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..kernels import attention, layer_kernels, qmm
from .config import ModelConfig
from ..util.errors import UserError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Compiled pieces of a layer. On CPU, MLX's fast RMSNorm and RoPE are not kernels but chains of
# small ops (square, sum, rsqrt, ...; cos, sin, multiplies, concatenate), each dispatched on its
# own: a SmolLM2-135M decode step ran ~1,700 ops, ~1,000 of them not products. mx.compile of the
# same computation fuses each elementwise run into one kernel, which does the same operations in
# the same order and type (MLX's CPU ops are scalar C++, and MLX builds the kernel with g++ -O3,
# no FMA contraction): results stay bit-identical to the uncompiled ops (tests/test_layer_ops.py),
# so a token still rounds the same whatever else is in the batch. A new input shape traces the
# function again (well under a millisecond); MLX compiles each new kernel once into its temporary
# folder, and without a C++ compiler it runs the ops unfused, with the same results.


@lru_cache(maxsize=None)
def _compiled_rms_norm(eps: float) -> Callable:
    return mx.compile(lambda x, weight: mx.fast.rms_norm(x, weight, eps))


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


@mx.compile
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up in one kernel."""
    return nn.silu(gate) * up


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameter): pipeline's kernel (layer_kernels.py) for float32 on the CPU, else
    compiled (the same results as MLX's)."""

    def __call__(self, x: mx.array) -> mx.array:
        kernel = layer_kernels.kernel(x)
        if kernel is not None and self["weight"].dtype == mx.float32:
            return kernel.rms_norm(x, self["weight"], self.eps)
        return _compiled_rms_norm(self.eps)(x, self["weight"])


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


class KVCache:
    """Keys and values of one attention layer, grown in steps to avoid a copy per token."""

    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.append(keys, values)
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add new positions [1, kv heads, new, d]; `keys` / `values` then hold them (and room after)."""
        previous = self.offset
        self.reserve(keys.shape[2], keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        self.offset += keys.shape[2]
        self.keys[..., previous:self.offset, :] = keys
        self.values[..., previous:self.offset, :] = values

    def reserve(self, new: int, kv_heads: int, key_size: int, value_size: int, dtype: mx.Dtype) -> None:
        """Room for `new` more positions past `offset`, grown `step` positions at a time."""
        if self.keys is not None and self.offset + new <= self.keys.shape[2]:
            return
        grow = ((new + self.step - 1) // self.step) * self.step
        k_extra = mx.zeros((1, kv_heads, grow, key_size), dtype)
        v_extra = mx.zeros((1, kv_heads, grow, value_size), dtype)
        if self.keys is None:
            self.keys, self.values = k_extra, v_extra
        else:
            self.keys = mx.concatenate([self.keys[..., :self.offset, :], k_extra], axis=2)
            self.values = mx.concatenate([self.values[..., :self.offset, :], v_extra], axis=2)

    def prefix(self, length: int) -> "KVCache":
        """A new cache holding this one's first `length` positions (the arrays are not changed:
        the next update of either cache makes new ones)."""
        cache = KVCache()
        cache.keys, cache.values = self.keys[..., :length, :], self.values[..., :length, :]
        cache.offset = length
        return cache

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @property
    def bytes_per_token(self) -> int:
        if self.keys is None:
            return 0
        per_key = self.keys.shape[1] * self.keys.shape[3] * self.keys.itemsize
        return per_key + self.values.shape[1] * self.values.shape[3] * self.values.itemsize


class Attention(nn.Module):
    """Multi-head attention with grouped-query key/value heads (n_kv_heads <= n_heads)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        hidden, qkv_bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        # Qwen2 puts a bias on q/k/v only; Llama's attention_bias covers o_proj too.
        out_bias = qkv_bias and config.model_type != "qwen2"
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=out_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rope = RoPE(self.head_dim, config.rope_theta, config.rope_scaling,
                         max_position_embeddings=config.max_position_embeddings)

    def __call__(self, x: mx.array, caches: list[KVCache], lengths: list[int], last_only: bool = False,
                 full: list[bool] | None = None) -> mx.array:
        """x: [1, sum(lengths), hidden], the new tokens of several sequences packed end to end;
        sequence i owns the next lengths[i] tokens and caches[i]. Projections run on all tokens
        at once; attention runs per sequence against its own cache, so each sequence keeps its
        own positions and batching never changes a sequence's result. last_only: the output of
        each sequence's last token only, [1, len(lengths), hidden] (every token's keys and values
        are cached all the same), but of every token of the sequences marked `full` (drafts
        being verified: see `kept_rows`)."""
        _, T, H = x.shape
        x = x.reshape(T, H)  # products of 2-D inputs: a 3-D one costs a flatten and an unflatten each
        offsets = positions(lengths, caches)
        if last_only:
            last, kept = kept_rows(lengths, full)
        if last_only and kept[-1][1] < T:  # queries of the kept rows only
            k, v = self.k_proj(x), self.v_proj(x)
            q = self.q_proj(x[last])
        else:  # every row's query (decoding: the one row is the last): one operation with int8 products
            q, k, v = qmm.products([self.q_proj, self.k_proj, self.v_proj], x)
        q = q.reshape(q.shape[0], self.n_heads, self.head_dim)
        k, v = k.reshape(T, self.n_kv_heads, self.head_dim), v.reshape(T, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if last_only:  # queries at the last positions, keys at all
            q, k = self.rope.rotate([q], offsets[last]), self.rope.rotate([k], offsets)
        else:
            # q and k of every token rotated in one RoPE call, each token at its own position (on CPU
            # a call costs ~40 us whatever its size; a token's rotation is the same either way).
            qk = self.rope.rotate([q, k], offsets)
            q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]  # [tokens, heads, head_dim]
        rows = [e - b for b, e in kept] if last_only else list(lengths)
        kernel = attention.kernel(q, (self.head_dim,))
        if kernel is not None:  # every sequence's cache update and attention in one operation (attention.py)
            out = attention.attend_and_append(kernel, q, k, v, caches, rows, lengths, self.scale)
            return self.o_proj(out)[None]
        attention.note_fallback()
        k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # head-major, as the caches hold them
        q = q.transpose(1, 0, 2)
        outputs, qb = [], 0
        for (begin, end), cache, t in zip(segments(lengths), caches, rows):
            ks, vs = cache.update_and_fetch(k[None, :, begin:end], v[None, :, begin:end])
            out = attend(q[None, :, qb:qb + t], ks, vs, self.scale, cache.offset - t)
            outputs.append(out.squeeze(0))  # [heads, t, head_dim]: back to token-major once, for all
            qb += t
        out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=1)
        return self.o_proj(out.transpose(1, 0, 2).reshape(out.shape[1], -1))[None]


def positions(lengths: list[int], caches: list) -> mx.array:
    """Each packed token's position in its own sequence (its cache's length before this step,
    plus its place among the sequence's new tokens): RoPE offsets, one per token. The layers of
    a step get the very same array (RoPE computes its angles once for it)."""
    global _last_positions
    values = [cache.offset + i for n, cache in zip(lengths, caches) for i in range(n)]
    if _last_positions[0] != values:
        _last_positions = (values, mx.array(values, dtype=mx.int32))
    return _last_positions[1]


_last_positions: tuple[list[int] | None, mx.array | None] = (None, None)


def last_indices(lengths: list[int]) -> mx.array:
    """Index of each sequence's last token among the packed tokens."""
    return mx.array([end - 1 for _, end in segments(lengths)])


def kept_rows(lengths: list[int], full: list[bool] | None = None) -> tuple[mx.array, list[tuple[int, int]]]:
    """What a final layer run with last_only returns: the index of each kept token among the packed
    tokens (each sequence's last, or all of a `full` one), and each sequence's [begin, end) among them."""
    index, bounds = [], []
    for i, (begin, end) in enumerate(segments(lengths)):
        first = begin if full and full[i] else end - 1
        bounds.append((len(index), len(index) + end - first))
        index.extend(range(first, end))
    return mx.array(index), bounds


def segments(lengths: list[int]) -> list[tuple[int, int]]:
    """[begin, end) of each sequence's tokens in a packed batch."""
    bounds, begin = [], 0
    for n in lengths:
        bounds.append((begin, begin + n))
        begin += n
    return bounds


# MLX's path (pipeline's kernel, attention.py, rounds each query alone in any chunk): a few new
# tokens appended to a sequence's cache (a speculative draft being verified) are attended one query
# at a time, each over the keys up to its own position: the very computation that decoding them one
# by one does, so verifying never changes a result. Attention over the whole chunk at once with a
# causal mask sums over a longer, masked row, which rounds differently.
EXACT_POSITIONS_MAX = 16


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float, cached: int) -> mx.array:
    """Attention of the t new tokens' queries [1, heads, t, d] over a sequence's keys and values
    [1, kv heads, cached + t, d] (the cache before this step held `cached` positions)."""
    t = queries.shape[2]
    if t == 1 or cached == 0 or t > EXACT_POSITIONS_MAX:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=causal_mask(t))
    return mx.concatenate([
        mx.fast.scaled_dot_product_attention(queries[:, :, j:j + 1], keys[:, :, :cached + j + 1],
                                             values[:, :, :cached + j + 1], scale=scale)
        for j in range(t)], axis=2)


def causal_mask(num_new_tokens: int):
    """Causal mask for new tokens appended after a cache: sdpa's "causal" is lower-right
    aligned, so the new tokens see the whole cache and each other causally."""
    return "causal" if num_new_tokens > 1 else None


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim == 2:
            return self.down_proj(qmm.swiglu_product(self.gate_proj, self.up_proj, x, swiglu))
        return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)  # 2-D products (see Attention)


class PreNormBlock(nn.Module):
    """The decoder block every family here shares: h = x + attn(norm(x)); out = h + mlp(norm(h)).
    Families differ only in the attention and the feed-forward they plug in."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_cache(self):
        return self.self_attn.make_cache() if hasattr(self.self_attn, "make_cache") else KVCache()

    def __call__(self, x: mx.array, caches: list, lengths: list[int], last_only: bool = False,
                 full: list[bool] | None = None) -> mx.array:
        """last_only: the output at each sequence's last token only, all of a `full` one's (see `Attention`)."""
        if full is not None and any(full):
            attention = self.self_attn(self.input_layernorm(x), caches, lengths, last_only=last_only, full=full)
        else:
            attention = self.self_attn(self.input_layernorm(x), caches, lengths, last_only=last_only)
        if last_only and attention.shape[1] < x.shape[1]:  # the kept rows' residuals (not a gather of all)
            x = x[:, kept_rows(lengths, full)[0]]
        h = x + attention
        return h + self.mlp(self.post_attention_layernorm(h))


def final_layer(layer: nn.Module, h: mx.array, caches: list, lengths: list[int], full: list[bool] | None) -> mx.array:
    """The model's last layer, returning each sequence's last position, and every position of
    those marked `full`, the last of them rounded exactly as without `full`. A chunk of drafts
    (up to EXACT_POSITIONS_MAX tokens after a cache) is: each query is attended alone. A longer
    chunk, or a sequence's first (a prompt whose every state the MTP drafter reads), is attended in
    one masked call, whose last row rounds differently from a query alone (and with over 64 rows
    so do the products): those positions come from a second pass over copies of the caches,
    thrown away, while the real pass computes the last positions as usual."""
    if not full or not any(full):
        return layer(h, caches, lengths, last_only=True)
    alone = [f and (cache.offset == 0 or n > EXACT_POSITIONS_MAX) for f, n, cache in zip(full, lengths, caches)]
    if not any(alone):
        return layer(h, caches, lengths, last_only=True, full=full)
    copies = [cache.prefix(cache.offset) if cache.offset else layer.make_cache() for cache in caches]
    every = layer(h, copies, lengths)  # [1, sum(lengths), hidden]
    kept = [f and not a for f, a in zip(full, alone)]
    out = layer(h, caches, lengths, last_only=True, full=kept)
    _, bounds = kept_rows(lengths, kept)
    parts = []
    for (begin, end), (b, e), a in zip(segments(lengths), bounds, alone):
        if a:
            parts.append(every[:, begin:end - 1])
        parts.append(out[:, b:e])
    return mx.concatenate(parts, axis=1)


def start_computing(h: mx.array) -> None:
    """Hand a layer's output to MLX's compute thread while Python builds the next layers. MLX
    keeps at most ~100 CPU operations in flight (10 tasks of 10 in its scheduler) and blocks
    `eval`/`async_eval` until the rest have run, so a step handed over whole (a decode step of
    SmolLM2 is ~330 operations) is mostly computed while Python waits, and an overlapped decode
    loop hides its graph building behind only the step's last ~100 operations. Handed over layer
    by layer, building and computing overlap throughout: SmolLM2's int8 decode on 1 rank x 2 CPUs
    went from 111 to 128 tok/s. Only where this rank has a second CPU for them to overlap on: a
    one-CPU rank gained nothing and its batch jobs lost ~2%. The values are the same."""
    if _several_cpus():
        mx.async_eval(h)


@lru_cache(maxsize=None)
def _several_cpus() -> bool:
    """Asked at the first step, after job.share_cores has bound this rank to its CPUs."""
    from ..util.cores import cpus_allowed

    return len(cpus_allowed()) > 1


class TransformerSlice(nn.Module):
    """The layers [start, end) of a decoder-only transformer, plus, on the first/last stage,
    the token embedding and the final norm + LM head, and with `head_rows` > 0 (the last rank of a
    batch job, see head_share.py) the final norm and the LM head's last `head_rows` rows.

    Parameter names mirror the checkpoint's with the "model." prefix dropped and layer indices
    made local: checkpoint `model.layers.{start + i}.X` is `layers.{i}.X` here.
    """

    def __init__(self, config: ModelConfig, make_layer: Callable[[ModelConfig, int], nn.Module],
                 start: int, end: int, has_ends: bool, head_rows: int = 0):
        super().__init__()
        self.config = config
        self.start, self.end, self.has_ends, self.head_rows = start, end, has_ends, head_rows
        self.layers = [make_layer(config, i) for i in range(start, end)]
        if has_ends or head_rows:
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if has_ends:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            if not config.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if head_rows:
            self.head_share = nn.Linear(config.hidden_size, head_rows, bias=False)

    def make_cache(self) -> list:
        """One sequence's caches, one per layer of this slice."""
        return [layer.make_cache() for layer in self.layers]

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens)

    def forward_layers(self, h: mx.array, caches: list[list], lengths: list[int], last_only: bool = False,
                       full: list[bool] | None = None) -> mx.array:
        """h: [1, sum(lengths), hidden], tokens of len(caches) sequences packed end to end;
        caches[i] is sequence i's list of per-layer caches (see `Attention`). last_only: if this
        slice holds the model's final layer, return each sequence's last position only
        ([1, len(lengths), hidden]): all sampling reads, and the final layer then skips the
        queries, attention output and MLP of a prompt's other tokens (their keys and values are
        still cached), ~1/num_layers of prefill. full: sequences that return every position even so
        (speculative drafts being verified)."""
        final = last_only and self.end == self.config.num_hidden_layers
        for j, layer in enumerate(self.layers):
            layer_caches = [seq_caches[j] for seq_caches in caches]
            if final and j == len(self.layers) - 1:
                h = final_layer(layer, h, layer_caches, lengths, full)
            else:
                h = layer(h, layer_caches, lengths)
                start_computing(h)
        return h

    def logits(self, h: mx.array, vocab_end: int | None = None) -> mx.array:
        """Logits of every vocabulary entry, or of entries [0, vocab_end) only."""
        h = self.norm(h)
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        if vocab_end is not None:
            from ..runtime.head_share import head_columns

            return head_columns(head, h, 0, vocab_end)
        return head.as_linear(h) if self.config.tie_word_embeddings else head(h)
