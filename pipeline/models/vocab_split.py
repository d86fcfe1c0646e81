"""The LM head split by vocabulary over a stage's tensor-parallel group (--tensor-parallel T): which
entries each member computes, what a member returns of its slice, and how rank 0 combines the slices
into what one whole head gives (the runtime moves the arrays: runtime/tensor_group.py SplitHead).

Member m of stage 0's group holds the head's rows (vocabulary entries) [v_m, v_m+1): an even split
in units of UNIT entries (whole int8 blocks, head_share.STEP), so every member's logit of an entry is
the same fixed sequence of float operations as the whole head's (the head's kernels do not depend on
the row range: the pipeline's head share relies on the same). Rank 0 keeps its embedding whole (it
looks tokens up); with a tied head it computes only its slice's rows of it.

What comes back to rank 0 for n rows:
- every logit of the slice (`full`): sampling, speculative verification, perplexity read the whole
  vocabulary; concatenated in member order they are the unsplit head's logits, bit for bit;
- or a summary, [n, 3 + 2 top] float32 (`summary`): the slice's largest logit, the first entry
  holding it, the slice's logsumexp, and its `top` largest logits with their entries. `combine`
  turns the members' summaries into the greedy token (the largest over members in member order, a
  tie kept by the earlier member: the lowest token id, as one argmax over the whole vocabulary), the
  logsumexp (max + log of the sum of exp(lse_m - max) in member order, float32) and the top entries.
Entry ids travel as float32: exact up to 2**24 entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

UNIT = 16  # entries: whole int8 blocks of the head's rows (kernels/int8_layout.INT8_BLOCK)


def vocab_share(vocab_size: int, size: int, member: int) -> tuple[int, int]:
    """[begin, end) of the vocabulary member `member` of a group of `size` computes: whole UNITs,
    as evenly as their count allows (the first ones one unit more), the last share ending at vocab_size."""
    units = -(-vocab_size // UNIT)
    base, extra = divmod(units, size)
    begin = member * base + min(member, extra)
    end = begin + base + (member < extra)
    return min(begin * UNIT, vocab_size), min(end * UNIT, vocab_size)


def summary(logits: mx.array, top: int = 0) -> mx.array:
    """[n, entries] logits of a slice -> [n, 3 + 2 top] float32: max, first argmax, logsumexp, then the
    `top` largest logits and their entries (within the slice)."""
    values = logits.astype(mx.float32)
    parts = [values.max(axis=-1, keepdims=True), mx.argmax(values, axis=-1, keepdims=True).astype(mx.float32),
             mx.logsumexp(values, axis=-1, keepdims=True)]
    if top:
        top = min(top, values.shape[-1])
        ids = mx.argsort(-values, axis=-1)[:, :top]
        parts += [mx.take_along_axis(values, ids, axis=-1), ids.astype(mx.float32)]
    return mx.concatenate(parts, axis=-1)


@dataclass
class Combined:
    """The whole vocabulary's figures for n rows, from the members' summaries."""
    tokens: np.ndarray  # [n] int64: the greedy token (first index of the largest logit)
    max: np.ndarray  # [n] float32: that logit
    logsumexp: np.ndarray  # [n] float32
    top_ids: np.ndarray  # [n, top] int64, by falling logit (a tie: the lower id first)
    top_values: np.ndarray  # [n, top] float32 logits

    def __getitem__(self, index) -> "Combined":
        """Rows `index` (an int keeps its row as a one-row Combined), as logits rows are indexed."""
        index = slice(index, index + 1) if isinstance(index, int) else index
        return Combined(self.tokens[index], self.max[index], self.logsumexp[index], self.top_ids[index],
                        self.top_values[index])

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def concatenate(parts: list["Combined"]) -> "Combined":
        if len(parts) == 1:
            return parts[0]
        return Combined(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                          ("tokens", "max", "logsumexp", "top_ids", "top_values")))

    def logprob(self, row: int) -> float:
        """The greedy token's log-probability."""
        return float(self.max[row] - self.logsumexp[row])

    def top_logprobs(self, row: int, top: int) -> list[tuple[int, float]]:
        return [(int(i), float(v - self.logsumexp[row])) for i, v in
                zip(self.top_ids[row, :top], self.top_values[row, :top])]


def combine(summaries: list[np.ndarray], begins: list[int], top: int = 0) -> Combined:
    """The members' summaries ([n, 3 + 2 top] float32 each, member order) of slices starting at
    `begins` -> the whole vocabulary's (see the module docstring), in float32, in member order."""
    first = summaries[0]
    best, tokens = first[:, 0].copy(), first[:, 1].astype(np.int64) + begins[0]
    for s, begin in zip(summaries[1:], begins[1:]):
        theirs = s[:, 0] > best  # a tie keeps the earlier member's: the lower entry
        best = np.where(theirs, s[:, 0], best).astype(np.float32)
        tokens = np.where(theirs, s[:, 1].astype(np.int64) + begin, tokens)
    total = np.zeros_like(best)
    for s in summaries:
        total += np.exp(s[:, 2] - best, dtype=np.float32)
    lse = (best + np.log(total, dtype=np.float32)).astype(np.float32)
    n = first.shape[0]
    if not top:
        return Combined(tokens, best, lse, np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32))
    values = np.concatenate([s[:, 3:3 + (s.shape[1] - 3) // 2] for s in summaries], axis=1)
    ids = np.concatenate([s[:, 3 + (s.shape[1] - 3) // 2:].astype(np.int64) + begin
                          for s, begin in zip(summaries, begins)], axis=1)
    order = np.lexsort((ids, -values), axis=-1)[:, :top]  # by falling value, then rising id
    return Combined(tokens, best, lse, np.take_along_axis(ids, order, axis=1),
                    np.take_along_axis(values, order, axis=1))
