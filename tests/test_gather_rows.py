"""Gathered products (mixture-of-experts) given x's distinct rows and a row index per (token, expert) pair
(qmm.gather_qmm -> the kernels' lhs form: int8_kernels.cpp rounds each row once, qmm_kernels.cpp permutes it
once). The truth is the same kernel on the materialized broadcast (each pair's own copy of its row, the path
before lhs indices) and each pair alone through the dense product of its expert: the very bits, for decode
(1 token x 8 experts, 1 rank's 256 features and --tensor-parallel 2's slices of 128), prefill (many tokens,
repeated experts), explicit lhs in any order with repeats, float32 and int8 activations; and the gathered gate
and up with their SwiGLU in one int8 operation (int8_gather_swiglu, SwitchGLU's path) against the separate ones."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from pipeline.checkpoints.int8_repack import use_int8
from pipeline.kernels import build, qmm
from pipeline.models.experts import SwitchGLU
from test_quant_kernels import quantized

GATHER_SWIGLU = qmm.gather_swiglu


def stack(kernels, rng, experts, n, k, int8, bits=4, group_size=64):
    w, scales, biases = quantized(rng, n, k, bits, group_size, "float16" if int8 else "float32", experts=experts)
    if int8:
        w, scales, biases = kernels.int8_repack(w, scales, biases, group_size, bits)
    return (w, scales, biases), group_size, bits


def product(kernels, int8):
    return kernels.int8_gather_qmm if int8 else kernels.gather_qmm


def alone(kernels, int8, row, weights, e, group_size, bits):
    """One row times expert e's matrix through the dense (not gathered) product."""
    dense = kernels.int8_matmul if int8 else kernels.quantized_matmul
    return np.array(dense(row, *(a[e] for a in weights), group_size, bits))[0]


CASES = {  # name: (tokens, experts, chosen per token, n, k)
    "decode, 1 rank": (1, 16, 8, 256, 2048),
    "decode, T=2 slice": (1, 16, 8, 128, 2048),
    "decode, 3 sequences": (3, 16, 8, 32, 256),
    "prefill": (13, 6, 4, 48, 256),  # 52 pairs over 6 experts: every expert repeated
}


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "float32"])
@pytest.mark.parametrize("case", list(CASES))
def test_gather_qmm_equals_the_materialized_broadcast(kernels, case, int8):
    tokens, experts, top, n, k = CASES[case]
    rng = np.random.default_rng(len(case) + 7 * int8)
    weights, group_size, bits = stack(kernels, rng, experts, n, k, int8)
    x = mx.array(rng.standard_normal((tokens, 1, 1, k)).astype(np.float32))  # as SwitchGLU calls it
    indices = np.stack([rng.permutation(experts)[:top] for _ in range(tokens)]).astype(np.uint32)
    before = build.load().used["int8" if int8 else "pipeline"]
    got = qmm.gather_qmm(x, *weights, rhs_indices=mx.array(indices), group_size=group_size, bits=bits, int8=int8)
    assert build.load().used["int8" if int8 else "pipeline"] == before + 1
    assert got.shape == (tokens, top, 1, n)
    got = np.array(got).reshape(tokens * top, n)
    flat_x = mx.broadcast_to(x, (tokens, top, 1, k)).reshape(-1, k)  # each pair's own copy
    old = np.array(product(kernels, int8)(flat_x, *weights, mx.array(indices.reshape(-1)), group_size, bits))
    assert np.array_equal(got, old)
    for p, e in enumerate(indices.reshape(-1)):
        assert np.array_equal(got[p], alone(kernels, int8, x[p // top, 0], weights, int(e), group_size, bits)), p


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "float32"])
def test_lhs_indices_in_any_order(kernels, int8):
    """Pairs whose rows come in any order, repeated, some rows unused, experts unsorted: pair p is row lhs[p]."""
    rng = np.random.default_rng(11)
    rows, pairs, experts, n, k = 9, 70, 5, 32, 256
    weights, group_size, bits = stack(kernels, rng, experts, n, k, int8, bits=8, group_size=32)
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    x[4, :32] = 0  # a chunk of zeros (int8: d = 0)
    lhs = rng.integers(0, rows - 1, pairs).astype(np.uint32)  # the last row unused
    chosen = rng.integers(0, experts, pairs).astype(np.uint32)
    run = product(kernels, int8)
    got = np.array(run(mx.array(x), *weights, mx.array(chosen), group_size, bits, mx.array(lhs)))
    assert got.shape == (pairs, n)
    old = np.array(run(mx.array(x[lhs]), *weights, mx.array(chosen), group_size, bits))
    assert np.array_equal(got, old)
    for p in range(pairs):
        assert np.array_equal(got[p], alone(kernels, int8, mx.array(x[lhs[p]:lhs[p] + 1]), weights, int(chosen[p]),
                                            group_size, bits)), p
    int32 = np.array(run(mx.array(x), *weights, mx.array(chosen.astype(np.int32)), group_size, bits,
                         mx.array(lhs.astype(np.int32))))
    assert np.array_equal(int32, got)


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "float32"])
def test_lhs_of_the_wrong_length_is_refused(kernels, int8):
    rng = np.random.default_rng(2)
    weights, group_size, bits = stack(kernels, rng, 3, 16, 128, int8)
    x, chosen = mx.zeros((2, 128)), mx.array(np.array([0, 1, 2], np.uint32))
    with pytest.raises(ValueError, match="per pair"):
        product(kernels, int8)(x, *weights, chosen, group_size, bits, mx.array(np.array([0, 1], np.uint32)))


def test_bfloat16_activations_keep_their_dtype(kernels):
    rng = np.random.default_rng(4)
    weights, group_size, bits = stack(kernels, rng, 16, 32, 256, True)
    x = mx.array(rng.standard_normal((1, 1, 1, 256)).astype(np.float32)).astype(mx.bfloat16)
    indices = mx.array(rng.permutation(16)[:8][None].astype(np.uint32))
    got = qmm.gather_qmm(x, *weights, rhs_indices=indices, group_size=group_size, bits=bits, int8=True)
    assert got.dtype == mx.bfloat16 and got.shape == (1, 8, 1, 32)
    old = kernels.int8_gather_qmm(mx.broadcast_to(x, (1, 8, 1, 256)).reshape(-1, 256).astype(mx.float32), *weights,
                                  indices.reshape(-1), group_size, bits)
    assert np.array_equal(np.array(got.astype(mx.float32)).reshape(8, 32), np.array(old.astype(mx.bfloat16).astype(mx.float32)))


@pytest.mark.parametrize("case", list(CASES))
def test_gather_swiglu_equals_the_separate_operations(kernels, case):
    """int8_gather_swiglu (gate and up in one call, each row rounded once, the SwiGLU inside): the bits of the
    two gathered products and SwitchGLU.activate (nn.silu(gate) * up), with and without lhs indices."""
    tokens, experts, top, n, k = CASES[case]
    rng = np.random.default_rng(len(case) + 3)
    gate, group_size, bits = stack(kernels, rng, experts, n, k, True)
    up, _, _ = stack(kernels, rng, experts, n, k, True)
    x = mx.array(rng.standard_normal((tokens, k)).astype(np.float32))
    chosen = mx.array(np.stack([rng.permutation(experts)[:top] for _ in range(tokens)]).reshape(-1).astype(np.uint32))
    lhs = mx.array(np.repeat(np.arange(tokens), top).astype(np.uint32))
    g = kernels.int8_gather_qmm(x, *gate, chosen, group_size, bits, lhs)
    u = kernels.int8_gather_qmm(x, *up, chosen, group_size, bits, lhs)
    want = np.array(SwitchGLU.activate(None, g, u))
    ws, ss, bs = zip(gate, up)
    got = np.array(kernels.int8_gather_swiglu(x, list(ws), list(ss), list(bs), chosen, group_size, bits, lhs))
    assert np.array_equal(got, want)
    flat = x[lhs]  # each pair's own row: the form without lhs
    assert np.array_equal(np.array(kernels.int8_gather_swiglu(flat, list(ws), list(ss), list(bs), chosen, group_size,
                                                              bits)), want)


class UnfusedSwitchGLU(SwitchGLU):
    def activate(self, gate: mx.array, up: mx.array) -> mx.array:  # the same code, not SwitchGLU's: never fused
        return nn.silu(gate) * up


@pytest.mark.parametrize("tokens", [1, 3, 20])  # decode, a few sequences, a prefill (sorted: 160 pairs)
def test_switch_glu_fused_gives_the_unfused_bits(kernels, monkeypatch, tokens):
    mx.random.seed(tokens)
    hidden, inter, experts, top = 256, 64, 16, 8
    fused = SwitchGLU(hidden, inter, experts)
    nn.quantize(fused, group_size=64, bits=4)
    plain = UnfusedSwitchGLU(hidden, inter, experts)
    nn.quantize(plain, group_size=64, bits=4)
    plain.update(fused.parameters())
    assert use_int8(fused) == use_int8(plain) == 3
    calls = []
    monkeypatch.setattr(qmm, "gather_swiglu", lambda *a: calls.append(1) or GATHER_SWIGLU(*a))
    x = mx.random.normal((tokens, hidden))
    indices = mx.array(np.stack([np.random.default_rng(t).permutation(experts)[:top] for t in range(tokens)])
                       .astype(np.uint32))
    got, want = np.array(fused(x, indices)), np.array(plain(x, indices))
    assert calls == [1]
    assert got.shape == want.shape == (tokens, top, hidden)
    assert np.array_equal(got, want)
