"""MiniMax-M2 in a GGUF (llama.cpp's `minimax-m2` architecture): its config from the metadata, and the one
name that differs from the other families'.

llama.cpp's converter (convert_hf_to_gguf.py, MiniMaxM2Model) changes no tensor's values: it stacks the
experts' w1/w3/w2 into `ffn_gate_exps`/`ffn_up_exps`/`ffn_down_exps`, maps the rest by gguf's TensorNameMap
(`attn_q_norm`/`attn_k_norm` are the norms over all heads, [heads x head_dim] wide, as we hold them;
`exp_probs_b` the router's correction bias, which our block holds as `mlp.e_score_correction_bias`,
not under the router as DeepSeek's), and writes the published `rotary_dim` as `rope.dimension_count`.
The converter writes the published scoring_func "sigmoid" as `expert_gating_func` 2, which llama.cpp's
graph for it reads (with the chosen weights renormalised, unscaled: it reads no expert_weights_scale), as
our block routes; another gating function is refused. No MLX here (the planner reads the index).
"""

from __future__ import annotations

from typing import Any

from ..util.errors import UserError

ARCH = "minimax-m2"
GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def our_name(layer: int, kind: str, name: str) -> str:
    """Our name for a minimax-m2 tensor the generic table named `name` (gguf_checkpoint.hf_name)."""
    return f"model.layers.{layer}.mlp.e_score_correction_bias" if kind == "exp_probs_b" else name


def config_fields(need, get, tensors, head_dim: int, path) -> dict[str, Any]:
    """The minimax_m2 config fields of a minimax-m2 GGUF: `need(key)` / `get(key, default)` read its
    `minimax-m2.*` metadata; `tensors` its tensor table (whether q/k norms and the correction bias exist)."""
    gating = int(get("expert_gating_func", GATING_SIGMOID) or GATING_SIGMOID)
    if gating != GATING_SIGMOID:
        raise UserError(f"{path}: {ARCH}.expert_gating_func is {gating}; MiniMax-M2 routes by sigmoid "
                        f"({GATING_SIGMOID}), and pipeline runs no other gating for it")
    return dict(
        num_local_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
        # the experts' width (the converter writes it as both keys; there is no dense MLP)
        intermediate_size=int(get("expert_feed_forward_length") or need("feed_forward_length")),
        rotary_dim=int(get("rope.dimension_count", head_dim) or head_dim),
        use_qk_norm="blk.0.attn_q_norm.weight" in tensors, use_routing_bias="blk.0.exp_probs_b.bias" in tensors,
        scoring_func="sigmoid")
