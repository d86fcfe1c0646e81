"""RMSNorm, RoPE's rotation and the SwiGLU as one MLX operation each (layer_kernels.cpp, compiled into
the quantized products' extension by build.py), where that extension is loaded and the activations are
float32 on the CPU; MLX's compiled ops otherwise (models/layers.py, models/rope.py).

MLX dispatches each node of a graph alone, at a few microseconds each on CPU, and these steps were
several nodes each: a compiled RMSNorm took 24 us a call, and a small model's decode step calls it
61 times. The SwiGLU is one node either way, but MLX's kernel of it computes its Sigmoid one
element at a time, with a call to exp and to fmaf each: the extension's, 16 at a time with MLX's
arithmetic (the same bits), is ~10x faster. layer_kernels.cpp's comments say what each computes and
why a row rounds the same whatever else shares the call. `PIPELINE_LAYER_KERNELS=0` turns them off.
"""

from __future__ import annotations

import mlx.core as mx

from . import qmm
from ..util.switches import turned_off

ENV = "PIPELINE_LAYER_KERNELS"


def kernel(x: mx.array):
    """The extension if it takes these activations (float32 on the CPU), else None."""
    if turned_off(ENV):
        return None
    module = qmm.extension_for(x)
    return module if module is not None and hasattr(module, "rms_norm") else None


def swiglu(gate: mx.array, up: mx.array) -> mx.array | None:
    """The extension's gate * sigmoid(gate) * up (MLX's nn.silu(gate) * up, the same bits) where it takes them
    (float32 both, one shape, on the CPU), else None."""
    module = kernel(gate)
    if module is None or up.dtype != mx.float32 or up.shape != gate.shape or not hasattr(module, "swiglu"):
        return None
    return module.swiglu(gate, up)
