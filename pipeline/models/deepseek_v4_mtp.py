"""DeepSeek V4's multi-token-prediction (MTP) module, the drafter of `--draft mtp` on V4.

V4 ships one MTP module (`num_nextn_predict_layers: 1`; tensors `mtp.0.*`, which transformers does
not read). DeepSeek's inference code (DeepSeek-V4-Flash inference/model.py, MTPBlock.forward) defines
it over the residual streams: for position j, with H_j [n, d] the main model's streams after its
last layer (before its hc_head) and t_{j+1} the token after j,

    e   = enorm(embed(t_{j+1}))                              [d]
    X   = e_proj(e) + h_proj(hnorm(H_j))  (e_proj's on every stream)   [n, d]
    X'  = Block(X)    a V4 decoder layer: hyper-connections, attention (its compress_ratios entry:
                      sliding for the published models), top-k MoE; its own cache
    logits(t_{j+2}) = head(norm(hc_head(X')))   with the module's own hc_head and norm, the main
                      model's embedding and head (the reference's MTPBlock.embed / .head are set to
                      the main model's).

hnorm is an RMSNorm over d, so on each stream. Drafting K > 1 tokens repeats the step on the
module's own output streams X' and its own draft (the reference runs one step only; as for V3,
models/mtp.py, the state the module hands on is the one its head reads from).

The main model's embedding of a token is the same on every stream (Slice.embed spreads it), so the
module reads stream 0 of what the drafter embeds: the embedding itself.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .deepseek_v4 import DecoderLayer, HyperHead, RMSNorm
from .deepseek_v4_config import FLOAT32, deepseek_v4_config


class MTPModule(nn.Module):
    """One V4 MTP module: its projections, norms and hc_head, and its decoder layer as `block`."""

    def __init__(self, config: ModelConfig, make_layer=DecoderLayer):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        v4 = deepseek_v4_config(config)
        self.n_streams = v4.hc_mult
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.norm = RMSNorm(d, eps)
        self.hc_head = HyperHead(config, v4)
        self.block = make_layer(config, config.num_hidden_layers)

    def keeps_float32(self, name: str) -> bool:
        """As the main model's slice (deepseek_v4.Slice): the loader keeps these in float32."""
        return name.endswith(FLOAT32)

    def make_cache(self):
        return self.block.make_cache()

    def __call__(self, embedded: mx.array, hidden: mx.array, cache) -> mx.array:
        """embedded: the main model's embedding of tokens t_{j+1} as its slice gives it ([1, T, n (+1), d]:
        the same on every stream; or [1, T, d]); hidden: [1, T, n, d] the streams H_j of T consecutive
        positions after those `cache` holds. Returns the block's output streams X' [1, T, n, d]."""
        e = embedded[0] if embedded.ndim == 3 else embedded[0, :, 0]
        h = hidden[0, :, : self.n_streams]
        x = self.e_proj(self.enorm(e))[:, None, :] + self.h_proj(self.hnorm(h))
        out, _ = self.block(x, [cache], [x.shape[0]], None)
        return out[None]

    def head_input(self, streams: mx.array) -> mx.array:
        """Streams [..., n, d] -> what the main model's head reads for the next-but-one token."""
        return self.norm(self.hc_head(streams))
