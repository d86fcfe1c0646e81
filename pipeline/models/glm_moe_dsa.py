"""GLM-5 / GLM-5.1 (`model_type` glm_moe_dsa): DeepSeek V3.2's layer (MLA with DSA's lightning indexer,
see deepseek_v32.py; dense MLP or DeepSeekMoE per `mlp_layer_types`), with two differences:

- The indexer rotates its queries and keys in interleaved pairs, as MLA does (V3.2's indexer rotates
  halves). Its heads are its own (index_n_heads x index_head_dim, from the config).
- Layers may share a top-k (`indexer_types`): a "full" layer runs its indexer; a "shared" one has no
  indexer (nor an indexer key in its cache) and attends to the positions the last full layer before it
  chose for the same queries in the same step. A full layer hands its choice, per sequence, to the
  shared layers after it in the same slice (`TopKRelay`); where a rank begins at a shared layer, the
  rank before sends that choice with the hidden states (`Slice`), since the full layer's queries and
  indexer keys live there. (The published GLM-5 and GLM-5.1 configs run the indexer on every layer.)

The published checkpoint's MTP layer (`model.layers.78.*`, after num_hidden_layers) is DeepSeek V3.2's
module (vLLM runs glm_moe_dsa's as its DeepseekV32MTPModel): models/mtp.py's MTPModule over this
module's DecoderLayer at index num_hidden_layers, a full layer (it runs its own indexer) and MoE.
"""

from __future__ import annotations

import mlx.core as mx

from .config import ModelConfig
from .deepseek_v3 import DeepseekMoE
from .deepseek_v32 import LightningIndexer, SparseLatentAttention, is_sparse_layer
from .layers import MLP, PreNormBlock
from .packing import segments
from .rope import RoPE
from .stage_slice import TransformerSlice
from ..util.errors import UserError


def indexer_types(config: ModelConfig) -> list[str]:
    """"full" or "shared" per layer, as transformers derives them: the config's list, else its
    index_topk_pattern ("FSS..."), else every index_topk_freq-th layer from index_skip_topk_offset
    (every layer by default)."""
    r, n = config.raw, config.num_hidden_layers
    if r.get("indexer_types"):
        return list(r["indexer_types"])
    pattern = r.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(r.get("index_topk_freq", 1) or 1), 1), int(r.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


class TopKRelay:
    """The positions the last full layer chose in this step, per sequence, for the shared layers after
    it: a mask [its query rows, positions] True where attended, None (every visible position), or, as
    received from the rank before, the positions themselves (`as_indices`). A plain object (not an MLX
    module): the layers of a slice share it, and it holds no parameters."""

    def __init__(self):
        self.chosen: list[mx.array | None] = []


class GlmIndexer(LightningIndexer):
    """V3.2's lightning indexer with interleaved RoPE (transformers' GlmMoeDsaIndexer)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.rope = RoPE(self.rope_dim, config.rope_theta, config.rope_scaling,
                         traditional=bool(config.raw.get("indexer_rope_interleave", True)),
                         max_position_embeddings=config.max_position_embeddings)


class GlmSparseAttention(SparseLatentAttention):
    """V3.2's sparse MLA attending to the top-k positions of its own indexer (a full layer: the
    cache's "values" hold each position's rotary key and, after it, the indexer's key) or of the last
    full layer's (a shared layer: the rotary key alone)."""

    indexer_class = GlmIndexer

    def __init__(self, config: ModelConfig, layer_index: int):
        kinds = indexer_types(config)
        shared = layer_index < len(kinds) and kinds[layer_index] == "shared"  # past them: the MTP layer, full
        super().__init__(config, indexed=not shared)
        self.shared = shared
        self.relay = TopKRelay()  # replaced by the slice's, which its layers share (Slice below)
        self.top_k = int(config.raw["index_topk"])

    def reused_choice(self, sequence: int, positions: int, queries: int) -> mx.array | None:
        """The full layer's choice for this sequence's last `queries` queries."""
        chosen = as_mask(self.relay.chosen[sequence], positions, self.top_k)
        return None if chosen is None else chosen[chosen.shape[0] - queries:]

    def chose(self, chosen: list[mx.array | None]) -> None:
        self.relay.chosen = chosen


def DecoderLayer(config: ModelConfig, layer_index: int) -> PreNormBlock:
    sparse = is_sparse_layer(config, layer_index)
    mlp = DeepseekMoE(config) if sparse else MLP(config.hidden_size, config.intermediate_size)
    return PreNormBlock(config, GlmSparseAttention(config, layer_index), mlp)


# A sent top-k's filler where a query chose fewer than index_topk positions: past any position, and an
# int32 whose bits are no NaN's when the hidden state carrying it is float32 (2**30 reads as 2.0).
NO_POSITION = 1 << 30


def as_indices(chosen: mx.array | None, rows: int, top_k: int) -> mx.array:
    """A sequence's top-k choice as it crosses to the next rank: [rows, top_k] int32 positions (filled
    with NO_POSITION), from a full layer's mask [rows, positions] (or None: every visible position)."""
    if chosen is None:
        return mx.full((rows, top_k), NO_POSITION, dtype=mx.int32)
    if chosen.dtype == mx.int32:  # received from the rank before, passed on as it came
        return chosen
    order = mx.argsort(mx.logical_not(chosen).astype(mx.int32), axis=-1)[:, :top_k]  # chosen positions first
    kept = mx.take_along_axis(chosen, order, axis=-1)
    return mx.where(kept, order, NO_POSITION).astype(mx.int32)


def as_mask(chosen: mx.array | None, positions: int, top_k: int) -> mx.array | None:
    """A relayed choice as a mask [rows, positions] (or None: every visible position), whether it is a
    full layer's mask of this rank or the positions sent by the rank before (`as_indices`)."""
    if chosen is None or chosen.dtype != mx.int32:
        return chosen
    if positions <= top_k:  # the full layer chose every visible position (LightningIndexer.selected)
        return None
    mask = mx.zeros((chosen.shape[0], positions + 1), dtype=mx.bool_)
    mask = mx.put_along_axis(mask, mx.minimum(chosen, positions), mx.array(True), axis=-1)
    return mask[:, :positions]


class Slice(TransformerSlice):
    """TransformerSlice whose layers share one TopKRelay. Where the next rank begins at a shared layer,
    the top-k this slice's last full layer chose goes with the hidden states: each token's positions
    (`as_indices`) as int32 bits in top_k more columns of the hidden state's dtype, taken off again by
    the next slice (as head_share.py returns its logits beside the rows)."""

    def __init__(self, config: ModelConfig, make_layer, start: int, end: int, has_ends: bool, head_rows: int = 0):
        super().__init__(config, make_layer, start, end, has_ends, head_rows)
        kinds = indexer_types(config)
        if kinds[0] == "shared":
            raise UserError("GLM's first layer is a shared-indexer one in indexer_types: no layer before it "
                            "chooses its top-k (config.json is not a published GLM model's)")
        self.top_k = int(config.raw["index_topk"])
        self.receives_top_k = start > 0 and kinds[start] == "shared"
        self.sends_top_k = end < config.num_hidden_layers and kinds[end] == "shared"
        self.relay = TopKRelay()
        for layer in self.layers:
            layer.self_attn.relay = self.relay

    def forward_layers(self, h: mx.array, caches: list[list], lengths: list[int], last_only: bool = False,
                       full: list[bool] | None = None) -> mx.array:
        if self.receives_top_k:
            width = self.config.hidden_size
            sent = mx.contiguous(h[0, :, width:]).view(mx.int32)  # [tokens, top_k]
            h = h[..., :width]
            self.relay.chosen = [sent[b:e] for b, e in segments(lengths)]
        h = super().forward_layers(h, caches, lengths, last_only=last_only, full=full)
        if self.sends_top_k:  # not the model's last slice: every token's row is here
            sent = mx.concatenate([as_indices(c, e - b, self.top_k)
                                   for c, (b, e) in zip(self.relay.chosen, segments(lengths))])
            h = mx.concatenate([h, sent.view(h.dtype)[None]], axis=-1)
        return h
