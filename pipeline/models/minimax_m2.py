"""MiniMax-M2 (`model_type` minimax_m2): grouped-query attention with two twists, and a sigmoid-routed
mixture of experts on every layer (no shared expert).

Attention. q and k are RMS-normalised over ALL heads together (q_norm's weight is heads x head_dim
wide, one norm per token over the whole projection), not per head as Qwen3's; and RoPE turns only each
head's first `rotary_dim` features (the published config's `rotary_dim`, transformers 5's
`partial_rotary_factor` x head_dim), rotate-half pairs among those, the rest passed through.

Experts. sigmoid(router logits) are each expert's score; a learned correction bias is added to choose
the top k (it never weighs an output), and the chosen scores, renormalised to sum to one, weigh them.
The published files name the block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up),
w2 (down); minimax_m2_names.py reads them as transformers' `mlp.experts.E.gate_proj` etc.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .experts import SwitchGLU
from .layers import Attention, PreNormBlock, RMSNorm
from .rope import RoPE


def rotary_dims(config: ModelConfig) -> int:
    """The features of a head that RoPE turns: `rotary_dim` as published, else transformers 5's
    rope_parameters' partial_rotary_factor, else all of them."""
    r = config.raw
    if r.get("rotary_dim"):
        return int(r["rotary_dim"])
    params = r.get("rope_parameters") if isinstance(r.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", r.get("partial_rotary_factor", 1.0))
    return int(config.head_dim * float(factor))


class RMSNormOverHeads(RMSNorm):
    """RMSNorm of a token's heads as one vector: [tokens, heads, head_dim] normalised over heads x
    head_dim features (the weight is that wide), as MiniMax-M2 norms its whole q and k projections."""

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x.reshape(*x.shape[:-2], -1)).reshape(x.shape)


class MiniMaxAttention(Attention):
    """layers.Attention (it norms q and k after splitting them into heads, where these norms take the
    heads back together) with the norms over all heads and RoPE over the first rotary_dims features."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.qk_norm = bool(config.raw.get("use_qk_norm", True))
        if self.qk_norm:
            self.q_norm = RMSNormOverHeads(self.n_heads * self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNormOverHeads(self.n_kv_heads * self.head_dim, eps=config.rms_norm_eps)
        self.rope = RoPE(rotary_dims(config), config.rope_theta, config.rope_scaling,
                         max_position_embeddings=config.max_position_embeddings)


class SparseMoeBlock(nn.Module):
    """Sigmoid routing with a correction bias that only chooses; chosen scores renormalised (and
    scaled by routed_scaling_factor where a config gives one; MiniMax-M2's does not)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        r = config.raw
        experts = int(r.get("num_local_experts") or r["num_experts"])
        self.top_k = int(r["num_experts_per_tok"])
        self.scaling = float(r.get("routed_scaling_factor") or 1.0)
        self.gate = nn.Linear(config.hidden_size, experts, bias=False)
        if r.get("use_routing_bias", True):
            self.e_score_correction_bias = mx.zeros((experts,))
        # The experts' width is the config's intermediate_size (there is no dense MLP to have another).
        self.switch_mlp = SwitchGLU(config.hidden_size, config.intermediate_size, experts)

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.reshape(-1, x.shape[-1])
        scores = mx.sigmoid(self.gate(tokens).astype(mx.float32))
        choice = scores + self.e_score_correction_bias.astype(mx.float32) if "e_score_correction_bias" in self \
            else scores
        indices = mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        weights = mx.take_along_axis(scores, indices, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True) * self.scaling
        routed = self.switch_mlp(tokens, indices)  # [tokens, k, hidden]
        return (routed * weights[..., None].astype(routed.dtype)).sum(axis=1).reshape(x.shape)


def DecoderLayer(config: ModelConfig, layer_index: int) -> PreNormBlock:
    return PreNormBlock(config, MiniMaxAttention(config), SparseMoeBlock(config))
