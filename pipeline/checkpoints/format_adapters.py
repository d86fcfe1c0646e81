"""Published checkpoint formats -> the tensors our modules hold, one tensor at a time.

- Hugging Face per-expert tensors (`mlp.experts.{e}.gate_proj.weight`) are stacked into one
  [experts, out, in] tensor per projection (`mlp.switch_mlp.gate_proj.weight`), as MLX
  checkpoints already store them.
- DeepSeek's FP8 (e4m3) weights carry `weight_scale_inv`, one float per 128x128 block:
  w = fp8 * scale_inv, block-wise.
- compressed-tensors "pack-quantized" INT4 (Kimi K2 Thinking): eight signed 4-bit values per
  int32 (`weight_packed`), one scale per group of 32 (`weight_scale`), symmetric. Stored
  unsigned as q + 8, so w = s * (u - 8) = s * u - 8s: MLX affine 4-bit with scales s and
  biases -8s, and the same nibble order, so the packed words are reused as they are.
- DeepSeek V4's mixed checkpoint, `.weight` with a ue8m0 `.scale` (a power of two 2^(b - 127) per
  byte): routed experts in FP4 (e2m1, two per byte, the first in the low nibble; one scale per 32
  values along a row) are exactly MLX's mxfp4 (the same e2m1 values, nibble order and scale
  byte), so the bytes are kept as they are (as uint32 words). The rest is FP8 (e4m3) with one
  scale per 128x128 block; MLX's mxfp8 is e4m3 with a ue8m0 scale per 32 values of a row, and
  every such run lies inside one block, so the block's scale repeated per run makes the same
  weights, again without touching the bytes (rows of a width that is no multiple of 32 are
  dequantized instead).
- mlx-lm's Qwen3.5 / Qwen3-Next conversions (mlx-community) store the linear attention's convolution
  kernel as [channels, kernel, 1] and the (1 + w) RMSNorms' weights with the 1 added (its sanitize());
  told by that kernel's shape, both are read back as transformers holds them ([channels, 1, kernel], w).
- mlx-lm's DeepSeek V3.2 / GLM-5 conversions split MLA's kv_b_proj [heads * (nope + v), latent] per head
  into `embed_q` [heads, latent, nope] and `unembed_out` [heads, v, latent], each MLX-quantized on its
  own where its width allows: they are dequantized and joined back into kv_b_proj (the attention splits
  it again after loading, models/deepseek_v3.py).
- `requantize` (the `--quantize` flag) turns float weights into MLX affine tensors right after
  each one is read, so a rank's memory never holds more than one float tensor at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx

from ..kernels import requantize as requantize_kernel
from ..kernels.int8_layout import packed_layout
from ..util.errors import UserError

_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
_ANY_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.")
_FP8_BLOCK = 128
# mlx-lm's Qwen3.5 conversions store these RMSNorms' weights as 1 + w (models/qwen3_5_moe.py scales by 1 + w)
_ONE_PLUS_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")
_CT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")


@dataclass(frozen=True)
class Requantize:
    bits: int
    group_size: int

    def validate(self) -> "Requantize":
        if self.bits not in (2, 3, 4, 5, 6, 8):
            raise UserError(f"--quantize {self.bits}: MLX affine quantization takes 2, 3, 4, 5, 6 or 8 bits")
        if self.group_size not in (32, 64, 128):
            raise UserError(f"--group-size {self.group_size}: choose 32, 64 or 128")
        return self


def adapt_tensors(names: list[str], tensors: dict, read: Callable[[str], mx.array], dtype: mx.Dtype,
                  requantize: Requantize | None = None,
                  keep_float32: Callable[[str], bool] | None = None) -> Iterator[tuple[str, mx.array]]:
    """Yield (checkpoint-style name, array) for a rank's tensors in the form our modules hold:
    floats in `dtype`, MLX-quantized triples as uint32 weight + scales/biases in `dtype`.
    Arrays come unevaluated (the caller evaluates them in groups, loading.py), but for stacked
    experts, written into their stack as they come.
    `tensors` maps every checkpoint name to its info (to find companions like scale_inv).
    keep_float32: names whose floats stay float32 whatever `dtype` (DeepSeek V4's mixing weights,
    sinks and norms, which its reference runs in float32)."""
    # Stacked expert tensors being filled: (prefix, proj, suffix) -> [array, experts still missing].
    experts: dict[tuple[str, str, str], list] = {}
    expert_counts: dict[str, int] = {}
    for name in names:
        m = _ANY_EXPERT.match(name)
        if m:
            expert_counts[m.group(1)] = max(expert_counts.get(m.group(1), 0), int(m.group(2)) + 1)

    def emit(name: str, array: mx.array) -> Iterator[tuple[str, mx.array]]:
        m = _EXPERT.match(name)
        if not m:
            yield name, array
            return
        prefix, expert, proj, suffix = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        key = (prefix, proj, suffix)
        if key not in experts:
            count = expert_counts[prefix]
            experts[key] = [mx.zeros((count, *array.shape), array.dtype), count]
            mx.eval(experts[key][0])
        entry = experts[key]
        # Written in place (the stacked array's only reference is donated), so a layer's
        # experts never exist twice in memory.
        entry[0][expert] = array
        mx.eval(entry[0])
        entry[1] -= 1
        if entry[1] == 0:
            del experts[key]
            yield f"{prefix}.switch_mlp.{proj}.{suffix}", entry[0]

    mlx_linear_attention = _mlx_linear_attention(tensors)
    for name in names:
        if name.endswith("_scale_inv") or name.endswith(_CT_SUFFIXES[1:]):
            continue  # consumed with the tensor they belong to
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in tensors:
            continue  # DeepSeek V4's ue8m0 scales: with their weight
        if name.endswith(".weight") and name[: -len(".weight")] + ".scale" in tensors:
            module = name[: -len(".weight")]
            for suffix, array in _deepseek_mx(module, read(name), read(module + ".scale"), tensors[name].dtype,
                                              dtype, requantize):
                yield from emit(f"{module}.{suffix}", array)
            continue
        if name.endswith(".self_attn.embed_q.weight"):
            yield name[: -len("embed_q.weight")] + "kv_b_proj.weight", _mlx_kv_b(read, name[: -len(".embed_q.weight")],
                                                                                  tensors, dtype)
            continue
        if ".self_attn.embed_q." in name or ".self_attn.unembed_out." in name:
            continue  # joined into kv_b_proj with embed_q.weight
        if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
            yield from _fused_experts(name, read(name), dtype)
            continue
        if name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            weight, scales, biases = _int4_pack_quantized(read, module, tensors, dtype)
            for suffix, array in (("weight", weight), ("scales", scales), ("biases", biases)):
                yield from emit(f"{module}.{suffix}", array)
            continue
        array = read(name)
        if mlx_linear_attention and name.endswith(".linear_attn.conv1d.weight"):
            array = array.swapaxes(1, 2)
        elif mlx_linear_attention and (name.endswith(_ONE_PLUS_NORMS) or name == "model.norm.weight"):
            array = array - 1  # exact: a weight near 1 minus 1 needs no more bits than it has
        scale_inv = read(name + "_scale_inv") if name + "_scale_inv" in tensors else None
        held = mx.float32 if scale_inv is None and keep_float32 and keep_float32(name) else dtype
        if requantize and _requantizable(name, array, requantize.group_size, fp8=scale_inv is not None):
            q, s, b = _quantize(array, scale_inv, held, requantize)
            module = name[: -len(".weight")]
            for suffix, part in (("weight", q), ("scales", s), ("biases", b)):
                yield from emit(f"{module}.{suffix}", part)
            continue
        if scale_inv is not None:
            array = dequantize_fp8(array, scale_inv, dtype)
        elif mx.issubdtype(array.dtype, mx.floating):
            array = array.astype(held)
        yield from emit(name, array)
    if experts:
        missing = ", ".join(f"{p}.experts.*.{proj}" for p, proj, _ in experts)
        raise UserError(f"incomplete expert tensors in the checkpoint: {missing}")


def _mlx_linear_attention(tensors: dict) -> bool:
    """Whether the checkpoint is mlx-lm's Qwen3.5 / Qwen3-Next layout: a convolution kernel [channels, kernel, 1]."""
    return any(name.endswith(".linear_attn.conv1d.weight") and len(info.shape) == 3 and info.shape[1] > 1
               and info.shape[2] == 1 for name, info in tensors.items())


def _mlx_kv_b(read, attention: str, tensors: dict, dtype: mx.Dtype) -> mx.array:
    """kv_b_proj [heads * (nope + v), latent] from mlx-lm's embed_q [heads, latent, nope] and unembed_out
    [heads, v, latent] (see the module docstring), each dequantized if it is MLX-quantized."""
    def part(module: str, in_features: int | None) -> mx.array:
        weight = read(f"{attention}.{module}.weight")
        if f"{attention}.{module}.scales" not in tensors:
            return weight.astype(mx.float32)
        scales = read(f"{attention}.{module}.scales")
        if in_features is None:  # embed_q's width (nope) from its packed words, at unembed_out's bits
            in_features = weight.shape[-1] * 32 // bits[0] if bits else None
        layout = in_features and packed_layout(in_features, weight.shape[-1], scales.shape[-1])
        if not layout:
            raise UserError(f"{attention}.{module}: packed {list(weight.shape)} with scales {list(scales.shape)} is "
                            "no MLX quantization this loader can tell (it reads embed_q at unembed_out's bits): "
                            "convert the model again with mlx_lm.convert, which quantizes both alike")
        bits.append(layout[1])
        biases = read(f"{attention}.{module}.biases") if f"{attention}.{module}.biases" in tensors else None
        return mx.dequantize(weight, scales.astype(mx.float32), biases.astype(mx.float32) if biases is not None
                             else None, group_size=layout[0], bits=layout[1])

    bits: list[int] = []
    latent = tensors[f"{attention}.embed_q.weight"].shape[1]
    values = part("unembed_out", latent)  # [heads, v, latent]
    keys = part("embed_q", None)  # [heads, latent, nope]
    joined = mx.concatenate([keys.swapaxes(1, 2), values], axis=1)  # [heads, nope + v, latent]
    return joined.reshape(-1, latent).astype(dtype)


def _fused_experts(name: str, array: mx.array, dtype: mx.Dtype) -> Iterator[tuple[str, mx.array]]:
    """transformers 5's in-memory layout: experts.gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    prefix = name[: name.index(".experts.")]
    array = array.astype(dtype)
    if name.endswith("gate_up_proj"):
        half = array.shape[1] // 2
        yield f"{prefix}.switch_mlp.gate_proj.weight", mx.contiguous(array[:, :half])
        yield f"{prefix}.switch_mlp.up_proj.weight", mx.contiguous(array[:, half:])
    else:
        yield f"{prefix}.switch_mlp.down_proj.weight", array


def _deepseek_mx(module: str, weight: mx.array, scale: mx.array, stored: str, dtype: mx.Dtype,
                 requantize: Requantize | None) -> Iterator[tuple[str, mx.array]]:
    """DeepSeek V4's FP4 (stored as I8) or FP8 (F8_E4M3) weight with its ue8m0 scale, as MLX's
    mxfp4 / mxfp8 (weight as uint32 words, scales as bytes: see the module docstring)."""
    rows, cols = weight.shape
    if stored == "I8":  # FP4: two values a byte, a scale per 32
        if scale.shape != (rows, cols * 2 // 32) or cols % 4:
            raise UserError(f"{module}: FP4 weight {list(weight.shape)} with scales {list(scale.shape)} is not "
                            "DeepSeek's layout (two values a byte, one ue8m0 scale per 32)")
        yield "weight", mx.contiguous(weight.view(mx.uint8).view(mx.uint32))
        yield "scales", scale
        return
    if stored != "F8_E4M3":
        raise UserError(f"{module}: a weight of dtype {stored} with a ue8m0 .scale is no format known here "
                        "(DeepSeek V4 ships FP4 as I8 and FP8 as F8_E4M3)")
    blocks = (-(-rows // _FP8_BLOCK), -(-cols // _FP8_BLOCK))
    if tuple(scale.shape) != blocks:
        raise UserError(f"{module}: FP8 weight {list(weight.shape)} has scales {list(scale.shape)}, expected one "
                        f"per {_FP8_BLOCK}x{_FP8_BLOCK} block {list(blocks)}")
    if cols % 32 == 0:  # mxfp8: each row's runs of 32 take their block's scale
        runs = _FP8_BLOCK // 32
        scales = mx.repeat(mx.repeat(scale, _FP8_BLOCK, axis=0)[:rows], runs, axis=1)[:, : cols // 32]
        yield "weight", mx.contiguous(weight.view(mx.uint32))
        yield "scales", mx.contiguous(scales)
        return
    array = dequantize_fp8(weight, mx.power(2.0, scale.astype(mx.float32) - 127), dtype)
    if requantize and _requantizable(module + ".weight", array, requantize.group_size):
        for suffix, part in zip(("weight", "scales", "biases"),
                                mx.quantize(array, group_size=requantize.group_size, bits=requantize.bits)):
            yield suffix, part
        return
    yield "weight", array


def dequantize_fp8(weight: mx.array, scale_inv: mx.array, dtype: mx.Dtype) -> mx.array:
    """DeepSeek FP8: e4m3 bytes times one scale per 128x128 block (edge blocks may be partial)."""
    rows, cols = weight.shape
    w = mx.from_fp8(weight, dtype=mx.float32)
    scale = scale_inv.astype(mx.float32)
    if rows % _FP8_BLOCK == 0 and cols % _FP8_BLOCK == 0:  # each block times its scale, broadcast
        blocks = w.reshape(rows // _FP8_BLOCK, _FP8_BLOCK, cols // _FP8_BLOCK, _FP8_BLOCK)
        return (blocks * scale[:, None, :, None]).reshape(rows, cols).astype(dtype)
    scale = mx.repeat(mx.repeat(scale, _FP8_BLOCK, axis=0), _FP8_BLOCK, axis=1)  # edge blocks are partial
    return (w * scale[:rows, :cols]).astype(dtype)


def _int4_pack_quantized(read, module: str, tensors: dict, dtype: mx.Dtype):
    packed = read(module + ".weight_packed")
    scale = read(module + ".weight_scale").astype(dtype)
    if module + ".weight_zero_point" in tensors:
        raise UserError(f"{module}: asymmetric compressed-tensors weights (with zero points) are not supported")
    if packed.dtype not in (mx.int32, mx.uint32):
        raise UserError(f"{module}.weight_packed has dtype {packed.dtype}, expected int32")
    out_features = packed.shape[0]
    in_features = packed.shape[1] * 8
    if module + ".weight_shape" in tensors:
        out_features, in_features = (int(v) for v in read(module + ".weight_shape").tolist())
    if packed.shape[1] * 8 != in_features or in_features % scale.shape[-1]:
        raise UserError(f"{module}: packed shape {packed.shape} does not match weight_shape "
                        f"[{out_features}, {in_features}]")
    return packed.view(mx.uint32), scale, -8 * scale


def _requantizable(name: str, array: mx.array, group_size: int, fp8: bool = False) -> bool:
    """Matrices of linear layers and embeddings (float, or FP8 bytes with block scales); not norms,
    biases or routers (too small and too sensitive to be worth it)."""
    return (name.endswith(".weight") and array.ndim >= 2 and array.shape[-1] % group_size == 0
            and not name.endswith("mlp.gate.weight") and (fp8 or mx.issubdtype(array.dtype, mx.floating)))


def _quantize(array: mx.array, scale_inv: mx.array | None, dtype: mx.Dtype, requantize: Requantize):
    """mx.quantize of the values held as `dtype` (FP8 bytes times their block scales): in one pass by
    pipeline's kernel where it is built (requantize.py), else through MLX's graph; the same bits."""
    fused = requantize_kernel.quantize(array, requantize.bits, requantize.group_size, dtype, scale_inv)
    if fused is not None:
        return fused
    array = dequantize_fp8(array, scale_inv, dtype) if scale_inv is not None else array.astype(dtype)
    return mx.quantize(array, group_size=requantize.group_size, bits=requantize.bits)
