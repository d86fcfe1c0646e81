"""Rows of a GGUF tensor held in its own blocks (checkpoints/quants.py native_arrays), dequantized exactly in
MLX operations: what an embedding held so returns for the tokens it looks up (kernels/qmm.py GGUFEmbedding).

Each value is computed as gguf_kernels.cpp's float products and the `gguf` package's dequantizers compute it,
in float32, where every step is exact (an fp16 scale times a small integer):
    IQ4_NL  w = d * KVALUES[q]                    d fp16 per 32 values, q a nibble
    IQ4_XS  w = (d * (ls_j - 32)) * KVALUES[q]    d fp16 per 256, ls_j 6 bits per 32 (4 in scales_l, 2 in scales_h)
    Q6_K    w = (d * sc_j) * (q - 32)             d fp16 per 256, sc_j int8 per 16, q 6 bits (ql's nibble, qh's 2 bits)
A type made native without a dequantizer here keeps its embedding re-quantized (quants.NATIVE_ROWS lists these).
"""

from __future__ import annotations

import mlx.core as mx

# ggml's kvalues_iq4nl (ggml-common.h): the 16 values an IQ4 code stands for
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _bytes(a: mx.array, per: int) -> mx.array:
    """a's bytes as uint8 [..., groups, per] (a row-major view of whatever integer dtype holds them)."""
    b = mx.view(a, mx.uint8)
    return b.reshape(*b.shape[:-1], b.shape[-1] // per, per)


def _halves(pairs: mx.array) -> mx.array:
    """uint8 [..., 2] little-endian fp16 bits -> float32 [...]."""
    bits = pairs[..., 0].astype(mx.uint16) | (pairs[..., 1].astype(mx.uint16) << 8)
    return mx.view(bits, mx.float16).astype(mx.float32)


def _iq4(codes: mx.array, block_scales: mx.array) -> mx.array:
    """IQ4 code bytes and one float32 scale per 32 values [..., k / 32] -> float32 [..., k]."""
    qs = _bytes(codes, 16)  # [..., blocks, 16]: byte i holds value i (low nibble) and value i + 16 (high)
    index = mx.concatenate([qs & 15, qs >> 4], axis=-1).astype(mx.uint32)
    w = mx.array(KVALUES, mx.float32)[index] * block_scales[..., None]
    return w.reshape(*w.shape[:-2], -1)


def iq4_nl(codes: mx.array, scales: mx.array, d: mx.array | None = None) -> mx.array:
    return _iq4(codes, mx.view(scales, mx.float16).astype(mx.float32))


def iq4_xs(codes: mx.array, scales: mx.array, d: mx.array | None = None) -> mx.array:
    head = _bytes(scales, 8)  # [..., super-blocks, 8]: d (fp16), scales_h (uint16), scales_l[4]
    high = (head[..., 2].astype(mx.uint32) | (head[..., 3].astype(mx.uint32) << 8))[..., None]
    j = mx.arange(8, dtype=mx.uint32)
    low = (head[..., 4:8].astype(mx.uint32)[..., j // 2] >> (4 * (j % 2))) & 15
    ls = (low | (((high >> (2 * j)) & 3) << 4)).astype(mx.int32) - 32
    block_scales = _halves(head[..., 0:2])[..., None] * ls.astype(mx.float32)  # [..., super-blocks, 8]
    return _iq4(codes, block_scales.reshape(*block_scales.shape[:-2], -1))


def q6_k(codes: mx.array, scales: mx.array, d: mx.array) -> mx.array:
    blocks = _bytes(codes, 192)  # [..., S, 192]: ql[128] then qh[64], each in two halves of 128 values
    ql = blocks[..., :128].reshape(*blocks.shape[:-1], 2, 2, 32)  # [half, c % 2, l]
    qh = blocks[..., 128:].reshape(*blocks.shape[:-1], 2, 32)  # [half, l]
    low = mx.stack([ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], axis=-2)
    high = mx.stack([(qh >> (2 * c)) & 3 for c in range(4)], axis=-2)  # [..., S, half, c, l]
    q = ((low | (high << 4)).astype(mx.int32) - 32).astype(mx.float32)
    sc = _bytes(scales, 16).view(mx.int8).astype(mx.float32)  # [..., S, 16]: sub-block 8 half + 2 c + l // 16
    s = _halves(_bytes(d, 2))[..., None] * sc  # d * sc_j, as the kernel
    w = s.reshape(*s.shape[:-1], 2, 4, 2, 1) * q.reshape(*q.shape[:-1], 2, 16)
    return w.reshape(*w.shape[:-5], -1)


def q8_0(blocks: mx.array) -> mx.array:
    """Rows of Q8_0 held as the file's row bytes (uint8 [..., k / 32 * 34]: per 32 values d fp16, q[32] int8) ->
    float32 [..., k], w = d q: exact, the values MLX's 8-bit layout of the same blocks gave (s (q + 128) - 128 s)."""
    b = blocks.reshape(*blocks.shape[:-1], blocks.shape[-1] // 34, 34)
    q = b[..., 2:].astype(mx.int16)
    q = mx.where(q >= 128, q - 256, q).astype(mx.float32)
    w = _halves(b[..., 0:2])[..., None] * q
    return w.reshape(*w.shape[:-2], -1)


# ggml type id -> the dequantizer of rows held as the file's row bytes (qmm.GGUFBlocksEmbedding) done here
BLOCK_ROWS = {8: q8_0}

# ggml type id (kernels/qmm.py GGUF_NATIVE) -> its rows' dequantizer (codes, scales, d) -> float32 [..., k]
DEQUANTIZERS = {20: iq4_nl, 23: iq4_xs, 14: q6_k}


def dequantize(codes: mx.array, scales: mx.array, d: mx.array | None, type_id: int) -> mx.array:
    """float32 [..., k] of rows held in their own blocks (gathered rows of codes, scales and d alike)."""
    return DEQUANTIZERS[type_id](codes, scales, d)
