"""DeepSeek V4 (`model_type` deepseek_v4: V4-Pro, V4-Flash), as transformers 5 implements it.

What changes from V3 (DeepSeek-V4 technical report, section 2):

Residual streams (manifold-constrained hyper-connections, mHC, 2.2). The residual is n = hc_mult
streams H [n, d] per token, not one vector. Around each sub-block (attention, then the MoE), a
small map read off all streams (RMSNorm(flatten H) @ fn, scaled per part, plus a bias) gives
    pre  = sigmoid(.) + eps                 [n]     the block's input  x = sum_i pre_i H_i
    post = 2 sigmoid(.)                     [n]     how its output y is spread back
    comb = Sinkhorn(softmax(.) + eps)       [n, n]  doubly stochastic mixing of the streams
and H <- post y^T + comb^T H. At the end the streams collapse the same way (hc_head's pre).

Attention (2.3): one shared key = value head per token (kv = RMSNorm(W_kv x), partial RoPE on its
last qk_rope_head_dim features), queries from a low-rank latent (per-head RMSNorm, same RoPE),
a learned sink logit per head, and each layer sees
  - the last sliding_window tokens' keys (every layer), and per `layer_types`
  - compressed_sparse_attention (CSA): one compressed entry per m = 4 tokens, each a softmax-gated
    sum over 2m tokens (the previous window's "a" half and this window's "b" half), of which a
    lightning indexer (its own smaller compressed keys, scored sum_h w_h ReLU(q_h . k)) picks the
    index_topk per query;
  - heavily_compressed_attention (HCA): one entry per m' = 128 tokens, all of them attended;
  - sliding_attention: the window alone.
A query sees the compressed entries of windows that ended at or before it. The rotary part of the
output is rotated back by the query's position (V = K carried the keys' rotation), and heads are
projected out in o_groups groups through a rank-o_lora_rank map (o_a_proj), then o_b_proj.
Sliding layers use plain RoPE (rope_theta); compressed ones YaRN on compress_rope_theta.

MoE (2.1): routed experts with a clamped SwiGLU (swiglu_limit) and one shared expert; scores
sqrt(softplus(x W^T)); the first layers (`mlp_layer_types` hash_moe) take their experts from the
token id (tid2eid[token]), the others the top-k of score + correction bias; weights are the chosen
scores renormalised, times routed_scaling_factor.

Between ranks the hidden state is the streams, [1, tokens, hc_mult, hidden]. A hash-routed layer
needs each token's id: while such a layer is still ahead, one more row rides on the stream axis
with the ids written in base 256 (digits 0..255 are exact in every float dtype), so the ring's
messages carry them unchanged; the row is dropped after the last hash-routed layer (for the
published models, on rank 0 itself).

Caches per layer and sequence (CompressedCache): the window's keys, the compressed entries (and
the indexer's), and the few tokens of an unfinished window; never the whole sequence's keys.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..kernels import qmm
from .config import ModelConfig
from .packing import kept_rows, positions, segments
from .rope import RoPE
from .stage_slice import TransformerSlice, start_computing
from .deepseek_v4_config import (CSA, FLOAT32, SLIDING, DeepSeekV4Config, attention_kind, compress_rate,
                                  deepseek_v4_config, last_hash_layer, layer_types, mlp_kind, rope_dim,
                                  rope_parameters)
from .experts import SwitchGLU


# ----------------------------------------------------------------------------------------- RoPE

def ropes(config: ModelConfig) -> dict[str, RoPE]:
    """"main" (sliding layers: plain RoPE on rope_theta) and "compress" (compressed layers, their
    compressors and indexer: rope_scaling's YaRN on compress_rope_theta, cos/sin not rescaled)."""
    dims = rope_dim(config)
    out = {}
    for name, p in rope_parameters(config).items():
        scaling = {k: v for k, v in p.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        out[name] = RoPE(dims, float(p.get("rope_theta", 10000.0)), scaling, traditional=True,
                         max_position_embeddings=config.max_position_embeddings)
    return out


# ------------------------------------------------------------------------------------------ helpers

def rms(x: mx.array, eps: float) -> mx.array:
    """RMSNorm without a weight, in float32."""
    x32 = x.astype(mx.float32)
    return (x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 with a float32 weight (loaded so: Slice.keeps_float32), the
    result in the input's dtype, as DeepSeek V4's reference keeps its norms."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        return (self.weight.astype(mx.float32) * rms(x.astype(mx.float32), self.eps)).astype(x.dtype)


def rotate_tail(x: mx.array, rope: RoPE, offsets: mx.array, inverse: bool = False) -> mx.array:
    """RoPE (interleaved pairs) on the last rope.dims features of x [tokens, heads, dim], token t at
    position offsets[t]; inverse: rotated back by it."""
    d = rope.dims
    at = -offsets if inverse else offsets
    tail = rope(x[..., -d:][:, :, None], offset=at)[:, :, 0]
    return mx.concatenate([x[..., :-d], tail.astype(x.dtype)], axis=-1)


class GroupedLinear(nn.Module):
    """g independent maps in one weight [g * out, in] (group i: rows [i * out, (i + 1) * out)):
    x [tokens, g, in] -> [tokens, g, out]."""

    def __init__(self, in_features: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = mx.zeros((groups * out_features, in_features))

    def __call__(self, x: mx.array) -> mx.array:
        w = self.weight.reshape(self.groups, -1, self.weight.shape[-1])
        return (x.transpose(1, 0, 2) @ w.swapaxes(-1, -2)).transpose(1, 0, 2)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_) -> "QuantizedGroupedLinear":
        q = QuantizedGroupedLinear(self.groups, group_size, bits, mode)
        parts = mx.quantize(self.weight, group_size=group_size, bits=bits, mode=mode)
        q.weight, q.scales = parts[0], parts[1]
        if mode == "affine":
            q.biases = parts[2]
        return q


class QuantizedGroupedLinear(nn.Module):
    """GroupedLinear over an MLX-quantized weight (the FP8 wo_a as mxfp8, or --quantize)."""

    def __init__(self, groups: int, group_size: int, bits: int, mode: str):
        super().__init__()
        self.groups, self.group_size, self.bits, self.mode = groups, group_size, bits, mode

    def __call__(self, x: mx.array) -> mx.array:
        g = self.groups

        def by_group(a):
            return None if a is None else a.reshape(g, -1, a.shape[-1])

        out = qmm.quantized_matmul(x.transpose(1, 0, 2), by_group(self.weight), by_group(self.scales),
                                   by_group(self.get("biases")), transpose=True, group_size=self.group_size,
                                   bits=self.bits, mode=self.mode)
        return out.transpose(1, 0, 2)


# --------------------------------------------------------------------------------- hyper-connections

class HyperConnection(nn.Module):
    """mHC around one sub-block: (post, comb, the block's input) from the streams h [T, n, d]."""

    def __init__(self, config: ModelConfig, v4: DeepSeekV4Config):
        super().__init__()
        n, d = v4.hc_mult, config.hidden_size
        self.n, self.iters = n, v4.hc_sinkhorn_iters
        self.eps, self.norm_eps = v4.hc_eps, config.rms_norm_eps
        self.fn = mx.zeros(((2 + n) * n, n * d))
        self.base = mx.zeros(((2 + n) * n,))
        self.scale = mx.ones((3,))

    def __call__(self, h: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        n, T = self.n, h.shape[0]
        mix = rms(h.reshape(T, -1).astype(mx.float32), self.norm_eps) @ self.fn.astype(mx.float32).T
        base, scale = self.base.astype(mx.float32), self.scale.astype(mx.float32)
        pre = mx.sigmoid(mix[:, :n] * scale[0] + base[:n]) + self.eps
        post = 2 * mx.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        comb = mx.softmax(mix[:, 2 * n:].reshape(T, n, n) * scale[2] + base[2 * n:].reshape(n, n), axis=-1) + self.eps
        # Sinkhorn-Knopp: columns, then rows and columns in turn, towards a doubly stochastic matrix.
        comb = comb / (comb.sum(axis=-2, keepdims=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + self.eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + self.eps)
        block_input = (pre[..., None] * h).sum(axis=1).astype(h.dtype)
        return post, comb, block_input


def expand(h: mx.array, post: mx.array, comb: mx.array, out: mx.array) -> mx.array:
    """H <- post y^T + comb^T H: the block output spread over the streams, the streams mixed."""
    dtype = h.dtype
    return post.astype(dtype)[..., None] * out[:, None, :] + comb.astype(dtype).swapaxes(-1, -2) @ h


class HyperHead(nn.Module):
    """The streams' final collapse, before the final norm."""

    def __init__(self, config: ModelConfig, v4: DeepSeekV4Config):
        super().__init__()
        n = v4.hc_mult
        self.eps, self.norm_eps = v4.hc_eps, config.rms_norm_eps
        self.hc_fn = mx.zeros((n, n * config.hidden_size))
        self.hc_base = mx.zeros((n,))
        self.hc_scale = mx.ones((1,))

    def __call__(self, h: mx.array) -> mx.array:
        """h [..., n, d] -> [..., d]"""
        flat = rms(h.reshape(*h.shape[:-2], -1).astype(mx.float32), self.norm_eps)
        mix = flat @ self.hc_fn.astype(mx.float32).T
        pre = mx.sigmoid(mix * self.hc_scale.astype(mx.float32) + self.hc_base.astype(mx.float32)) + self.eps
        return (pre[..., None] * h).sum(axis=-2).astype(h.dtype)


# ----------------------------------------------------------------------------------------- caches

class Series:
    """One compressed series of a sequence: its entries so far, the tokens of the window being
    filled (their projections, before the position bias), and (overlapping windows, CSA) the last
    full window's "a" half (also before the bias)."""

    def __init__(self):
        self.entries = None  # [count, dim]
        self.pending_kv = self.pending_gate = None  # [< rate, width]
        self.overlap_kv = self.overlap_gate = None  # [rate, dim]
        self.count = 0
        self.raw = None  # the last update's projections (pending tokens, then the new ones): the cache's log

    def copy(self) -> "Series":
        other = Series()
        other.__dict__.update(self.__dict__)  # arrays are immutable; updates make new ones
        other.raw = None
        return other

    def at(self, before: "Series", raw: tuple[mx.array, mx.array], position: int, rate: int, dim: int,
           overlap: bool) -> "Series":
        """This series (after an update) as it was at `position`, within that update: `before` is
        it before, `raw` the update's projections from token before.count * rate on. Entries only
        grow (an entry depends on its own window and the one before), so the state at `position` is
        slices of what is held: bit for bit the state a run stopping there had."""
        out, kv, gate = Series(), *raw
        count, base = position // rate, before.count * rate
        out.count = count
        out.entries = self.entries[:count] if count else None
        out.pending_kv, out.pending_gate = kv[count * rate - base:position - base], gate[count * rate - base:position - base]
        if overlap and count:
            if count == before.count:
                out.overlap_kv, out.overlap_gate = before.overlap_kv, before.overlap_gate
            else:
                w = (count - 1) * rate - base
                out.overlap_kv, out.overlap_gate = kv[w:w + rate, :dim], gate[w:w + rate, :dim]
        return out

    def arrays(self) -> list[mx.array]:
        """The arrays it holds (the last update's projections too, until the cache's log takes them)."""
        held = [self.entries, self.pending_kv, self.pending_gate, self.overlap_kv, self.overlap_gate, *(self.raw or ())]
        return [a for a in held if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in {id(a): a for a in self.arrays()}.values())


LOG_LIMIT = 64  # a call of at most this many tokens is logged: it can be rewound (drafts) or cut within


def reuse_stride(config: ModelConfig) -> int:
    """Positions between a V4 cache's kept points (prefix cache): a multiple of every compression
    rate (no unfinished window there), at least 4 sliding windows (a point holds a window of keys:
    about a quarter of a key per position more; 512 for V4-Flash and -Pro)."""
    kinds = set(layer_types(config)) - {SLIDING}
    lcm = math.lcm(*(compress_rate(config, k) for k in kinds)) if kinds else 1
    window = deepseek_v4_config(config).sliding_window
    return lcm * max(1, -(-4 * window // lcm))


def _own(a: mx.array | None) -> mx.array | None:
    """A copy of a slice, so that a kept point does not hold the whole array it was cut from."""
    return None if a is None else a * 1


class CompressedCache:
    """A V4 layer's cache for one sequence: the last sliding_window - 1 keys (the window a next
    query needs), and the compressed series (CSA: main and indexer; HCA: main).

    A compressed window cannot be reopened nor the window of keys grown back, so a shorter prefix
    (the prefix cache's fork) or fewer positions (rejected drafts' rewind) come from what the cache
    keeps for them: the state before each of its last calls and their keys and projections (calls of
    LOG_LIMIT tokens in all: decoding steps, a verify trip, an MTP module's drafting steps), from
    which any position within them is rebuilt, and the state at every multiple of `stride` positions (kept points: window, overlap
    halves; the entries are the held ones' first). `reusable` says which prefix a fork can have."""

    def __init__(self, kind: str, entry_values: float, stride: int = 0, window: int = 0):
        self.kind = kind
        self.window = None  # [<= sliding_window - 1, head_dim]
        self._offset = 0
        self.compressor = Series() if kind != SLIDING else None
        self.indexer = Series() if kind == CSA else None
        self._entry_values = entry_values  # values per token of the compressed series
        self.stride, self.keep = stride, window - 1
        # the last calls, oldest first: (start, end, keys from position key_start, key_start,
        # [(series before, raw, rate, dim, overlap)])
        self.logs = []
        self.points = {}  # position -> (window, [series with entries=None]) at multiples of stride

    @property
    def offset(self) -> int:
        return self._offset

    @offset.setter
    def offset(self, value: int) -> None:
        if value < self._offset:  # speculative decoding's rewind
            if not self.logs or value < self.logs[0][0]:
                raise ValueError(f"a DeepSeek V4 cache of {self._offset} positions cannot drop back to {value}")
            self._become(self._at(value), value)
            self.logs = [log for log in self.logs if log[0] < value or log is self.logs[0]]
            self.logs[-1] = (self.logs[-1][0], value, *self.logs[-1][2:])
            return
        self._offset = value

    def series(self) -> list[Series]:
        return [s for s in (self.compressor, self.indexer) if s is not None]

    def note_call(self, start: int, keys: mx.array, befores: list[Series], shapes: list[tuple[int, int, bool]]) -> None:
        """After a call that took the cache from `start` to `offset`: `keys` the window before it and
        its own keys, `befores` the series before it, shapes each series' (rate, dim, overlap)."""
        log = (start, self._offset, keys, start - (keys.shape[0] - (self._offset - start)),
               [(b, s.raw, *shape) for b, s, shape in zip(befores, self.series(), shapes)])
        for s in self.series():
            s.raw = None
        for b in befores:  # (copies) Series.at reads a log's series before the call for its count and overlap
            b.entries = b.pending_kv = b.pending_gate = None  # halves only: its entries are the live ones' first,
            # its pending tokens' projections the start of `raw`; kept, an older entries array per call stayed
            # held (16 a CSA layer over 64 decoded tokens at rate 4: most of a long sequence's bytes)
        self.logs.append(log)
        if self.stride:
            first = -(-(start + 1) // self.stride) * self.stride
            for p in range(first, self._offset + 1, self.stride):
                window, series = self._at(p)
                for s in series:
                    s.entries = None
                    s.pending_kv, s.pending_gate = _own(s.pending_kv), _own(s.pending_gate)
                    s.overlap_kv, s.overlap_gate = _own(s.overlap_kv), _own(s.overlap_gate)
                self.points[p] = (_own(window), series)
        while self.logs and self._offset - self.logs[0][0] > LOG_LIMIT:
            self.logs.pop(0)

    def _at(self, position: int) -> tuple[mx.array, list[Series]]:
        """(window, series) at `position` within the logged calls."""
        log = next(log for log in self.logs if log[0] <= position <= log[1])
        _, _, keys, key_start, series = log
        window = keys[:position - key_start][-self.keep:] if self.keep > 0 else keys[:0]
        return window, [live.at(before, raw, position, rate, dim, overlap)
                        for live, (before, raw, rate, dim, overlap) in zip(self.series(), series)]

    def _become(self, state: tuple[mx.array, list[Series]], position: int) -> None:
        self.window, series = state
        if self.compressor is not None:
            self.compressor = series[0]
        if self.indexer is not None:
            self.indexer = series[1]
        self._offset = position
        self.points = {p: v for p, v in self.points.items() if p <= position}

    def reusable(self, length: int) -> int:
        """The longest prefix of at most `length` positions that `prefix` can give."""
        if length >= self._offset:
            return self._offset
        if self.logs and length >= self.logs[0][0]:
            return length
        return max((p for p in self.points if p <= length), default=0)

    def resume_points(self, length: int) -> list[int]:
        """Every prefix of at most `length` positions that `prefix` can give (the prefix cache's
        resume points: models.cache.resume_points)."""
        near = range(self.logs[0][0], min(length, self._offset) + 1) if self.logs else ()
        return sorted({p for p in self.points if p <= length} | set(near)
                      | ({length} if self.reusable(length) == length else set()))

    def prefix(self, length: int) -> "CompressedCache":
        """A new cache holding this one's first `length` positions, exactly as a run stopping there
        had them; `length` must be one `reusable` gives."""
        other = CompressedCache.__new__(CompressedCache)
        other.__dict__.update(self.__dict__)
        if length == self._offset:
            other.compressor = self.compressor.copy() if self.compressor else None
            other.indexer = self.indexer.copy() if self.indexer else None
            other.points, other.logs = dict(self.points), list(self.logs)
            return other
        if self.logs and self.logs[0][0] <= length < self._offset:
            state = self._at(length)
        elif length == 0:
            return CompressedCache(self.kind, self._entry_values, self.stride, self.keep + 1)
        elif length in self.points:
            window, kept = self.points[length]
            series = []
            for live, point in zip(self.series(), kept):
                s = point.copy()
                s.entries = live.entries[:s.count] if s.count else None
                series.append(s)
            state = (window, series)
        else:
            raise ValueError(f"a DeepSeek V4 cache of {self._offset} positions keeps no state at {length}")
        other.logs = []
        other._become(state, length)
        return other

    SERIES_FIELDS = ("entries", "pending_kv", "pending_gate", "overlap_kv", "overlap_gate")

    def state_arrays(self) -> list[tuple[str, mx.array, int | None]]:
        """The state after `offset` positions as named arrays for the prompt cache on disk (none cut to a
        shorter prefix: the window and the open compressed windows cannot be): the window of keys, each
        series' count, entries, pending tokens' projections and overlap halves (those it holds). The logs
        and kept points are not part of it."""
        named = [("window", self.window, None)] if self.window is not None else []
        for label, s in zip(("compressor", "indexer"), (self.compressor, self.indexer)):
            if s is not None:
                named.append((f"{label}.count", mx.array([s.count], mx.int64), None))
                named += [(f"{label}.{f}", getattr(s, f), None) for f in self.SERIES_FIELDS if getattr(s, f) is not None]
        return named

    def load_state_arrays(self, named: dict[str, mx.array], positions: int) -> None:
        """Become the state `state_arrays` gave, after `positions` positions (ValueError where the arrays
        are not it); that state is kept as a point (a later fork can start from it)."""
        named = dict(named)
        window = named.pop("window", None)
        if window is None or window.ndim != 2 or window.shape[0] != min(positions, self.keep):
            raise ValueError("not a DeepSeek V4 cache's window of keys")
        series = []
        for label, s in zip(("compressor", "indexer"), (self.compressor, self.indexer)):
            if s is None:
                continue
            count = named.pop(f"{label}.count", None)
            if count is None or count.size != 1:
                raise ValueError(f"no count of the {label} series")
            s = Series()
            s.count = int(count.item())
            for f in self.SERIES_FIELDS:
                setattr(s, f, named.pop(f"{label}.{f}", None))
            if (s.entries.shape[0] if s.entries is not None else 0) != s.count:
                raise ValueError(f"the {label} series' entries are not its count")
            series.append(s)
        if named:
            raise ValueError(f"arrays a DeepSeek V4 {self.kind} cache does not hold: {sorted(named)}")
        self.logs, self.points = [], {}
        self._become((window, series), positions)
        if self.stride:
            kept = []
            for s in series:
                point = s.copy()
                point.entries = None
                kept.append(point)
            self.points[positions] = (window, kept)

    @property
    def nbytes(self) -> int:
        """Every array the cache holds, each once: the window and series, the kept points (a window and
        open compressions every `stride` positions), and the last calls' logs (their keys, projections
        and the series before each call, whose entries arrays are older ones than the series' own)."""
        held = [self.window, *(a for s in self.series() for a in s.arrays())]
        for window, kept in self.points.values():
            held += [window, *(a for s in kept for a in s.arrays())]
        for _, _, keys, _, series in self.logs:
            held += [keys, *(a for before, raw, *_ in series for a in (*before.arrays(), *(raw or ())))]
        return sum(a.nbytes for a in {id(a): a for a in held if a is not None}.values())

    @property
    def bytes_per_token(self) -> float:
        """What each further token adds once the window is full: its share of a compressed entry."""
        return 0 if self.window is None else self._entry_values * self.window.dtype.size


# ------------------------------------------------------------------------------------- compressors

class Compressor(nn.Module):
    """Turns a sequence's tokens into compressed entries, one per `rate` tokens (report eqs. 9-12,
    20-23): entry = RMSNorm(sum_j softmax_j(gate_j + position_bias_j) * kv_j), rotated to the
    window's first position. overlap (CSA): each entry spans 2 * rate tokens, the previous window's
    first `dim` features (its "a" series) and this window's last `dim` ("b")."""

    def __init__(self, config: ModelConfig, rate: int, dim: int, overlap: bool):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.rate, self.dim, self.overlap = rate, dim, overlap
        self.kv_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.position_bias = mx.zeros((rate, width))
        self.kv_norm = RMSNorm(dim, eps=config.rms_norm_eps)

    def update(self, series: Series, x: mx.array, rope: RoPE) -> mx.array:
        """x: [t, hidden], a sequence's next tokens: add the entries of the windows they complete;
        returns all entries [count, dim]."""
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        if series.pending_kv is not None:
            kv = mx.concatenate([series.pending_kv, kv])
            gate = mx.concatenate([series.pending_gate, gate])
        series.raw = (kv, gate)
        windows = kv.shape[0] // self.rate
        usable = windows * self.rate
        series.pending_kv, series.pending_gate = kv[usable:], gate[usable:]
        if windows:
            kv = kv[:usable].reshape(windows, self.rate, -1)
            gate = (gate[:usable].reshape(windows, self.rate, -1).astype(mx.float32)
                    + self.position_bias.astype(mx.float32))  # a float32 sum, as transformers' promotion
            if self.overlap:
                kv, gate = self._with_previous_halves(series, kv, gate, series.raw[1][:usable])
            weights = mx.softmax(gate.astype(mx.float32), axis=1).astype(kv.dtype)
            entries = self.kv_norm((kv * weights).sum(axis=1))  # [windows, dim]
            starts = (mx.arange(windows) + series.count) * self.rate
            entries = rotate_tail(entries[:, None], rope, starts.astype(mx.int32))[:, 0]
            series.entries = entries if series.entries is None else mx.concatenate([series.entries, entries])
            series.count += windows
        return series.entries if series.entries is not None else mx.zeros((0, self.dim), x.dtype)

    def _with_previous_halves(self, series: Series, kv: mx.array, gate: mx.array,
                              raw_gate: mx.array) -> tuple[mx.array, mx.array]:
        """[windows, rate, 2 dim] -> [windows, 2 rate, dim]: the previous window's a half, then this
        window's b half (the very first window's a slots weigh nothing: gate -inf). The last
        window's a half is kept for the next (its gate before the position bias: raw_gate)."""
        d, w = self.dim, kv.shape[0]
        first_kv = series.overlap_kv if series.overlap_kv is not None else mx.zeros((self.rate, d), kv.dtype)
        first_gate = (series.overlap_gate.astype(mx.float32) + self.position_bias[:, :d].astype(mx.float32)
                      if series.overlap_gate is not None else mx.full((self.rate, d), -mx.inf, gate.dtype))
        previous_kv = mx.concatenate([first_kv[None], kv[:w - 1, :, :d]])
        previous_gate = mx.concatenate([first_gate[None], gate[:w - 1, :, :d]])
        series.overlap_kv, series.overlap_gate = kv[-1, :, :d], raw_gate[-self.rate:, :d]
        return (mx.concatenate([previous_kv, kv[..., d:]], axis=1),
                mx.concatenate([previous_gate, gate[..., d:]], axis=1))


class Scorer(nn.Module):
    def __init__(self, config: ModelConfig, heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(config.hidden_size, heads, bias=False)


class Indexer(Compressor):
    """CSA's lightning indexer (report eqs. 13-17): its own compressed keys (index_head_dim) and
    queries from the query latent; score[t, s] = sum_h w[t, h] ReLU(q[t, h] . k[s]) / sqrt(dim),
    w = weights_proj(x) / sqrt(heads)."""

    def __init__(self, config: ModelConfig, v4: DeepSeekV4Config, rate: int):
        dim = v4.index_head_dim
        super().__init__(config, rate, dim, overlap=True)
        self.heads, self.top_k = v4.index_n_heads, v4.index_topk
        self.q_b_proj = nn.Linear(v4.q_lora_rank, self.heads * dim, bias=False)
        self.scorer = Scorer(config, self.heads)

    def scores(self, q_latent: mx.array, x: mx.array, q_positions: mx.array, keys: mx.array, rope: RoPE) -> mx.array:
        """[queries, entries] index scores of the querying tokens (q_latent, x: theirs)."""
        q = self.q_b_proj(q_latent).reshape(q_latent.shape[0], self.heads, self.dim)
        q = rotate_tail(q, rope, q_positions).astype(mx.float32)
        relu = nn.relu(q @ keys.astype(mx.float32).T) * self.dim ** -0.5  # [t, heads, entries]
        w = self.scorer.weights_proj(x).astype(mx.float32) * self.heads ** -0.5
        return (w[:, None, :] @ relu)[:, 0]


class CompressedKV(Compressor):
    """A compressed layer's long-range keys: its compressor (the checkpoint's `attn.compressor.*`),
    and for CSA the lightning indexer that chooses among the entries."""

    def __init__(self, config: ModelConfig, v4: DeepSeekV4Config, kind: str):
        super().__init__(config, compress_rate(config, kind), config.head_dim, overlap=kind == CSA)
        self.kind = kind
        if kind == CSA:
            self.indexer = Indexer(config, v4, self.rate)

    def update_all(self, cache: CompressedCache, x: mx.array, rope: RoPE) -> tuple[mx.array, mx.array | None]:
        """(the entries, the indexer's entries or None) after a sequence's next tokens x."""
        entries = self.update(cache.compressor, x, rope)
        return entries, self.indexer.update(cache.indexer, x, rope) if self.kind == CSA else None

    def visible(self, q_positions: mx.array, count: int) -> mx.array:
        """[queries, entries]: entry w is seen by a query at p once its window ended, w < (p + 1) // rate."""
        return mx.arange(count)[None, :] < ((q_positions + 1) // self.rate)[:, None]


# -------------------------------------------------------------------------------------- attention

class Attention(nn.Module):
    def __init__(self, config: ModelConfig, v4: DeepSeekV4Config, layer_index: int):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.kind = attention_kind(config, layer_index)
        self.n_heads, self.head_dim = config.num_attention_heads, hd
        self.window = v4.sliding_window
        self.groups, self.o_rank = v4.o_groups, v4.o_lora_rank
        self.eps = config.rms_norm_eps
        self.scale = hd ** -0.5
        q_lora = v4.q_lora_rank
        self.q_a_proj = nn.Linear(d, q_lora, bias=False)
        self.q_a_norm = RMSNorm(q_lora, eps=config.rms_norm_eps)
        self.q_b_proj = nn.Linear(q_lora, self.n_heads * hd, bias=False)
        self.kv_proj = nn.Linear(d, hd, bias=False)
        self.kv_norm = RMSNorm(hd, eps=config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(self.n_heads * hd // self.groups, self.o_rank, self.groups)
        self.o_b_proj = nn.Linear(self.groups * self.o_rank, d, bias=False)
        self.sinks = mx.zeros((self.n_heads,))
        if self.kind != SLIDING:
            self.compressor = CompressedKV(config, v4, self.kind)
        rope = ropes(config)
        self._rope = rope["main"] if self.kind == SLIDING else rope["compress"]
        self._compress_rope = rope["compress"]
        entry = hd / self.compressor.rate if self.kind != SLIDING else 0
        if self.kind == CSA:
            entry += self.compressor.indexer.dim / self.compressor.rate
        self._entry_values = entry  # cached values per token, once the window is full
        self._stride = reuse_stride(config)

    def make_cache(self) -> CompressedCache:
        return CompressedCache(self.kind, self._entry_values, self._stride, self.window)

    def __call__(self, x: mx.array, caches: list[CompressedCache], lengths: list[int], last_only: bool = False,
                 full: list[bool] | None = None) -> mx.array:
        """x: [T, hidden], the packed sequences' new tokens (the layer's normalised input) -> [t, hidden]
        for the queries: every token, or with last_only each sequence's last (all of a `full` one's)."""
        offsets = positions(lengths, caches)
        if last_only:
            last, kept = kept_rows(lengths, full)
            xq, q_offsets = x[last], offsets[last]
        else:
            xq, q_offsets, kept = x, offsets, segments(lengths)
        q_latent = self.q_a_norm(self.q_a_proj(xq))
        q = rms(self.q_b_proj(q_latent).reshape(xq.shape[0], self.n_heads, self.head_dim), self.eps)
        q = rotate_tail(q, self._rope, q_offsets)
        kv = rotate_tail(self.kv_norm(self.kv_proj(x))[:, None], self._rope, offsets)[:, 0]  # K = V: [T, hd]
        outputs = []
        for (begin, end), (qb, qe), cache in zip(segments(lengths), kept, caches):
            outputs.append(self._attend(cache, x[begin:end], kv[begin:end], q[qb:qe], q_latent[qb:qe], xq[qb:qe],
                                        q_offsets[qb:qe]))
        out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs)  # [t, heads, hd]
        out = rotate_tail(out, self._rope, q_offsets, inverse=True)  # V = K carried the keys' rotation
        out = self.o_a_proj(out.reshape(out.shape[0], self.groups, -1)).reshape(out.shape[0], -1)
        return self.o_b_proj(out)

    def _attend(self, cache: CompressedCache, x: mx.array, kv: mx.array, q: mx.array, q_latent: mx.array,
                xq: mx.array, q_pos: mx.array) -> mx.array:
        """One sequence: its new tokens x / kv, its queries q [t, heads, hd] at q_pos."""
        start = cache.offset
        keys = kv if cache.window is None else mx.concatenate([cache.window, kv])
        key_pos = mx.arange(start + kv.shape[0] - keys.shape[0], start + kv.shape[0])
        cache.window = keys[-(self.window - 1):] if self.window > 1 else keys[:0]
        cache.offset = start + kv.shape[0]
        near = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] > q_pos[:, None] - self.window)
        logits = [mx.where(near[:, None, :], (q @ keys.T) * self.scale, -mx.inf)]  # [t, heads, keys]
        values = [keys]
        befores = [s.copy() for s in cache.series()]
        if self.kind != SLIDING:
            entries, index_keys = self.compressor.update_all(cache, x, self._compress_rope)
            seen = self.compressor.visible(q_pos, entries.shape[0])
            if self.kind == CSA and entries.shape[0] > self.compressor.indexer.top_k:
                entries, seen = self._top_k(entries, index_keys, seen, q_latent, xq, q_pos)  # per query: [t, k, hd]
                logits.append(mx.where(seen[:, None, :], (q @ entries.swapaxes(-1, -2)) * self.scale, -mx.inf))
            else:
                logits.append(mx.where(seen[:, None, :], (q @ entries.T) * self.scale, -mx.inf))
            values.append(entries)
        cache.note_call(start, keys, befores, self._series_shapes())
        sinks = mx.broadcast_to(self.sinks.astype(mx.float32)[None, :, None], (q.shape[0], self.n_heads, 1))
        p = mx.softmax(mx.concatenate([a.astype(mx.float32) for a in logits] + [sinks], axis=-1), axis=-1)
        out, begin = 0, 0
        for a, v in zip(logits, values):
            part = p[..., begin:begin + a.shape[-1]].astype(v.dtype)
            out = out + part @ v  # [t, heads, k] @ [k, hd] or, per query, [t, k, hd]
            begin += a.shape[-1]
        return out

    def _series_shapes(self) -> list[tuple[int, int, bool]]:
        """(rate, dim, overlap) of each compressed series a cache of this layer holds."""
        if self.kind == SLIDING:
            return []
        c = self.compressor
        return [(c.rate, c.dim, c.overlap)] + ([(c.indexer.rate, c.indexer.dim, True)] if self.kind == CSA else [])

    def _top_k(self, entries: mx.array, index_keys: mx.array, seen: mx.array, q_latent: mx.array, xq: mx.array,
               q_pos: mx.array):
        """The indexer's index_topk entries of each query among those it sees: ([t, k, hd], [t, k])."""
        indexer = self.compressor.indexer
        scores = indexer.scores(q_latent, xq, q_pos, index_keys, self._compress_rope)
        scores = mx.where(seen, scores, -mx.inf)
        best = mx.argpartition(-scores, kth=indexer.top_k - 1, axis=-1)[:, : indexer.top_k]  # [t, k]
        return entries[best], mx.take_along_axis(seen, best, axis=-1)


# -------------------------------------------------------------------------------------------- MoE

class Router(nn.Module):
    """Expert choice and weights. Hash-routed layers take their experts from the token id."""

    def __init__(self, config: ModelConfig, v4: DeepSeekV4Config, hashed: bool):
        super().__init__()
        experts, self.top_k = v4.n_routed_experts, v4.num_experts_per_tok
        self.hashed, self.scale = hashed, v4.routed_scaling_factor
        self.scoring = v4.scoring_func
        self.weight = mx.zeros((experts, config.hidden_size))
        if hashed:
            self.tid2eid = mx.zeros((config.vocab_size, self.top_k), dtype=mx.int32)
        else:
            self.e_score_correction_bias = mx.zeros((experts,))

    def __call__(self, x: mx.array, ids: mx.array | None) -> tuple[mx.array, mx.array]:
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        if self.scoring == "sqrtsoftplus":
            scores = mx.sqrt(nn.softplus(logits))
        elif self.scoring == "sigmoid":
            scores = mx.sigmoid(logits)
        else:
            scores = mx.softmax(logits, axis=-1)
        if self.hashed:
            if ids is None:
                raise RuntimeError("a hash-routed layer ran without the tokens' ids")
            indices = self.tid2eid[ids].astype(mx.int32)
        else:
            biased = scores + self.e_score_correction_bias.astype(mx.float32)
            indices = mx.argpartition(-biased, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        weights = mx.take_along_axis(scores, indices, axis=-1)
        return indices, weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * self.scale


class ClampedSwitchGLU(SwitchGLU):
    """Routed experts whose SwiGLU clamps its pre-activations: gate <= limit, |up| <= limit."""

    def __init__(self, hidden: int, intermediate: int, experts: int, limit: float):
        super().__init__(hidden, intermediate, experts)
        self.limit = limit

    def activate(self, gate: mx.array, up: mx.array) -> mx.array:
        return nn.silu(mx.minimum(gate, self.limit)) * mx.clip(up, -self.limit, self.limit)


class ClampedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, limit: float):
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate = mx.minimum(self.gate_proj(x), self.limit)
        return self.down_proj(nn.silu(gate) * mx.clip(self.up_proj(x), -self.limit, self.limit))


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, v4: DeepSeekV4Config, layer_index: int):
        super().__init__()
        inter, limit = v4.moe_intermediate_size, v4.swiglu_limit
        self.gate = Router(config, v4, mlp_kind(config, layer_index) == "hash_moe")
        self.switch_mlp = ClampedSwitchGLU(config.hidden_size, inter, v4.n_routed_experts, limit)
        self.shared_experts = ClampedMLP(config.hidden_size, inter * v4.n_shared_experts, limit)

    def __call__(self, x: mx.array, ids: mx.array | None) -> mx.array:
        indices, weights = self.gate(x, ids)
        routed = self.switch_mlp(x, indices)
        return (routed * weights[..., None].astype(routed.dtype)).sum(axis=1) + self.shared_experts(x)


# ------------------------------------------------------------------------------------- the block

class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        v4 = deepseek_v4_config(config)
        self.index = layer_index
        self.self_attn = Attention(config, v4, layer_index)
        self.mlp = MoE(config, v4, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn_hc = HyperConnection(config, v4)
        self.ffn_hc = HyperConnection(config, v4)

    def make_cache(self) -> CompressedCache:
        return self.self_attn.make_cache()

    def __call__(self, h: mx.array, caches: list, lengths: list[int], ids: mx.array | None,
                 last_only: bool = False, full: list[bool] | None = None) -> tuple[mx.array, mx.array | None]:
        """h: the streams [T, n, hidden] -> the streams after the block (with last_only, of each
        sequence's kept positions only), and the ids of those positions."""
        post, comb, x = self.attn_hc(h)
        out = self.self_attn(self.input_layernorm(x), caches, lengths, last_only=last_only, full=full)
        if last_only:
            last, _ = kept_rows(lengths, full)
            h, post, comb = h[last], post[last], comb[last]
            ids = None if ids is None else ids[last]
        h = expand(h, post, comb, out)
        post, comb, x = self.ffn_hc(h)
        return expand(h, post, comb, self.mlp(self.post_attention_layernorm(x), ids)), ids


# ------------------------------------------------------------------------ the slice a rank holds

ID_DIGITS = 4  # base-256 digits of a token id on the ids row: ids below 2**32


def attach_ids(streams: mx.array, ids: mx.array) -> mx.array:
    """[T, n, d] streams + ids [T] -> [T, n + 1, d]: the ids' base-256 digits start the extra row."""
    digits = mx.stack([(ids // 256 ** k) % 256 for k in range(ID_DIGITS)], axis=-1).astype(streams.dtype)
    row = mx.concatenate([digits, mx.zeros((ids.shape[0], streams.shape[-1] - ID_DIGITS), streams.dtype)], axis=-1)
    return mx.concatenate([streams, row[:, None]], axis=1)


def detach_ids(h: mx.array, n: int) -> tuple[mx.array, mx.array | None]:
    if h.shape[1] == n:
        return h, None
    digits = mx.round(h[:, n, :ID_DIGITS].astype(mx.float32)).astype(mx.int32)
    ids = sum(digits[:, k] * 256 ** k for k in range(ID_DIGITS))
    return h[:, :n], ids


class Slice(TransformerSlice):
    """A rank's layers of a V4 model; with the ends, the embedding (spread over the streams), the
    streams' final collapse (hc_head), the final norm and the LM head. Hidden states are
    [1, tokens, hc_mult (+1 with the ids row), hidden]."""

    def __init__(self, config: ModelConfig, make_layer, start: int, end: int, has_ends: bool, head_rows: int = 0):
        super().__init__(config, make_layer, start, end, has_ends, head_rows)
        v4 = deepseek_v4_config(config)
        self.n_streams = v4.hc_mult
        self.last_hash = last_hash_layer(config)
        if has_ends or head_rows:  # the last rank's share of the head reads the collapsed streams too
            self.hc_head = HyperHead(config, v4)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def keeps_float32(self, name: str) -> bool:
        """The loader keeps these tensors' floats in float32 (see FLOAT32)."""
        return name.endswith(FLOAT32)

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)[0]  # [T, d]
        streams = mx.broadcast_to(h[:, None, :], (h.shape[0], self.n_streams, h.shape[1]))
        if self.last_hash >= 0:
            streams = attach_ids(streams, tokens[0])
        return streams[None]

    def forward_layers(self, h: mx.array, caches: list[list], lengths: list[int], last_only: bool = False,
                       full: list[bool] | None = None) -> mx.array:
        streams, ids = detach_ids(h[0], self.n_streams)
        final = last_only and self.end == self.config.num_hidden_layers
        for j, layer in enumerate(self.layers):
            layer_caches = [seq_caches[j] for seq_caches in caches]
            if layer.index <= self.last_hash and ids is None:
                raise RuntimeError(f"layer {layer.index} is hash-routed but the tokens' ids did not reach it")
            streams, ids = layer(streams, layer_caches, lengths, ids, last_only=final and j == len(self.layers) - 1,
                                 full=full)
            if layer.index >= self.last_hash:
                ids = None  # no hash-routed layer ahead
            start_computing(streams)
        return (streams if ids is None else attach_ids(streams, ids))[None]

    def collapse(self, h: mx.array) -> mx.array:
        """Streams [..., n (+1), hidden] -> the residual the final norm reads [..., hidden] (hc_head)."""
        if h.shape[-2] != self.n_streams:
            h = h[..., : self.n_streams, :]
        return self.hc_head(h)

    def logits(self, h: mx.array, vocab_end: int | None = None) -> mx.array:
        """h: streams [..., n, hidden] (3 or more dimensions), or rows [t, hidden] already collapsed
        (the last rank's, when it computed a share of the head: head_share.returned_rows) -> logits."""
        return super().logits(h if h.ndim == 2 else self.collapse(h), vocab_end)
