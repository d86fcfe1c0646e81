"""A model's architecture, read from config.json.

Two dialects of the same facts exist in the wild: published checkpoints write `rope_theta` and
`rope_scaling`, while `transformers` 5 writes `rope_parameters` (theta and scaling in one dict).
Everything downstream sees one normalised `ModelConfig`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..util.errors import UserError


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None for plain RoPE; else a dict with "rope_type"
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always has it)
    mlp_bias: bool
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (Qwen3)
    quantization: dict | None  # mlx-lm style: {"group_size", "bits", per-module overrides}
    raw: dict = field(repr=False, default_factory=dict)  # family-specific keys

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        # Multimodal wrappers nest the language model's config.
        if "text_config" in d and "hidden_size" not in d:
            outer = d
            d = {"model_type": outer.get("model_type"), **outer["text_config"],
                 "quantization": outer.get("quantization")}
            # The wrapper's settings hold for the whole checkpoint: its quantization, and whether the
            # LM head is the embedding (transformers ties by the wrapper's tie_word_embeddings).
            if outer.get("quantization_config") and not d.get("quantization_config"):
                d["quantization_config"] = outer["quantization_config"]
            if "tie_word_embeddings" in outer:
                d["tie_word_embeddings"] = outer["tie_word_embeddings"]
        model_type = d.get("model_type")
        if not model_type:
            raise UserError("config.json has no 'model_type'")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            layers = int(d["num_hidden_layers"])
            vocab = int(d["vocab_size"])
        except KeyError as e:
            raise UserError(f"config.json lacks the required key {e.args[0]!r}") from None

        rope_theta, rope_scaling = _rope_settings(d)
        context = int(d.get("max_position_embeddings", 4096))
        if model_type == "mistral" and d.get("sliding_window"):
            # We attend to the whole context; past the window Mistral would attend differently.
            context = min(context, int(d["sliding_window"]))
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d.get("intermediate_size", 4 * hidden)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=context,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            quantization=d.get("quantization") or d.get("quantization_config") or None,
            raw=d,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        return cls.from_dict(read_config_json(folder))

    def quantization_for(self, module_path: str) -> dict | None:
        """{"group_size", "bits"} for one module of an MLX-quantized checkpoint, else None."""
        q = self.quantization
        if not q or "bits" not in q:
            return None
        override = q.get(module_path)
        if override is False:
            return None
        if isinstance(override, dict):
            return {"group_size": override.get("group_size", q.get("group_size", 64)),
                    "bits": override["bits"]}
        return {"group_size": q.get("group_size", 64), "bits": q["bits"]}


def read_config_json(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"no config.json in model folder {folder}: pass --model a Hugging Face-layout folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None


def _rope_settings(d: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either config dialect; scaling is None for plain RoPE."""
    params = d.get("rope_parameters")
    # transformers 5 may key rope_parameters by attention type (e.g. {"full_attention": {...}}).
    if isinstance(params, dict) and "rope_type" not in params and "rope_theta" not in params:
        params = params.get("full_attention") or next(iter(params.values()), None)
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else {}
    if "type" in scaling and "rope_type" not in scaling:  # the older spelling
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling
