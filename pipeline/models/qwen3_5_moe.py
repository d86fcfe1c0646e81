"""Qwen3.5-MoE (`model_type` qwen3_5_moe, its language model `qwen3_5_moe_text`): per `layer_types`,
Gated DeltaNet linear attention (gated_deltanet.py) or gated full attention (an output gate
sigmoid(gate) from q_proj, per-head q/k RMSNorm, RoPE on the first quarter of each head), each
followed by a softmax-routed MoE whose shared expert is scaled by a sigmoid gate. Its RMSNorms
scale by (1 + weight): checkpoints store the weight centred on zero.

Text only: the checkpoint's vision tower (`model.visual.*`) and MTP module (`mtp.*`) are not read.
The RoPE's multimodal sections (mrope) rotate every section by the token's position in text, which
is plain RoPE."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..kernels import attention
from .config import ModelConfig
from .cache import KVCache, LinearAttentionState
from .gated_deltanet import GatedDeltaNet
from .layers import MLP, attend
from .packing import kept_rows, positions, segments
from .qwen3_moe import SparseMoeBlock
from .rope import RoPE
from .stage_slice import TransformerSlice


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), in float32 (the stored weight is centred on zero)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        scale = 1.0 + self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), scale, self.eps).astype(x.dtype)


def layer_type(config: ModelConfig, layer_index: int) -> str:
    """"linear_attention" or "full_attention": `layer_types`, else every `full_attention_interval`-th
    layer full (as transformers fills it in)."""
    types = config.raw.get("layer_types")
    if types:
        return types[layer_index]
    interval = int(config.raw.get("full_attention_interval", 4))
    return "full_attention" if (layer_index + 1) % interval == 0 else "linear_attention"


def rotary_dims(config: ModelConfig) -> int:
    params = config.raw.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", config.raw.get("partial_rotary_factor", 0.25)))
    return int(config.head_dim * factor)


class GatedAttention(nn.Module):
    """Grouped-query attention whose output is gated per feature by sigmoid(gate), the gate coming
    from q_proj beside the query (per head: head_dim query features, then head_dim gate features)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, 2 * self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rope = RoPE(rotary_dims(config), config.rope_theta, config.rope_scaling,
                         max_position_embeddings=config.max_position_embeddings)

    def make_cache(self) -> KVCache:
        return KVCache()

    def __call__(self, x: mx.array, caches: list[KVCache], lengths: list[int]) -> mx.array:
        """x: [tokens, hidden], sequences packed end to end as in layers.Attention; every token's output."""
        T = x.shape[0]
        query_and_gate = self.q_proj(x).reshape(T, self.n_heads, 2 * self.head_dim)
        q, gate = query_and_gate[..., :self.head_dim], query_and_gate[..., self.head_dim:]
        k = self.k_proj(x).reshape(T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(T, self.n_kv_heads, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        qk = self.rope.rotate([q, k], positions(lengths, caches))
        q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
        kernel = attention.kernel(q, (self.head_dim,))
        if kernel is not None:
            out = attention.attend_and_append(kernel, q, k, v, caches, list(lengths), lengths, self.scale)
        else:
            attention.note_fallback()
            q, k, v = q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # head-major
            outputs = []
            for (begin, end), cache in zip(segments(lengths), caches):
                ks, vs = cache.update_and_fetch(k[None, :, begin:end], v[None, :, begin:end])
                outputs.append(attend(q[None, :, begin:end], ks, vs, self.scale, cache.offset - (end - begin))[0])
            out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=1)
            out = out.transpose(1, 0, 2).reshape(T, -1)
        return self.o_proj(out * mx.sigmoid(gate.reshape(T, -1)))


class SharedExpertMoe(SparseMoeBlock):
    """Qwen3-MoE's routed experts (top-k weights always renormalised) plus a shared expert, an MLP
    every token goes through, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.norm_topk_prob = True
        self.shared_expert = MLP(config.hidden_size, int(config.raw["shared_expert_intermediate_size"]))
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        shared = mx.sigmoid(self.shared_gate(x)) * self.shared_expert(x)
        return super().__call__(x) + shared

    def shared_gate(self, x: mx.array) -> mx.array:
        """shared_expert_gate(x), [tokens, 1]: a one-column product goes to the BLAS's sgemv, whose rows
        round differently by their number (a trip verifying 4 drafts then moved the hidden states by
        2e-7 from decoding them one by one); as a sum over each row, in float32, a row rounds the same
        whatever shares the call. A quantized gate keeps its own product."""
        gate = self.shared_expert_gate
        if "scales" in gate:
            return gate(x)
        return (x.astype(mx.float32) * gate.weight[0].astype(mx.float32)).sum(axis=-1, keepdims=True).astype(x.dtype)


class DecoderLayer(nn.Module):
    """x + mixer(norm(x)), then + moe(norm(.)): the mixer `linear_attn` or `self_attn` per layer_types."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.linear = layer_type(config, layer_index) == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = SharedExpertMoe(config)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_cache(self):
        return (self.linear_attn if self.linear else self.self_attn).make_cache()

    def __call__(self, x: mx.array, caches: list, lengths: list[int], last_only: bool = False,
                 full: list[bool] | None = None) -> mx.array:
        """x: [1, tokens, hidden]. last_only: each sequence's last position (all of a `full` one's);
        every token still goes through the mixer, whose state or cache takes them all."""
        mixer = self.linear_attn if self.linear else self.self_attn
        h = x + mixer(self.input_layernorm(x[0]), caches, lengths)[None]
        if last_only:
            h = h[:, kept_rows(lengths, full)[0]]
        return h + self.mlp(self.post_attention_layernorm(h))


class Slice(TransformerSlice):
    """TransformerSlice with the final norm zero-centred, and the linear layers' decay parameters kept
    in float32 whatever --dtype is (A_log is exponentiated twice: bfloat16 would move every decay).
    keep_points (set with a prefix cache, runtime/job.py): each linear state keeps its state at the end
    of every trip of more than one token that verifies no drafts (a prompt chunk; the rule is the same
    on every rank, so every rank keeps the same points)."""

    keep_points = False

    def __init__(self, config: ModelConfig, make_layer, start: int, end: int, has_ends: bool, head_rows: int = 0):
        super().__init__(config, make_layer, start, end, has_ends, head_rows)
        if has_ends or head_rows:
            self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward_layers(self, h: mx.array, caches: list[list], lengths: list[int], last_only: bool = False,
                       full: list[bool] | None = None) -> mx.array:
        """TransformerSlice.forward_layers, the linear states of the sequences marked `full` (drafts being
        verified) told to keep a trail of the trip's positions, for the rewind of rejected ones."""
        full = full or [False] * len(caches)
        for seq_caches, verifying in zip(caches, full):
            for cache in seq_caches:
                if isinstance(cache, LinearAttentionState):
                    cache.verifying = verifying
        h = super().forward_layers(h, caches, lengths, last_only, full if any(full) else None)
        if self.keep_points:  # a prompt chunk's end: a resume point for the prefix cache
            for seq_caches, n, verifying in zip(caches, lengths, full):
                if n > 1 and not verifying:
                    for cache in seq_caches:
                        if isinstance(cache, LinearAttentionState):
                            cache.keep_point()
        return h

    @staticmethod
    def keeps_float32(name: str) -> bool:
        return name.endswith((".linear_attn.A_log", ".linear_attn.dt_bias"))
