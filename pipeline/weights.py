"""Reading a rank's tensors, and only those, from a model folder's safetensors files.

We parse the safetensors layout ourselves (an 8-byte header length, a JSON header of
name -> dtype/shape/byte range, then raw bytes) instead of using `safetensors.safe_open`
because numpy, which it hands tensors through, has no bfloat16, and because we want to read
exactly the bytes of the tensors a rank owns and to name the file when one is truncated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import ModelConfig
from .errors import UserError

# safetensors dtype -> (numpy dtype to read the bytes as, mlx dtype to view them as)
_DTYPES = {
    "F32": (np.float32, mx.float32),
    "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16),
    "F64": (np.float64, mx.float32),
    "U32": (np.uint32, mx.uint32),
    "I32": (np.int32, mx.int32),
    "I64": (np.int64, mx.int64),
    "U8": (np.uint8, mx.uint8),
    "I8": (np.int8, mx.int8),
    "F8_E4M3": (np.uint8, mx.uint8),  # raw bytes; dequantized by the format adapter
    "BOOL": (np.bool_, mx.bool_),
}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ENDS = ("model.embed_tokens.", "model.norm.", "lm_head.")


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class Checkpoint:
    """The tensors of a model folder: names, shapes and where their bytes are."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.files = self._weight_files()
        self.tensors: dict[str, TensorInfo] = {}
        for path, names in self.files.items():
            header = _read_header(path)
            for name, info in header.items():
                if names is None or name in names:
                    self.tensors[name] = info

    def _weight_files(self) -> dict[Path, set[str] | None]:
        """Each weight file with the names the index assigns to it (None: all it holds)."""
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError):
                raise UserError(f"{index} is not a valid safetensors index (no 'weight_map')") from None
            files: dict[Path, set[str]] = {}
            for name, file_name in weight_map.items():
                files.setdefault(self.folder / file_name, set()).add(name)
            for path in files:
                if not path.is_file():
                    raise UserError(f"shard {path.name} named in {index.name} is missing from "
                                    f"{self.folder}: download it again")
            return files
        found = sorted(self.folder.glob("*.safetensors"))
        if not found:
            raise UserError(f"no *.safetensors weights in {self.folder}")
        return {path: None for path in found}

    def read(self, name: str) -> mx.array:
        info = self.tensors[name]
        np_dtype, mx_dtype = _DTYPES[info.dtype]
        with open(info.file, "rb") as f:
            f.seek(info.begin)
            data = f.read(info.nbytes)
        if len(data) != info.nbytes:
            raise UserError(f"{info.file} is truncated or corrupt (tensor {name}): download it again")
        array = mx.array(np.frombuffer(data, dtype=np_dtype).reshape(info.shape))
        if info.dtype == "BF16":
            return array.view(mx.bfloat16)  # the bytes were read as uint16
        return array.astype(mx_dtype) if array.dtype != mx_dtype else array


def _read_header(path: Path) -> dict[str, TensorInfo]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise UserError(f"{path} is truncated or corrupt (no safetensors header): download it again")
        header_len = int.from_bytes(raw_len, "little")
        if header_len > size - 8 or header_len > 100_000_000:
            raise UserError(f"{path} is truncated or corrupt (bad header length): download it again")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path} is corrupt (unreadable safetensors header): download it again") from None
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry.get("dtype") not in _DTYPES:
            raise UserError(f"{path}: tensor {name} has unsupported dtype {entry.get('dtype')}")
        begin, end = entry["data_offsets"]
        tensors[name] = TensorInfo(path, entry["dtype"], tuple(entry["shape"]),
                                   data_start + begin, data_start + end)
    if tensors and max(t.end for t in tensors.values()) > size:
        raise UserError(f"{path} is truncated or corrupt ({size} bytes, header needs "
                        f"{max(t.end for t in tensors.values())}): download it again")
    return tensors


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def owned_tensor_names(checkpoint: Checkpoint, start: int, end: int, has_ends: bool) -> list[str]:
    """The checkpoint tensors one rank loads: its layers, plus embedding/norm/head on the ends
    stage. Tensors of no layer we run (e.g. rotary caches, extra MTP layers) are skipped."""
    names = []
    for name in checkpoint.tensors:
        layer = layer_of(name)
        if layer is not None:
            if start <= layer < end:
                names.append(name)
        elif has_ends and name.startswith(_ENDS):
            names.append(name)
    return sorted(names)


def local_name(name: str, start: int) -> str:
    """Checkpoint name -> parameter path in a TransformerSlice starting at layer `start`."""
    layer = layer_of(name)
    if layer is not None:
        return f"layers.{layer - start}." + name[_LAYER.match(name).end():]
    return name.removeprefix("model.")


def layer_nbytes(checkpoint: Checkpoint, num_layers: int) -> tuple[list[int], int]:
    """Bytes on disk of each layer, and of the embedding + final norm + LM head together."""
    per_layer = [0] * num_layers
    ends = 0
    for name, info in checkpoint.tensors.items():
        layer = layer_of(name)
        if layer is not None and layer < num_layers:
            per_layer[layer] += info.nbytes
        elif layer is None and name.startswith(_ENDS):
            ends += info.nbytes
    return per_layer, ends


def load_slice(model: nn.Module, checkpoint: Checkpoint, config: ModelConfig, dtype: mx.Dtype,
               progress: bool = False) -> list[str]:
    """Load this rank's tensors into `model` (a TransformerSlice), casting floats to `dtype`.
    Returns the checkpoint names read, so callers (and tests) can see exactly what was loaded."""
    names = owned_tensor_names(checkpoint, model.start, model.end, model.has_ends)
    _quantize_like_checkpoint(model, checkpoint, names, config)

    from tqdm import tqdm

    weights = []
    for name in tqdm(names, desc="loading", unit="tensor", disable=not progress, delay=2.0):
        array = checkpoint.read(name)
        if mx.issubdtype(array.dtype, mx.floating):
            array = array.astype(dtype)
        mx.eval(array)
        weights.append((local_name(name, model.start), array))
    try:
        model.load_weights(weights, strict=True)
    except ValueError as e:
        raise UserError(f"weights in {checkpoint.folder} do not match config.json: {e}") from None
    mx.eval(model.parameters())
    return names


def _quantize_like_checkpoint(model: nn.Module, checkpoint: Checkpoint, names: list[str],
                              config: ModelConfig) -> None:
    """Swap Linear/Embedding modules for quantized ones where the checkpoint stores them
    MLX-quantized (a `.scales` tensor beside the packed uint32 `.weight`)."""
    quantized = {}
    for name in names:
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            settings = config.quantization_for(module)
            group_size = settings["group_size"] if settings else 64
            weight = checkpoint.tensors[module + ".weight"].shape
            in_features = checkpoint.tensors[name].shape[-1] * group_size
            bits = settings["bits"] if settings else weight[-1] * 32 // in_features
            quantized[local_name(module + ".weight", model.start).removesuffix(".weight")] = {
                "group_size": group_size, "bits": bits}
    if quantized:
        nn.quantize(model, class_predicate=lambda path, _: quantized.get(path, False))
