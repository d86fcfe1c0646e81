"""Layer partition: balanced by bytes (checked against brute force), explicit splits."""

import itertools

import pytest

from pipeline.util.errors import UserError
from pipeline.planner.partition import balanced_counts, layer_ranges, parse_split


def brute_force_best(layer_bytes, ranks, extra):
    best = None
    for cuts in itertools.combinations(range(1, len(layer_bytes)), ranks - 1):
        bounds = (0, *cuts, len(layer_bytes))
        loads = [sum(layer_bytes[a:b]) + (extra if r == 0 else 0) for r, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        best = max(loads) if best is None else min(best, max(loads))
    return best


@pytest.mark.parametrize("layer_bytes,ranks,extra", [
    ([10] * 30, 2, 0), ([10] * 30, 3, 25), ([5, 1, 1, 1, 9, 2, 2, 7], 3, 4), ([3, 3, 3, 3], 4, 100),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 0),
])
def test_balanced_counts_are_optimal(layer_bytes, ranks, extra):
    counts = balanced_counts(layer_bytes, ranks, extra)
    assert len(counts) == ranks and sum(counts) == len(layer_bytes) and min(counts) >= 1
    ranges = layer_ranges(counts)
    loads = [sum(layer_bytes[a:b]) + (extra if r == 0 else 0) for r, (a, b) in enumerate(ranges)]
    assert max(loads) == brute_force_best(layer_bytes, ranks, extra)


def test_rank0_share_includes_embedding_and_head():
    # 30 equal layers, embedding + head worth 5 layers: rank 0 gets fewer layers.
    counts = balanced_counts([10] * 30, 2, rank0_extra_bytes=50)
    assert counts == [13, 17] or counts == [12, 18]


def test_ranges_and_splits():
    assert layer_ranges([10, 10, 10]) == [(0, 10), (10, 20), (20, 30)]
    assert parse_split("10,10,10", 30, 3) == [10, 10, 10]
    for bad, message in [("10,10", "3 ranks"), ("10,10,11", "sums to 31"), ("a,b,c", "comma"), ("0,15,15", "at least one")]:
        with pytest.raises(UserError, match=message):
            parse_split(bad, 30, 3)
    with pytest.raises(UserError, match="at most 4 ranks"):
        balanced_counts([1, 1, 1, 1], 5)
