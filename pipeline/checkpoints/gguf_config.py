"""The Hugging Face config.json a GGUF's metadata and tensor table describe: what the in-place checkpoint
(gguf_checkpoint.py) runs with and the converter (gguf_convert.py) writes.

llama.cpp keeps a model's architecture as `{arch}.*` metadata keys, written by its convert_hf_to_gguf.py
from the config.json; this undoes that mapping for the architectures we run, reading values as
llama.cpp's graphs read them where a key is absent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..util.errors import UserError
from . import gguf_glm, gguf_minimax, gguf_qwen35
from .gguf_file import GGUFModel

# GGUF architecture -> our model_type
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                 "deepseek2": "deepseek_v3", gguf_qwen35.ARCH: "qwen3_5_moe_text",
                 gguf_minimax.ARCH: "minimax_m2", gguf_glm.ARCH: "glm_moe_dsa"}
GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1 is softmax)


def build_config(g: GGUFModel) -> dict[str, Any]:
    """The Hugging Face config.json this GGUF's metadata and tensor shapes describe."""
    meta, arch, path = g.metadata, g.architecture, g.path
    if arch not in ARCHITECTURES:
        raise UserError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise UserError(f"{path}: GGUF metadata lacks {arch}.{key}; the file is incomplete or not a {arch} model")
        return meta[f"{arch}.{key}"]

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    if "rope_freqs.weight" in g.tensors:
        raise UserError(f"{path}: llama3-style rope scaling (a rope_freqs.weight tensor) is not supported; "
                        "use the original Hugging Face model folder instead")
    embedding = g.tensors.get("token_embd.weight")
    if embedding is None:
        raise UserError(f"{path}: no token_embd.weight tensor; the file is incomplete")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    layers = int(need("block_count"))
    model_type = ARCHITECTURES[arch]
    name = f"{meta.get('general.name', '')} {meta.get('general.basename', '')}".lower()
    if arch == "llama" and "mistral" in name:
        model_type = "mistral"
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "intermediate_size": int(get("feed_forward_length", 0) or 0),
        "hidden_act": "silu",
        "rms_norm_eps": _float32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": int(embedding.shape[0]),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "torch_dtype": "float32",
    }
    if model_type == "mistral":
        config["sliding_window"] = None
    for key, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{meta_key}" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{meta_key}"])
    rope_scaling = _rope_scaling(meta, arch, path)
    if arch == "qwen3moe":
        config.update(num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                      moe_intermediate_size=int(need("expert_feed_forward_length")),
                      # llama.cpp's qwen3moe graph always renormalises the chosen experts' weights
                      norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in g.tensors])
    if arch == gguf_qwen35.ARCH:
        config.update(gguf_qwen35.config_fields(need, get, g.tensors, layers - int(get("nextn_predict_layers", 0) or 0),
                                                config["head_dim"]))
    if arch == gguf_minimax.ARCH:
        config.update(gguf_minimax.config_fields(need, get, g.tensors, config["head_dim"], path))
    if arch in ("deepseek2", gguf_glm.ARCH):  # GLM-5's converter is DeepSeek V2's, plus the indexer
        rope = int(need("rope.dimension_count"))
        # Files converted since llama.cpp split kv_b (MLA as MQA) keep the per-head sizes in *_mla keys;
        # older ones in key_length / value_length.
        key_length = int(get("attention.key_length_mla") or need("attention.key_length"))
        v_dim = int(get("attention.value_length_mla") or need("attention.value_length"))
        q_lora = int(get("attention.q_lora_rank", 0) or 0)
        pre = meta.get("tokenizer.ggml.pre")
        config.update(
            model_type="kimi_k2" if pre == "kimi-k2" else "deepseek_v3",
            num_key_value_heads=heads, head_dim=key_length,
            q_lora_rank=q_lora or None, kv_lora_rank=int(need("attention.kv_lora_rank")),
            qk_rope_head_dim=rope, qk_nope_head_dim=key_length - rope, v_head_dim=v_dim,
            n_routed_experts=int(get("expert_count", 0) or 0) or None,
            num_experts_per_tok=int(get("expert_used_count", 0) or 0),
            moe_intermediate_size=int(get("expert_feed_forward_length", 0) or 0),
            n_shared_experts=int(get("expert_shared_count", 0) or 0),
            first_k_dense_replace=int(get("leading_dense_block_count", 0) or 0), moe_layer_freq=1,
            routed_scaling_factor=_float32(get("expert_weights_scale", 1.0)),
            # As llama.cpp reads these: no expert_weights_norm key means no renormalisation, and no
            # gating function key means softmax (DeepSeek V2's files predate the key).
            norm_topk_prob=bool(get("expert_weights_norm", False)),
            scoring_func="sigmoid" if int(get("expert_gating_func", 1) or 1) == GATING_SIGMOID else "softmax",
            n_group=int(get("expert_group_count", 1) or 1), topk_group=int(get("expert_group_used_count", 1) or 1),
            rope_interleave=True, attention_bias=False)
        if rope_scaling and rope_scaling["rope_type"] == "yarn":
            # convert_hf_to_gguf writes yarn_log_multiplier = 0.1 * mscale_all_dim; DeepSeek V3 and
            # Kimi K2 set mscale = mscale_all_dim, which llama.cpp's graph assumes too.
            log_mul = get("rope.scaling.yarn_log_multiplier")
            if log_mul:
                rope_scaling["mscale_all_dim"] = rope_scaling["mscale"] = _float32(float(log_mul) / 0.1)
            for key in ("beta_fast", "beta_slow"):
                if get(f"rope.scaling.yarn_{key}") is not None:
                    rope_scaling[key] = _float32(get(f"rope.scaling.yarn_{key}"))
    if arch == gguf_glm.ARCH:
        config.update(gguf_glm.config_fields(need, get, g.tensors, path))
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _float32(value) -> float:
    """A GGUF float32 as the short decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(meta: dict[str, Any], arch: str, gguf_path: Path) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"type": "linear", "rope_type": "linear", "factor": _float32(factor)}
    if kind == "yarn":
        scaling = {"type": "yarn", "rope_type": "yarn", "factor": _float32(factor)}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise UserError(f"{gguf_path}: unsupported rope scaling type {kind!r} in the GGUF metadata")
