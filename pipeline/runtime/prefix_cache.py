"""Prefix cache: the KV caches of finished sequences, kept so that a request starting with the same
tokens skips their prefill (multi-turn chats re-sending their history, shared system prompts,
agents re-sending their context).

Every rank keeps a finished sequence's caches for its own layers under the sequence's id, as it
did while the sequence ran; rank 0 alone decides what is kept, what a new request reuses and what
is evicted, and tells the ring in order: FORK (a new sequence starts from the first L positions of a
kept one) and RELEASE (evicted), as it does for everything else. This module is rank 0's index.

With --prompt-cache-dir, the entries are also kept on disk, each rank its own file per entry
(prompt_cache_store.py), so that they outlive the server: `StoredIndex` is rank 0's index of them,
and the ring hears SAVE (a finished sequence is written), LOAD (a new sequence starts from a stored
entry, every rank confirming it loaded its part) and DROP (a stored entry is removed).

A hit reuses keys and values that were computed in other products than a cold run would use (a
decoded token one row at a time, a prompt in chunks), so logits after a hit are equal to a cold
run's within float rounding, not bit for bit; greedy texts agree unless two tokens are tied to
within that rounding (docs/serve.md).

A linear-attention layer's state (Qwen3.5) cannot be cut back to a shorter prefix: such an entry
also names its resume points, the lengths whose states every rank kept (models.cache.resume_points:
the end of each prompt chunk and the sequence's end), and a hit resumes from the longest one within
the match; each point's states are budgeted as `point_positions` positions.

serve's and batch's cache (job.prefix_cache, `for_job`) counts bytes instead: what each kept entry's
caches hold (`EntryBytes`: every array of every layer's cache, each cache's `nbytes`: KV keys and values
as grown, linear states with their points and verify trail, DeepSeek V4's window, compressed series,
the state every 512 positions and the logs of the last calls), so that --prefix-cache-gb bounds what
the rank holding the most keeps.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable

CACHE_STEP = 256  # KVCache grows in steps of this many positions: what a kept entry holds at most


class PrefixCache:
    def __init__(self, capacity_tokens: int, min_reuse: int = 1, step: int = CACHE_STEP, point_positions: int = 0,
                 measure: "EntryBytes | None" = None):
        """capacity_tokens: positions kept over all entries, as the rank with the most cached bytes
        per position can hold them. min_reuse: shorter matches are not reused.
        step: an entry of n positions holds n rounded up to this many (the caches grow in steps).
        point_positions: what one resume point's linear-attention states take, in positions.
        measure: capacity_tokens is then in bytes, and `add` is given each entry's size (the scheduler
        measures a finished sequence's caches with it): `for_job`."""
        self.capacity = capacity_tokens
        self.measure = measure
        self.sizes: dict[int, int] = {}  # id -> what `add` was told it holds (measured entries)
        self.min_reuse = min_reuse
        self.step = step
        self.point_positions = point_positions
        self.points: dict[int, tuple[int, ...]] = {}  # id -> its resume points, for entries that have them
        self.entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # id -> cached token ids, LRU first
        self.held = 0  # positions held, counted as the caches' grown size (and resume points' states)
        self.lookups = 0
        self.hits = 0
        self.reused_tokens = 0

    def _held(self, tokens: int, points: tuple[int, ...] | None = None) -> int:
        """Positions an entry takes: its caches' grown size, and with resume points each one's states,
        plus one more state (the memory a sequence that ended on a verify trip keeps to replay it)."""
        states = len(points) + 1 if points else 0
        return -(-tokens // self.step) * self.step + states * self.point_positions

    def _usable(self, seq_id: int, n: int) -> int:
        """How many positions of an entry a match of n can start from: n, or its longest resume point <= n."""
        points = self.points.get(seq_id)
        return n if points is None else max((p for p in points if p <= n), default=0)

    def lookup(self, prompt_ids: list[int]) -> tuple[int | None, int]:
        """The kept sequence sharing the longest prefix with `prompt_ids`, and how many of its
        positions to reuse (at most all but the prompt's last token, whose logits are needed)."""
        self.lookups += 1
        best, best_len = self.best(prompt_ids)
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        self.hits += 1
        self.reused_tokens += best_len
        return best, best_len

    def best(self, prompt_ids: list[int]) -> tuple[int | None, int]:
        """What `lookup` would reuse, without counting it or refreshing the entry."""
        best, best_len = None, 0
        limit = len(prompt_ids) - 1
        for seq_id, tokens in self.entries.items():
            if not tokens or tokens[0] != prompt_ids[0]:
                continue
            n = self._usable(seq_id, _common_prefix(tokens, prompt_ids, limit))
            if n > best_len:
                best, best_len = seq_id, n
        if best is None or best_len < self.min_reuse:
            return None, 0
        return best, best_len

    def add(self, seq_id: int, tokens: list[int], points: list[int] | None = None, size: int | None = None) -> list[int]:
        """Keep a finished sequence's caches (positions for `tokens`; `points`: its resume points, where
        its caches cannot be cut anywhere; `size`: what it holds, in the capacity's units, where measured:
        else its positions as grown and its points' states); returns the ids to release: entries this one
        makes redundant (their tokens are a prefix of its, their resume points among its), the least
        recently used while over capacity, or the new one itself if it adds nothing or cannot fit."""
        tokens = tuple(tokens)
        points = None if points is None else tuple(sorted(set(points)))
        size = self._held(len(tokens), points) if size is None else size
        if not tokens or size > self.capacity:
            return [seq_id]
        release = []
        for other, kept in list(self.entries.items()):
            if len(kept) >= len(tokens) and kept[:len(tokens)] == tokens and _within(points, self.points.get(other)):
                self.entries.move_to_end(other)  # it already holds all of these: refresh it
                return [seq_id]
            if kept == tokens[:len(kept)] and _within(self.points.get(other), points):
                release.append(other)  # a prefix of the new one: nothing it offers is lost
                self._drop(other)
        self.entries[seq_id] = tokens
        if points is not None:
            self.points[seq_id] = points
        self.sizes[seq_id] = size
        self.held += size
        while self.held > self.capacity:
            oldest = next(iter(self.entries))
            release.append(oldest)
            self._drop(oldest)
        return release

    def _drop(self, seq_id: int) -> None:
        self.entries.pop(seq_id)
        self.points.pop(seq_id, None)
        self.held -= self.sizes.pop(seq_id)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class EntryBytes:
    """What a kept sequence's caches hold on the rank holding the most, in bytes. Rank 0 measures its own
    (each layer's cache's `nbytes`: every array it holds, kept points and logs included) and counts each
    other rank's layers at what a layer of the same kind (the planner's LayerCache.kind: the same shapes,
    and every rank's caches saw the same calls) holds on rank 0; a kind rank 0 holds none of at the
    planner's estimate for it, scaled as rank 0's measured bytes are to their estimate. On one rank, or
    where rank 0 holds every kind, that is each rank's bytes exactly."""

    def __init__(self, kinds: list[str], ranges: list[tuple[int, int]], estimate: Callable[[int, int], float]):
        """kinds: each layer's cache kind; ranges: each stage's [first, last) layers, rank 0's first;
        estimate(layer, positions): the planner's bytes for one layer's cache of a sequence."""
        self.kinds, self.ranges, self.estimate = kinds, ranges, estimate

    def __call__(self, caches: list, positions: int) -> int:
        first, last = self.ranges[0]
        own = sum(cache.nbytes for cache in caches)
        guess = sum(self.estimate(layer, positions) for layer in range(first, last))
        scale = own / guess if own and guess else 1.0
        measured: dict[str, int] = {}
        if len(caches) == last - first:  # (else each rank at its estimate, scaled)
            for kind, cache in zip(self.kinds[first:last], caches):
                measured[kind] = max(measured.get(kind, 0), cache.nbytes)
        others = [sum(measured[self.kinds[layer]] if self.kinds[layer] in measured
                      else self.estimate(layer, positions) * scale for layer in range(start, end))
                  for start, end in self.ranges[1:]]
        return max([own, *(math.ceil(b) for b in others)])


def for_job(gb: float, arch, ranges: list[tuple[int, int]], dtype_bytes: int) -> PrefixCache:
    """serve's and batch's prefix cache for --prefix-cache-gb (per rank): bytes, each entry as measured
    (`EntryBytes`; arch: the planner's Architecture, its per-layer caches' kinds and estimates)."""
    kinds = [c.kind for c in arch.kv_layers] if arch.kv_layers else ["kv"] * len(arch.layers)
    measure = EntryBytes(kinds, list(ranges), lambda layer, positions: arch.kv_bytes(layer, layer + 1, positions,
                                                                                   dtype_bytes))
    return PrefixCache(int(gb * 1e9), measure=measure)


class StoredIndex:
    """Rank 0's index of the entries on disk (--prompt-cache-dir), each held by every rank, keyed by
    prompt_cache_store.entry_key of its tokens: which to write, which a request loads, which go when
    the folder is over its bound (least recently used first). Like the memory's, over positions:
    capacity_tokens is the bound in GB over all ranks' bytes per position (job.prompt_cache)."""

    def __init__(self, capacity_tokens: int, key, min_positions: int = 1, point_positions: int = 0):
        """key: tokens -> entry key. min_positions: shorter entries are neither written nor loaded
        (reading a file costs more than computing a few positions). point_positions: what an entry's
        fixed-size states (Qwen3.5, DeepSeek V4) take on disk, in positions (PrefixCache counts two per
        entry with a resume point, its end and a verify trip's replay: the bound errs on the safe side)."""
        self.index = PrefixCache(capacity_tokens, min_reuse=min_positions, step=1, point_positions=point_positions)
        self.key = key
        self.min_positions = min_positions
        self.loads = 0  # confirmed by every rank
        self.failed = 0  # a rank could not load its part: the request ran without it
        self.loaded_tokens = 0
        self.load_s = self.save_s = 0.0  # rank 0's reading and handing over of entries, on the scheduler's thread

    def restore(self, stored: list[tuple]) -> list[int]:
        """The entries found at start-up, (key, tokens[, resume points: None where any length]) least
        recently used first; returns the keys to remove (another entry holds all their positions, or over
        the bound)."""
        removed = []
        for key, tokens, *points in stored:
            removed += self.index.add(key, list(tokens), points[0] if points else None)
        return removed

    def lookup(self, prompt_ids: list[int], beyond: int) -> tuple[int | None, int]:
        """The stored entry sharing the longest prefix with the prompt and its length, if that is
        at least `min_positions` more than `beyond` (what the memory's cache offers); else (None, 0)."""
        best, best_len = self.index.best(prompt_ids)
        if best is None or best_len < beyond + self.min_positions:
            return None, 0
        self.index.entries.move_to_end(best)
        return best, best_len

    def add(self, tokens: list[int], points: list[int] | None = None) -> tuple[int | None, list[int]]:
        """A finished sequence's tokens (`points`: its resume points where its states cannot be cut: its
        length, for a stored entry): (the key to write it under, or None where it is not written: too
        short, or a stored entry already holds all its positions; the keys to remove)."""
        if len(tokens) < self.min_positions:
            return None, []
        key = self.key(tokens)
        if key in self.index.entries:
            if self.index.entries[key] == tuple(tokens):
                self.index.entries.move_to_end(key)
                return None, []
            self.index._drop(key)  # another entry's tokens under the same key: the new one replaces it
        removed = self.index.add(key, tokens, points)
        if key in removed:
            return None, [k for k in removed if k != key]
        return key, removed

    def forget(self, key: int) -> None:
        """An entry that failed to load: gone from the index (the caller removes its files)."""
        if key in self.index.entries:
            self.index._drop(key)

    def __len__(self) -> int:
        return len(self.index.entries)


def _within(points: tuple[int, ...] | None, holder: tuple[int, ...] | None) -> bool:
    """Whether an entry with resume points `holder` (None: any length) offers every one of `points`."""
    return holder is None or (points is not None and set(points) <= set(holder))


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
