"""MiniMax-M2's published tensor names -> transformers' in-memory ones, which the loader and the modules use.

MiniMax publishes (and transformers 5 saves) the MoE block as `block_sparse_moe` with the experts'
projections w1 (gate), w2 (down), w3 (up): `model.layers.N.block_sparse_moe.experts.E.w1.weight`, its
router `block_sparse_moe.gate.weight` and correction bias `block_sparse_moe.e_score_correction_bias`.
These are read as `mlp.experts.E.gate_proj.weight`, `mlp.gate.weight`, `mlp.e_score_correction_bias`
(transformers' conversion mapping for minimax_m2, inverted), so the experts stack as every other
family's (checkpoints/format_adapters.py). A name without `block_sparse_moe` is kept. No MLX.
"""

from __future__ import annotations

import re

_BLOCK = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.\d+\.)w([123])\.")
_W = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def transformers_name(name: str) -> str:
    renamed = _BLOCK.sub(r"\1mlp.", name, count=1)
    if renamed == name:
        return name
    return _EXPERT.sub(lambda m: f"{m.group(1)}{_W[m.group(2)]}.", renamed, count=1)
