"""DeepSeek's multi-token-prediction (MTP) module, the drafter of `--draft mtp`.

DeepSeek V3 / R1 / V3.1 / V3.2 ship one MTP module after the main model's layers (config.json
`num_nextn_predict_layers: 1`; tensors `model.layers.{num_hidden_layers}.*`), and so do GLM-5 / 5.1
(`glm_moe_dsa`: vLLM maps it to its DeepseekV32MTPModel; the block is GLM's decoder layer, a full one). For position j it
combines the main model's hidden state h_j with the token after it, t_{j+1}, and predicts t_{j+2}:

    x_j = eh_proj([enorm(embed(t_{j+1})) ; hnorm(h_j)])
    o_j = a decoder layer (MLA + MoE, as the main model's; its own cache over the positions it saw)
    next-but-one token logits = head(shared_head.norm(o_j))

What the published weights expect, from public inference code (DeepSeek's own inference code
never runs the module):
- The concatenation puts the embedding first: vLLM's deepseek_mtp.py (`torch.cat([inputs_embeds,
  previous_hidden_states])`) and SGLang's deepseek_nextn.py (`cat(enorm(embeds), hnorm(hidden))`).
  The V3 report's equation (21) writes [RMSNorm(h); RMSNorm(Emb)], the other order; the code is
  what reaches the acceptance rates measured on these weights.
- h_j is the main model's final hidden state after its final norm (what the LM head reads):
  vLLM's DeepseekV2Model.forward returns `self.norm(hidden_states, residual)` and the MTP proposer
  is given that output; SGLang's target model hands on what its logits processor reads, the same.
- Drafting K > 1 tokens repeats the step on the module's own output and its own draft (SGLang runs
  it so; vLLM too). SGLang feeds the module's output after shared_head.norm (again what its head
  reads), vLLM before it; we follow SGLang, so h is always "the state the head reads".
- embed_tokens and shared_head.head are the main model's (DeepSeek's README_WEIGHTS.md: they
  "share parameters" with the main model's embedding and output head), so rank 0, which holds
  both, uses its own, and the copies stored in the layer are never read.
- RoPE: x_j sits at position j (vLLM passes the target's positions). vLLM also zeroes the
  embedding at position 0; SGLang does not, nor do we (it changes the first position only).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import deepseek_v4_mtp
from .config import ModelConfig
from .deepseek_v4_names import MTP_OWN
from .registry import family_for
from ..util.errors import UserError

SHARED = ("embed_tokens.", "shared_head.head.")  # the main model's, never read from the layer
OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")  # the module's own; the rest is its decoder layer


class SharedHeadNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(dims, eps=eps)


class MTPModule(nn.Module):
    """One MTP module: its norms and projection, and its decoder layer as `block`."""

    def __init__(self, config: ModelConfig, make_layer):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = nn.RMSNorm(d, eps=eps)
        self.hnorm = nn.RMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = make_layer(config, config.num_hidden_layers)
        self.shared_head = SharedHeadNorm(d, eps)

    def make_cache(self):
        return self.block.make_cache()

    def __call__(self, embedded: mx.array, hidden: mx.array, cache) -> mx.array:
        """embedded: [1, T, d] embeddings of tokens t_{j+1}; hidden: [1, T, d] the states h_j the head
        reads, of T consecutive positions after those `cache` holds. Returns shared_head.norm(o_j):
        what the head reads to predict t_{j+2}, and the next step's h."""
        x = self.eh_proj(mx.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1))
        return self.shared_head.norm(self.block(x, [cache], [x.shape[1]]))


def mtp_prefix(config: ModelConfig) -> str:
    if config.model_type == "deepseek_v4":  # its own module (models/deepseek_v4_mtp.py), under mtp.0.
        return "mtp.0."
    return f"model.layers.{config.num_hidden_layers}."


def own_names(config: ModelConfig) -> tuple[str, ...]:
    """The module's own tensors (after mtp_prefix); the others are its decoder layer's (`block.`)."""
    return MTP_OWN if config.model_type == "deepseek_v4" else OWN


def make_module(config: ModelConfig, make_layer) -> nn.Module:
    """The family's MTP module: DeepSeek V4's over its residual streams, or V3's."""
    if config.model_type == "deepseek_v4":
        return deepseek_v4_mtp.MTPModule(config, make_layer)
    return MTPModule(config, make_layer)


def mtp_tensor_names(checkpoint, config: ModelConfig) -> list[str]:
    """The checkpoint tensors of the (first) MTP module that we read: all but its copies of the
    main model's embedding and head."""
    prefix = mtp_prefix(config)
    return sorted(name for name in checkpoint.tensors
                  if name.startswith(prefix) and not name[len(prefix):].startswith(SHARED))


def has_mtp(checkpoint, config: ModelConfig) -> bool:
    prefix = tuple(mtp_prefix(config) + p for p in ("eh_proj.", "e_proj."))  # V3's, V4's
    return int(config.raw.get("num_nextn_predict_layers") or 0) >= 1 and any(
        name.startswith(prefix) for name in checkpoint.tensors)


def mtp_nbytes(checkpoint, config: ModelConfig) -> int:
    """Bytes on disk of what `load_mtp` (checkpoints/mtp.py) reads (0 without an MTP module)."""
    if not has_mtp(checkpoint, config):
        return 0
    return sum(checkpoint.tensors[name].nbytes for name in mtp_tensor_names(checkpoint, config))


def check_mtp(checkpoint, config: ModelConfig, folder) -> None:
    """One line for `--draft mtp` on a model without the module, before anything is loaded."""
    if not family_for(config).mtp:
        raise UserError(f"--draft mtp needs DeepSeek's multi-token-prediction module, and model_type "
                        f"{config.model_type} has none: use --draft ngram")
    if not has_mtp(checkpoint, config):
        layers = int(config.raw.get("num_nextn_predict_layers") or 0)
        raise UserError(f"--draft mtp: {folder} has no MTP module (config.json num_nextn_predict_layers "
                        f"{layers}, no {mtp_prefix(config)}eh_proj tensor; MLX conversions usually drop it): "
                        f"use a folder with DeepSeek's layer {config.num_hidden_layers}, or --draft ngram")
