"""Model families by `model_type`: each maps to a module with a `DecoderLayer(config, index)`, and
where a family's slice differs from base.TransformerSlice (its embedding, hidden state or head:
DeepSeek V4's residual streams), a `Slice` class."""

from types import ModuleType

from .config import ModelConfig
from ..util.errors import UserError
from . import deepseek_v3, deepseek_v4, deepseek_v32, llama, qwen3_moe

FAMILIES: dict[str, ModuleType] = {
    "llama": llama,
    "mistral": llama,
    "qwen2": llama,
    "qwen3": llama,
    "qwen3_moe": qwen3_moe,
    "deepseek_v3": deepseek_v3,
    "kimi_k2": deepseek_v3,  # Kimi K2 checkpoints use the DeepSeek V3 architecture
    "deepseek_v32": deepseek_v32,
    "deepseek_v4": deepseek_v4,
    "kimi_k25": deepseek_v3,  # Kimi K2.5's language model is K2's (its text_config names deepseek_v3)
}


def family_for(config: ModelConfig) -> ModuleType:
    try:
        return FAMILIES[config.model_type]
    except KeyError:
        raise UserError(f"model_type {config.model_type!r} is not supported "
                        f"(supported: {', '.join(sorted(FAMILIES))})") from None
