"""The KV cache of one attention layer and sequence."""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys and values of one attention layer, grown in steps to avoid a copy per token."""

    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.append(keys, values)
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add new positions [1, kv heads, new, d]; `keys` / `values` then hold them (and room after)."""
        previous = self.offset
        self.reserve(keys.shape[2], keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        self.offset += keys.shape[2]
        self.keys[..., previous:self.offset, :] = keys
        self.values[..., previous:self.offset, :] = values

    def reserve(self, new: int, kv_heads: int, key_size: int, value_size: int, dtype: mx.Dtype) -> None:
        """Room for `new` more positions past `offset`, grown `step` positions at a time."""
        if self.keys is not None and self.offset + new <= self.keys.shape[2]:
            return
        grow = ((new + self.step - 1) // self.step) * self.step
        k_extra = mx.zeros((1, kv_heads, grow, key_size), dtype)
        v_extra = mx.zeros((1, kv_heads, grow, value_size), dtype)
        if self.keys is None:
            self.keys, self.values = k_extra, v_extra
        else:
            self.keys = mx.concatenate([self.keys[..., :self.offset, :], k_extra], axis=2)
            self.values = mx.concatenate([self.values[..., :self.offset, :], v_extra], axis=2)

    def prefix(self, length: int) -> "KVCache":
        """A new cache holding this one's first `length` positions (the arrays are not changed:
        the next update of either cache makes new ones)."""
        cache = KVCache()
        cache.keys, cache.values = self.keys[..., :length, :], self.values[..., :length, :]
        cache.offset = length
        return cache

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @property
    def bytes_per_token(self) -> int:
        if self.keys is None:
            return 0
        per_key = self.keys.shape[1] * self.keys.shape[3] * self.keys.itemsize
        return per_key + self.values.shape[1] * self.values.shape[3] * self.values.itemsize


class LinearAttentionState:
    """The state of one linear-attention (Gated DeltaNet) layer and sequence: fixed in size
    whatever the context, unlike a KV cache. `conv`: the last kernel - 1 inputs of the layer's causal
    convolution [kernel - 1, channels] (the window the next token's convolution reads back);
    `recurrent`: the delta rule's memory, one [key dim, value dim] matrix per value head, in float32.
    A sequence's state sums up every position it has seen: it cannot be cut back to a shorter
    prefix, nor drop a rejected draft's positions (registry: the family refuses both)."""

    def __init__(self):
        self.conv = None
        self.recurrent = None
        self.offset = 0  # positions seen (what packing.positions and the stats read)

    def prefix(self, length: int) -> "LinearAttentionState":
        """A copy of this state, which only holds for its whole length."""
        if length != self.offset:
            raise ValueError(f"a linear-attention state of {self.offset} positions cannot be cut back to {length}")
        state = LinearAttentionState()
        state.conv, state.recurrent, state.offset = self.conv, self.recurrent, self.offset
        return state

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.conv, self.recurrent) if a is not None)

    @property
    def bytes_per_token(self) -> int:
        return 0  # fixed in size: nothing grows with the context
