"""GLM-5 in a GGUF (llama.cpp's `glm-dsa` architecture): its config from the metadata, and the names of
the tensors DeepSeek's (`deepseek2`) do not have.

llama.cpp's converter (convert_hf_to_gguf.py, GlmMoeDsaModel) is DeepSeek V2's (DeepseekV2Model): the
same MLA tensors, kv_b split into `attn_k_b` / `attn_v_b` (gguf_checkpoint rebuilds kv_b, as for
deepseek2), experts stacked, the router's correction bias as `exp_probs_b`, the same metadata keys
(gguf_config's deepseek2 branch reads them); no value changed (MLA and the indexer rotate interleaved
pairs, as llama.cpp's deepseek2 graph does, so nothing is permuted). What it adds:
- the lightning indexer, `blk.N.indexer.attn_q_b` / `attn_k` / `k_norm` (a LayerNorm: weight and bias)
  / `proj`, our `self_attn.indexer.wq_b` / `wk` / `k_norm` / `weights_proj`; its sizes in
  `attention.indexer.head_count` / `key_length` / `top_k`;
- which layers run their indexer and which reuse the last full layer's top-k: `attention.indexer.types`
  (true: full), written since GLM-5.2's IndexShare; without the key, a layer holding no indexer tensors
  is a shared one; where every layer holds them, as llama.cpp's glm-dsa loader decides: all full below a
  1M-token context (GLM-5, 5.1), else GLM-5.2's published pattern (full at 0, 1, then every 4th from 2;
  the shared layers' indexer tensors, which llama.cpp does not run either, are not read);
- a file without `expert_gating_func` routes by sigmoid (llama.cpp's glm-dsa default; deepseek2's is softmax);
- its MTP layers appended past the model's (`nextn_predict_layers`): the first, block N = the model's
  layer count, is `--draft mtp`'s module (models/mtp.py), under the names of a published checkpoint's
  layer N: that block's attention, indexer and experts as any layer's, and `blk.N.nextn.eh_proj` / `enorm` /
  `hnorm` / `shared_head_norm` (gguf-py's NEXTN_* names) as `model.layers.N.eh_proj` / `enorm` / `hnorm` /
  `shared_head.norm`; its copies of the embedding and head (`nextn.embed_tokens`, `nextn.shared_head_head`)
  are the main model's and are not read, nor are blocks past N.
Dense or MoE per layer is whether the layer holds a router (`ffn_gate_inp`), which also covers
`leading_dense_block_count`. No MLX here (the planner reads the index).
"""

from __future__ import annotations

import re
from typing import Any

from ..util.errors import UserError

ARCH = "glm-dsa"
_INDEXER = {"attn_q_b": "wq_b", "attn_k": "wk", "k_norm": "k_norm", "proj": "weights_proj"}
_TENSOR = re.compile(r"^blk\.(\d+)\.indexer\.([a-z_]+)\.(weight|bias)$")
GLM_5_2_CONTEXT = 1 << 20  # llama.cpp: a file without indexer types from this context up is GLM-5.2's
UNUSED = (-1, "")  # hf_name's answer for a shared layer's indexer tensor: not read


def hf_name(gguf_name: str, indexer_types: list[str]) -> tuple[int, str] | None:
    """(layer, our name) of a glm-dsa indexer tensor (UNUSED where its layer is a shared one), or None where
    it is not one."""
    m = _TENSOR.match(gguf_name)
    if not m or m.group(2) not in _INDEXER:
        return None
    layer = int(m.group(1))
    if layer < len(indexer_types) and indexer_types[layer] == "shared":
        return UNUSED
    return layer, f"model.layers.{layer}.self_attn.indexer.{_INDEXER[m.group(2)]}.{m.group(3)}"


_NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.([a-z_]+)\.(weight|bias)$")
_NEXTN_OWN = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "shared_head_norm": "shared_head.norm"}
_NEXTN_COPIES = ("embed_tokens", "shared_head_head")  # the main model's embedding and head, never read


def nextn_name(gguf_name: str) -> tuple[int, str] | None:
    """(layer, our name) of an MTP block's own tensor (`blk.N.nextn.*`; UNUSED for its copies of the
    embedding and head), or None where it is not one."""
    m = _NEXTN.match(gguf_name)
    if not m:
        return None
    if m.group(2) in _NEXTN_COPIES:
        return UNUSED
    if m.group(2) not in _NEXTN_OWN:
        return None
    layer = int(m.group(1))
    return layer, f"model.layers.{layer}.{_NEXTN_OWN[m.group(2)]}.{m.group(3)}"


def config_fields(need, get, tensors, path) -> dict[str, Any]:
    """The glm_moe_dsa fields of a glm-dsa GGUF, over those gguf_config's deepseek2 branch read:
    `need(key)` / `get(key, default)` read its `glm-dsa.*` metadata, `tensors` its tensor table."""
    nextn = int(get("nextn_predict_layers", 0) or 0)
    layers = int(need("block_count")) - nextn
    types = get("attention.indexer.types")
    if types is not None:
        types = [bool(t) for t in types][:layers]
        if len(types) != layers:
            raise UserError(f"{path}: {ARCH}.attention.indexer.types has {len(types)} entries for {layers} layers; "
                            "the file is damaged")
    else:
        types = [f"blk.{i}.indexer.attn_k.weight" in tensors for i in range(layers)]
        if all(types) and int(need("context_length")) >= GLM_5_2_CONTEXT:
            types = [i < 2 or (i - 2) % 4 == 0 for i in range(layers)]
    if not types[0]:
        raise UserError(f"{path}: layer 0 of this {ARCH} GGUF reuses an earlier layer's top-k, and there is none; "
                        "the file is damaged")
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers)]
    return dict(
        model_type="glm_moe_dsa", num_hidden_layers=layers, num_nextn_predict_layers=nextn,
        index_n_heads=int(need("attention.indexer.head_count")),
        index_head_dim=int(need("attention.indexer.key_length")),
        index_topk=int(need("attention.indexer.top_k")),
        indexer_types=["full" if t else "shared" for t in types],
        mlp_layer_types=["sparse" if s else "dense" for s in sparse],
        first_k_dense_replace=next((i for i, s in enumerate(sparse) if s), layers),
        scoring_func="softmax" if int(get("expert_gating_func", 0) or 0) == 1 else "sigmoid",
        indexer_rope_interleave=True, rope_interleave=True)
