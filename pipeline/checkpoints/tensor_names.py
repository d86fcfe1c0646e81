"""A rank's tensors by name: a checkpoint's names mapped to the loader's, the tensors one rank
owns (its layers, and the embedding, final norm and LM head on rank 0), their names inside the
rank's slice, and the bytes of each layer on disk. Names and byte counts only: no MLX. A
`checkpoint` here is any reader (safetensors_checkpoint.Checkpoint, gguf_checkpoint.GGUFCheckpoint):
only its `tensors` by name are read.
"""

from __future__ import annotations

import re

from ..models import deepseek_v4_names, minimax_m2_names

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ENDS = ("model.embed_tokens.", "model.norm.", "lm_head.", "model.hc_head.")


# ---- checkpoint names -> the names the loader works with ----------------------------------------
# Every layout is read under one set of names, transformers' in-memory ones (`model.layers.N.X`,
# `model.embed_tokens.weight`, `lm_head.weight`): a rank finds its layers by those, and the format
# adapters and modules see the same names whatever the folder's publisher wrote.

# Multimodal wrappers (Kimi K2.5): the language model under a prefix, the vision tower and its
# projector beside it, never read. transformers 5 saves Kimi K2.5 as published but with "layers"
# spelled "blocks" (its conversion renames blocks -> layers everywhere, and saving inverts that).
_WRAPPED = ((re.compile(r"^language_model\.model\.(?:layers|blocks)\."), "model.layers."),
            (re.compile(r"^language_model\.model\."), "model."),
            (re.compile(r"^language_model\.lm_head\."), "lm_head."),
            (re.compile(r"^model\.language_model\."), "model."))
_NEVER_RUN = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


def canonical_tensors(tensors: dict) -> dict:
    """A checkpoint's tensors under the loader's names (see above; DeepSeek's own names are mapped by
    models/deepseek_v4_names.py, MiniMax's block_sparse_moe by models/minimax_m2_names.py); a
    wrapper's vision tower and projector are left out, so no rank ever reads them."""
    native = deepseek_v4_names.uses_native_names(tensors)
    renamed = {}
    for name, info in tensors.items():
        new = deepseek_v4_names.transformers_name(name) if native else _wrapped_name(name)
        if new is not None:
            renamed[minimax_m2_names.transformers_name(new)] = info
    return renamed


def _wrapped_name(name: str) -> str | None:
    if name.startswith(_NEVER_RUN):
        return None
    for pattern, prefix in _WRAPPED:
        if pattern.match(name):
            return pattern.sub(prefix, name, count=1)
    return name


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def owned_tensor_names(checkpoint, start: int, end: int, has_ends: bool) -> list[str]:
    """The checkpoint tensors one rank loads: its layers, plus embedding/norm/head on the ends
    stage. Tensors of no layer we run (e.g. rotary caches, extra MTP layers) are skipped."""
    names = []
    for name in checkpoint.tensors:
        layer = layer_of(name)
        if layer is not None:
            if start <= layer < end:
                names.append(name)
        elif has_ends and name.startswith(_ENDS):
            names.append(name)
    return sorted(names)


def local_name(name: str, start: int) -> str:
    """Checkpoint name -> parameter path in a TransformerSlice starting at layer `start`."""
    layer = layer_of(name)
    if layer is not None:
        return f"layers.{layer - start}." + name[_LAYER.match(name).end():]
    return name.removeprefix("model.")


def head_prefix(config) -> str:
    """Checkpoint prefix of the LM head's tensors: the embedding's, when tied."""
    return "model.embed_tokens." if config.tie_word_embeddings else "lm_head."


def head_tensor_names(checkpoint, config) -> list[str]:
    """The checkpoint tensors of the LM head."""
    return sorted(name for name in checkpoint.tensors if name.startswith(head_prefix(config)))


def layer_nbytes(checkpoint, num_layers: int) -> tuple[list[int], int]:
    """Bytes on disk of each layer, and of the embedding + final norm + LM head together."""
    per_layer = [0] * num_layers
    ends = 0
    for name, info in checkpoint.tensors.items():
        layer = layer_of(name)
        if layer is not None and layer < num_layers:
            per_layer[layer] += info.nbytes
        elif layer is None and name.startswith(_ENDS):
            ends += info.nbytes
    return per_layer, ends
