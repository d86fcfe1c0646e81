"""IQ4_NL's, IQ4_XS's and Q6_K's int8 products in column and row tiles (kernels/gguf_kernels.cpp nl_product,
xs_product, q6_product: AVX-512 VNNI + VBMI builds) give the bits of the per-row path they replace (int8_tile,
reached with gguf_iq4_tiled(False)) at every row count, shape and thread count, and both equal a float64 product of
the gguf package's dequantization times x rounded as ggml's q8_0 / q8_K round it (test_gguf_iquants.rounded).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import gguf
from test_gguf_inplace import random_blocks
from test_gguf_iquants import held, rounded
from pipeline.kernels import qmm

# the tiles' row counts and their remainders: 1 and 2 (Q6_K: per row), 3, 4, 7, 8 (a tile of 4 and its remainders),
# 15, 16, 17, 33 (Q6_K: past a pass of 32 rows), 64
ROW_COUNTS = (1, 2, 3, 4, 7, 8, 15, 16, 17, 33, 64)
# (n, k): n not a multiple of the tiles' 4, 8 or 16 columns (Q6_K: 16 a tile, 77 = 4 x 16 + 13, 13 and 9 fewer than
# one tile, 21 one and 5); IQ4_NL with an odd number of blocks (96, 544: the last block alone) and fewer than one
# group of 8 pairs (96); IQ4_XS and Q6_K with 1, 4, 6 and 8 super-blocks; the first shape big enough at 64 rows
# (4M multiply-adds) for 2 threads to share it
SHAPES = {QT.IQ4_NL: ((77, 1024), (13, 96), (9, 544), (21, 1536)), QT.IQ4_XS: ((77, 1024), (13, 256), (21, 1536), (11, 2048)),
          QT.Q6_K: ((77, 1024), (13, 256), (21, 1536), (32, 2048), (9, 512))}
TYPE_IDS = {QT.Q6_K: 14, QT.IQ4_NL: 20, QT.IQ4_XS: 23}


@pytest.fixture
def tiled(kernels):
    if not hasattr(kernels, "gguf_iq4_tiled"):
        pytest.skip("kernels without gguf_iq4_tiled")
    yield kernels
    kernels.gguf_iq4_tiled(True)


def _both(kernels, x, arrays, type_id):
    """(tiled, per-row) int8 products of x with the held arrays."""
    codes, scales, *d = arrays
    out = []
    for on in (True, False):
        kernels.gguf_iq4_tiled(on)
        out.append(np.array(kernels.gguf_matmul(mx.array(x), codes, scales, type_id, True, d[0] if d else None)))
    kernels.gguf_iq4_tiled(True)
    return out


@pytest.mark.parametrize("qtype", (QT.IQ4_NL, QT.IQ4_XS, QT.Q6_K), ids=lambda t: t.name)
def test_tiles_give_the_per_row_bits_and_the_float64_truth(tiled, qtype):
    """Random block bytes (every code, fp16 scales of every size, every IQ4_XS 6-bit scale, every Q6_K int8 scale):
    the tiled product equals the per-row one bit for bit (np.array_equal) at every row count of ROW_COUNTS, on 1 and
    2 threads, and both are the float64 truth within float32 accumulation (measured up to 6e-8 relative, bound
    2e-7)."""
    rng = np.random.default_rng(11)
    block = 32 if qtype == QT.IQ4_NL else 256
    type_id = TYPE_IDS[qtype]
    try:
        for n, k in SHAPES[qtype]:
            raw = random_blocks(qtype, n, k, rng)
            w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
            arrays = held(raw, qtype)
            x_all = rng.normal(0, 1, (max(ROW_COUNTS), k)).astype(np.float32)
            x_all[1, k - block:] = 0 if k > block else 1e-30  # an all-zero activation block (a tiny one if alone)
            x_all[2, :7] *= 1e4  # one block's scale far above the others'
            for threads in (1, 2):
                qmm.set_threads(threads)
                for rows in ROW_COUNTS:
                    x = x_all[:rows]
                    got, per_row = _both(tiled, x, arrays, type_id)
                    assert np.array_equal(got, per_row), (n, k, threads, rows)
                    truth = rounded(x, block) @ w.T
                    error = (np.abs(got - truth) / (np.abs(x).astype(np.float64) @ np.abs(w).T)).max()
                    assert error < 2e-7, (n, k, threads, rows, error)
                    if rows == max(ROW_COUNTS):  # batch invariance: each row the bits of that row alone
                        for r in (0, 5, rows - 1):
                            alone, _ = _both(tiled, x[r:r + 1], arrays, type_id)
                            assert np.array_equal(alone[0], got[r]), (n, k, threads, r)
    finally:
        qmm.set_threads()  # the BLAS's, as before


def test_non_finite_activations_as_the_per_row_path(tiled):
    """x with infinities and NaN: the tiled rounding (vector max, round, clamp) treats them as round_rows does."""
    rng = np.random.default_rng(12)
    for qtype, type_id in TYPE_IDS.items():
        raw = random_blocks(qtype, 16, 512, rng)
        x = rng.normal(0, 1, (5, 512)).astype(np.float32)
        x[0, 3], x[1, 40], x[2, 300], x[3, 0] = np.inf, -np.inf, np.nan, 1e-42
        got, per_row = _both(tiled, x, held(raw, qtype), type_id)
        np.testing.assert_array_equal(got, per_row)
