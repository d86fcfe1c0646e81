"""pipeline's attention kernel (pipeline/kernels/attention_kernels.cpp through pipeline/kernels/attention.py) against an
independent truth: causal softmax attention over each sequence's cache in float64 with numpy. Then
the property batch jobs, prefix-cache hits and speculative verification rely on: a query's output
does not depend on what else shares the call (other rows of its chunk, other sequences, threads,
the cache buffer's spare room), to the bit. And the models' attention through it against MLX's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from pipeline.kernels import attention, qmm


def reference(q, keys, values, rows, key_len, scale):
    """float64 attention, and beside each output sum_j p_j |v_j| (its natural scale)."""
    out, size = [], []
    r0 = 0
    for k, v, t, n in zip(keys, values, rows, key_len):
        rep = q.shape[1] // k.shape[0]
        for i in range(t):
            m = n - t + i + 1  # keys the query at this position sees
            o, s = [], []
            for h in range(q.shape[1]):
                scores = k[h // rep, :m].astype(np.float64) @ q[r0 + i, h].astype(np.float64) * scale
                p = np.exp(scores - scores.max())
                p /= p.sum()
                o.append(p @ v[h // rep, :m].astype(np.float64))
                s.append(p @ np.abs(v[h // rep, :m]).astype(np.float64))
            out.append(np.concatenate(o))
            size.append(np.concatenate(s))
        r0 += t
    return np.array(out), np.array(size)


def random_batch(rng, heads, kv_heads, dk, dv, shapes, spare=13, peak=3.0):
    """Sequences of (new rows, cached positions incl. them) in buffers with spare room past the end;
    queries scaled by `peak` so that softmaxes are far from uniform."""
    keys = [rng.standard_normal((kv_heads, n + spare, dk)).astype(np.float32) for _, n in shapes]
    values = [rng.standard_normal((kv_heads, n + spare, dv)).astype(np.float32) for _, n in shapes]
    q = (rng.standard_normal((sum(t for t, _ in shapes), heads, dk)) * peak).astype(np.float32)
    return q, keys, values


def run(kernels, q, keys, values, rows, key_len, scale, threads=2):
    qmm.set_threads(threads)
    begin = np.concatenate([[0], np.cumsum(rows)]).astype(int).tolist()
    out = kernels.cached_attention(mx.array(q), [mx.array(k)[None] for k in keys], [mx.array(v)[None] for v in values],
                                   begin, list(key_len), scale)
    return np.array(out)


# Error of one output over its float64 value, relative to sum_j p_j |v_j|: a score rounds ~5 times
# (dk / 16 FMAs per lane, the lane tree, the scale), exp16 is within 2 ulp, the weighted sum once
# per position. Measured: at most 1.0e-6 over the cases below; a key too many or too few, a wrong
# head or a wrong scale is off by order 1e-2 or more.
RELATIVE_TOLERANCE = 2e-6

CASES = {
    "grouped heads, decode and chunks": (9, 3, 64, 64, [(1, 37), (5, 200), (1, 1), (17, 17), (3, 16)]),
    "8 heads on one kv head": (8, 1, 128, 128, [(1, 300), (4, 4)]),
    "6 heads per kv head (a tile of 4, then 2)": (12, 2, 32, 32, [(2, 33), (1, 64)]),
    "keys and values of different sizes (MLA)": (4, 1, 96, 64, [(3, 50), (1, 7)]),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(kernels, case):
    heads, kv_heads, dk, dv, shapes = CASES[case]
    rng = np.random.default_rng(len(case))
    q, keys, values = random_batch(rng, heads, kv_heads, dk, dv, shapes)
    rows, key_len = [t for t, _ in shapes], [n for _, n in shapes]
    scale = dk ** -0.5
    got = run(kernels, q, keys, values, rows, key_len, scale)
    want, size = reference(q, keys, values, rows, key_len, scale)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want) / size) < RELATIVE_TOLERANCE


def test_each_query_rounds_the_same_whatever_shares_the_call(kernels):
    """A query alone (decoding), in its chunk (prefill, a draft being verified), among other
    sequences (a batch), with one thread or two, and over a cache with more spare room: same bits."""
    heads, kv_heads, dk, dv = 9, 3, 64, 64
    shapes = [(1, 40), (6, 90), (1, 300), (20, 20), (24, 400)]  # 18 M multiply-adds: two threads take it
    rng = np.random.default_rng(3)
    q, keys, values = random_batch(rng, heads, kv_heads, dk, dv, shapes)
    rows, key_len = [t for t, _ in shapes], [n for _, n in shapes]
    together = run(kernels, q, keys, values, rows, key_len, 0.125)
    assert np.array_equal(together, run(kernels, q, keys, values, rows, key_len, 0.125, threads=1))
    r0 = 0
    for k, v, t, n in zip(keys, values, rows, key_len):
        chunk = run(kernels, q[r0:r0 + t], [k], [v], [t], [n], 0.125)
        assert np.array_equal(chunk, together[r0:r0 + t])
        roomier = [np.concatenate([k, np.ones_like(k)], axis=1)], [np.concatenate([v, np.ones_like(v)], axis=1)]
        assert np.array_equal(run(kernels, q[r0:r0 + t], *roomier, [t], [n], 0.125), chunk)
        for i in range(t):  # each position alone, its cache holding only what it sees
            alone = run(kernels, q[r0 + i:r0 + i + 1], [k], [v], [1], [n - t + i + 1], 0.125)
            assert np.array_equal(alone[0], together[r0 + i])
        r0 += t


def test_strided_inputs(kernels):
    """Queries as a view of a wider array (q of a fused q/k RoPE) and caches as prefix views of a
    bigger buffer (a prefix-cache fork) read the same numbers as contiguous copies."""
    rng = np.random.default_rng(5)
    qk = mx.array(rng.standard_normal((7, 12, 64)).astype(np.float32))
    q_view = qk[:, :9]
    buffer = mx.array(rng.standard_normal((1, 3, 256, 64)).astype(np.float32))
    values = mx.array(rng.standard_normal((1, 3, 256, 64)).astype(np.float32))
    qmm.set_threads(2)
    got = kernels.cached_attention(q_view, [buffer[:, :, :100]], [values[:, :, :100]], [0, 7], [100], 0.125)
    copies = kernels.cached_attention(mx.array(np.array(q_view)), [mx.array(np.array(buffer[:, :, :100]))],
                                      [mx.array(np.array(values[:, :, :100]))], [0, 7], [100], 0.125)
    assert np.array_equal(np.array(got), np.array(copies))


def test_bad_calls_are_refused(kernels):
    q = mx.zeros((2, 4, 64))
    k = mx.zeros((1, 2, 8, 64))
    with pytest.raises(ValueError, match="key_len"):
        kernels.cached_attention(q, [k], [k], [0, 2], [9], 0.125)  # more keys than the cache holds
    with pytest.raises(ValueError, match="multiples of 16"):
        kernels.cached_attention(mx.zeros((2, 4, 40)), [mx.zeros((1, 2, 8, 40))], [mx.zeros((1, 2, 8, 40))],
                                 [0, 2], [4], 0.125)
    with pytest.raises(ValueError, match="kv heads"):
        kernels.cached_attention(mx.zeros((2, 3, 64)), [k], [k], [0, 2], [4], 0.125)


def test_model_attention_matches_mlx_fallback(kernels, monkeypatch):
    """A layer's attention through the kernel (every sequence in one call) against MLX's per-sequence
    path (PIPELINE_ATTENTION=0) on a batch of a prompt chunk and decoding sequences."""
    from pipeline.models.config import ModelConfig
    from pipeline.models.cache import KVCache
    from pipeline.models.layers import Attention

    config = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 8,
                                    "num_key_value_heads": 2, "intermediate_size": 512, "num_hidden_layers": 1,
                                    "vocab_size": 100, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                                    "max_position_embeddings": 4096})
    mx.random.seed(0)
    layer = Attention(config)
    outputs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(attention.ENV, setting)
        caches = [KVCache() for _ in range(3)]
        rng = np.random.default_rng(0)
        prompt = mx.array(rng.standard_normal((1, 50, 256)).astype(np.float32) * 4)
        layer(prompt[:, :30], caches[:1], [30])
        layer(prompt[:, 30:50], caches[1:2], [20])
        step = mx.array(rng.standard_normal((1, 1 + 10 + 1, 256)).astype(np.float32) * 4)
        outputs[setting] = np.array(layer(step, caches, [1, 10, 1]))
    scale = np.abs(outputs["0"]).max()
    assert np.max(np.abs(outputs["1"] - outputs["0"])) < 1e-5 * scale


def test_attend_and_append_writes_each_cache_and_attends_as_after_it(kernels):
    """One operation appends a step's keys and values to every sequence's cache and attends: the caches
    after it hold what slice updates would write, nothing else moves, and the output is the attention
    over the updated caches."""
    from pipeline.models.cache import KVCache

    rng = np.random.default_rng(11)
    kv_heads, d, heads = 2, 64, 6
    lengths, cached = [1, 4, 1], [5, 0, 300]  # new tokens per sequence, positions cached before
    caches, reference_k, reference_v = [], [], []
    for n in cached:
        cache = KVCache()
        if n:
            k0 = mx.array(rng.standard_normal((1, kv_heads, n, d)).astype(np.float32))
            v0 = mx.array(rng.standard_normal((1, kv_heads, n, d)).astype(np.float32))
            cache.append(k0, v0)
            mx.eval(cache.keys, cache.values)
        caches.append(cache)
    new_k = rng.standard_normal((sum(lengths), kv_heads, d)).astype(np.float32)
    new_v = rng.standard_normal((sum(lengths), kv_heads, d)).astype(np.float32)
    q = (rng.standard_normal((sum(lengths), heads, d)) * 3).astype(np.float32)
    begin = 0
    for cache, n, c in zip(caches, lengths, cached):
        old_k = np.array(cache.keys[..., :c, :]) if c else np.zeros((1, kv_heads, 0, d), np.float32)
        old_v = np.array(cache.values[..., :c, :]) if c else np.zeros((1, kv_heads, 0, d), np.float32)
        reference_k.append(np.concatenate([old_k, new_k[begin:begin + n].transpose(1, 0, 2)[None]], axis=2))
        reference_v.append(np.concatenate([old_v, new_v[begin:begin + n].transpose(1, 0, 2)[None]], axis=2))
        begin += n
    qmm.set_threads(2)
    out = attention.attend_and_append(kernels, mx.array(q), mx.array(new_k), mx.array(new_v), caches, lengths,
                                      lengths, 0.125)
    mx.eval(out)
    for cache, k, v, n, c in zip(caches, reference_k, reference_v, lengths, cached):
        assert cache.offset == c + n
        assert np.array_equal(np.array(cache.keys[..., :cache.offset, :]), k)
        assert np.array_equal(np.array(cache.values[..., :cache.offset, :]), v)
    want = run(kernels, q, [k[0] for k in reference_k], [v[0] for v in reference_v], lengths,
               [c + n for c, n in zip(cached, lengths)], 0.125)
    assert np.array_equal(np.array(out), want)


def test_appending_never_changes_a_fork_sharing_the_buffer(kernels):
    """A prefix-cache fork is a view of its parent's buffer: appending to either must not write into
    what the other holds, even where the parent first drops positions (rejected drafts) that the fork
    still holds: the shared buffer is copied, not updated in place."""
    from pipeline.models.cache import KVCache

    rng = np.random.default_rng(12)
    parent = KVCache()
    parent.append(mx.array(rng.standard_normal((1, 2, 10, 64)).astype(np.float32)),
                  mx.array(rng.standard_normal((1, 2, 10, 64)).astype(np.float32)))
    mx.eval(parent.keys, parent.values)
    child = parent.prefix(10)
    held = np.array(child.keys), np.array(child.values)
    parent.offset -= 2  # two rejected positions: the next append writes position 8, which the fork holds
    for cache in (parent, child):
        step = [mx.array(rng.standard_normal((1, 2, 64)).astype(np.float32)) for _ in range(2)]
        out = attention.attend_and_append(kernels, mx.array(rng.standard_normal((1, 4, 64)).astype(np.float32)),
                                          *step, [cache], [1], [1], 0.125)
        mx.eval(out, cache.keys, cache.values)
    assert np.array_equal(np.array(child.keys[..., :10, :]), held[0])
    assert np.array_equal(np.array(child.values[..., :10, :]), held[1])
    assert parent.offset == 9 and child.offset == 11
