"""What a model's weights take in memory as a rank holds them, from its shapes (shapes.py) and its
checkpoint's format (stored_formats.py): per layer, rank 0's extras, and what each layer reads per token.

Bytes per parameter, resident (in memory at run time, as checkpoints/format_adapters.py's `adapt_tensors` loads
them):
- float tensors are held in the activation dtype (`--dtype`: 4 B for float32, 2 B for
  bfloat16/float16), whatever they were on disk; DeepSeek's FP8 weights are dequantized into it
  (MLX has no FP8 matmul);
- MLX affine b-bit, group g (`--quantize b --group-size g`, or an MLX-quantized folder): b/8 B
  packed plus one scale and one bias per g values, each in the dtype: b/8 + 2*dtype/g B
  (4-bit, group 64, bfloat16: 0.5 + 4/64 = 0.5625 B). `--quantize` takes every matrix whose
  rows divide into groups (embedding and LM head included) except MoE routers;
- compressed-tensors INT4 (Kimi K2 Thinking's routed experts, symmetric, group 32) maps exactly
  onto MLX affine 4-bit group 32 (scale s, bias -8s): 0.5 + 2*dtype/32 B;
- MLA's kv_b_proj is held in the dtype whatever its format (MLA_KV_B below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from ..checkpoints.model_files import find
from ..kernels.int8_layout import INT8_BITS, INT8_BLOCK, SYMMETRIC_BITS
from ..models.config import ModelConfig
from ..models.deepseek_v4_config import FLOAT32
from .shapes import Architecture, Param, architecture
from .stored_formats import CheckpointFormat, affine_bytes, checkpoint_format

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# MLA's kv_b_proj (DeepSeek V3 / V3.2, Kimi, GLM-5): the attention dequantizes it after loading and keeps its
# per-head halves w_uk / w_uv in the activation dtype (models/deepseek_v3.py after_load), so it is held in floats
# whether stored MLX-quantized (mlx-lm's GLM-5 / V3.2 folders store it as embed_q / unembed_out, which the
# loader joins back: checkpoints/format_adapters.py), re-quantized by --quantize, or read from a GGUF.
MLA_KV_B = ".self_attn.kv_b_proj.weight"


def _mx_bytes(shape: tuple[int, ...], bits: int) -> int:
    """MLX mxfp4 / mxfp8 of one tensor: uint32-packed values and one uint8 scale per 32, no biases."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    return rows * math.ceil(cols * bits / 32) * 4 + rows * math.ceil(cols / 32)


@dataclass(frozen=True)
class Precision:
    """What the weights become in memory: the checkpoint's format, the activation dtype floats
    are cast to, and an optional re-quantization (`--quantize`)."""
    checkpoint: CheckpointFormat
    dtype: str = "float32"
    quantize: int | None = None
    group_size: int = 64
    dense: bool = False  # MLX-quantized weights dequantized to the dtype (generate --weights-in-memory)
    int8: bool = False  # --int8-activations: 4- and 8-bit matrices repacked for the int8 products (int8_repack.use_int8)
    # MLA's kv_b_proj held in floats, as our attention holds it (MLA_KV_B); False: kept as stored or re-quantized,
    # as mlx-lm and llama.cpp keep its halves (calibration.py models their published runs)
    mla_kv_b_float: bool = True

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def resident_bytes(self, p: Param) -> int:
        if p.is_index_table:
            return p.numel * 8  # int64, never cast
        bits = self.checkpoint.mx_bits(p)
        if bits:
            return p.copies * _mx_bytes(p.shape, bits)
        if self.checkpoint.config.model_type == "deepseek_v4":
            if p.name.endswith(FLOAT32):  # held in float32 whatever the dtype, as the loader does
                return p.numel * 4
        if self.mla_kv_b_float and p.name.endswith(MLA_KV_B):  # MLA's absorbed halves, whatever the format
            return p.numel * self.dtype_bytes
        if self.checkpoint.held_in_blocks(p):  # a GGUF's tensors in their own blocks (stored_formats): the file's bytes
            return self.checkpoint.held_bytes(p)
        native = self.checkpoint.native(p)
        if native and self.dense and self.checkpoint.kind in ("mlx", "gguf"):
            return p.numel * self.dtype_bytes
        if native:
            repacked = not p.is_embedding and self.int8_repacked(p, native[0])
            # a 5-bit matrix holds float16 scales and biases where stored so (a GGUF's Q5_1: qmm.hold_half), and no
            # biases where symmetric (Q5_0: qmm.hold_symmetric)
            five = not p.is_embedding and native[0] in SYMMETRIC_BITS
            half = (repacked or five) and self.checkpoint.half_scales(p)
            return p.copies * affine_bytes(p.shape, *native, 2 if half else self.dtype_bytes,
                                            biases=not ((repacked or five) and self.checkpoint.symmetric(p)))
        if self.requantized(p):
            return p.copies * affine_bytes(p.shape, self.quantize, self.group_size, self.dtype_bytes)
        return p.numel * self.dtype_bytes

    def int8_repacked(self, p: Param, bits: int) -> bool:
        """Whether --int8-activations repacks this MLX-quantized matrix (int8_repack.int8_covers): 4 or 8 bits
        in whole blocks of 16 rows. Its scales and biases become float16 where they are all float16
        values, which the planner counts where the checkpoint stores them so (half_scales)."""
        return self.int8 and self.dtype == "float32" and bits in INT8_BITS and p.shape[-2] % INT8_BLOCK == 0

    def int8_head_copy(self, embedding: Param) -> int:
        """The bytes of the int8 copy a tied, MLX-quantized embedding gains as the LM head (int8_repack.use_int8); 0 if none
        (8 bits are the head as they are: int8_rows_matmul reads them in place)."""
        native = self.checkpoint.native(embedding)
        if (self.dense or not native or self.checkpoint.held_in_blocks(embedding)  # in its blocks: no copy made
                or native[0] == 8
                or not self.int8_repacked(embedding, native[0])):
            return 0
        return affine_bytes(embedding.shape, *native, 2 if self.checkpoint.half_scales(embedding) else self.dtype_bytes,
                             biases=not self.checkpoint.symmetric(embedding))

    def requantized(self, p: Param) -> bool:
        return (bool(self.quantize) and p.is_matrix and not p.is_router and p.shape[-1] % self.group_size == 0
                and not self.checkpoint.mx_bits(p))

    def describe(self) -> str:
        d, name = self.dtype_bytes, self.dtype
        parts = []
        if self.checkpoint.kind == "int4":
            g = self.checkpoint.group_size
            parts.append(f"routed experts INT4 -> MLX affine 4-bit, group {g} (0.5 + 2x{d}/{g} = "
                         f"{0.5 + 2 * d / g:.4g} B/param)")
        if self.checkpoint.kind == "mlx":
            q = self.checkpoint.config.quantization
            b, g = q["bits"], q.get("group_size", 64)
            if self.dense:
                parts.append(f"MLX affine {b}-bit, group {g} dequantized to {name} at load (--weights-in-memory fp32)")
            else:
                parts.append(f"MLX affine {b}-bit, group {g} as stored ({b}/8 + 2x{d}/{g} = {b / 8 + 2 * d / g:.4g} B/param)")
        if self.checkpoint.kind == "gguf":
            parts.append(self.checkpoint.resident(self.dense, name))
        if self.quantize:
            b, g = self.quantize, self.group_size
            parts.append(f"MLX affine {b}-bit, group {g} from --quantize {b} ({b}/8 + 2x{d}/{g} = "
                         f"{b / 8 + 2 * d / g:.4g} B/param) for the other matrices but routers")
        if self.checkpoint.kind == "fp8" and self.checkpoint.mx:
            if self.checkpoint.fp4_experts:
                parts.append("routed experts FP4 held as stored, MLX mxfp4 (0.5 + 1/32 B/param)")
            parts.append("FP8 held as stored, MLX mxfp8 (1 + 1/32 B/param: the 128x128 block's scale repeated "
                         "per 32 values)")
        elif self.checkpoint.kind == "fp8" and not self.quantize:
            parts.append(f"FP8 weights dequantized to {name} at load (MLX has no FP8 matmul)")
        if self.int8:
            parts.append("--int8-activations: 4- and 8-bit matrices repacked (scales and biases float16 where "
                         "stored so, no biases for GGUF's Q4_0 and Q8_0), a tied 4-bit embedding held twice on rank 0 "
                         "(its int8 copy is the head; an 8-bit one is the head as it is)")
        parts.append(f"other tensors {name} ({d} B)")
        return "; ".join(parts)


@dataclass
class ModelBytes:
    """Resident bytes per layer and of rank 0's extras, plus what each layer reads per token."""
    layers: list[int]
    ends: int
    fixed_read: list[int]  # per layer: bytes read every step (everything but routed experts)
    expert_bytes: list[int]  # per layer: bytes of one routed expert (0: dense layer)
    experts: list[int]  # per layer: routed experts (0: dense layer)
    head_read: int  # rank 0 per token: final norm + LM head + one embedding row
    active_params: list[int]  # per layer, for compute
    head_params: int
    head: int = 0  # the LM head's matrix as held (the tied embedding where there is no lm_head)
    mtp: int = 0  # DeepSeek's MTP module as held (without its copies of the embedding and head): rank 0's with --draft mtp


def with_mtp(mb: ModelBytes) -> ModelBytes:
    """The bytes of a job drafting with the MTP module (--draft mtp): rank 0 holds it beside its
    other extras, so the split gives rank 0 that much less of the rest."""
    return replace(mb, ends=mb.ends + mb.mtp)


def model_bytes(arch: Architecture, precision: Precision) -> ModelBytes:
    b = precision.resident_bytes
    layers, fixed, expert_bytes, experts, active = [], [], [], [], []
    for params in arch.layers:
        layers.append(sum(b(p) for p in params))
        fixed.append(sum(b(p) for p in params if not p.experts))
        routed = [p for p in params if p.experts]
        expert_bytes.append(sum(b(p) // p.copies for p in routed))
        experts.append(routed[0].experts if routed else 0)
        active.append(sum(p.numel for p in params if not p.experts) + arch.top_k * sum(p.size for p in routed))
    ends = sum(b(p) for p in arch.ends)
    embedding = next(p for p in arch.ends if p.is_embedding)
    tied = arch.config.tie_word_embeddings
    head = [p for p in arch.ends if not p.is_embedding] + ([embedding] if tied else [])
    head_read = sum(b(p) for p in head) + (0 if tied else b(embedding) // embedding.shape[0])
    matrix = next((p for p in arch.ends if p.name.startswith("lm_head.")), embedding)
    head_bytes = b(matrix)
    copy = precision.int8_head_copy(embedding) if tied else 0
    if copy:  # rank 0 holds the tied embedding twice: MLX's layout for lookups, int8's as the head
        ends += copy
        head_read += copy - b(embedding)
        head_bytes = copy  # the last rank's share of the head (head_share.py) is cut from the int8 copy's layout
    mtp = sum(b(p) for p in arch.unused if not p.name.endswith(("embed_tokens.weight", "shared_head.head.weight")))
    return ModelBytes(layers, ends, fixed, expert_bytes, experts, head_read, active, sum(p.numel for p in head), head_bytes,
                      mtp)


def model_bytes_of(config: ModelConfig, model: str | Path, dtype: str = "float32", quantize: int | None = None,
                   group_size: int = 64, dense: bool = False) -> ModelBytes:
    """The bytes of the model in folder (or GGUF file) `model` as a rank holds them: floats in `dtype`,
    `--quantize` applied, MLX-quantized weights packed or (dense) dequantized. The one count behind
    `plan`, `preflight`, `--weights-in-memory auto` and `--host-memory` (memory.py)."""
    return held_and_dense(config, model, dtype, quantize, group_size)[dense]


def held_and_dense(config: ModelConfig, model: str | Path, dtype: str = "float32", quantize: int | None = None,
                   group_size: int = 64, int8: bool = False) -> tuple[ModelBytes, ModelBytes]:
    """model_bytes_of packed and dequantized, the checkpoint's format read once (a GGUF's header
    is parsed to learn it). int8: --int8-activations (its repack and head copy counted)."""
    checkpoint, arch = checkpoint_format(config, find(model), quantize, group_size), architecture(config)
    return tuple(model_bytes(arch, Precision(checkpoint, dtype, quantize, group_size, dense, int8))
                 for dense in (False, True))
