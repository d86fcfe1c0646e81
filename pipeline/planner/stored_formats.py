"""How a published checkpoint stores its tensors, read from config.json (or a GGUF file's tensor
table): each tensor's bytes on disk, and the tensors it stores quantized in a form MLX runs as they are.

On disk (the checkpoint's own format, reported for comparison with download sizes): bf16 2 B;
FP8 e4m3 1 B plus one fp32 scale_inv per 128x128 block (1 + 4/16384 B); pack-quantized INT4
0.5 B plus one bf16 scale per 32 values (0.5625 B) and an int64[2] shape per tensor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoints import quants
from ..checkpoints.gguf_checkpoint import GGUFCheckpoint
from ..checkpoints.model_files import ModelFiles
from ..checkpoints.safetensors_checkpoint import read_header
from ..models.config import ModelConfig
from ..util.errors import UserError
from .shapes import Param


@dataclass(frozen=True)
class CheckpointFormat:
    """How the published checkpoint stores its tensors, read from config.json."""
    kind: str  # "float", "mlx", "fp8", "int4"; "gguf": GGUFFormat below
    float_bytes: int  # bytes of its float tensors on disk
    config: ModelConfig
    block: tuple[int, int] = (128, 128)  # fp8 scale blocks
    group_size: int = 32  # int4
    ignore: tuple[str, ...] = ()  # int4: modules left in float
    # DeepSeek V4's fp8: ue8m0 block scales (one byte each), routed experts in FP4 (fp4_experts), both
    # held as they are stored, as MLX's mxfp8 and mxfp4 (checkpoints/format_adapters.py)
    mx: bool = False
    fp4_experts: bool = False
    half_scales_stored: bool = False  # MLX folder: its scales and biases are float16 in the files

    def half_scales(self, p: Param) -> bool:
        """Whether the scales and biases of a tensor held MLX-quantized as the checkpoint stores it are
        float16 values (the int8 repack then holds them as float16: int8_repack.use_int8)."""
        return self.kind == "mlx" and self.half_scales_stored

    def symmetric(self, p: Param) -> bool:
        """Whether every bias of a tensor held MLX-quantized as stored is -2^(bits - 1) times its scale
        (the int8 repack then holds no biases: int8_repack.use_int8; 5 bits hold none anyway: qmm.hold_symmetric):
        in an MLX folder, the modules `convert` listed so (a GGUF's Q4_0, Q5_0 and Q8_0); other folders are not
        assumed to be."""
        return self.kind == "mlx" and p.module in self.config.raw.get(quants.SYMMETRIC_KEY, ())

    def held_in_blocks(self, p: Param) -> bool:
        """Whether a tensor is held as the file's own blocks, its bytes on disk (a GGUF's IQ4_NL / IQ4_XS / Q6_K
        layer matrices, LM head, embedding and expert stacks: checkpoints/quants.py NATIVE)."""
        return False

    def held_bytes(self, p: Param) -> int:
        """The bytes of a tensor held_in_blocks as loaded: its bytes on disk (a GGUF's, with the arrays' extras)."""
        return self.disk_bytes(p)

    def mx_bits(self, p: Param) -> int | None:
        """4 or 8: a tensor held in MLX's mxfp4 / mxfp8 mode as stored (DeepSeek V4); else None."""
        if not self.mx or not p.is_matrix:
            return None
        if p.experts:
            return 4 if self.fp4_experts else 8
        return 8 if self.is_fp8(p) else None

    def native(self, p: Param) -> tuple[int, int] | None:
        """(bits, group) of a tensor the checkpoint stores quantized in a form MLX runs as it is."""
        if self.kind == "mlx" and p.is_matrix:
            q = self.config.quantization
            if p.is_router and p.module not in q:
                return None  # routers stay in float unless listed
            settings = self.config.quantization_for(p.module)
            return (settings["bits"], settings["group_size"]) if settings else None
        if self.kind == "int4" and p.is_linear and not self._ignored(p.module):
            return 4, self.group_size
        return None

    def _ignored(self, module: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif pattern == module:
                return True
        return False

    def is_fp8(self, p: Param) -> bool:
        # DeepSeek ships a few small projections in bf16: V3.2's and V4's indexer weights_proj, V4's
        # compressors (the indexer's too); V4's routed experts are FP4
        if self.kind != "fp8" or not p.is_linear or p.module == "lm_head" or p.module.endswith("weights_proj"):
            return False
        if self.mx and (p.module.endswith(("compressor.kv_proj", "compressor.gate_proj", "indexer.kv_proj",
                                          "indexer.gate_proj")) or (p.experts and self.fp4_experts)):
            return False
        return True

    def _stored_fp32(self, p: Param) -> bool:
        """V4's tensors DeepSeek keeps in float32: hyper-connections, compressors' position biases,
        attention sinks, router correction biases."""
        return self.mx and p.name.endswith((".fn", ".base", ".scale", "hc_fn", "hc_base", "hc_scale",
                                            "position_bias", "sinks", "e_score_correction_bias"))

    def disk_bytes(self, p: Param) -> int:
        if p.is_index_table:
            return p.numel * 8  # int64
        bits = self.mx_bits(p)
        if bits == 4:  # e2m1 nibbles, one ue8m0 byte per 32
            return p.copies * (p.size // 2 + p.size // 32)
        if bits == 8:  # e4m3 bytes, one ue8m0 byte per block
            rows, cols = p.shape
            return p.copies * (p.size + math.ceil(rows / self.block[0]) * math.ceil(cols / self.block[1]))
        if self._stored_fp32(p):
            return p.numel * 4
        native = self.native(p)
        if native and self.kind == "int4":  # int32-packed nibbles, bf16 scale per group, int64[2] shape
            rows, cols = p.shape
            return p.copies * (rows * cols // 2 + rows * (cols // self.group_size) * 2 + 16)
        if native:  # MLX affine: uint32-packed, scales and biases in the float dtype
            return p.copies * affine_bytes(p.shape, *native, self.float_bytes)
        if self.is_fp8(p):
            rows, cols = p.shape
            blocks = math.ceil(rows / self.block[0]) * math.ceil(cols / self.block[1])
            return p.copies * (p.size + 4 * blocks)
        if self.kind == "fp8" and p.name.endswith("e_score_correction_bias"):
            return p.numel * 4  # stored in fp32
        return p.numel * self.float_bytes

    def describe(self) -> str:
        floats = {2: "bf16", 4: "fp32"}.get(self.float_bytes, f"{self.float_bytes}-byte floats")
        if self.kind == "fp8" and self.mx:
            b = self.block
            experts = "routed experts FP4 e2m1 with a ue8m0 scale per 32 (0.5 + 1/32 B/param), " if self.fp4_experts else ""
            return (f"{experts}FP8 e4m3 with a ue8m0 scale per {b[0]}x{b[1]} block (1 + 1/{b[0] * b[1]} B/param), "
                    f"hyper-connections and biases fp32, rest {floats}")
        if self.kind == "fp8":
            b = self.block
            return f"FP8 e4m3 with one fp32 scale per {b[0]}x{b[1]} block (1 + 4/{b[0] * b[1]} B/param), rest {floats}"
        if self.kind == "int4":
            return (f"compressed-tensors INT4, group {self.group_size}, for routed experts "
                    f"(0.5 + 2/{self.group_size} B/param), rest {floats}")
        if self.kind == "mlx":
            q = self.config.quantization
            return f"MLX affine {q['bits']}-bit, group {q.get('group_size', 64)}, rest {floats}"
        return floats


def checkpoint_format(config: ModelConfig, model: ModelFiles | None = None, quantize: int | None = None,
                      group_size: int = 64) -> CheckpointFormat:
    """model: the files config came from (model_files.find; None: a config.json alone); a GGUF file's
    tensor table (header only) gives each tensor's type, bytes and MLX layout, quantize/group_size the
    layout of types MLX cannot hold exactly."""
    if model is not None and model.format == "gguf":
        return GGUFFormat.of(model.path, config, quantize, group_size)
    raw = config.raw
    float_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(raw.get("torch_dtype") or raw.get("dtype"), 2)
    if config.quantization and "bits" in config.quantization:
        return CheckpointFormat("mlx", float_bytes, config, half_scales_stored=_scales_dtype(model) == "F16")
    q = raw.get("quantization_config") or {}
    method = q.get("quant_method")
    if not method:
        return CheckpointFormat("float", float_bytes, config)
    if method == "fp8":
        block = tuple(q.get("weight_block_size") or (128, 128))
        if config.model_type == "deepseek_v4":  # FP4 experts unless the config says fp8 (DeepSeek's own switch)
            experts = raw.get("expert_dtype") or q.get("expert_dtype") or "fp4"
            return CheckpointFormat("fp8", float_bytes, config, block=block, mx=True, fp4_experts=experts == "fp4")
        return CheckpointFormat("fp8", float_bytes, config, block=block)
    if method == "compressed-tensors":
        groups = list((q.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        if (q.get("format") != "pack-quantized" or len(weights) != 1 or weights[0].get("num_bits") != 4
                or weights[0].get("type") != "int" or not weights[0].get("symmetric")
                or weights[0].get("strategy") != "group"):
            raise UserError("compressed-tensors checkpoints are supported as symmetric INT4 pack-quantized "
                            "with group strategy (as Kimi K2 Thinking ships), not this quantization_config")
        return CheckpointFormat("int4", float_bytes, config, group_size=int(weights[0]["group_size"]),
                                ignore=tuple(q.get("ignore") or ()))
    raise UserError(f"unknown quantization method {method!r} in config.json (known: fp8, compressed-tensors, "
                    f"MLX 'quantization')")


def _scales_dtype(model: ModelFiles | None) -> str | None:
    """The safetensors dtype of an MLX folder's first `.scales` tensor (from one file's header), or None."""
    if model is None or model.format != "safetensors":
        return None
    for path in sorted(model.path.glob("*.safetensors")):
        try:
            tensors = read_header(path)
        except (OSError, UserError):  # the loader reports a bad file; the planner only counts
            return None
        scales = next((info for name, info in tensors.items() if name.endswith(".scales")), None)
        if scales is not None:
            return scales.dtype
    return None


def affine_bytes(shape: tuple[int, ...], bits: int, group: int, scale_bytes: int, biases: bool = True) -> int:
    """MLX affine quantization of one tensor: rows of uint32-packed values plus a scale and a bias
    per group (no biases: a symmetric matrix repacked for the int8 products, or one of 5 bits)."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    return rows * math.ceil(cols * bits / 32) * 4 + rows * math.ceil(cols / group) * (1 + biases) * scale_bytes


@dataclass(frozen=True)
class _ModuleInfo:
    types: tuple[str, ...]  # GGML types of the GGUF tensors behind it
    disk: int  # their bytes in the file(s)
    native: tuple[int, int] | None  # (bits, group) it is held in, MLX-quantized; None: float
    how: str
    held: int = 0  # held in its own blocks ("native"): the arrays' bytes (the file's, and a BLOCKS type's 4-byte id)


@dataclass(frozen=True)
class GGUFFormat(CheckpointFormat):
    """CheckpointFormat for a GGUF: per module (the planner's names, experts as
    `mlp.experts.0.*` standing for the stack), the bytes in the file and the MLX layout it loads as."""
    modules: dict[str, _ModuleInfo] = field(default_factory=dict)
    path: Path | None = None
    disk_total: int = 0  # bytes of the file(s)

    @classmethod
    def of(cls, path: Path, config, quantize: int | None, group_size: int) -> "GGUFFormat":
        checkpoint = GGUFCheckpoint(path, quantize, group_size)
        modules: dict[str, _ModuleInfo] = {}
        held_by_module: dict[str, int] = {}  # a module's arrays (weight, scales, ...): what the loader holds
        for name, entry in checkpoint.tensors.items():
            held_by_module[name.rpartition(".")[0]] = held_by_module.get(name.rpartition(".")[0], 0) + entry.nbytes
        for name, entry in checkpoint.tensors.items():
            module, _, part = name.rpartition(".")
            if part not in ("weight", "bias") and not name.endswith("e_score_correction_bias"):
                continue  # scales/biases of a quantized triple: counted with its weight
            if name.endswith("e_score_correction_bias"):
                module = name
            plan_module = module.replace(".mlp.switch_mlp.", ".mlp.experts.0.")
            lay = entry.layout
            native = (lay.bits, lay.group_size) if lay is not None and part == "weight" else None
            held = held_by_module.get(module, 0) if entry.how == "native" else 0
            modules[plan_module + ("" if module == name else f".{part}")] = _ModuleInfo(
                tuple(t.ggml_type for t in entry.source), sum(t.nbytes for t in entry.source), native, entry.how, held)
        return cls("gguf", 4, config, modules=modules, path=path, disk_total=checkpoint.gguf.nbytes_on_disk())

    def _info(self, p) -> _ModuleInfo | None:
        return self.modules.get(p.name) or self.modules.get(p.module + "." + p.name.rpartition(".")[2])

    def native(self, p):
        info = self._info(p)
        return info.native if info is not None else None

    def is_fp8(self, p) -> bool:
        return False

    def held_in_blocks(self, p) -> bool:
        info = self._info(p)
        return info is not None and info.how == "native"

    def held_bytes(self, p) -> int:
        info = self._info(p)
        return info.held if info is not None else 0

    def half_scales(self, p) -> bool:
        """Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks store float16 scales (and offsets): held exactly, they stay float16
        values."""
        return self._held_exactly_from(p, ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"))

    def symmetric(self, p) -> bool:
        """Q4_0, Q5_0 and Q8_0 are d (q - 8), d (q - 16) and d (q - 128): held exactly, every bias is -2^(bits - 1)
        times its scale."""
        return self._held_exactly_from(p, quants.SYMMETRIC_TYPES)

    def _held_exactly_from(self, p, types: tuple[str, ...]) -> bool:
        """Whether `p` is held exactly as stored, from tensors of these GGML types only."""
        info = self._info(p)
        return info is not None and info.how == "exact" and all(t in types for t in info.types)

    def disk_bytes(self, p) -> int:
        info = self._info(p)
        return info.disk if info is not None else 0

    def _shares(self, how: str | None = None) -> str:
        by_type: dict[str, int] = {}
        for info in self.modules.values():
            if how is None or info.how == how:
                for t in info.types:
                    by_type[t] = by_type.get(t, 0) + info.disk // len(info.types)
        total = sum(by_type.values()) or 1
        return ", ".join(f"{t} {100 * n / total:.0f}%" for t, n in sorted(by_type.items(), key=lambda kv: -kv[1]))

    def describe(self) -> str:
        return f"GGUF ({self._shares()} of its tensor bytes; {self.disk_total / 1e9:.1f} GB in the file(s))"

    def resident(self, dense: bool, dtype: str) -> str:
        exact = sorted({t for i in self.modules.values() if i.how == "exact" for t in i.types if t != "MXFP4"})
        mxfp4 = any("MXFP4" in i.types for i in self.modules.values() if i.how == "exact")
        requant = sorted({(t, i.native) for i in self.modules.values() if i.how == "requantized" for t in i.types})
        blocks = sorted({t for i in self.modules.values() if i.how == "native" for t in i.types})
        parts = []
        if blocks:
            parts.append(f"{', '.join(blocks)} in their own blocks, as the file's bytes")
        if exact:
            parts.append(f"{', '.join(exact)} exactly as MLX affine, group 32"
                         + (" (Q5_0 layer matrices with float16 scales and no biases: the file's bytes)"
                            if "Q5_0" in exact and not dense else ""))
        if mxfp4:
            parts.append("MXFP4 exactly as MLX mxfp4")
        if dense and (exact or mxfp4):
            parts.append(f"those dequantized to {dtype} at load")
        if requant:
            parts.append("re-quantized: " + ", ".join(f"{t} -> {b}-bit group {g}" for t, (b, g) in requant))
        return "; ".join(parts) or "all tensors float"
