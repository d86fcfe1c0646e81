"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", ICLR 2025), the linear
attention of Qwen3.5's `linear_attn` layers: a causal depthwise convolution over the projected
queries, keys and values, then per value head a fixed-size memory S (key dim x value dim) updated
token by token by the gated delta rule, read by the query, then a gated RMSNorm and a projection.

Each sequence carries its state (cache.LinearAttentionState: the convolution's last inputs and S)
as attention layers carry a KV cache. The recurrence runs token by token everywhere, prefill
included: a prompt prefilled in chunks, a batch's packed sequences and one decoded token at a time
all do the same operations in the same order, so from the same inputs they reach the same bits (the
chunked form of the paper sums in another order and only agrees within float rounding; the
projections before it may still round differently with more than 64 rows, kernels/blas.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .cache import LinearAttentionState
from .config import ModelConfig
from .packing import segments


@mx.compile
def delta_rule_step(memory: mx.array, q: mx.array, k: mx.array, v: mx.array, decay: mx.array,
                    beta: mx.array) -> tuple[mx.array, mx.array]:
    """One token of the gated delta rule, per value head h (memory[h]: [key dim, value dim], the
    transpose of the paper's S, which maps keys to values as S k):

        S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T,     o_t = S_t q_t

    read as: decay the memory by the gate a_t = exp(g_t) first, then write to it the part of v_t the
    decayed memory does not already recall for k_t (the delta rule: b_t (v_t - a_t S_{t-1} k_t)), so
    the error is measured against the memory that will hold the write. q, k: [heads, key dim] (unit
    length, q scaled by 1/sqrt(key dim)); v: [heads, value dim]; decay (a_t), beta (b_t): [heads].
    The reads of the memory are products per head (a_t (S_{t-1} k_t) rather than (a_t S_{t-1}) k_t):
    3.3x faster than elementwise sums over a 397B-A17B layer's 64 x 128 x 128 memory (11.7 -> 3.7 ms a
    token on this CPU), and every caller does the same operations, whatever else is in its batch."""
    recalled = decay[:, None] * (k[:, None, :] @ memory)[:, 0]  # a_t S_{t-1} k_t: [heads, value dim]
    correction = beta[:, None] * (v - recalled)
    memory = decay[:, None, None] * memory + k[:, :, None] * correction[:, None, :]
    return memory, (q[:, None, :] @ memory)[:, 0]


def l2_normalized(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(|x|^2 + eps) over the last axis: unit keys keep the delta rule's update a projection."""
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


class DepthwiseConv(nn.Module):
    """The causal depthwise convolution's kernel, as checkpoints store it: weight [channels, 1, kernel]."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel))

    def __call__(self, x: mx.array, state: LinearAttentionState) -> mx.array:
        """x: [new tokens, channels] -> the same shape: each output is the kernel over its token and the
        kernel - 1 before it, the sequence's earlier tokens taken from the state (zeros at its start),
        which then keeps the last kernel - 1 inputs for the next call."""
        kernel = self.weight.shape[-1]
        before = state.conv if state.conv is not None else mx.zeros((kernel - 1, x.shape[1]), x.dtype)
        window = mx.concatenate([before, x], axis=0)  # [kernel - 1 + new, channels]
        n = x.shape[0]
        weight = self.weight[:, 0, :].astype(mx.float32)  # [channels, kernel]
        window32 = window.astype(mx.float32)
        out = window32[0:n] * weight[:, 0]
        for j in range(1, kernel):
            out = out + window32[j:j + n] * weight[:, j]
        state.conv = window[-(kernel - 1):]
        return out


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then times silu of its gate z (in float32)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(x.astype(mx.float32), self.weight.astype(mx.float32), self.eps)
        return normed * nn.silu(gate.astype(mx.float32))


class GatedDeltaNet(nn.Module):
    """A `linear_attn` layer; checkpoint names as published (in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a, conv1d, dt_bias, A_log, norm, out_proj)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        r = config.raw
        self.key_heads, self.value_heads = int(r["linear_num_key_heads"]), int(r["linear_num_value_heads"])
        self.key_dim, self.value_dim = int(r["linear_key_head_dim"]), int(r["linear_value_head_dim"])
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.tiled = bool(r.get("linear_value_heads_tiled"))
        hidden = config.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, 2 * keys + values, bias=False)
        self.in_proj_z = nn.Linear(hidden, values, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.value_heads, bias=False)
        self.conv1d = DepthwiseConv(2 * keys + values, int(r.get("linear_conv_kernel_dim", 4)))
        self.dt_bias = mx.ones((self.value_heads,))
        self.A_log = mx.zeros((self.value_heads,))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(values, hidden, bias=False)

    def make_cache(self) -> LinearAttentionState:
        return LinearAttentionState()

    def __call__(self, x: mx.array, states: list[LinearAttentionState], lengths: list[int]) -> mx.array:
        """x: [tokens, hidden], several sequences' new tokens packed end to end (sequence i owns the
        next lengths[i] and states[i]) -> [tokens, hidden]. The projections run on all tokens at once;
        the convolution and the recurrence per sequence, on its own state."""
        mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)
        beta = mx.sigmoid(self.in_proj_b(x).astype(mx.float32))  # the write strength b_t, in (0, 1)
        # The decay a_t = exp(g_t), g_t = -exp(A_log) * softplus(a + dt_bias) <= 0: a learned rate per
        # head times a data-dependent step size (Mamba2's discretisation).
        step = nn.softplus(self.in_proj_a(x).astype(mx.float32) + self.dt_bias.astype(mx.float32))
        decay = mx.exp(-mx.exp(self.A_log.astype(mx.float32)) * step)
        outputs = [self.sequence(mixed[b:e], decay[b:e], beta[b:e], state)
                   for (b, e), state in zip(segments(lengths), states)]
        out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)  # [tokens, value heads, value dim]
        out = self.norm(out, z.reshape(out.shape)).astype(x.dtype)
        return self.out_proj(out.reshape(x.shape[0], -1))

    def sequence(self, mixed: mx.array, decay: mx.array, beta: mx.array, state: LinearAttentionState) -> mx.array:
        """One sequence's new tokens through its convolution and recurrence: [new, value heads, value dim]."""
        n = mixed.shape[0]
        trail = state.verifying and 1 < n <= state.trail_max  # drafts being verified: keep each position's state
        if trail:
            kernel = self.conv1d.weight.shape[-1]
            before = state.conv if state.conv is not None else mx.zeros((kernel - 1, mixed.shape[1]), mixed.dtype)
            window = mx.concatenate([before, mixed], axis=0)
        mixed = nn.silu(self.conv1d(mixed, state))
        keys = self.key_heads * self.key_dim
        q = l2_normalized(mixed[:, :keys].reshape(n, self.key_heads, self.key_dim)) * self.key_dim ** -0.5
        k = l2_normalized(mixed[:, keys:2 * keys].reshape(n, self.key_heads, self.key_dim))
        v = mixed[:, 2 * keys:].reshape(n, self.value_heads, self.value_dim)
        # Each query/key head serves value_heads / key_heads consecutive value heads (a GGUF's value heads
        # are tiled instead: value head j reads key head j % key_heads, checkpoints/gguf_qwen35.py).
        group = self.value_heads // self.key_heads
        if group > 1 and self.tiled:
            q, k = mx.tile(q, (1, group, 1)), mx.tile(k, (1, group, 1))
        elif group > 1:
            q, k = mx.repeat(q, group, axis=1), mx.repeat(k, group, axis=1)
        memory = state.recurrent
        if memory is None:
            memory = mx.zeros((self.value_heads, self.key_dim, self.value_dim), mx.float32)
        if trail:  # the trip's inputs (a few hundred KiB a layer), not a memory (MiB) per position
            def replay(done: int, memory=memory, inputs=(q, k, v, decay, beta)) -> mx.array:
                """The memory after the trip's first `done` positions: the same steps on the same inputs."""
                for t in range(done):
                    memory, _ = delta_rule_step(memory, *(a[t] for a in inputs))
                return memory
        outputs = []
        for t in range(n):
            memory, o = delta_rule_step(memory, q[t], k[t], v[t], decay[t], beta[t])
            outputs.append(o)
        state.recurrent = memory
        state.offset += n
        state.record((window, n, replay) if trail else None)
        return mx.stack(outputs)
