"""The layers the families share: RMSNorm, grouped-query attention (and MLX's attention of a few
new tokens, each query alone), the SwiGLU MLP, and the pre-norm decoder block."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..kernels import attention, layer_kernels, qmm
from .cache import KVCache
from .config import ModelConfig
from .packing import kept_rows, positions, segments
from .rope import RoPE

# Compiled pieces of a layer. On CPU, MLX's fast RMSNorm and RoPE are not kernels but chains of
# small ops (square, sum, rsqrt, ...; cos, sin, multiplies, concatenate), each dispatched on its
# own: a SmolLM2-135M decode step ran ~1,700 ops, ~1,000 of them not products. mx.compile of the
# same computation fuses each elementwise run into one kernel, which does the same operations in
# the same order and type (MLX's CPU ops are scalar C++, and MLX builds the kernel with g++ -O3,
# no FMA contraction): results stay bit-identical to the uncompiled ops (tests/test_layer_ops.py),
# so a token still rounds the same whatever else is in the batch. A new input shape traces the
# function again (well under a millisecond); MLX compiles each new kernel once into its temporary
# folder, and without a C++ compiler it runs the ops unfused, with the same results. RoPE's rotation
# is compiled so in rope.py.


@lru_cache(maxsize=None)
def _compiled_rms_norm(eps: float) -> Callable:
    return mx.compile(lambda x, weight: mx.fast.rms_norm(x, weight, eps))


@mx.compile
def _compiled_swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up in one operation: pipeline's kernel (layer_kernels.py) for float32 on the CPU, 16 elements
    at a time, else compiled (MLX's, one element at a time on the CPU): the same bits either way."""
    out = layer_kernels.swiglu(gate, up)
    return _compiled_swiglu(gate, up) if out is None else out


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameter): pipeline's kernel (layer_kernels.py) for float32 on the CPU, else
    compiled (the same results as MLX's)."""

    def __call__(self, x: mx.array) -> mx.array:
        kernel = layer_kernels.kernel(x)
        if kernel is not None and self["weight"].dtype == mx.float32:
            return kernel.rms_norm(x, self["weight"], self.eps)
        return _compiled_rms_norm(self.eps)(x, self["weight"])


class Attention(nn.Module):
    """Multi-head attention with grouped-query key/value heads (n_kv_heads <= n_heads)."""

    group_sum = None  # --tensor-parallel: the group's sum of this rank's partial output (tensor_parallel.py)

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
            return summed(self, self.o_proj(out))[None]
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
        return summed(self, self.o_proj(out.transpose(1, 0, 2).reshape(out.shape[1], -1)))[None]


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


def summed(module: nn.Module, partial: mx.array) -> mx.array:
    """A layer's output: its own, or with --tensor-parallel the group's sum of every rank's partial one."""
    return partial if module.group_sum is None else module.group_sum(partial)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    group_sum = None  # as Attention's

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim == 2:
            return summed(self, self.down_proj(qmm.swiglu_product(self.gate_proj, self.up_proj, x, swiglu)))
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
