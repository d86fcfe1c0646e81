"""Quantized matrix products on CPU at memory speed: pipeline's own kernels (qmm_kernels.cpp) as an
MLX operation, with MLX's kernels as the fallback.

MLX's CPU `quantized_matmul` reads a quantized weight matrix at a few percent of memory bandwidth
and costs about a whole matvec per row, so quantized models decoded 2x slower than with their
weights dequantized to fp32. qmm_kernels.cpp defines a custom MLX Primitive (the route of MLX's
"Custom Extensions" docs) whose `eval_cpu` runs our kernels: products stay lazy nodes of the graph
like any MLX op, evaluated on MLX's CPU stream. A load-ahead shim (as blas.py does for
`cblas_sgemm`) could not do this: libmlx.so does not export its quantized kernels, so there is no
symbol to take over. What the kernels compute, and why each row rounds the same whatever else
shares the call (batch jobs equal `generate`), is in qmm_kernels.cpp's opening comment.

Building. The kernels are one extension with the attention and layer kernels, compiled at first use
and loaded by build.py (which says how, where it is cached and what is refused).

With --int8-activations (checkpoints/int8_repack.py), 4- and 8-bit weights are repacked at load for int8_kernels.cpp:
activations rounded to int8 per 32 inputs, integer dot products (AVX-512 VNNI where the CPU has it),
as llama.cpp computes; 2-6x faster than the float32 kernels, outputs within about 1% of them, and
still the same bits whatever the batch, row count or ISA.

GGUF tensors held in their own blocks (IQ4_NL, IQ4_XS, Q6_K: checkpoints/quants.py NATIVE) look like MLX's
quantized modules whose scales are integers (IQ4: mxfp4 with uint16 scales, IQ4_NL's fp16 bits, or int8,
IQ4_XS's; Q6_K: 6-bit affine, group 128, int64 scales holding the blocks' int8 scales and uint8 biases their
fp16 d); their products run
gguf_kernels.cpp, as llama.cpp computes them: int8 activations rounded per block where this machine's
int8 products are the default (x86-64 with AVX2), float products elsewhere (`gguf_int8`).

Without a compiler, with the build or a check failing, or with `PIPELINE_QMM=0`, every product goes
to MLX's `quantized_matmul` / `gather_qmm` as before, and the stats line says so (`describe()`).
Products the kernels do not cover go there too: activations other than float32, MLX's mxfp4/mxfp8
modes (no biases), gathers with lhs indices, or a default device other than the CPU.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import blas, gguf_rows
from .build import int8_by_default, load, loaded
from .int8_layout import INT8_BLOCK, SYMMETRIC_BITS

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# the scales' dtype of a GGUF tensor held in its own blocks -> its GGML type id (gguf_kernels.cpp)
GGUF_NATIVE = {mx.uint16: 20, mx.int8: 23, mx.int64: 14}
# ggml type id -> the extension's product for a GGUF tensor held as the file's row bytes (checkpoints/quants.py
# BLOCKS), each `f(x, blocks, type, int8)`: the K-quants and ternary types in gguf_kquant_kernels.cpp
BLOCK_KERNELS = {10: "gguf_kquant_matmul", 11: "gguf_kquant_matmul", 12: "gguf_kquant_matmul", 13: "gguf_kquant_matmul",
                 34: "gguf_kquant_matmul", 35: "gguf_kquant_matmul"}
BLOCK_KERNELS.update(dict.fromkeys((16, 17, 18, 19, 21, 22, 29), "gguf_iquant_matmul"))  # grid i-quants (IQ1_S..IQ3_S)
BLOCK_KERNELS[8] = "gguf_q8_0_matmul"  # a tied Q8_0 embedding's head (int8_kernels.cpp; its rows: gguf_rows.q8_0)


def extension_for(x: mx.array) -> object:
    """The extension if it takes this product's activations, else None."""
    state = load()
    if state.module is None or x.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return None
    if not state.threads:
        set_threads()
    return state.module


def set_threads(threads: int | None = None) -> None:
    """The kernels' threads: `threads`, else the BLAS's (blas.num_threads(), a rank's share of its
    host's cores), read once per load and again by use_in() (not per product: a ctypes call)."""
    state = load()
    if state.module is not None:
        state.threads = threads or blas.num_threads() or 1
        state.module.set_threads(state.threads)


def covers(w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int, mode: str,
           transpose: bool = True) -> bool:
    """Whether the kernels compute this layout (MLX affine; the rest goes to MLX)."""
    return (mode == "affine" and transpose and biases is not None and bits in BITS and group_size in GROUP_SIZES
            and w.dtype == mx.uint32 and scales.dtype in SCALE_DTYPES
            and (biases.dtype == scales.dtype or biases.size == 0))  # none held: symmetric (hold_symmetric)


def symmetric_offset(bits: int) -> float:
    """A symmetric matrix's bias in units of its scale (int8_kernels.cpp's symmetric_offset)."""
    return -float(1 << (bits - 1))


def full_biases(scales: mx.array, biases: mx.array | None, bits: int) -> mx.array | None:
    """The biases of an affine matrix: a symmetric one's, held as none (shape [..., 0]: hold_symmetric), are
    -2^(bits - 1) times its scales, computed here (exact: a power of two, in the scales' dtype, as checked at load)."""
    if biases is not None and biases.shape[-1] == 0 and scales.shape[-1] != 0:
        return scales * symmetric_offset(bits)
    return biases


def hold_symmetric(module: nn.Module) -> bool:
    """After loading: a matrix of SYMMETRIC_BITS whose every bias is -2^(bits - 1) times its scale, exactly (a GGUF's
    Q5_0 held exactly: checkpoints/quants.py), holds no biases (an empty [..., 0] array, as the int8 repack's
    symmetric matrices: full_biases computes them per product), and its scales in float16 where they are all float16
    values (a GGUF's d; the loader casts them to --dtype): the file's 22 bytes per 32 values, not 28. The products
    are the same numbers. Returns whether it did."""
    if getattr(module, "mode", "affine") != "affine" or module.bits not in SYMMETRIC_BITS or "biases" not in module:
        return False
    scales, biases = module["scales"], module["biases"]
    if biases.shape != scales.shape or biases.shape[-1] == 0 or scales.dtype not in SCALE_DTYPES:
        return False
    # float16 scales where -16 x them are the biases loaded (then they are the scales loaded, too), else as they are
    candidates = [scales.astype(mx.float16), scales] if scales.dtype == mx.float32 else [scales]
    wanted = biases.astype(mx.float32)
    for held in candidates:  # the biases full_biases will compute from these scales: the ones loaded, bit for bit
        if mx.array_equal((held * symmetric_offset(module.bits)).astype(mx.float32), wanted).item():
            module["scales"], module["biases"] = held, mx.zeros((*biases.shape[:-1], 0), held.dtype)
            return True
    return False


def hold_half(module: nn.Module) -> bool:
    """After loading: a matrix of SYMMETRIC_BITS that is not symmetric but whose float32 scales and biases are all
    float16 values (a GGUF's Q5_1: d and m; the loader casts them to --dtype) holds them in float16: the file's 24
    bytes per 32 values, not 28. The products are the same numbers. Returns whether it did."""
    if getattr(module, "mode", "affine") != "affine" or module.bits not in SYMMETRIC_BITS or "biases" not in module:
        return False
    scales, biases = module["scales"], module["biases"]
    if scales.dtype != mx.float32 or biases.dtype != mx.float32 or biases.shape != scales.shape:
        return False
    half_scales, half_biases = scales.astype(mx.float16), biases.astype(mx.float16)
    if not (mx.array_equal(half_scales.astype(mx.float32), scales).item()
            and mx.array_equal(half_biases.astype(mx.float32), biases).item()):
        return False
    module["scales"], module["biases"] = half_scales, half_biases
    return True


def is_gguf_native(scales: mx.array, mode: str) -> bool:
    """Whether a quantized module's arrays are a GGUF tensor held in its own blocks (see the module docstring)."""
    return mode in ("mxfp4", "affine") and scales.dtype in GGUF_NATIVE


def set_gguf_int8(on: bool) -> None:
    """The job's --int8-activations choice for the products of GGUF tensors in their own blocks (else
    they follow this machine's default, as a test or a script without flags does)."""
    load().gguf_int8 = on


def gguf_int8() -> bool:
    """Whether products of GGUF tensors in their own blocks round activations to int8 per block (llama.cpp's
    arithmetic): where this machine's int8 products are the default (build.int8_by_default)."""
    state = load()
    if state.gguf_int8 is None:
        state.gguf_int8 = int8_by_default(None, "float32")
    return state.gguf_int8


def _gguf_kernels(int8: bool | None) -> tuple[object, bool]:
    """The extension for a product of GGUF tensors held in their own blocks, and its int8 choice (None:
    gguf_int8()), the product counted for the stats line."""
    state = load()
    if state.module is None:
        raise RuntimeError(f"GGUF tensors held in their own blocks need pipeline's kernels ({state.why_not})")
    int8 = gguf_int8() if int8 is None else int8
    state.used["int8" if int8 else "pipeline"] += 1
    return state.module, int8


def gguf_matmul(x: mx.array, codes: mx.array, scales: mx.array, int8: bool | None = None,
                d: mx.array | None = None) -> mx.array:
    """x @ w.T for a GGUF tensor held in its own blocks (codes, scales and Q6_K's d: checkpoints/quants.py
    native_arrays); int8: activations rounded per block (None: gguf_int8())."""
    kernels, int8 = _gguf_kernels(int8)
    return _in_dtype_of(x, kernels.gguf_matmul(_float32(x), codes, scales, GGUF_NATIVE[scales.dtype], int8, d))


def gguf_gather(x: mx.array, codes: mx.array, scales: mx.array, d: mx.array | None, rhs_indices: mx.array,
                int8: bool | None = None) -> mx.array:
    """`gather_qmm` for an expert stack held in its own blocks (codes, scales, d [experts, n, ...]): each row of x
    times the experts it chose (rhs_indices), on gguf_kernels.cpp's gathered product (rows grouped per expert
    there, each row the bits of gguf_matmul on it alone)."""
    kernels, int8 = _gguf_kernels(int8)
    flat_x, experts, shape = _pairs(x, rhs_indices)
    out = kernels.gguf_gather_matmul(_float32(flat_x), codes, scales, GGUF_NATIVE[scales.dtype], int8, experts, d)
    return _in_dtype_of(x, out).reshape(*shape, codes.shape[1])


def gguf_blocks_gather(x: mx.array, blocks: mx.array, ggml_type: int, rhs_indices: mx.array,
                       int8: bool | None = None) -> mx.array:
    """`gather_qmm` for an expert stack held as the file's row bytes (blocks uint8 [experts, n, row bytes]) of ggml
    type id `ggml_type` (BLOCK_KERNELS): each row of x times the experts it chose (rhs_indices), on the type's
    gathered product (kernels_common.h: rows grouped per expert, each row the bits of gguf_blocks_matmul on it
    alone); int8: activations rounded per 256 as Q8_K (None: gguf_int8())."""
    kernels, int8 = _gguf_kernels(int8)
    flat_x, experts, shape = _pairs(x, rhs_indices)
    kernel = getattr(kernels, BLOCK_KERNELS[ggml_type].replace("_matmul", "_gather_matmul"))
    return _in_dtype_of(x, kernel(_float32(flat_x), blocks, ggml_type, int8, experts)).reshape(*shape, blocks.shape[1])


def _pairs(x: mx.array, rhs_indices: mx.array) -> tuple[mx.array, mx.array, tuple[int, ...]]:
    """A gather's (token, expert) pairs: x's rows broadcast against rhs_indices as [pairs, k], each pair's expert
    uint32 [pairs], and the output's shape but its last axis."""
    rows, k = x.shape[-2:]
    batch = tuple(mx.broadcast_shapes(x.shape[:-2], rhs_indices.shape))
    flat_x = mx.broadcast_to(x, (*batch, rows, k)).reshape(-1, k)
    experts = mx.broadcast_to(rhs_indices[..., None], (*batch, rows)).reshape(-1).astype(mx.uint32)
    return flat_x, experts, (*batch, rows)


def _rows_and_pairs(x: mx.array, rhs_indices: mx.array) -> tuple[mx.array, mx.array | None, mx.array,
                                                                  tuple[int, ...]]:
    """A gather's (token, expert) pairs without copying x's rows: x's distinct rows [x rows, k], each pair's row
    of them (lhs, uint32 [pairs]; None where every pair has its own row, as `_pairs` would give), each pair's
    expert uint32 [pairs], and the output's shape but its last axis. The kernels round (int8) or permute each
    distinct row once, however many experts it meets (a decode token's row meets top-k of them)."""
    rows, k = x.shape[-2:]
    batch = tuple(mx.broadcast_shapes(x.shape[:-2], rhs_indices.shape))
    experts = mx.broadcast_to(rhs_indices[..., None], (*batch, rows)).reshape(-1).astype(mx.uint32)
    distinct = x.reshape(-1, k)
    if distinct.shape[0] == experts.shape[0]:
        return distinct, None, experts, (*batch, rows)
    ids = mx.arange(distinct.shape[0], dtype=mx.uint32).reshape(x.shape[:-1])
    lhs = mx.broadcast_to(ids, (*batch, rows)).reshape(-1)
    return distinct, lhs, experts, (*batch, rows)


def gguf_blocks_matmul(x: mx.array, blocks: mx.array, ggml_type: int, int8: bool | None = None) -> mx.array:
    """x @ w.T for a GGUF tensor held as the file's row bytes (blocks [n, row bytes]) of ggml type id `ggml_type`
    (BLOCK_KERNELS); int8: activations rounded per 256 as Q8_K (None: gguf_int8())."""
    kernels, int8 = _gguf_kernels(int8)
    kernel = getattr(kernels, BLOCK_KERNELS[ggml_type])
    return _in_dtype_of(x, kernel(_float32(x), blocks, ggml_type, int8))


def gguf_q5_type(w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int, mode: str,
                 transpose: bool = True) -> int | None:
    """The ggml type id of a GGUF Q5_0 (6) or Q5_1 (7) matrix (or stack) as the loader holds it at the file's size:
    MLX 5-bit codes in groups of 32, float16 scales (d) and no biases (hold_symmetric: Q5_0) or float16 ones (m,
    hold_half: Q5_1); None for any other layout."""
    if not (mode == "affine" and transpose and bits == 5 and group_size == 32 and w.dtype == mx.uint32
            and scales.dtype == mx.float16 and biases is not None):
        return None
    if biases.shape[-1] == 0:
        return 6
    return 7 if biases.dtype == mx.float16 and biases.shape == scales.shape else None


def _gguf_q5_kernels(x: mx.array, q5_type: int | None) -> object:
    """The extension where a product of a Q5_0 / Q5_1 matrix (gguf_q5_type) runs its int8 path (gguf_q5_kernels.cpp,
    llama.cpp's arithmetic): float32 activations on the CPU and int8 products chosen (gguf_int8: --int8-activations);
    else None (the float products of qmm_kernels.cpp, or MLX's)."""
    if q5_type is None:
        return None
    kernels = extension_for(x)
    if kernels is None or not hasattr(kernels, "gguf_q5_matmul") or not gguf_int8():
        return None
    load().used["int8"] += 1
    return kernels


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None = None,
                     transpose: bool = True, group_size: int = 64, bits: int = 4, mode: str = "affine",
                     int8: bool = False) -> mx.array:
    """`mx.quantized_matmul`, through pipeline's kernels where they cover the product. int8: w, scales
    and biases are in the int8 products' layout (checkpoints/int8_repack.py)."""
    if is_gguf_native(scales, mode):
        return gguf_matmul(x, w, scales, d=biases)
    state = load()
    if int8:
        state.used["int8"] += 1
        return _in_dtype_of(x, state.module.int8_matmul(_float32(x), w, scales, biases, group_size, bits))
    q5_type = gguf_q5_type(w, scales, biases, group_size, bits, mode, transpose)
    if w.ndim == 2 and (q5 := _gguf_q5_kernels(x, q5_type)) is not None:
        return _in_dtype_of(x, q5.gguf_q5_matmul(_float32(x), w, scales, biases, q5_type))
    kernels = extension_for(x)
    if kernels is not None and covers(w, scales, biases, group_size, bits, mode, transpose):  # (symmetric: biases none)
        if w.ndim == 2:
            state.used["pipeline"] += 1
            return kernels.quantized_matmul(x, w, scales, biases, group_size, bits)
        if w.ndim == 3 and x.ndim >= 3 and x.shape[-3] == w.shape[0]:
            # a batch of matrices, one per x[..., b, :, :] (DeepSeek V4's grouped projection): a gather of each
            return gather_qmm(x, w, scales, biases, rhs_indices=mx.arange(w.shape[0], dtype=mx.uint32),
                              group_size=group_size, bits=bits, mode=mode)
    state.used["mlx"] += 1
    scales, biases = _affine(x, scales, full_biases(scales, biases, bits) if mode == "affine" else biases)
    return mx.quantized_matmul(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits,
                               mode=mode)


def _affine(x: mx.array, scales: mx.array, biases: mx.array | None) -> tuple[mx.array, mx.array | None]:
    """Scales (and biases) as a product takes them: float16 ones held for float32 activations (hold_symmetric)
    as they are where pipeline's kernels take them, else in x's dtype, as MLX's products want (exact)."""
    if scales.dtype == mx.float16 and x.dtype == mx.float32 and extension_for(x) is None:
        return scales.astype(x.dtype), None if biases is None else biases.astype(x.dtype)
    return scales, biases


def _float32(x: mx.array) -> mx.array:
    """x as the int8 kernels take it (--dtype float32 already is: an astype would add a node anyway)."""
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _in_dtype_of(x: mx.array, out: mx.array) -> mx.array:
    return out if x.dtype == out.dtype else out.astype(x.dtype)


def gather_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None = None,
               lhs_indices: mx.array | None = None, rhs_indices: mx.array | None = None, transpose: bool = True,
               group_size: int = 64, bits: int = 4, mode: str = "affine", sorted_indices: bool = False,
               int8: bool = False) -> mx.array:
    """`mx.gather_qmm` with rhs indices (each row of x times the experts it chose), through
    pipeline's kernels where they cover the product: rows grouped per expert in the kernel. int8:
    the weights are in the int8 products' layout (checkpoints/int8_repack.py)."""
    q5_type = None if int8 or lhs_indices is not None or rhs_indices is None or w.ndim != 3 else \
        gguf_q5_type(w, scales, biases, group_size, bits, mode, transpose)
    if (q5 := _gguf_q5_kernels(x, q5_type)) is not None:  # a Q5_0 / Q5_1 stack: int8 products, gathered
        flat_x, experts, shape = _pairs(x, rhs_indices)
        out = q5.gguf_q5_gather_matmul(_float32(flat_x), w, scales, biases, q5_type, experts)
        return _in_dtype_of(x, out).reshape(*shape, w.shape[1])
    state = load()
    kernels = state.module if int8 else extension_for(x)
    if int8 or (kernels is not None and lhs_indices is None and rhs_indices is not None and w.ndim == 3
                and covers(w, scales, biases, group_size, bits, mode, transpose)):
        state.used["int8" if int8 else "pipeline"] += 1
        rows, lhs, experts, shape = _rows_and_pairs(x, rhs_indices)
        product = kernels.int8_gather_qmm if int8 else kernels.gather_qmm
        args = (_float32(rows), w, scales, biases, experts, group_size, bits) + (() if lhs is None else (lhs,))
        return _in_dtype_of(x, product(*args)).reshape(*shape, w.shape[1])
    state.used["mlx"] += 1
    if mode == "affine":
        scales, biases = _affine(x, scales, full_biases(scales, biases, bits))
    return mx.gather_qmm(x, w, scales, biases, lhs_indices=lhs_indices, rhs_indices=rhs_indices,
                         transpose=transpose, group_size=group_size, bits=bits, mode=mode,
                         sorted_indices=sorted_indices)


def gathers_together(gate: nn.Module, up: nn.Module, x: mx.array) -> bool:
    """Whether an MoE layer's gathered gate and up (QuantizedSwitchLinear stacks) can run as one int8 operation
    with their SwiGLU (gather_swiglu): both in the int8 layout, alike, and float32 activations."""
    return (x.dtype == mx.float32 and all(getattr(m, "int8", False) and "biases" in m for m in (gate, up))
            and gate.group_size == up.group_size and gate.bits == up.bits
            and gate["weight"].shape == up["weight"].shape)


def gather_swiglu(x: mx.array, gate: nn.Module, up: nn.Module, rhs_indices: mx.array) -> mx.array:
    """silu(gate(x, rhs_indices)) * up(x, rhs_indices) for int8 stacks (gathers_together): one operation
    (int8_kernels.cpp's Int8GatherSwiGLU), each distinct row of x rounded once, the same bits as the two gathered
    products and models/experts.py's SwitchGLU.activate."""
    state = load()
    state.used["int8"] += 2
    rows, lhs, experts, shape = _rows_and_pairs(x, rhs_indices)
    args = (rows, [gate["weight"], up["weight"]], [gate["scales"], up["scales"]], [gate["biases"], up["biases"]],
            experts, gate.group_size, gate.bits) + (() if lhs is None else (lhs,))
    return state.module.int8_gather_swiglu(*args).reshape(*shape, gate["weight"].shape[1])


# ---- the model's quantized layers --------------------------------------------------------------

class QuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product goes through `quantized_matmul` above."""

    def __call__(self, x: mx.array) -> mx.array:
        out = rows_product(self, x)
        return out + self["bias"] if "bias" in self else out

    def after_load(self) -> None:
        """Once its arrays are in (checkpoints/weights.py calls it): a GGUF tensor held in its own blocks
        becomes a GGUFLinear."""
        if is_gguf_native(self["scales"], getattr(self, "mode", "affine")):
            self.__class__ = GGUFLinear
        elif not hold_symmetric(self):
            hold_half(self)


class GGUFLinear(nn.Module):
    """A Linear whose weight is a GGUF tensor held in its own blocks (IQ4_NL, IQ4_XS, Q6_K): `weight` (the codes),
    `scales` (and Q6_K's d as `biases`) as checkpoints/quants.py native_arrays holds them, products by
    gguf_matmul. Loaded as an MLX quantized module (QuantizedLinear.after_load), then no longer one: what handles MLX's layouts (dequantizing a
    slice for --weights-in-memory fp32, the int8 repack) leaves it as it is."""

    def __call__(self, x: mx.array) -> mx.array:
        out = gguf_matmul(x, self["weight"], self["scales"], d=self.get("biases"))
        return out + self["bias"] if "bias" in self else out


class GGUFBlocksLinear(nn.Module):
    """A Linear whose weight is a GGUF tensor held as the file's row bytes (checkpoints/quants.py BLOCKS):
    `weight` uint8 [out, row bytes], `ggml_type` int32 [1] (the type id, also kept as the int `type_id`),
    products by gguf_blocks_matmul. A Linear becomes one where the loaded arrays say so (checkpoints/weights.py,
    before they go in); what handles MLX's layouts (--weights-in-memory's dequantizing, the int8 repack) leaves
    it as it is."""

    @classmethod
    def become(cls, module: nn.Module, weight: mx.array, ggml_type: mx.array) -> None:
        """Turns the Linear `module` into one, in place, holding these arrays."""
        module.__class__ = cls
        module["weight"], module["ggml_type"] = weight, ggml_type
        module.type_id = int(ggml_type[0].item())

    def __call__(self, x: mx.array) -> mx.array:
        out = gguf_blocks_matmul(x, self["weight"], self.type_id)
        return out + self["bias"] if "bias" in self else out


class GGUFBlocksEmbedding(GGUFBlocksLinear):
    """An Embedding whose table is a GGUF tensor held as the file's row bytes (arrays as GGUFBlocksLinear's): the
    looked-up rows dequantized exactly by the type's kernel (BLOCK_KERNELS' `..._dequantize`: the values the
    products use), and as the LM head (tied embeddings) products by gguf_blocks_matmul."""

    def __call__(self, ids: mx.array) -> mx.array:
        state = load()
        rows = self["weight"][ids.reshape(-1)]
        if self.type_id in gguf_rows.BLOCK_ROWS:  # dequantized in MLX operations
            return gguf_rows.BLOCK_ROWS[self.type_id](rows).reshape(*ids.shape, -1)
        dequantize = getattr(state.module, BLOCK_KERNELS[self.type_id].replace("_matmul", "_dequantize"))
        return dequantize(rows, self.type_id).reshape(*ids.shape, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return gguf_blocks_matmul(x, self["weight"], self.type_id)


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose use as the LM head (tied embeddings) goes through `quantized_matmul`."""

    def as_linear(self, x: mx.array) -> mx.array:
        return rows_product(self, x)

    def after_load(self) -> None:
        """As QuantizedLinear.after_load: a GGUF tensor held in its own blocks becomes a GGUFEmbedding."""
        if is_gguf_native(self["scales"], getattr(self, "mode", "affine")):
            self.__class__ = GGUFEmbedding


class GGUFEmbedding(nn.Module):
    """An Embedding whose table is a GGUF tensor held in its own blocks (arrays as GGUFLinear's): the looked-up
    rows dequantized exactly (gguf_rows.py: float32, the values the products use), and as the LM head (tied
    embeddings) products by gguf_matmul."""

    def __call__(self, ids: mx.array) -> mx.array:
        d = self.get("biases")
        return gguf_rows.dequantize(self["weight"][ids], self["scales"][ids], None if d is None else d[ids],
                                    GGUF_NATIVE[self["scales"].dtype])

    def as_linear(self, x: mx.array) -> mx.array:
        return gguf_matmul(x, self["weight"], self["scales"], d=self.get("biases"))


def rows_product(module: nn.Module, x: mx.array, begin: int = 0, end: int | None = None) -> mx.array:
    """x @ rows [begin, end) of a quantized Linear's (or Embedding's) weight, transposed: in the int8
    layout where the int8 repack (checkpoints/int8_repack.py) made one (a 4-bit embedding keeps its own for
    lookups beside it; begin and end are then multiples of 16, whole blocks), else MLX's; an 8-bit tied
    embedding marked `int8_rows` in its own layout, with the int8 products' bits (int8_rows_matmul)."""
    if getattr(module, "int8_rows", False):  # a tied 8-bit embedding as the head, read in place (int8_repack)
        weight, scales, biases = module["weight"], module["scales"], module["biases"]
        if begin or end is not None:
            weight, scales, biases = weight[begin:end], scales[begin:end], biases[begin:end]
        state = load()
        state.used["int8"] += 1
        return _in_dtype_of(x, state.module.int8_rows_matmul(_float32(x), weight, scales, biases, module.group_size))
    int8 = getattr(module, "int8", False)
    assert not int8 or begin % INT8_BLOCK == 0 and (end is None or end % INT8_BLOCK == 0), (begin, end)
    prefix = "int8_" if int8 and "int8_weight" in module else ""
    weight, scales, biases = module[prefix + "weight"], module[prefix + "scales"], module.get(prefix + "biases")
    if begin or end is not None:  # a slice is a node of the graph: none for the whole matrix (every layer's call)
        weight, scales = weight[begin:end], scales[begin:end]
        biases = None if biases is None else biases[begin:end]
    return quantized_matmul(x, weight, scales, biases, transpose=True, group_size=module.group_size,
                            bits=module.bits, mode=getattr(module, "mode", "affine"), int8=int8)


def _int8_together(modules: list[nn.Module], x: mx.array) -> bool:
    """Whether these Linears' products can be one int8 operation on x: each in the int8 layout (not an
    embedding's copy), one group size and bit width, float32 2-D x."""
    first = modules[0]
    return (x.ndim == 2 and x.dtype == mx.float32
            and all(getattr(m, "int8", False) and "int8_weight" not in m and m.group_size == first.group_size
                    and m.bits == first.bits for m in modules))


def _int8_fused(kernel: str, modules: list[nn.Module], x: mx.array):
    """The extension's fused int8 call `kernel` (int8_products, int8_swiglu) on these Linears' repacked weights."""
    state = load()
    state.used["int8"] += len(modules)
    return getattr(state.module, kernel)(x, [m["weight"] for m in modules], [m["scales"] for m in modules],
                                         [m["biases"] for m in modules], modules[0].group_size, modules[0].bits)


def products(modules: list[nn.Module], x: mx.array) -> list[mx.array]:
    """[m(x) for m in modules] (a layer's q, k and v projections). With int8 products, one operation: x is
    rounded once and MLX dispatches one node instead of one per product, each output the same bits."""
    if not _int8_together(modules, x):
        return [m(x) for m in modules]
    outs = _int8_fused("int8_products", modules, x)
    return [out + m["bias"] if "bias" in m else out for m, out in zip(modules, outs)]


def swiglu_product(gate: nn.Module, up: nn.Module, x: mx.array, swiglu) -> mx.array:
    """swiglu(gate(x), up(x)). With int8 products and no Linear biases, one operation (int8_kernels.cpp's
    Int8Products): the same bits as the three it replaces."""
    if "bias" in gate or "bias" in up or not _int8_together([gate, up], x):
        return swiglu(gate(x), up(x))
    return _int8_fused("int8_swiglu", [gate, up], x)


_OURS = {nn.QuantizedLinear: QuantizedLinear, nn.QuantizedEmbedding: QuantizedEmbedding}


def use_in(model: nn.Module) -> int:
    """Route `model`'s MLX quantized layers through pipeline's kernels: each module's class becomes
    the subclass above, in place (same parameters, same tree; isinstance checks still hold). Returns
    how many. Experts (models/experts.py) call `gather_qmm` themselves."""
    set_threads()
    count = 0
    for module in model.modules():
        ours = _OURS.get(type(module))
        if ours is not None:
            module.__class__ = ours
            count += 1
    return count


def describe() -> str:
    """The stats line's phrase for quantized products ("" if this process ran none)."""
    state = loaded()
    if state is None or not any(state.used.values()):
        return ""
    if state.used["pipeline"] or state.used["int8"]:
        threads = state.threads or 1
        ours = f"pipeline's {state.module.isa()} kernels ({threads} thread{'s' if threads != 1 else ''})"
        if state.used["int8"]:
            ours += f", int8 activations ({state.module.int8_isa()})"
            ours += ", some float32" if state.used["pipeline"] else ""
        return ours + (", some MLX's" if state.used["mlx"] else "")
    return "MLX's" + (f" ({state.why_not})" if state.why_not else "")
