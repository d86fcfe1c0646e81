"""GGML tensor types -> what MLX holds, row block by row block, from the raw bytes of a GGUF file.

Exact types. Wherever a GGML block is "scale x q + offset" over 32 consecutive values, MLX's affine
quantization (group size 32) represents it bit for bit: the codes are repacked, the scales and
offsets become MLX scales and biases, held in float32 (every value below is exact in float32):

    Q4_0  w = d (q - 8)            q 0..15   -> 4 bits, scale d, bias -8 d
    Q4_1  w = d q + m              q 0..15   -> 4 bits, scale d, bias m
    Q5_0  w = d (q - 16)           q 0..31   -> 5 bits, scale d, bias -16 d
    Q5_1  w = d q + m              q 0..31   -> 5 bits, scale d, bias m
    Q8_0  w = d q                  q -128..127, stored as q + 128 -> 8 bits, scale d, bias -128 d
    Q4_K  w = (d sc_j) q - (dmin m_j)  per 32-value sub-block j of a 256-value super-block,
                                   sc_j, m_j 6-bit, q 0..15  -> 4 bits, scale d sc_j, bias -dmin m_j
    Q5_K  the same with q 0..31    -> 5 bits
          (Q4_K and Q5_K so only with --quantize or without pipeline's kernels: else BLOCKS, below)
    MXFP4 w = 2^(e - 127) e2m1(q)  per 32 values -> MLX's mxfp4 mode (uint8 scales e, no biases)

(d, m, dmin are fp16: an 11-bit significand times a 6-bit sub-block scale has at most 17 bits,
so d sc_j is exact in float32 but generally not in fp16; and MLX's s q + b then rounds exactly
once, as gguf's own dequantizer does.)

Types held in their own blocks (NATIVE: IQ4_NL, IQ4_XS). Where pipeline's kernels are built and no
--quantize asks otherwise, a layer's matrix of these types is held as the file's bytes, split per row
into the blocks' 4-bit codes and their scales (native_arrays), and its products run on them as llama.cpp
computes (kernels/gguf_kernels.cpp, through kernels/qmm.py): no value changes. The module looks like
MLX's mxfp4 (4-bit codes, one scale per 32, no biases); its scales' dtype says the type (uint16: IQ4_NL's
fp16 d per 32, as bits, which no cast to --dtype touches; int8: IQ4_XS's 8 header bytes per 256). A Q6_K
matrix (256 values: ql[128], qh[64], int8 scales[16], fp16 d) has no split into those shapes (210 bytes per
256 values): it looks like MLX's 6-bit affine with groups of 128, its weight the 192 code bytes, its scales
int64 (the 16 int8 scales, 2 per 256), its biases uint8 (d's 2 bytes). Embeddings, the LM head and expert
stacks of those types are held so too (NATIVE_ROWS: rows dequantized by kernels/gguf_rows.py, stacks gathered by
gguf_kernels.cpp). The BLOCKS types (K-quants Q2_K, Q3_K, Q4_K, Q5_K, ternary TQ1_0, TQ2_0, the grid i-quants) are held as
the file's row bytes verbatim, one uint8 array and the type id, in layer matrices, ends and expert stacks
([experts, rows, row bytes], each token's experts gathered by kernels_common.h's gathered product) alike.

Re-quantized types: without pipeline's kernels, with --quantize, and for NVFP4 and MLA's kv_b. Q6_K, Q3_K and Q2_K
scale 16-value sub-blocks, which no MLX group size (32, 64, 128) carries, and the i-quants look values up in
codebooks: they are dequantized by the
`gguf` package's own dequantizers and re-quantized by MLX, a row chunk at a time, so memory stays
near the quantized size. The largest error against the dequantized source is measured on the fly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import build

# GGML type -> (bits, group size, MLX mode) of the MLX layout that holds it exactly.
EXACT = {
    "Q4_0": (4, 32, "affine"), "Q4_1": (4, 32, "affine"), "Q5_0": (5, 32, "affine"), "Q5_1": (5, 32, "affine"),
    "Q8_0": (8, 32, "affine"), "Q4_K": (4, 32, "affine"), "Q5_K": (5, 32, "affine"), "MXFP4": (4, 32, "mxfp4"),
}
# Types the gguf package dequantizes, and the bits they are re-quantized to unless --quantize says: 8 for all,
# the MLX format nearest them that keeps perplexity within 1% of llama.cpp's (4 bits cost IQ4_NL's file 2.3x
# its perplexity, Q2_K's 15%, Q3_K_M's 3.5%: docs/formats.md); the loader says what it costs in memory.
REQUANTIZED = {
    "Q6_K": 8, "Q2_K": 8, "Q3_K": 8, "IQ1_S": 8, "IQ1_M": 8, "IQ2_XXS": 8, "IQ2_XS": 8, "IQ2_S": 8,
    "IQ3_XXS": 8, "IQ3_S": 8, "IQ4_NL": 8, "IQ4_XS": 8, "TQ1_0": 8, "TQ2_0": 8, "NVFP4": 8,
}
# GGML type -> (its ggml type id, the dtype its scales are held in, values per block) for types held in their own
# blocks (see the module docstring): the kernels' `gguf_matmul` takes them (kernels/qmm.py GGUF_NATIVE)
NATIVE = {"IQ4_NL": (20, "U16", 32), "IQ4_XS": (23, "I8", 256), "Q6_K": (14, "I64", 256)}
# NATIVE types whose token embeddings and expert stacks are held in their own blocks too: kernels/gguf_rows.py
# dequantizes their looked-up rows and gguf_kernels.cpp's gathered product takes their stacks (a NATIVE type
# not listed keeps those re-quantized; its LM head, a product, is held in its blocks as its layer matrices)
NATIVE_ROWS = ("IQ4_NL", "IQ4_XS", "Q6_K")
# GGML type -> (its ggml type id, bytes per 256 values) for types held as the file's row bytes verbatim (see the
# module docstring): one uint8 array [rows, row bytes] (an expert stack's [experts, rows, row bytes]) and the type
# id, products and gathered products by the kernels' functions for the type (kernels/qmm.py BLOCK_KERNELS:
# gguf_kquant_kernels.cpp, ...). Checked before NATIVE, EXACT and REQUANTIZED.
BLOCKS = {"Q4_K": (12, 144), "Q5_K": (13, 176), "Q3_K": (11, 110), "Q2_K": (10, 84), "TQ2_0": (35, 66), "TQ1_0": (34, 54)}
BLOCKS.update({"IQ2_XXS": (16, 66), "IQ2_XS": (17, 74), "IQ2_S": (22, 82), "IQ3_XXS": (18, 98), "IQ3_S": (21, 110),
               "IQ1_S": (19, 50), "IQ1_M": (29, 56)})  # the grid i-quants: gguf_iquant_kernels.cpp
# GGML type -> (its ggml type id, bytes per 32 values) for a type held as the file's row bytes only where it is a tied
# embedding (the LM head too: gguf_checkpoint.py decides): one copy, the file's bytes, serves the lookups
# (kernels/gguf_rows.py q8_0) and the head's products (int8_kernels.cpp's gguf_q8_0_matmul, the bits the int8 repack's
# copy gave), where the int8 products held a second, int8 copy for the head (30 MB of SmolLM2's 98 MB Q4_1 file).
TIED_BLOCKS = {"Q8_0": (8, 34)}
# Types whose MLX scales and biases fp16 holds exactly (d, m, or d times a power of two), kept in fp16;
# the K-quants' d x sc_j needs float32.
FP16_SCALES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# Types that are d (q - 2^(bits - 1)): every bias is -2^(bits - 1) times its scale, which the int8 repack does not
# keep (4 and 8 bits: int8_kernels.cpp) and a 5-bit matrix does not hold (Q5_0: kernels/qmm.py hold_symmetric,
# its float16 d and codes only, the file's 22 bytes per 32 values; the products compute the biases).
SYMMETRIC_TYPES = ("Q4_0", "Q5_0", "Q8_0")
# A converted folder lists under this key of its config.json the modules held exactly from SYMMETRIC_TYPES
# (gguf_convert.py writes it), for the planner (planner/stored_formats.py), which reads no weights.
SYMMETRIC_KEY = "pipeline_symmetric_modules"
# Float types, read as they are (numpy dtype to read the bytes as; BF16 as raw uint16).
FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
INTEGERS = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}
SUPPORTED = (*FLOATS, *EXACT, *REQUANTIZED)

# About this many float32 values are decoded at once: bounds the memory a tensor costs beyond
# its quantized size while it loads (a DeepSeek expert stack is 3.7e9 values).
CHUNK_VALUES = 1 << 24


@dataclass(frozen=True)
class Layout:
    """How a GGUF tensor is held once loaded: floats as stored, or MLX-quantized."""
    kind: str  # "float", "exact", "requantized", "native" (the file's blocks, NATIVE)
    bits: int = 0
    group_size: int = 0
    mode: str = "affine"

    @property
    def quantized(self) -> bool:
        return self.kind != "float"


def layout(ggml_type: str, cols: int, requantize_bits: int | None, group_size: int, native: bool = False) -> Layout | None:
    """The layout of a `ggml_type` matrix with rows of `cols` values (None: not supported).
    `requantize_bits`/`group_size`: --quantize and --group-size, for the types that cannot map
    exactly (exact types ignore them). native: a NATIVE type may stay in its own blocks (the caller
    knows the kernels take this matrix; --quantize not given)."""
    if ggml_type in FLOATS or ggml_type in INTEGERS:
        return Layout("float")
    if native and ggml_type in BLOCKS and not requantize_bits:
        return Layout("native", 8, 256, "blocks")
    if native and ggml_type in NATIVE and not requantize_bits:
        return Layout("native", 6, 128, "affine") if ggml_type == "Q6_K" else Layout("native", 4, 32, "mxfp4")
    if ggml_type in EXACT:
        bits, group, mode = EXACT[ggml_type]
        return Layout("exact", bits, group, mode)
    if ggml_type in REQUANTIZED:
        group = group_size if cols % group_size == 0 else 32
        return Layout("requantized", requantize_bits or REQUANTIZED[ggml_type], group)
    return None


def block_type(ggml_type: str) -> tuple[int, int, int]:
    """(ggml type id, bytes per block, values per block) of a type held as the file's row bytes (BLOCKS, TIED_BLOCKS)."""
    if ggml_type in TIED_BLOCKS:
        return (*TIED_BLOCKS[ggml_type], 32)
    return (*BLOCKS[ggml_type], 256)


def packed_shapes(rows: tuple[int, ...], cols: int, lay: Layout, ggml_type: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """suffix -> (shape, safetensors-style dtype) of the arrays an MLX-quantized tensor becomes."""
    if lay.mode == "blocks":  # the file's row bytes, and the type (BLOCKS, TIED_BLOCKS)
        _, nbytes, values = block_type(ggml_type)
        return {"weight": ((*rows, cols // values * nbytes), "U8"), "ggml_type": ((1,), "I32")}
    shapes = {"weight": ((*rows, cols * lay.bits // 32), "U32")}
    if lay.kind == "native" and ggml_type == "Q6_K":
        shapes["scales"] = ((*rows, cols // 128), "I64")
        shapes["biases"] = ((*rows, cols // 128), "U8")
    elif lay.kind == "native":
        shapes["scales"] = ((*rows, cols // 32), NATIVE[ggml_type][1])
    elif lay.mode == "mxfp4":
        shapes["scales"] = ((*rows, cols // lay.group_size), "U8")
    else:
        dtype = "F16" if ggml_type in FP16_SCALES else "F32"
        shapes["scales"] = ((*rows, cols // lay.group_size), dtype)
        shapes["biases"] = ((*rows, cols // lay.group_size), dtype)
    return shapes


# ---- exact repacking ---------------------------------------------------------------------------------------

def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes [rows, cols] (each < 2**bits) -> MLX's packed uint32 [rows, cols*bits/32]: a row is a
    little-endian bit stream, value j at bits [bits*j, bits*(j+1))."""
    rows, cols = q.shape
    if bits == 8:
        packed = q.astype(np.uint8)
    elif bits == 4:
        q = q.astype(np.uint8)
        packed = q[:, 0::2] | (q[:, 1::2] << np.uint8(4))
    else:
        stream = (q[..., None].astype(np.uint8) >> np.arange(bits, dtype=np.uint8)) & np.uint8(1)
        packed = np.packbits(stream.reshape(rows, cols * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").reshape(rows, cols * bits // 32)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block, as float32 [rows, blocks]."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML's 32-value nibble block: byte i holds value i (low nibble) and value i + 16 (high)."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _repack_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML nibble blocks [rows, blocks, 16] straight to MLX 4-bit words [rows, blocks * 4]: MLX byte j
    holds values 2j, 2j+1, i.e. the low (j < 8) or high nibbles of GGML bytes 2j mod 16 and the next."""
    rows = qs.shape[0]
    pairs = np.ascontiguousarray(qs).view("<u2")  # GGML bytes 2k, 2k+1 as one little-endian uint16
    packed = np.empty(qs.shape, np.uint8)
    low = pairs & np.uint16(0x0F)  # low nibbles of the pair -> one byte
    low |= (pairs >> np.uint16(4)) & np.uint16(0xF0)
    packed[..., :8] = low
    high = (pairs >> np.uint16(4)) & np.uint16(0x0F)  # high nibbles of the pair -> one byte
    high |= (pairs >> np.uint16(8)) & np.uint16(0xF0)
    packed[..., 8:] = high
    return packed.reshape(rows, -1).view("<u4")


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 bytes, bit j (little-endian) is the fifth bit of value j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the eight 6-bit (scale, min) pairs packed in 12 bytes (ggml's get_scale_min_k4):
    pairs 0-3 in the low 6 bits of bytes 0-3 / 4-7; pairs 4-7 take their low 4 bits from the
    nibbles of bytes 8-11 and their top 2 bits from the top of bytes 0-3 / 4-7."""
    lo, mid, hi = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([lo & np.uint8(63), (hi & np.uint8(15)) | ((lo >> np.uint8(6)) << np.uint8(4))], axis=-1)
    mn = np.concatenate([mid & np.uint8(63), (hi >> np.uint8(4)) | ((mid >> np.uint8(6)) << np.uint8(4))], axis=-1)
    return sc, mn


# GGML type -> its number, for the types pipeline's kernel repacks in one pass (requantize_kernels.cpp)
REPACKED = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12}


def native_kernels() -> bool:
    """Whether NATIVE types may stay in their own blocks: pipeline's kernels, which compute them, are
    expected in this process (build.expected(): loads no MLX, for the planner)."""
    return build.expected()


def repacker():
    """The kernels' extension where it is built (it repacks REPACKED types in one pass, without the
    GIL), else None: numpy does it. Called once before the decoding threads start."""
    module = build.load().module
    return module if module is not None and hasattr(module, "gguf_repack") else None


def decode_exact(raw: np.ndarray, ggml_type: str, kernels=None,
                 weight_out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGML rows (uint8 [rows, bytes per row]) -> MLX (packed uint32 weight, scales, biases or None),
    the arrays `mx.quantize` would give for the same values (see the module docstring); scales and
    biases in fp16 for FP16_SCALES types, else float32. `kernels`: repacker()'s module, or None.
    weight_out: C-contiguous uint8 [rows, packed bytes per row] the weight is written into (a slice of
    the whole tensor's, so that its pieces need no joining); the weight returned is a view of it."""
    if kernels is not None and ggml_type in REPACKED:
        rows, bits = raw.shape[0], EXACT[ggml_type][0]
        values = raw.shape[1] // {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144}[ggml_type] * (
            256 if ggml_type == "Q4_K" else 32)
        packed = np.empty((rows, values * bits // 8), np.uint8) if weight_out is None else weight_out
        raw = np.ascontiguousarray(raw)
        # fp16 straight from the kernel (the rule below); float32 where a bias overflows it
        for dtype in ((np.float16, np.float32) if ggml_type in FP16_SCALES else (np.float32,)):
            scales, biases = np.empty((rows, values // 32), dtype), np.empty((rows, values // 32), dtype)
            if kernels.gguf_repack(raw, REPACKED[ggml_type], packed, scales, biases):
                break
        return packed.view("<u4"), scales, biases
    weight, scales, biases = _decode_exact(raw, ggml_type)
    if weight_out is not None:
        weight_out[...] = np.ascontiguousarray(weight).view(np.uint8).reshape(weight_out.shape)
        weight = weight_out.view("<u4")
    if ggml_type in FP16_SCALES:
        # exact: fp16 values, or fp16 times 8, 16 or 128 (only the exponent changes) unless that overflows,
        # where float32 keeps them (no real weights come near: d > 511)
        with np.errstate(over="ignore"):
            half_scales, half_biases = scales.astype(np.float16), biases.astype(np.float16)
        if np.isfinite(half_biases).all():
            return weight, half_scales, half_biases
    return weight, scales, biases


def _decode_exact(raw: np.ndarray, ggml_type: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    rows = raw.shape[0]
    if ggml_type in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "MXFP4": 17}[ggml_type]
        blocks = raw.reshape(rows, -1, size)
        if ggml_type == "MXFP4":
            return _repack_nibbles(blocks[..., 1:]), np.ascontiguousarray(blocks[..., 0]), None
        d = _f16(blocks, 0)
        if ggml_type == "Q8_0":
            q = blocks[..., 2:] ^ np.uint8(0x80)  # int8 q -> q + 128: flip the top bit
            return pack_bits(q.reshape(rows, -1), 8), d, d * np.float32(-128)
        if ggml_type == "Q4_0":
            return _repack_nibbles(blocks[..., 2:]), d, d * np.float32(-8)
        if ggml_type == "Q4_1":
            return _repack_nibbles(blocks[..., 4:]), d, _f16(blocks, 2)
        start = 2 if ggml_type == "Q5_0" else 4
        q = _nibbles(blocks[..., start + 4:]) | (_high_bits(blocks[..., start:start + 4]) << np.uint8(4))
        bias = d * np.float32(-16) if ggml_type == "Q5_0" else _f16(blocks, 2)
        return pack_bits(q.reshape(rows, -1), 5), d, bias
    if ggml_type in ("Q4_K", "Q5_K"):
        blocks = raw.reshape(rows, -1, 144 if ggml_type == "Q4_K" else 176)
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _k_scales(blocks[..., 4:16])
        qs = blocks[..., -128:].reshape(rows, -1, 4, 32)  # four 64-value chunks of 32 bytes
        # chunk c holds sub-block 2c in its low nibbles and sub-block 2c+1 in its high nibbles
        q = np.stack([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-2)  # [rows, blocks, 4, 2, 32]
        if ggml_type == "Q5_K":
            qh = blocks[..., 16:48]  # bit j of byte l: the fifth bit of value l of sub-block j
            high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)  # [rows, blocks, 8, 32]
            q = q | (high.reshape(q.shape) << np.uint8(4))
        scales = (d[..., None] * sc.astype(np.float32)).reshape(rows, -1)
        biases = -(dmin[..., None] * mn.astype(np.float32)).reshape(rows, -1)
        return pack_bits(q.reshape(rows, -1), 4 if ggml_type == "Q4_K" else 5), scales, biases
    raise ValueError(f"{ggml_type} does not map exactly onto MLX")


def native_arrays(raw: np.ndarray, ggml_type: str) -> tuple[np.ndarray, ...]:
    """GGML rows of a NATIVE type (uint8 [rows, bytes per row]) -> (codes uint32 [rows, cols / 8], scales
    [rows, cols / 32]): the same bytes, the blocks' codes apart from their scales (see the module docstring
    and kernels/gguf_kernels.cpp): IQ4_NL blocks are d (fp16) + 16 code bytes, IQ4_XS super-blocks 8 header
    bytes (d, scales_h, scales_l) + 128 code bytes. Q6_K -> (codes uint32 [rows, 3 cols / 16]: ql and qh,
    scales int64 [rows, cols / 128]: the 16 int8 scales, d uint8 [rows, cols / 128]: d's bytes)."""
    rows = raw.shape[0]
    if ggml_type in BLOCKS or ggml_type in TIED_BLOCKS:  # the row bytes verbatim, and the type id (qmm.GGUFBlocksLinear)
        return np.ascontiguousarray(raw), np.array([block_type(ggml_type)[0]], np.int32)
    if ggml_type == "Q6_K":
        blocks = raw.reshape(rows, -1, 210)
        codes = np.ascontiguousarray(blocks[..., :192]).reshape(rows, -1).view("<u4")
        scales = np.ascontiguousarray(blocks[..., 192:208]).reshape(rows, -1).view("<i8")
        return codes, scales, np.ascontiguousarray(blocks[..., 208:]).reshape(rows, -1)
    header = 2 if ggml_type == "IQ4_NL" else 8
    blocks = raw.reshape(rows, -1, header + (16 if ggml_type == "IQ4_NL" else 128))
    codes = np.ascontiguousarray(blocks[..., header:]).reshape(rows, -1).view("<u4")
    scales = np.ascontiguousarray(blocks[..., :header]).reshape(rows, -1)
    return codes, scales.view("<u2") if ggml_type == "IQ4_NL" else scales.view(np.int8)


def dequantize(raw: np.ndarray, ggml_type: str) -> np.ndarray:
    """GGML rows -> float32 [rows, cols], by the gguf package's own dequantizers."""
    import gguf  # here, not at the top: ~40 ms to import, and every command's parser loads this module

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type]).astype(np.float32, copy=False)


def requantize(raw: np.ndarray, ggml_type: str, bits: int, group_size: int):
    """GGML rows -> MLX affine (weight, scales, biases) as mx arrays, the largest |error| of the
    re-quantized values against the dequantized source, and the largest |value| of the source."""
    import mlx.core as mx  # here, not at the top: `pipeline plan` loads this module and no MLX

    w = mx.array(dequantize(raw, ggml_type))
    q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    error = mx.abs(mx.dequantize(q, s, b, group_size=group_size, bits=bits) - w).max()
    largest = mx.abs(w).max()
    mx.eval(q, s, b, error, largest)
    return q, s, b, float(error.item()), float(largest.item())
