"""The LM head shared between rank 0 and the last rank in batch jobs, its split set at run time.

Why: decoding, rank 0 runs its layers and the LM head (vocab x hidden: on SmolLM2 as much work as
two layers), the last rank only its layers; while prompts are being read the head has almost
nothing to do. So no split of whole layers balances both phases, and the rank with the longer
stage idles the other (measured: 8% of a 2-rank job's decoding). The head has no state, so any
part of it can move from one micro-batch to the next.

How: the last rank also holds the head's last `max_columns` rows (vocabulary entries). For each
micro-batch rank 0 asks it for `columns` of them: the last rank computes their logits at each
sequence's last position and returns only their maximum and its index, beside the hidden
states; rank 0 computes the other entries and takes the larger maximum, its own on a tie (the
first index, as one argmax over the whole vocabulary does). A logit is the same fixed sequence of
float operations on either rank (the BLAS shim's kernel does not depend on the column range, and
both ranks run it; with --packed-matmuls, whose results are only within rounding anyway, it is on
too), so greedy tokens are exactly those of an unshared head. Rows that sample
(temperature, penalties) need every logit: micro-batches holding any are not shared.

The split follows the ring: after each micro-batch rank 0 compares how long it waited for it with
how long the last rank waited before it, and moves towards the rank that waited a part (GAIN) of
the columns that would even the two out, at rank 0's measured cost per column (small steps: the
waits jitter, and with two micro-batches in flight a change shows only a round later).
"""

from __future__ import annotations

import mlx.core as mx

from ..models.stage_slice import head_columns

GAIN = 0.3  # fraction of the measured imbalance corrected per micro-batch: smooths the wait jitter
STEP = 16  # columns move in multiples of this


def head_share_fraction(setting: str | float, group_rows: list[int]) -> float:
    """The part of the LM head the last rank holds (0: no sharing). setting: --head-share (auto,
    off, or a fraction of the vocabulary); group_rows: each rank's exact product limit
    (scheduler.exact_group_rows): sharing needs rank 0's and the last rank's to be exact (> 0)."""
    if setting == "off" or len(group_rows) < 2 or not (group_rows[0] and group_rows[-1]):
        return 0.0
    return 0.5 if setting == "auto" else float(setting)


def head_share_rows(fraction: float, vocab_size: int) -> int:
    """Rows (vocabulary entries) of the LM head that `fraction` of it is: a multiple of STEP."""
    return 0 if fraction <= 0 else max(STEP, round(vocab_size * fraction / STEP) * STEP)


def returned_rows(model, last: mx.array, columns: int, groups: list[tuple[int, int]]) -> mx.array:
    """Last rank: what goes back to rank 0 for a micro-batch: `last`, each sequence's last hidden
    state [1, n, hidden], and with `columns` > 0 the max and argmax of its logits over the last
    `columns` vocabulary entries (see the module docstring). groups: the [begin, end) row ranges
    that share a product (scheduler.row_groups), as everywhere."""
    if not columns:
        return last
    if hasattr(model, "collapse"):  # DeepSeek V4: the streams' collapse, which the head reads, done here
        last = model.collapse(last)
    rows = model.norm(last[0])
    held = model.head_share.weight.shape[0]
    logits = [head_columns(model.head_share, rows[b:e], held - columns, held) for b, e in groups]
    logits = logits[0] if len(logits) == 1 else mx.concatenate(logits, axis=0)
    best = mx.stack([logits.max(axis=-1).astype(mx.float32),
                     mx.argmax(logits, axis=-1).astype(mx.float32)], axis=-1)  # exact up to 2**24 entries
    return mx.concatenate([last, best.view(last.dtype)[None]], axis=-1)


def split_returned(returned: mx.array, hidden_size: int) -> tuple[mx.array, mx.array | None]:
    """Rank 0: [1, n, hidden (+ extra)] -> (the n last hidden states [n, hidden], the share's
    [n, 2] float32 (max, argmax) or None if there was no share)."""
    rows = returned[0]
    if rows.shape[-1] == hidden_size:
        return rows, None
    return rows[:, :hidden_size], rows[:, hidden_size:].view(mx.float32)


def combined_argmax(own_logits: mx.array, share: mx.array, own_columns: int) -> mx.array:
    """Greedy tokens over the whole vocabulary from rank 0's logits of entries [0, own_columns)
    and the last rank's (max, argmax) over the rest: the first index of the largest logit."""
    own_best = mx.argmax(own_logits, axis=-1)
    theirs = share[:, 0] > own_logits.max(axis=-1).astype(mx.float32)  # a tie keeps the lower (own) index
    return mx.where(theirs, share[:, 1].astype(mx.int32) + own_columns, own_best.astype(mx.int32))


class HeadSplit:
    """Rank 0's choice of how many head columns the last rank computes, micro-batch by micro-batch.
    fixed: a constant number of columns instead (tests, experiments)."""

    def __init__(self, max_columns: int, fixed: int | None = None):
        self.max_columns = max_columns
        self.columns = fixed if fixed is not None else 0
        self.fixed = fixed is not None
        self.cost = None  # seconds per row and column of rank 0's own head product
        self.shared_columns = 0  # over the shared micro-batches, for the summary
        self.shared = 0

    def observe_cost(self, seconds: float, rows: int, columns: int) -> None:
        """Rank 0 timed its own share of the head: `rows` x `columns` logits in `seconds`."""
        if rows >= 4 and columns:
            cost = seconds / (rows * columns)
            self.cost = cost if self.cost is None else 0.8 * self.cost + 0.2 * cost

    def update(self, rank0_wait_s: float, last_rank_wait_s: float, rows: int) -> None:
        """After a micro-batch came back: rank 0 waited `rank0_wait_s` for it, the last rank
        `last_rank_wait_s` before it; move columns towards the rank that waited."""
        if self.fixed or self.cost is None or rows == 0:
            return
        # Moving c columns shifts c * cost * rows seconds from one rank to the other: a difference of twice that.
        step = GAIN * (last_rank_wait_s - rank0_wait_s) / (2 * self.cost * rows)
        columns = min(max(self.columns + step, 0), self.max_columns)
        self.columns = int(columns) // STEP * STEP

    def note_shared(self, columns: int) -> None:
        self.shared_columns += columns
        self.shared += 1

    def mean_columns(self) -> float:
        return self.shared_columns / self.shared if self.shared else 0.0
