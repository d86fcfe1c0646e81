"""The Llama family: Llama 1/2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm).

One pre-norm decoder block: h = x + attn(norm(x)); out = h + mlp(norm(h)).
The differences between these families are config switches inside `Attention`.
"""

import mlx.core as mx
import mlx.nn as nn

from ..config import ModelConfig
from .base import MLP, Attention, KVCache


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, caches: list[KVCache], lengths: list[int]) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), caches, lengths)
        return h + self.mlp(self.post_attention_layernorm(h))
