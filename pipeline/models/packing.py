"""Several sequences' new tokens packed end to end in one batch: each token's position in its own
sequence, each sequence's [begin, end), and the rows a final layer run with last_only keeps."""

from __future__ import annotations

import mlx.core as mx


def positions(lengths: list[int], caches: list) -> mx.array:
    """Each packed token's position in its own sequence (its cache's length before this step,
    plus its place among the sequence's new tokens): RoPE offsets, one per token. The layers of
    a step get the very same array (RoPE computes its angles once for it)."""
    global _last_positions
    values = [cache.offset + i for n, cache in zip(lengths, caches) for i in range(n)]
    if _last_positions[0] != values:
        _last_positions = (values, mx.array(values, dtype=mx.int32))
    return _last_positions[1]


_last_positions: tuple[list[int] | None, mx.array | None] = (None, None)


def kept_rows(lengths: list[int], full: list[bool] | None = None) -> tuple[mx.array, list[tuple[int, int]]]:
    """What a final layer run with last_only returns: the index of each kept token among the packed
    tokens (each sequence's last, or all of a `full` one), and each sequence's [begin, end) among them."""
    index, bounds = [], []
    for i, (begin, end) in enumerate(segments(lengths)):
        first = begin if full and full[i] else end - 1
        bounds.append((len(index), len(index) + end - first))
        index.extend(range(first, end))
    return mx.array(index), bounds


def segments(lengths: list[int]) -> list[tuple[int, int]]:
    """[begin, end) of each sequence's tokens in a packed batch."""
    bounds, begin = [], 0
    for n in lengths:
        bounds.append((begin, begin + n))
        begin += n
    return bounds
