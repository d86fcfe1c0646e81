"""Model families by `model_type`, and what each can do, declared once.

Each family names a module of this package holding its `DecoderLayer(config, index)` and, where its
slice differs from the generic TransformerSlice (its embedding, hidden state or head: DeepSeek V4's
residual streams), a `Slice` class. The module is imported on first use, by `Family.module()`:
this registry imports no MLX, so the planner and the job's checks read the capabilities without it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from .config import ModelConfig
from ..util.errors import UserError


@dataclass(frozen=True)
class Family:
    module_name: str  # the module under pipeline.models
    drafts: bool = True  # speculative decoding: its caches can drop a rejected draft's positions
    head_share: bool = True  # a batch job's last rank can hold a share of the LM head
    prefix_cache: bool = True  # a finished sequence's cache can be cut back to a shorter prefix
    stored_cache: bool = True  # --prompt-cache-dir: its entries on disk hold what its caches hold
    mtp: bool = False  # DeepSeek's multi-token-prediction module runs as a drafter (models/mtp.py)
    kept_state: str = "compressed caches"  # what makes drafts or the prefix cache refuse it, in their errors

    def module(self) -> ModuleType:
        """The family's module (imports MLX)."""
        return importlib.import_module(f"{__package__}.{self.module_name}")


LLAMA = Family("llama")
DEEPSEEK_V3 = Family("deepseek_v3", mtp=True)
# DeepSeek V4's compressed caches resume a prefix or drop rejected drafts from the states they keep
# (models/deepseek_v4.py CompressedCache); the prompt cache on disk stores a sequence's states at its end.
DEEPSEEK_V4 = Family("deepseek_v4", mtp=True)
# Qwen3.5's linear-attention layers keep one fixed-size state per sequence (models/gated_deltanet.py),
# which sums up every position seen: the prefix cache resumes it only where it kept it (the end of a
# prompt chunk or of a sequence), and a rejected draft goes back to a state the verify trip kept
# (models.cache.LinearAttentionState). The prompt cache on disk stores those states at a sequence's end.
QWEN3_5_MOE = Family("qwen3_5_moe", kept_state="linear-attention states")

FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "qwen3_moe": Family("qwen3_moe"),
    "deepseek_v3": DEEPSEEK_V3,
    "kimi_k2": DEEPSEEK_V3,  # Kimi K2 checkpoints use the DeepSeek V3 architecture
    "deepseek_v32": Family("deepseek_v32", mtp=True),
    "deepseek_v4": DEEPSEEK_V4,
    "kimi_k25": DEEPSEEK_V3,  # Kimi K2.5's language model is K2's (its text_config names deepseek_v3)
    "minimax_m2": Family("minimax_m2"),  # plain KV caches, as qwen3_moe; its MTP modules are not published
    "glm_moe_dsa": Family("glm_moe_dsa", mtp=True),  # V3.2's caches; its MTP layer is DeepSeek's module (models/mtp.py)
    "qwen3_5_moe": QWEN3_5_MOE,
    "qwen3_5_moe_text": QWEN3_5_MOE,  # a published config's text_config type, which ModelConfig reads
}


# Families `pipeline plan` sizes (planner/shapes.py) before the runtime runs them: refused by name.
PLANNED: dict[str, str] = {
}


def family_for(config: ModelConfig) -> Family:
    family = FAMILIES.get(config.model_type)
    if family is not None:
        return family
    if config.model_type in PLANNED:
        raise UserError(f"{PLANNED[config.model_type]} ({config.model_type}) is not yet supported by the runtime "
                        f"(issue 36); `pipeline plan --model ...` sizes it for a cluster")
    raise UserError(f"model_type {config.model_type!r} is not supported "
                    f"(supported: {', '.join(sorted(FAMILIES))})")
