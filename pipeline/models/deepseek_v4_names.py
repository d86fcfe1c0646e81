"""DeepSeek's own tensor names -> transformers' in-memory ones, which the loader and the modules use.

DeepSeek V4 is published under DeepSeek's names (`layers.N.attn.wq_a.weight`, `embed.weight`,
`head.weight`; transformers saves V4 the same way under "model."). These are the renames of
transformers' conversion mapping for deepseek_v4, module by module within a layer, the first match
winning. They apply to the checkpoint's index before anything is read (a rank reads only its own
tensors, found by these names). No MLX: the index is built at plan time too.
"""

from __future__ import annotations

import re

_LAYER = (
    ("attn_norm.", "input_layernorm."), ("ffn_norm.", "post_attention_layernorm."),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.indexer.compressor.wkv.", "self_attn.compressor.indexer.kv_proj."),
    ("attn.indexer.compressor.wgate.", "self_attn.compressor.indexer.gate_proj."),
    ("attn.indexer.compressor.norm.", "self_attn.compressor.indexer.kv_norm."),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."),
    ("attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."),
    ("attn.compressor.wkv.", "self_attn.compressor.kv_proj."),
    ("attn.compressor.wgate.", "self_attn.compressor.gate_proj."),
    ("attn.compressor.norm.", "self_attn.compressor.kv_norm."),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.wq_a.", "self_attn.q_a_proj."), ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wq_b.", "self_attn.q_b_proj."), ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.kv_norm.", "self_attn.kv_norm."),
    ("attn.norm.", "self_attn.kv_norm."),  # how transformers saves it (its rename of .norm. inverted)
    ("attn.wo_a.", "self_attn.o_a_proj."), ("attn.wo_b.", "self_attn.o_b_proj."),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"), ("ffn.gate.", "mlp.gate."),
    ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
    ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
    ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
)
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.w([123])\.")
_W = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
_TOP = {"embed.weight": "model.embed_tokens.weight", "embed_tokens.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
        "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
        "hc_head_scale": "model.hc_head.hc_scale"}
_NATIVE_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def uses_native_names(names) -> bool:
    """Whether a checkpoint's tensor names are DeepSeek's own (V4 as published), not transformers'."""
    names = set(names)
    return "embed.weight" in names or "head.weight" in names or any(
        name.startswith("layers.") or (".attn.wq_a." in name) for name in names)


_MTP = re.compile(r"^mtp\.(\d+)\.")
_MTP_OWN = {"hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
MTP_OWN = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head.")  # the MTP module's own; the rest its block's


def transformers_name(name: str) -> str:
    """DeepSeek's name of a tensor -> transformers' (transformers has no `mtp.*`, the multi-token-
    prediction module: `mtp.K.` + its own tensors as DeepSeek names them, hc_head_* as the main model's
    hc_head.*, and its block's as a layer's; models/deepseek_v4_mtp.py)."""
    m = _MTP.match(name)
    if m:
        rest = name[m.end():]
        if rest in _MTP_OWN or rest.startswith(MTP_OWN):
            return m.group(0) + _MTP_OWN.get(rest, rest)
        return m.group(0) + transformers_name("layers.0." + rest).removeprefix("model.layers.0.")
    top = name.removeprefix("model.")
    if top in _TOP:
        return _TOP[top]
    if top.startswith("hc_head."):
        return "model." + top
    m = _NATIVE_LAYER.match(name)
    if not m:
        return name
    prefix, rest = f"model.layers.{m.group(1)}.", name[m.end():]
    e = _EXPERT.match(rest)
    if e:
        return f"{prefix}mlp.experts.{e.group(1)}.{_W[e.group(2)]}.{rest[e.end():]}"
    for native, ours in _LAYER:
        if rest.startswith(native):
            return prefix + ours + rest[len(native):]
    return prefix + rest  # already transformers' name (or one the model will refuse, naming it)
