"""DeepSeek V4's config values (see deepseek_v4.py), read once from config.json into typed fields.

Imports no MLX: the planner counts V4's parameters and caches from these at plan time. Each value
with a default has it here and nowhere else; a key the model cannot do without (q_lora_rank, the
experts' counts and size) has none, and a config.json lacking it fails with its name (KeyError).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

from .config import ModelConfig

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}

# Tensors V4 keeps in float32 whatever --dtype: the hyper-connections' mixing, sinks, compressors'
# position biases, router correction biases, norms (transformers' _keep_in_fp32_modules_strict).
FLOAT32 = (".fn", ".base", ".scale", "hc_fn", "hc_base", "hc_scale", "sinks", "position_bias",
           "e_score_correction_bias", "norm.weight")


@dataclass(frozen=True)
class DeepSeekV4Config:
    """The V4-specific keys of config.json under their own names (the shared ones, hidden_size,
    head_dim, rms_norm_eps..., stay on ModelConfig)."""

    q_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    # residual streams (mHC)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # attention
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_head_dim: int = 128
    index_n_heads: int = 64
    index_topk: int = 512
    # MoE
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sqrtsoftplus"
    swiglu_limit: float = 10.0
    num_hash_layers: int = 3
    num_nextn_predict_layers: int = 0  # the MTP layers, unused by the main model


_READ = tuple(f for f in fields(DeepSeekV4Config))
_CASTS = {"int": int, "float": float, "str": str}


def deepseek_v4_config(config: ModelConfig) -> DeepSeekV4Config:
    """The record of a V4 config: each key as given, else its default."""
    r = config.raw
    given = {f.name: _CASTS[f.type](r[f.name]) for f in _READ
             if f.default is MISSING or r.get(f.name) is not None}  # a required key missing: KeyError
    return DeepSeekV4Config(**given)


# ----------------------------------------------------------------------- per-layer kinds and rates

def layer_types(config: ModelConfig) -> list[str]:
    """Attention per layer: `layer_types` (transformers) or DeepSeek's `compress_ratios` (0, 4, 128;
    its entries past num_hidden_layers are the MTP layers')."""
    r, n = config.raw, config.num_hidden_layers
    if r.get("layer_types"):
        return list(r["layer_types"])[:n]
    if r.get("compress_ratios"):
        return [_RATIO_TYPES.get(int(m)) or (HCA if int(m) > 4 else CSA) for m in r["compress_ratios"][:n]]
    return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


def attention_kind(config: ModelConfig, index: int) -> str:
    """Layer `index`'s attention; past the main layers, the MTP module's: its compress_ratios entry
    (0, sliding, for the published models), sliding without one."""
    n = config.num_hidden_layers
    if index < n:
        return layer_types(config)[index]
    ratios = config.raw.get("compress_ratios") or []
    if index < len(ratios) and int(ratios[index]):
        return HCA if int(ratios[index]) > 4 else CSA
    return SLIDING


def mlp_kind(config: ModelConfig, index: int) -> str:
    """Layer `index`'s routing; the MTP module's (past the main layers) is top-k, never hashed."""
    return mlp_layer_types(config)[index] if index < config.num_hidden_layers else "moe"


def compress_rate(config: ModelConfig, kind: str) -> int:
    """Tokens per compressed entry of a CSA or HCA layer."""
    r = config.raw
    rates = r.get("compress_rates") or {}
    if kind in rates:
        return int(rates[kind])
    ratios = {int(m) for m in r.get("compress_ratios") or []} - {0}
    if kind == CSA:
        return min(ratios) if ratios else 4
    return max(ratios) if ratios else 128


def mlp_layer_types(config: ModelConfig) -> list[str]:
    """MoE routing per layer: "hash_moe" (experts from the token id) or "moe" (top-k)."""
    r, n = config.raw, config.num_hidden_layers
    if r.get("mlp_layer_types"):
        return list(r["mlp_layer_types"])[:n]
    hashed = deepseek_v4_config(config).num_hash_layers
    return ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)


def last_hash_layer(config: ModelConfig) -> int:
    """Index of the last hash-routed layer (-1: none)."""
    kinds = mlp_layer_types(config)
    return max((i for i, kind in enumerate(kinds) if kind == "hash_moe"), default=-1)


# ------------------------------------------------------------------------------------------- RoPE

def rope_dim(config: ModelConfig) -> int:
    """Rotated features per head: the last qk_rope_head_dim (or partial_rotary_factor of head_dim)."""
    r = config.raw
    if r.get("qk_rope_head_dim"):
        return int(r["qk_rope_head_dim"])
    return int(config.head_dim * float(r.get("partial_rotary_factor") or 64 / 512))


def rope_parameters(config: ModelConfig) -> dict[str, dict]:
    """"main" (sliding layers: plain RoPE on rope_theta) and "compress" (compressed layers, their
    compressors and indexer: rope_scaling's YaRN on compress_rope_theta, cos/sin not rescaled),
    each a dict of rope_theta and the scaling's keys."""
    r = config.raw
    params = r.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):  # transformers' dialect
        return {"main": dict(params["main"]), "compress": dict(params["compress"])}
    scaling = dict(r.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    main = {"rope_type": "default", "rope_theta": r.get("rope_theta", 10000.0)}
    compress = {**scaling, "rope_theta": r.get("compress_rope_theta", 160000.0)}
    if compress.get("rope_type", "default") == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}
