"""Qwen3-MoE (`model_type` qwen3_moe): Qwen3 attention (per-head q/k RMSNorm) with a
softmax-routed mixture of experts in place of the MLP on sparse layers; no shared experts."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .layers import MLP, Attention, PreNormBlock
from .experts import SwitchGLU


def num_experts(config: ModelConfig) -> int:
    # transformers 5 writes num_local_experts; published configs say num_experts.
    return int(config.raw.get("num_experts") or config.raw.get("num_local_experts") or 0)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        r = config.raw
        self.top_k = int(r["num_experts_per_tok"])
        self.norm_topk_prob = bool(r.get("norm_topk_prob", False))
        self.gate = nn.Linear(config.hidden_size, num_experts(config), bias=False)
        self.switch_mlp = SwitchGLU(config.hidden_size, int(r["moe_intermediate_size"]), num_experts(config))

    def route(self, tokens: mx.array, choice=None) -> tuple[mx.array, mx.array]:
        """Each token's top-k experts and their weights. `choice`: what makes the indices final (under
        tensor parallelism, the group's first member's choices on every member)."""
        probs = mx.softmax(self.gate(tokens).astype(mx.float32), axis=-1)
        indices = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        if choice is not None:
            indices = choice(indices)
        weights = mx.take_along_axis(probs, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return indices, weights

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.reshape(-1, x.shape[-1])
        indices, weights = self.route(tokens)
        routed = self.switch_mlp(tokens, indices)  # [tokens, k, hidden]
        return (routed * weights[..., None].astype(routed.dtype)).sum(axis=1).reshape(x.shape)


def is_sparse_layer(config: ModelConfig, layer_index: int) -> bool:
    r = config.raw
    step = int(r.get("decoder_sparse_step", 1) or 1)
    return (num_experts(config) > 0 and layer_index not in (r.get("mlp_only_layers") or [])
            and (layer_index + 1) % step == 0)


def DecoderLayer(config: ModelConfig, layer_index: int) -> PreNormBlock:
    if is_sparse_layer(config, layer_index):
        mlp = SparseMoeBlock(config)
    else:
        mlp = MLP(config.hidden_size, config.intermediate_size)
    return PreNormBlock(config, Attention(config), mlp)
