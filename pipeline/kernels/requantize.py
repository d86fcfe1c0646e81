"""Re-quantization at load (`--quantize` on a float or FP8 checkpoint) as one MLX operation per
tensor: requantize_kernels.cpp, compiled into the quantized products' extension by build.py.

MLX's graph for an FP8 weight was from_fp8, the block scale, a cast and mx.quantize: about 8.5 ns
of one core per weight, most of a DeepSeek rank's load. The kernel decodes, scales and quantizes
each value in one pass (about 4x less CPU) and gives mx.quantize's bits exactly (see its opening
comment), so a model loads the same whichever runs. checkpoints/format_adapters.py falls back to MLX's graph
where the extension is not built (macOS, no compiler, `PIPELINE_QMM=0`) or the held dtype is float16.
"""

from __future__ import annotations

import mlx.core as mx

from . import build


def quantize(array: mx.array, bits: int, group_size: int, dtype: mx.Dtype,
             block_scales: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array] | None:
    """mx.quantize(array held as `dtype`) (`array` FP8 e4m3 bytes [rows, cols] when `block_scales`,
    one per 128x128 block, are given), lazily; None where the kernel cannot do it."""
    if dtype not in (mx.float32, mx.bfloat16) or mx.default_device() != mx.cpu:
        return None
    if block_scales is None and array.dtype not in (mx.float32, mx.bfloat16, mx.float16):
        return None
    if block_scales is not None and (array.dtype != mx.uint8 or array.ndim != 2 or block_scales.shape != tuple(
            -(-n // 128) for n in array.shape)):
        return None  # MLX's graph says what is wrong
    module = build.load().module
    if module is None or not hasattr(module, "requantize"):
        return None
    scales = None if block_scales is None else block_scales.astype(mx.float32)
    return tuple(module.requantize(array, scales, bits, group_size, dtype))
