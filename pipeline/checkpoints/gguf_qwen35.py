"""Qwen3.5-MoE in a GGUF (llama.cpp's `qwen35moe` architecture): its config from the metadata, and its
tensors' names and what llama.cpp's converter changed (convert_hf_to_gguf.py, Qwen3NextModel and the
Qwen3.5 text models above it), to undo:
- names: `attn_qkv` / `attn_gate` / `ssm_beta` / `ssm_alpha` / `ssm_out` are the linear layers' in_proj_qkv,
  in_proj_z, in_proj_b, in_proj_a and out_proj; `ssm_conv1d` the convolution, squeezed to [channels,
  kernel]; `ssm_norm` the gated norm; `ssm_a` (no suffix) is -exp(A_log); `ssm_dt.bias` is dt_bias;
  `post_attention_norm` the second norm; `ffn_*_shexp` / `ffn_gate_inp_shexp` the shared expert and its gate;
- the RMSNorms that scale by (1 + weight) are stored as 1 + weight (but the gated `ssm_norm`);
- with fewer key heads than value heads, value heads are stored tiled ([K0, K1, ..., K0, K1, ...]) rather
  than grouped by key head: we keep that order and tell the model (config `linear_value_heads_tiled`),
  which then pairs value head j with key head j % key heads (no weight is permuted, quantized ones included);
- MTP layers, when converted, are extra blocks past the model's (`nextn_predict_layers`): not read.
No MLX here (the planner reads the index).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

ARCH = "qwen35moe"
_NAMES = {
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a", "ssm_out": "linear_attn.out_proj",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj", "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_ONE_PLUS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm")  # stored as 1 + weight
FLOAT_ONLY = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # a router; the shared expert's one-row gate (a sum: qwen3_5_moe)
_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)(?:\.(weight|bias))?$")


def hf_name(gguf_name: str) -> tuple[int | None, str, str, str] | None:
    """(layer, our name, llama.cpp's kind, the transform to undo: "" | "one_plus" | "neg_exp" | "conv") of a
    qwen35moe tensor, or None where we hold no such tensor."""
    if gguf_name == "output_norm.weight":
        return None, "model.norm.weight", "output_norm", "one_plus"
    if gguf_name in ("token_embd.weight", "output.weight"):
        return None, {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}[gguf_name], \
            gguf_name.split(".")[0], ""
    m = _TENSOR.match(gguf_name)
    if not m:
        return None
    layer, kind, suffix = int(m.group(1)), m.group(2), m.group(3)
    prefix = f"model.layers.{layer}."
    if kind == "ssm_a" and suffix is None:
        return layer, prefix + "linear_attn.A_log", kind, "neg_exp"
    if kind == "ssm_dt" and suffix == "bias":
        return layer, prefix + "linear_attn.dt_bias", kind, ""
    if kind not in _NAMES or suffix is None:
        return None
    transform = "one_plus" if kind in _ONE_PLUS else "conv" if kind == "ssm_conv1d" else ""
    return layer, f"{prefix}{_NAMES[kind]}.{suffix}", kind, transform


def undo(array: np.ndarray, transform: str) -> np.ndarray:
    """A float tensor as our module holds it, from llama.cpp's form of it."""
    if transform == "one_plus":
        return array.astype(np.float32) - np.float32(1)
    if transform == "neg_exp":
        return np.log(-array.astype(np.float32))
    if transform == "conv":
        return array.reshape(array.shape[0], 1, array.shape[-1])  # [channels, kernel] -> [channels, 1, kernel]
    return array


def held_shape(shape: tuple[int, ...], transform: str) -> tuple[int, ...]:
    return (shape[0], 1, shape[-1]) if transform == "conv" else tuple(shape)


def config_fields(need, get, tensors, layers: int, head_dim: int) -> dict[str, Any]:
    """The qwen3_5_moe_text config fields of a qwen35moe GGUF: `need(key)` / `get(key, default)` read its
    `qwen35moe.*` metadata; `layers`: its block count less its MTP layers."""
    value_heads = int(need("ssm.time_step_rank"))
    return dict(
        model_type="qwen3_5_moe_text", num_hidden_layers=layers, head_dim=head_dim,
        num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
        moe_intermediate_size=int(need("expert_feed_forward_length")),
        shared_expert_intermediate_size=int(need("expert_shared_feed_forward_length")),
        linear_conv_kernel_dim=int(need("ssm.conv_kernel")), linear_key_head_dim=int(need("ssm.state_size")),
        linear_num_key_heads=int(need("ssm.group_count")), linear_num_value_heads=value_heads,
        linear_value_head_dim=int(need("ssm.inner_size")) // value_heads,
        layer_types=["linear_attention" if f"blk.{i}.attn_qkv.weight" in tensors else "full_attention"
                     for i in range(layers)],
        partial_rotary_factor=int(get("rope.dimension_count", head_dim // 4)) / head_dim,
        linear_value_heads_tiled=True, norm_topk_prob=True)
