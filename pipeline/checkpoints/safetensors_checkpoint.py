"""A model folder's safetensors files as a `Checkpoint`: every tensor indexed from the files'
headers, and read, each rank only its own.

We parse the safetensors headers ourselves (an 8-byte header length, a JSON header of
name -> dtype/shape/byte range, then raw bytes) to index every tensor and check each file holds
the bytes its header promises (naming the file when one is truncated). The bytes themselves are
mapped (mapped_files.py: arrays over the page cache's pages, no copy), or where that is not available
read by MLX (`mx.load`, lazily: at evaluation, straight into the array's own memory, and only for the
arrays evaluated), so a rank reads exactly its tensors' bytes with no copy in between; loading.py
evaluates them in groups.

Indexing loads no MLX (the planner reads an MLX folder's headers, and gguf_checkpoint.py's index builds
on this class): MLX is imported where arrays are made.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..models.config import ModelConfig
from ..util.errors import UserError
from .tensor_names import canonical_tensors

if TYPE_CHECKING:  # annotations only
    import mlx.core as mx

# safetensors dtype -> (numpy dtype to read the bytes as, name of the mlx dtype to view them as; by name,
# so that indexing a folder loads no MLX)
_DTYPES = {
    "F32": (np.float32, "float32"),
    "F16": (np.float16, "float16"),
    "BF16": (np.uint16, "bfloat16"),
    "F64": (np.float64, "float32"),
    "U32": (np.uint32, "uint32"),
    "I32": (np.int32, "int32"),
    "I64": (np.int64, "int64"),
    "U8": (np.uint8, "uint8"),
    "I8": (np.int8, "int8"),
    "F8_E4M3": (np.uint8, "uint8"),  # raw bytes; dequantized by the format adapter
    "F8_E8M0": (np.uint8, "uint8"),  # ue8m0 scales: exponent bytes, 2 ** (byte - 127)
    "BOOL": (np.bool_, "bool_"),
}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int
    key: str = ""  # its name in the file (the index's names are canonical_tensors')
    whole: bool = True  # False: a share of the tensor (checkpoints/share_reads.py), read by its byte range

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
            header = read_header(path)
            for name, info in header.items():
                if names is None or name in names:
                    self.tensors[name] = info
        self.tensors = canonical_tensors(self.tensors)
        self._lazy: dict[tuple, dict[str, mx.array] | None] = {}  # (file, stream) -> mx.load's arrays
        self._mapped: bool | None = None  # whether read() maps the files (known at the first read)
        self.bytes_read = 0  # the tensors' bytes read() returned (their shares' where share_reads narrows them)

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

    def model_config(self):
        """The model's architecture (config.json)."""
        return ModelConfig.from_folder(self.folder)

    def in_huge_pages(self, name: str) -> bool:
        """Whether the tensor `name` (read already) is in a buffer of its own in huge pages (a GGUF's decoded
        weights): the int8 repack then keeps it there, in place."""
        return False

    def loaded(self, names: list[str]) -> None:
        """Called once a rank has loaded `names` (a GGUF reports what it re-quantized)."""
        self._lazy.clear()  # closes the files

    def read(self, name: str) -> mx.array:
        """The tensor as stored (BF16 as bfloat16, FP8 and ue8m0 as uint8 bytes): over its file's
        mapped pages (mapped_files.py), else lazily: its bytes read when it is evaluated, on the
        stream current now."""
        import mlx.core as mx  # here, where arrays are made: indexing a folder (`pipeline plan`) loads no MLX

        info = self.tensors[name]
        self.bytes_read += info.nbytes
        if self._mapped is None:
            from ..kernels import mapped_files  # loads mlx.core, as the import above

            self._mapped = mapped_files.available()
        if self._mapped and info.dtype != "F64":  # F64 is read as float32
            from ..kernels.mapped_files import mapped_array  # loads mlx.core, as the import above

            try:
                array = mapped_array(info.file, info.begin, info.shape, getattr(mx, _DTYPES[info.dtype][1]))
            except RuntimeError:  # cannot map (mmap refused, an MLX build whose buffers cannot wrap pages)
                array = None
            if array is not None:
                return array
        if not info.whole:  # mx.load reads whole tensors only
            return self._read_with_numpy(name, info)
        key = (info.file, str(mx.default_stream(mx.cpu)))  # str: a Stream hashes by object, not by value
        if key not in self._lazy:
            try:  # the header only: nothing is read until an array is evaluated
                self._lazy[key] = mx.load(str(info.file), format="safetensors")
            except (ValueError, RuntimeError):  # a dtype MLX cannot load (F64): numpy reads that file
                self._lazy[key] = None
        arrays = self._lazy[key]
        if arrays is None:
            return self._read_with_numpy(name, info)
        array = arrays.pop(info.key, None)  # popped: an evaluated array stays with its owner only
        if array is None:  # read before: the header again
            del self._lazy[key]
            self.bytes_read -= info.nbytes  # counted again by the call
            return self.read(name)
        return array

    def _read_with_numpy(self, name: str, info: TensorInfo) -> mx.array:
        with open(info.file, "rb") as f:
            f.seek(info.begin)
            data = f.read(info.nbytes)
        if len(data) != info.nbytes:
            raise UserError(f"{info.file} is truncated or corrupt (tensor {name}): download it again")
        return from_bytes(np.frombuffer(data, np.uint8), info.dtype, info.shape)

    def spans(self, name: str) -> list[tuple[Path, int, int]]:
        """The byte ranges (file, begin, end) reading `name` reads."""
        info = self.tensors[name]
        return [(info.file, info.begin, info.end)]


def from_bytes(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> mx.array:
    """A tensor of safetensors `dtype` from its raw bytes (uint8, row-major), as Checkpoint.read returns it (BF16's
    bits as bfloat16, FP8 and ue8m0 as uint8 bytes, F64 as float32)."""
    import mlx.core as mx  # here, where arrays are made, as in Checkpoint.read

    np_dtype, mx_dtype = _DTYPES[dtype][0], getattr(mx, _DTYPES[dtype][1])
    array = mx.array(data.view(np_dtype).reshape(shape))
    if dtype == "BF16":
        return array.view(mx.bfloat16)  # the bytes were read as uint16
    return array.astype(mx_dtype) if array.dtype != mx_dtype else array


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Every tensor a safetensors file's header names, each field checked against the file (one
    UserError line naming the file where it is truncated or corrupt); no tensor data is read."""
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
    if not isinstance(header, dict):
        raise UserError(f"{path} is corrupt (its safetensors header is not a JSON object): download it again")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or entry["dtype"] not in _DTYPES:
            raise UserError(f"{path}: tensor {name} has unsupported dtype "
                            f"{entry.get('dtype') if isinstance(entry, dict) else entry!r}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        # every field checked: a mapped tensor (mapped_files.py) is exactly the bytes its header names, so a
        # header whose shape and byte range disagree would read its neighbour's bytes where mx.load refused
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and o >= 0 for o in offsets) and offsets[0] <= offsets[1]
                and offsets[1] - offsets[0] == math.prod(shape) * np.dtype(_DTYPES[entry["dtype"]][0]).itemsize):
            raise UserError(f"{path} is corrupt (tensor {name}: shape {shape} does not fit its byte range "
                            f"{offsets}): download it again")
        begin, end = offsets
        tensors[name] = TensorInfo(path, entry["dtype"], tuple(shape), data_start + begin, data_start + end, name)
    if tensors and max(t.end for t in tensors.values()) > size:
        raise UserError(f"{path} is truncated or corrupt ({size} bytes, header needs "
                        f"{max(t.end for t in tensors.values())}): download it again")
    return tensors
