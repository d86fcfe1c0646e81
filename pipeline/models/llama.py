"""The Llama family: Llama 1/2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm).

A pre-norm block of grouped-query attention and a SwiGLU MLP; the differences between these
families are config switches inside `Attention`.
"""

from .config import ModelConfig
from .layers import MLP, Attention, PreNormBlock


def DecoderLayer(config: ModelConfig, layer_index: int) -> PreNormBlock:
    return PreNormBlock(config, Attention(config),
                        MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias))
