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

    def state_arrays(self) -> list[tuple[str, mx.array, int | None]]:
        """The whole state as named arrays (the prompt cache on disk: stage.Stage.stored_arrays), each
        with its positions axis: keys and values as held (room past `offset` included: cut by the store)."""
        return [("keys", self.keys, 2), ("values", self.values, 2)]

    def load_state_arrays(self, named: dict[str, mx.array], positions: int) -> None:
        """Become the state `state_arrays` gave, at `positions` (ValueError where the arrays are not it)."""
        if set(named) != {"keys", "values"} or any(a.ndim != 4 or a.shape[2] != positions for a in named.values()):
            raise ValueError("not a KV cache's keys and values")
        self.keys, self.values, self.offset = named["keys"], named["values"], positions

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

    A state sums up every position it has seen: it cannot be cut back to any shorter prefix, only to
    one it kept on the way (MLX arrays are never written in place, so keeping is holding references):
    - `points`: the state at the end of each prompt chunk (`keep_point`, the prefix cache's resume
      points; qwen3_5_moe.Slice decides when), offset -> (conv, recurrent);
    - `trail`: while a trip verifies drafts (`verifying` set before it: qwen3_5_moe.Slice), the
      convolution's window over the trip and a replay of its recurrence (the memory before the trip and
      the trip's inputs: gated_deltanet.GatedDeltaNet.sequence), so that lowering `offset`
      (stage.Stage.rewind: rejected drafts) goes back to the state after the last accepted position,
      the same steps on the same inputs as decoding took (bit for bit), and `prefix` can start a
      sequence there. A sequence that ends on a verify trip keeps its trail: its end may lie within it."""

    trail_max = 16  # most positions of a trip with a trail (models.layers.EXACT_POSITIONS_MAX: K + 1 verified)
    # Most points a sequence keeps (each a whole state: 4.1 MiB a layer in Qwen3.5-397B-A17B): past it, a
    # new point replaces the newest, so a long prompt keeps its first chunks' (a shared system prompt's)
    # and its latest; the sequence's end is always there besides.
    points_max = 8

    def __init__(self):
        self.conv = None
        self.recurrent = None
        self._offset = 0  # positions seen (what packing.positions and the stats read)
        self.points: dict[int, tuple] = {}
        self.verifying = False  # the next call keeps a trail
        self.trail = None  # (offset before the trip, its window [kernel - 1 + n, channels], n, replay(done) -> memory)

    @property
    def offset(self) -> int:
        return self._offset

    @offset.setter
    def offset(self, value: int) -> None:
        if value < self._offset:  # rejected drafts: back to the state after the last accepted position
            self.conv, self.recurrent = self._state_at(value)
            self.trail = None if value == self.trail[0] else self.trail
        self._offset = value

    def _state_at(self, length: int) -> tuple:
        """(conv, recurrent) after `length` positions: the current state, a kept point, or within the trail."""
        if length == self._offset:
            return self.conv, self.recurrent
        if length in self.points:
            return self.points[length]
        if self.trail is not None and self.trail[0] <= length < self._offset:
            start, window, n, replay = self.trail
            done = length - start  # positions of the trip kept
            kernel_1 = window.shape[0] - n
            return window[done:done + kernel_1], replay(done)
        raise ValueError(f"a linear-attention state of {self._offset} positions cannot be cut back to {length} "
                         f"(kept: {sorted(self.points)})")

    def record(self, trip: tuple | None) -> None:
        """A verify trip's (window, positions, replay) (gated_deltanet.GatedDeltaNet.sequence), kept as the
        trail; None after any other trip. The offset has already moved past the trip."""
        self.trail = None if trip is None else (self._offset - trip[1], *trip)

    def keep_point(self) -> None:
        """Keep the state as it is now as a resume point."""
        if self.recurrent is not None:
            if len(self.points) >= self.points_max:
                del self.points[max(self.points)]
            self.points[self._offset] = (self.conv, self.recurrent)

    def prefix(self, length: int) -> "LinearAttentionState":
        """A new state after this one's first `length` positions, where kept (`_state_at`); its kept
        points up to there go with it, and `length` is one of them (the next turn of a chat then holds
        every point of the turn it extends)."""
        state = LinearAttentionState()
        state.conv, state.recurrent = self._state_at(length)
        state._offset = length
        state.points = {at: kept for at, kept in self.points.items() if at <= length}
        if length and self.points:  # (a state keeping points: a prefix cache's; a draft's copy keeps none)
            state.points[length] = (state.conv, state.recurrent)
        return state

    def state_arrays(self) -> list[tuple[str, mx.array, int | None]]:
        """The state after `offset` positions as named arrays (neither cut to a shorter prefix: no
        positions axis); the kept points and trail are not part of it."""
        return [("conv", self.conv, None), ("recurrent", self.recurrent, None)]

    def load_state_arrays(self, named: dict[str, mx.array], positions: int) -> None:
        """Become the state `state_arrays` gave, after `positions` positions: its one kept point."""
        if set(named) != {"conv", "recurrent"} or named["conv"].ndim != 2 or named["recurrent"].ndim < 3:
            raise ValueError("not a linear-attention state's convolution window and memory")
        self.conv, self.recurrent, self._offset = named["conv"], named["recurrent"], positions
        self.points, self.trail = {positions: (self.conv, self.recurrent)}, None

    @property
    def nbytes(self) -> int:
        held = {id(a): a for a in (self.conv, self.recurrent) if a is not None}
        for pair in self.points.values():
            held.update((id(a), a) for a in pair)
        if self.trail is not None:  # the trip's window, and the replay's first memory and inputs (its defaults)
            _, window, _, replay = self.trail
            held.update((id(a), a) for a in _arrays((window, getattr(replay, "__defaults__", None))))
        return sum(a.nbytes for a in held.values())

    @property
    def bytes_per_token(self) -> int:
        return 0  # fixed in size: nothing grows with the context


def _arrays(held) -> list[mx.array]:
    """The arrays in nested tuples and lists."""
    if isinstance(held, mx.array):
        return [held]
    return [a for item in held for a in _arrays(item)] if isinstance(held, (tuple, list)) else []


def resume_points(caches: list, length: int) -> list[int] | None:
    """The lengths a sequence's caches (its first `length` positions) can start another from: None
    where they can be cut anywhere (KV caches only), else the resume points of its linear-attention
    states (the same on every rank and layer) up to `length`, and `length` itself."""
    for cache in caches:
        if hasattr(cache, "resume_points"):  # DeepSeek V4's compressed caches (models/deepseek_v4.py)
            return cache.resume_points(length)
        if isinstance(cache, LinearAttentionState):
            return sorted(p for p in cache.points if p < length) + [length]
    return None
