"""Writing safetensors files whose tensors can be mapped in place (mapped_files.py).

The format puts an 8-byte header length and a JSON header before the tensors' bytes, back to back
with no gaps allowed. MLX's `mx.save_safetensors` neither pads the header nor orders the tensors, so
a tensor's bytes start at any offset, and a tensor not aligned to its element size cannot be mapped
(it is read into new memory instead). Like the `safetensors` library, we pad the header with spaces
to a multiple of 8 bytes and write the tensors widest element first: each then starts at a multiple of
its element size.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

# MLX dtype -> safetensors dtype: the ones pipeline's reader takes (safetensors_checkpoint.py)
DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32", mx.int32: "I32",
          mx.int64: "I64", mx.uint8: "U8", mx.int8: "I8", mx.bool_: "BOOL"}
ALIGN = 8


def save(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str] | None = None) -> None:
    """Write `arrays` to `path` (any tensors, evaluated one at a time as they are written)."""
    unsupported = sorted(f"{name} ({a.dtype})" for name, a in arrays.items() if a.dtype not in DTYPES)
    if unsupported:  # float64 and complex: MLX's CPU cannot compute in them, nothing of ours writes them
        raise ValueError(f"safetensors_file.save: no safetensors dtype for {', '.join(unsupported)}")
    order = sorted(arrays, key=lambda name: (-arrays[name].dtype.size, name))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        a = arrays[name]
        header[name] = {"dtype": DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name in order:
            a = arrays[name]
            if a.size == 0:  # nothing to write (and an empty shape cannot be cast to bytes)
                continue
            raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a  # numpy has no bfloat16: its bits
            f.write(memoryview(np.ascontiguousarray(np.array(raw, copy=False))).cast("B"))
