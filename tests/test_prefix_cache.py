"""Rank 0's prefix-cache index (runtime/prefix_cache.py) alone: which kept sequence a prompt reuses,
and how many of its positions, exactly; which entry goes when the cache is full (the least recently
used, a lookup's hit counting as a use). The caches themselves, across ranks: test_scheduler.py and
test_batch.py."""

from __future__ import annotations

from pipeline.runtime.prefix_cache import CACHE_STEP, PrefixCache


def test_lookup_reuses_exactly_the_shared_prefix_of_a_diverging_prompt():
    cache = PrefixCache(capacity_tokens=10 * CACHE_STEP)
    assert cache.add(1, [5, 6, 7, 8, 9, 10]) == []
    assert cache.add(2, [5, 6, 20, 21, 22]) == []
    assert cache.lookup([5, 6, 7, 99, 100]) == (1, 3)  # diverges at its 4th token
    assert cache.lookup([5, 6, 20, 21, 7, 8]) == (2, 4)  # the longest match wins
    assert cache.lookup([5, 6, 7, 8, 9, 10, 11, 12]) == (1, 6)  # all of the kept tokens
    # At most all but the prompt's last token, whose logits the request needs
    assert cache.lookup([5, 6, 7, 8, 9, 10]) == (1, 5)
    assert cache.lookup([5, 6, 7, 8]) == (1, 3)
    assert cache.lookup([4, 5, 6, 7]) == (None, 0)  # nothing in common from the first token
    assert cache.lookup([5]) == (None, 0)  # no position to reuse: its one token must be fed
    assert (cache.lookups, cache.hits, cache.reused_tokens) == (7, 5, 3 + 4 + 6 + 5 + 3)


def test_lookup_ignores_a_match_shorter_than_min_reuse():
    cache = PrefixCache(capacity_tokens=CACHE_STEP, min_reuse=4)
    cache.add(1, [1, 2, 3, 4, 5])
    assert cache.lookup([1, 2, 3, 9, 9]) == (None, 0)
    assert cache.lookup([1, 2, 3, 4, 9]) == (1, 4)


def filled(capacity_entries: int = 3) -> PrefixCache:
    """A cache that holds `capacity_entries` entries of one CACHE_STEP each, holding 1, 2, 3 (added
    in that order: 1 is the least recently used)."""
    cache = PrefixCache(capacity_tokens=capacity_entries * CACHE_STEP)
    for seq_id in (1, 2, 3):
        assert cache.add(seq_id, [seq_id * 100 + i for i in range(10)]) == []
    return cache


def test_a_full_cache_evicts_its_least_recently_used_entry():
    cache = filled()
    assert cache.add(4, [400, 401]) == [1]
    assert list(cache.entries) == [2, 3, 4] and cache.held == 3 * CACHE_STEP


def test_a_lookup_hit_makes_its_entry_the_most_recently_used():
    """Entry 1 is the oldest, but a prompt just reused it: the next one out is 2, then 3, and 1 last."""
    cache = filled()
    assert cache.lookup([100, 101, 102, 7]) == (1, 3)
    assert cache.lookup([999, 1000]) == (None, 0)  # a miss refreshes nothing
    assert cache.add(4, [400, 401]) == [2]
    assert list(cache.entries) == [3, 1, 4]
    assert cache.add(5, [500, 501]) == [3]
    assert cache.add(6, [600, 601]) == [1]
    assert list(cache.entries) == [4, 5, 6]


def test_a_sequence_already_held_refreshes_its_holder_and_a_longer_one_replaces_its_prefix():
    cache = filled()
    assert cache.add(4, [100, 101, 102]) == [4]  # 1 holds all of it: 4 is released, 1 refreshed
    assert list(cache.entries) == [2, 3, 1]
    assert cache.add(5, [200 + i for i in range(12)]) == [2]  # extends 2: 2 is no longer needed
    assert list(cache.entries) == [3, 1, 5] and cache.held == 3 * CACHE_STEP
    assert cache.add(6, list(range(2 * CACHE_STEP))) == [3, 1]  # needs two entries' room
    assert list(cache.entries) == [5, 6]
    assert cache.add(7, list(range(4 * CACHE_STEP))) == [7]  # larger than the whole cache: never kept
