"""`TransformerSlice`, the part of a model one rank holds (its layers, and on the ends the
embedding, the final norm and the LM head, or a share of the head's columns), and how its layers
run: the final layer's kept rows, each layer's output handed to MLX's compute thread."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..kernels import qmm
from .config import ModelConfig
from .layers import EXACT_POSITIONS_MAX, RMSNorm
from .packing import kept_rows, segments
from .vocab_split import combine, summary
from ..util.cores import cpus_allowed


def final_layer(layer: nn.Module, h: mx.array, caches: list, lengths: list[int], full: list[bool] | None) -> mx.array:
    """The model's last layer, returning each sequence's last position, and every position of
    those marked `full`, the last of them rounded exactly as without `full`. A chunk of drafts
    (up to EXACT_POSITIONS_MAX tokens after a cache) is: each query is attended alone. A longer
    chunk, or a sequence's first (a prompt whose every state the MTP drafter reads), is attended in
    one masked call, whose last row rounds differently from a query alone (and with over 64 rows
    so do the products): those positions come from a second pass over copies of the caches,
    thrown away, while the real pass computes the last positions as usual."""
    if not full or not any(full):
        return layer(h, caches, lengths, last_only=True)
    alone = [f and (cache.offset == 0 or n > EXACT_POSITIONS_MAX) for f, n, cache in zip(full, lengths, caches)]
    if not any(alone):
        return layer(h, caches, lengths, last_only=True, full=full)
    copies = [cache.prefix(cache.offset) if cache.offset else layer.make_cache() for cache in caches]
    every = layer(h, copies, lengths)  # [1, sum(lengths), hidden]
    kept = [f and not a for f, a in zip(full, alone)]
    out = layer(h, caches, lengths, last_only=True, full=kept)
    _, bounds = kept_rows(lengths, kept)
    parts = []
    for (begin, end), (b, e), a in zip(segments(lengths), bounds, alone):
        if a:
            parts.append(every[:, begin:end - 1])
        parts.append(out[:, b:e])
    return mx.concatenate(parts, axis=1)


def start_computing(h: mx.array) -> None:
    """Hand a layer's output to MLX's compute thread while Python builds the next layers. MLX
    keeps at most ~100 CPU operations in flight (10 tasks of 10 in its scheduler) and blocks
    `eval`/`async_eval` until the rest have run, so a step handed over whole (a decode step of
    SmolLM2 is ~330 operations) is mostly computed while Python waits, and an overlapped decode
    loop hides its graph building behind only the step's last ~100 operations. Handed over layer
    by layer, building and computing overlap throughout: SmolLM2's int8 decode on 1 rank x 2 CPUs
    went from 111 to 128 tok/s. Only where this rank has a second CPU for them to overlap on: a
    one-CPU rank gained nothing and its batch jobs lost ~2%. The values are the same."""
    if _several_cpus():
        mx.async_eval(h)


@lru_cache(maxsize=None)
def _several_cpus() -> bool:
    """Asked at the first step, after job.share_cores has bound this rank to its CPUs."""
    return len(cpus_allowed()) > 1


class TransformerSlice(nn.Module):
    """The layers [start, end) of a decoder-only transformer, plus, on the first/last stage,
    the token embedding and the final norm + LM head, and with `head_rows` > 0 (the last rank of a
    batch job, see head_share.py) the final norm and the LM head's last `head_rows` rows.

    Parameter names mirror the checkpoint's with the "model." prefix dropped and layer indices
    made local: checkpoint `model.layers.{start + i}.X` is `layers.{i}.X` here.
    """

    def __init__(self, config: ModelConfig, make_layer: Callable[[ModelConfig, int], nn.Module],
                 start: int, end: int, has_ends: bool, head_rows: int = 0):
        super().__init__()
        self.config = config
        self.start, self.end, self.has_ends, self.head_rows = start, end, has_ends, head_rows
        self.layers = [make_layer(config, i) for i in range(start, end)]
        if has_ends or head_rows:
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if has_ends:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            if not config.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if head_rows:
            self.head_share = nn.Linear(config.hidden_size, head_rows, bias=False)

    def make_cache(self) -> list:
        """One sequence's caches, one per layer of this slice."""
        return [layer.make_cache() for layer in self.layers]

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)  # a GGUF embedding held in its own blocks (qmm.py) gives float32 rows:
        return h if h.dtype == self.norm.weight.dtype else h.astype(self.norm.weight.dtype)  # the floats' dtype

    def forward_layers(self, h: mx.array, caches: list[list], lengths: list[int], last_only: bool = False,
                       full: list[bool] | None = None) -> mx.array:
        """h: [1, sum(lengths), hidden], tokens of len(caches) sequences packed end to end;
        caches[i] is sequence i's list of per-layer caches (see `Attention`). last_only: if this
        slice holds the model's final layer, return each sequence's last position only
        ([1, len(lengths), hidden]): all sampling reads, and the final layer then skips the
        queries, attention output and MLP of a prompt's other tokens (their keys and values are
        still cached), ~1/num_layers of prefill. full: sequences that return every position even so
        (speculative drafts being verified)."""
        final = last_only and self.end == self.config.num_hidden_layers
        for j, layer in enumerate(self.layers):
            layer_caches = [seq_caches[j] for seq_caches in caches]
            if final and j == len(self.layers) - 1:
                h = final_layer(layer, h, layer_caches, lengths, full)
            else:
                h = layer(h, layer_caches, lengths)
                start_computing(h)
        return h

    # --tensor-parallel T > 1, rank 0: the runtime's callable that computes the head split by vocabulary
    # over stage 0's group (runtime/tensor_group.py SplitHead; models/vocab_split.py): given the normed rows,
    # this rank's own logits of entries [0, vocab_split.own_end) and `top`, the whole vocabulary's logits
    # (top None) or its summary (vocab_split.Combined). Models never talk to other ranks.
    vocab_split = None
    head_begin = None  # the first row of `head_share` (None: the head's last rows; else a group member's slice)

    def logits(self, h: mx.array, vocab_end: int | None = None) -> mx.array:
        """Logits of every vocabulary entry, or of entries [0, vocab_end) only."""
        h = self.norm(h)
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        if self.vocab_split is not None and vocab_end is None:
            shape = h.shape
            rows = h.reshape(-1, shape[-1])
            logits = self.vocab_split(rows, lambda x: head_columns(head, x, 0, self.vocab_split.own_end))
            return logits.reshape(*shape[:-1], logits.shape[-1])
        if vocab_end is not None:
            return head_columns(head, h, 0, vocab_end)
        return head.as_linear(h) if self.config.tie_word_embeddings else head(h)

    def head_summary(self, rows: mx.array, top: int = 0):
        """rows [n, hidden] (before the norm) -> the whole vocabulary's greedy tokens, logsumexp and `top`
        entries (vocab_split.Combined), from the members' summaries where the head is split by vocabulary
        (only a summary of each slice crosses the group), else from the whole head's logits."""
        if self.vocab_split is None:
            return combine([np.asarray(summary(self.logits(rows), top))], [0], top)
        h = self.norm(rows)
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return self.vocab_split(h, lambda x: head_columns(head, x, 0, self.vocab_split.own_end), top=top)


def head_columns(head: nn.Module, x: mx.array, begin: int, end: int) -> mx.array:
    """x @ rows [begin, end) of an LM head (a Linear, or an Embedding used as one), quantized or not:
    the logits of vocabulary entries [begin, end)."""
    if "scales" in head:  # QuantizedLinear / QuantizedEmbedding (begin, end: head_share.STEP multiples: whole int8 blocks)
        return qmm.rows_product(head, x, begin, end)
    if "ggml_type" in head:  # a GGUF tensor held as the file's row bytes (qmm.GGUFBlocksLinear / GGUFBlocksEmbedding)
        return qmm.gguf_blocks_matmul(x, head["weight"][begin:end], head.type_id)
    return x @ head.weight[begin:end].T
