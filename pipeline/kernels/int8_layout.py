"""The int8 products' weight layout (int8_kernels.cpp), as plain numbers: which MLX-quantized
matrices it takes, in blocks of how many rows. No MLX here: the planner counts a model's bytes with
these before anything loads MLX (`pipeline plan` reads config.json only)."""

from __future__ import annotations

INT8_BITS = (4, 8)
INT8_BLOCK = 16  # columns per block of the int8 layout (int8_kernels.cpp)
# bit widths (not the int8 layout's) whose symmetric matrices, every bias -2^(bits - 1) times its scale (a GGUF's
# Q5_0), are held in MLX's layout without biases and with float16 scales where they are float16 values
# (qmm.hold_symmetric); the int8 layout's widths drop theirs where repacked (int8_kernels.cpp int8_repack)
SYMMETRIC_BITS = (5,)

# MLX's affine quantization: the bit widths and group sizes it makes
_QUANT_BITS, _QUANT_GROUPS = (2, 3, 4, 5, 6, 8), (64, 32, 128)


def packed_layout(in_features: int, packed: int, scale_columns: int) -> tuple[int, int] | None:
    """(group size, bits) of an MLX-quantized matrix of `in_features` inputs held as `packed` uint32 and
    `scale_columns` scales a row; None where no MLX quantization gives those shapes."""
    if scale_columns <= 0:
        return None
    group_size, bits = in_features // scale_columns, packed * 32 // in_features
    if (group_size * scale_columns != in_features or bits * in_features != packed * 32
            or group_size not in _QUANT_GROUPS or bits not in _QUANT_BITS):
        return None
    return group_size, bits
