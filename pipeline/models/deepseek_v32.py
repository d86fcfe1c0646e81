"""DeepSeek V3.2 (`model_type` deepseek_v32): DeepSeek V3 with DeepSeek Sparse Attention (DSA).

Everything is V3's (MLA, DeepSeekMoE; see deepseek_v3.py) but the attention's choice of keys. A
lightning indexer scores every cached position s for each query t (DeepSeek-V3.2 report, eq. 1):

    I[t, s] = sum_h  w[t, h] * ReLU(q_I[t, h] . k_I[s])

with its own small heads: q_I = W_qI c_q (from MLA's query latent c_q, index_n_heads x index_head_dim),
one key per token k_I = LayerNorm(W_kI x), and per-head weights w = W_w x / sqrt(index_n_heads); both
rotated (half-split RoPE on their first qk_rope_head_dim features). Each query then attends only to
its index_topk best-scoring positions among those it may see (causally); while a sequence holds no
more than index_topk positions that is all of them, and DSA is V3's attention.

The indexer's key of every position is cached beside MLA's latent and rotary key, so the caches a
rank keeps grow by index_head_dim values per token per layer.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .cache import KVCache
from .layers import EXACT_POSITIONS_MAX, MLP, PreNormBlock, attend
from .packing import kept_rows, positions, segments
from .rope import RoPE
from .deepseek_v3 import DeepseekMoE, MultiHeadLatentAttention, is_moe_layer


class LightningIndexer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        r = config.raw
        self.n_heads, self.head_dim = int(r["index_n_heads"]), int(r["index_head_dim"])
        self.top_k = int(r["index_topk"])
        self.rope_dim = int(r["qk_rope_head_dim"])
        self.wq_b = nn.Linear(int(r["q_lora_rank"]), self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        # The model's rotary frequencies (YaRN included), applied to rotate-half pairs, unlike MLA's
        # interleaved ones.
        self.rope = RoPE(self.rope_dim, config.rope_theta, config.rope_scaling, traditional=False,
                         max_position_embeddings=config.max_position_embeddings)

    def _rotate(self, x: mx.array, offsets: mx.array) -> mx.array:
        """x: [tokens, heads, head_dim], each token at its own position: RoPE on the first rope_dim."""
        rotated = self.rope(x[..., : self.rope_dim][:, :, None], offset=offsets)[:, :, 0]
        return mx.concatenate([rotated, x[..., self.rope_dim:]], axis=-1)

    def keys(self, x: mx.array, offsets: mx.array) -> mx.array:
        """k_I of every new token: [tokens, head_dim]."""
        return self._rotate(self.k_norm(self.wk(x))[:, None], offsets)[:, 0]

    def queries(self, q_latent: mx.array, x: mx.array, offsets: mx.array) -> tuple[mx.array, mx.array]:
        """(q_I [queries, heads, head_dim], w [queries, heads]) of the querying tokens."""
        q = self.wq_b(q_latent).reshape(q_latent.shape[0], self.n_heads, self.head_dim)
        return self._rotate(q, offsets), self.weights_proj(x) * self.n_heads ** -0.5

    def selected(self, q: mx.array, w: mx.array, keys: mx.array, q_positions: mx.array) -> mx.array | None:
        """Which of a sequence's cached positions each query attends to, [queries, positions] (True:
        attended), or None when every position it may see is chosen anyway."""
        n = keys.shape[0]
        if n <= self.top_k:
            return None
        scores = nn.relu(q.astype(mx.float32) @ keys.astype(mx.float32).T * self.head_dim ** -0.5)  # [t, h, n]
        index = (w.astype(mx.float32)[:, None, :] @ scores)[:, 0]  # sum_h w[t, h] * ReLU(q . k): [t, n]
        visible = mx.arange(n)[None, :] <= q_positions[:, None]
        index = mx.where(visible, index, -mx.inf)
        best = mx.argpartition(-index, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        chosen = mx.put_along_axis(mx.zeros((q.shape[0], n), dtype=mx.bool_), best, mx.array(True), axis=-1)
        return chosen & visible  # a query with fewer than top_k visible positions picked some unseen ones


class SparseLatentAttention(MultiHeadLatentAttention):
    """MLA attending to the indexer's top-k positions. The cache's "values" hold each position's
    rotary key and, after it, the indexer's key (so every cache operation keeps the two together).

    A subclass may make layers without an indexer of their own (`indexed` False: GLM's shared
    layers): their cache holds the rotary key alone, and they attend to the positions
    `reused_choice` gives; an indexed layer hands what it chose to `chose`."""

    indexer_class = LightningIndexer

    def __init__(self, config: ModelConfig, indexed: bool = True):
        super().__init__(config)
        self.indexed = indexed
        if indexed:
            self.indexer = self.indexer_class(config)

    def reused_choice(self, sequence: int, positions: int, queries: int) -> mx.array | None:
        """A layer without an indexer: which of the `sequence`-th sequence's `positions` cached
        positions its last `queries` queries attend to (as LightningIndexer.selected)."""
        raise NotImplementedError("every DeepSeek V3.2 layer has its own indexer")

    def chose(self, chosen: list[mx.array | None]) -> None:
        """What an indexed layer chose in this step, per sequence (for layers that reuse it)."""

    def __call__(self, x: mx.array, caches: list[KVCache], lengths: list[int], last_only: bool = False,
                 full: list[bool] | None = None) -> mx.array:
        _, T, _ = x.shape
        offsets = positions(lengths, caches)
        if last_only:  # queries at each sequence's last token only (all of a full one's)
            last, kept = kept_rows(lengths, full)
            xq, q_offsets = x[:, last], offsets[last]
        else:
            xq, q_offsets = x, offsets
        q_latent = self.q_a_layernorm(self.q_a_proj(xq))[0]  # c_q: [queries, q_lora_rank]
        q = self.q_b_proj(q_latent).reshape(xq.shape[1], self.n_heads, -1).transpose(1, 0, 2)
        q_nope, q_rope = q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim:]
        q_absorbed = q_nope @ self.w_uk.swapaxes(-1, -2)  # [heads, queries, latent]

        compressed = self.kv_a_proj_with_mqa(x)[0]
        latent = self.kv_a_layernorm(compressed[:, : self.kv_lora_rank])
        k_rope = self.rope(compressed[:, self.kv_lora_rank:][:, None, None], offset=offsets)[:, 0, 0]
        q_rope = self.rope(q_rope.transpose(1, 0, 2)[:, :, None], offset=q_offsets)[:, :, 0].transpose(1, 0, 2)
        if self.indexed:
            index_keys = self.indexer.keys(x[0], offsets)
            index_q, index_w = self.indexer.queries(q_latent, xq[0], q_offsets)

        outputs, chosen_here = [], []
        for i, ((begin, end), cache) in enumerate(zip(segments(lengths), caches)):
            qb, qe = kept[i] if last_only else (begin, end)
            new_values = mx.concatenate([k_rope[begin:end], index_keys[begin:end]], axis=-1) if self.indexed \
                else k_rope[begin:end]
            cached_latent, values = cache.update_and_fetch(latent[None, None, begin:end], new_values[None, None])
            cached_rope = values[..., : self.qk_rope_head_dim]
            queries = mx.concatenate([q_absorbed[None, :, qb:qe], q_rope[None, :, qb:qe]], axis=-1)
            keys = mx.concatenate([cached_latent, cached_rope], axis=-1)
            if self.indexed:
                chosen = self.indexer.selected(index_q[qb:qe], index_w[qb:qe],
                                               values[0, 0, :, self.qk_rope_head_dim:], q_offsets[qb:qe])
                chosen_here.append(chosen)
            else:
                chosen = self.reused_choice(i, cached_latent.shape[2], qe - qb)
            if chosen is None:  # every visible position chosen: V3's attention
                out = attend(queries, keys, cached_latent, self.scale, cache.offset - (qe - qb))
            else:
                out = attend_chosen(queries, keys, cached_latent, self.scale, cache.offset - (qe - qb), chosen)
            outputs.append(out[0])
        if self.indexed:
            self.chose(chosen_here)
        out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=1)
        out = out @ self.w_uv.swapaxes(-1, -2)
        return self.o_proj(out.transpose(1, 0, 2).reshape(1, out.shape[1], -1))


def attend_chosen(queries: mx.array, keys: mx.array, values: mx.array, scale: float, cached: int,
                  chosen: mx.array) -> mx.array:
    """Attention of t new queries [1, heads, t, d] to the positions `chosen` [t, cached + t] marks. A few
    new tokens after a cache (drafts being verified) are attended one query at a time over the keys up to
    its own position, as decoding them one by one does (layers.attend), so verifying never changes a
    result; a prompt chunk in one masked call."""
    t = queries.shape[2]
    if t == 1 or cached == 0 or t > EXACT_POSITIONS_MAX:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=chosen[None, None])
    return mx.concatenate([
        mx.fast.scaled_dot_product_attention(queries[:, :, j:j + 1], keys[:, :, :cached + j + 1],
                                             values[:, :, :cached + j + 1], scale=scale,
                                             mask=chosen[None, None, j:j + 1, :cached + j + 1])
        for j in range(t)], axis=2)


def is_sparse_layer(config: ModelConfig, layer_index: int) -> bool:
    """MoE or dense MLP: transformers writes the choice per layer (mlp_layer_types), DeepSeek's config
    as V3's first_k_dense_replace."""
    kinds = config.raw.get("mlp_layer_types")
    return kinds[layer_index] == "sparse" if kinds and layer_index < len(kinds) else is_moe_layer(config, layer_index)


def DecoderLayer(config: ModelConfig, layer_index: int) -> PreNormBlock:
    sparse = is_sparse_layer(config, layer_index)
    mlp = DeepseekMoE(config) if sparse else MLP(config.hidden_size, config.intermediate_size)
    return PreNormBlock(config, SparseLatentAttention(config), mlp)
