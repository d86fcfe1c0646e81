"""Model families by `model_type`: each maps to a module with a `DecoderLayer(config, index)`."""

from types import ModuleType

from ..config import ModelConfig
from ..errors import UserError
from . import llama

FAMILIES: dict[str, ModuleType] = {
    "llama": llama,
    "mistral": llama,
    "qwen2": llama,
    "qwen3": llama,
}


def family_for(config: ModelConfig) -> ModuleType:
    try:
        return FAMILIES[config.model_type]
    except KeyError:
        raise UserError(f"model_type {config.model_type!r} is not supported "
                        f"(supported: {', '.join(sorted(FAMILIES))})") from None
