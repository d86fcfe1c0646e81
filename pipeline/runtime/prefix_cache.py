"""Prefix cache: the KV caches of finished sequences, kept so that a request starting with the same
tokens skips their prefill (multi-turn chats re-sending their history, shared system prompts,
agents re-sending their context).

Every rank keeps a finished sequence's caches for its own layers under the sequence's id, as it
did while the sequence ran; rank 0 alone decides what is kept, what a new request reuses and what
is evicted, and tells the ring in order: FORK (a new sequence starts from the first L positions of a
kept one) and RELEASE (evicted), as it does for everything else. This module is rank 0's index.

A hit reuses keys and values that were computed in other products than a cold run would use (a
decoded token one row at a time, a prompt in chunks), so logits after a hit are equal to a cold
run's within float rounding, not bit for bit; greedy texts agree unless two tokens are tied to
within that rounding (docs/serve.md).
"""

from __future__ import annotations

from collections import OrderedDict

CACHE_STEP = 256  # KVCache grows in steps of this many positions: what a kept entry holds at most


class PrefixCache:
    def __init__(self, capacity_tokens: int, min_reuse: int = 1):
        """capacity_tokens: positions kept over all entries, as the rank with the most cached bytes
        per position can hold them (job.prefix_cache_for). min_reuse: shorter matches are not reused."""
        self.capacity = capacity_tokens
        self.min_reuse = min_reuse
        self.entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # seq id -> cached token ids, LRU first
        self.held = 0  # positions held, counted as the caches' grown size
        self.lookups = 0
        self.hits = 0
        self.reused_tokens = 0

    @staticmethod
    def _held(tokens: int) -> int:
        return -(-tokens // CACHE_STEP) * CACHE_STEP

    def lookup(self, prompt_ids: list[int]) -> tuple[int | None, int]:
        """The kept sequence sharing the longest prefix with `prompt_ids`, and how many of its
        positions to reuse (at most all but the prompt's last token, whose logits are needed)."""
        self.lookups += 1
        best, best_len = None, 0
        limit = len(prompt_ids) - 1
        for seq_id, tokens in self.entries.items():
            if not tokens or tokens[0] != prompt_ids[0]:
                continue
            n = _common_prefix(tokens, prompt_ids, limit)
            if n > best_len:
                best, best_len = seq_id, n
        if best is None or best_len < self.min_reuse:
            return None, 0
        self.entries.move_to_end(best)
        self.hits += 1
        self.reused_tokens += best_len
        return best, best_len

    def add(self, seq_id: int, tokens: list[int]) -> list[int]:
        """Keep a finished sequence's caches (positions for `tokens`); returns the ids to release:
        entries this one makes redundant (their tokens are a prefix of its), the least recently
        used while over capacity, or the new one itself if it adds nothing or cannot fit."""
        tokens = tuple(tokens)
        if not tokens or self._held(len(tokens)) > self.capacity:
            return [seq_id]
        release = []
        for other, kept in list(self.entries.items()):
            if len(kept) >= len(tokens) and kept[:len(tokens)] == tokens:
                self.entries.move_to_end(other)  # it already holds all of these: refresh it
                return [seq_id]
            if kept == tokens[:len(kept)]:  # a prefix of the new one: nothing it offers is lost
                release.append(other)
                self._drop(other)
        self.entries[seq_id] = tokens
        self.held += self._held(len(tokens))
        while self.held > self.capacity:
            oldest = next(iter(self.entries))
            release.append(oldest)
            self._drop(oldest)
        return release

    def _drop(self, seq_id: int) -> None:
        self.held -= self._held(len(self.entries.pop(seq_id)))

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
