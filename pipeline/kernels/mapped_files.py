"""Tensors read by mapping their files: an array over the page cache's own pages, no copy.

A tensor the rank holds as stored (bf16 kept, fp32, an MLX-quantized matrix for the float32 kernels)
then costs the mapping of its pages, not a read into new memory; a tensor the loader converts (a cast,
FP8 re-quantization, the int8 repack) is converted straight from those pages into its one new buffer.
The pages are mapped when the tensor is read (read from disk there if the page cache lacks them), so
a load still ends with every byte in memory. llama.cpp maps its files the same way by default; as
there, a weight file must not be changed or truncated while a job that mapped it runs.

mapped_files.cpp does the mapping, in pipeline's kernels' extension (build.py). Without it (no compiler,
PIPELINE_QMM=0, macOS, an accelerator as the default device) or with PIPELINE_MMAP=0, MLX reads the
bytes into arrays it allocates (safetensors_checkpoint.Checkpoint.read), as before.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

from . import build
from ..util.switches import turned_off

ENV = "PIPELINE_MMAP"


def available() -> bool:
    """Whether this process maps weight files (the extension loaded, the CPU the default device)."""
    if turned_off(ENV) or sys.platform != "linux" or mx.default_device() != mx.cpu:
        return False
    module = build.load().module
    return module is not None and hasattr(module, "mapped_array")


def mapped_array(path: Path, offset: int, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array | None:
    """Bytes [offset, offset + size) of `path` as an array of `shape` and `dtype`, evaluated, without
    a copy; None where they cannot be mapped (not aligned to the dtype: the caller reads them)."""
    if offset % dtype.size:
        return None
    return build.load().module.mapped_array(str(path), offset, list(shape), dtype)
