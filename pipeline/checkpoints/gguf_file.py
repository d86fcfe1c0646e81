"""The header of a GGUF file, or of a split set of them, read without touching tensor data.

A GGUF file is a header (magic, version, counts, key/value metadata, then one entry per tensor:
name, dimensions, GGML type, offset) followed, at the next multiple of `general.alignment`, by
the tensors' bytes. We parse the header ourselves, reading only its bytes, so that `plan`,
`preflight` and every rank learn names, shapes, types and byte ranges without mapping or reading
any tensor, and so that a truncated or foreign file is one clear line.

llama.cpp's gguf-split names the parts of a large model `NAME-00001-of-00009.gguf`, ...; each
part has its own header, the first one all the metadata, and `split.count` says how many.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..util.errors import UserError

SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_DEFAULT_ALIGNMENT = 32
_READ_STEP = 1 << 20

# GGUF value types: id -> struct format (None: string/array, read specially)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as a GGUF header describes it."""
    name: str
    ggml_type: str  # "Q4_K", "F32", ...
    shape: tuple[int, ...]  # numpy order: rows first, the row (GGML's ne[0]) last
    file: Path
    begin: int  # absolute byte offset in `file`
    nbytes: int

    @property
    def rows(self) -> int:
        n = 1
        for d in self.shape[:-1]:
            n *= d
        return n

    @property
    def cols(self) -> int:
        return self.shape[-1]


@dataclass
class GGUFModel:
    """A GGUF model, one file or a split set: the first part's metadata, every part's tensors."""
    path: Path  # the file the user named
    parts: list[Path]
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    header_bytes: dict[Path, int] = field(default_factory=dict)  # bytes before each part's tensor data

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def nbytes_on_disk(self) -> int:
        return sum(part.stat().st_size for part in self.parts)


def open_gguf(path: Path | str) -> GGUFModel:
    """Read the header of `path` and of the rest of its split set. One `UserError` line for a
    missing or truncated part, a foreign file or an unknown tensor type. The last one read is kept
    (the tokenizer and the checkpoint of a rank both need it) while its files are unchanged."""
    path = Path(path)
    parts = split_parts(path)
    key = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in parts)
    if _last[0] == key:
        return _last[1]
    model = _read_model(path, parts)
    _last[:] = [key, model]
    return model


_last: list = [None, None]


def _read_model(path: Path, parts: list[Path]) -> GGUFModel:
    metadata: dict[str, Any] = {}
    tensors: dict[str, GGUFTensor] = {}
    header_bytes = {}
    for i, part in enumerate(parts):
        meta, part_tensors, header_bytes[part] = read_header(part)
        if i == 0:
            metadata = meta
        count = meta.get("split.count")
        if len(parts) > 1 and count is not None and (int(count) != len(parts) or int(meta.get("split.no", i)) != i):
            raise UserError(f"{part}: its metadata says part {int(meta.get('split.no', i)) + 1} of {count}, but its "
                            f"name says part {i + 1} of {len(parts)}: rename the parts as gguf-split wrote them")
        for tensor in part_tensors:
            if tensor.name in tensors:
                raise UserError(f"{part}: tensor {tensor.name} is also in {tensors[tensor.name].file.name}: "
                                "the parts belong to different models")
            tensors[tensor.name] = tensor
    if len(parts) == 1 and int(metadata.get("split.count", 1)) > 1:
        raise UserError(f"{path} is part of a split GGUF ({metadata['split.count']} parts) but not named "
                        "NAME-00001-of-NNNNN.gguf as gguf-split names the parts: rename it so the others can be found")
    return GGUFModel(path, parts, metadata, tensors, header_bytes)


def split_parts(path: Path) -> list[Path]:
    """All files of the split set `path` belongs to (gguf-split's naming), or just `path`."""
    if not path.is_file():
        what = "is a folder, not a GGUF file" if path.is_dir() else "does not exist"
        raise UserError(f"GGUF file {path} {what}")
    m = SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    parts = [path.with_name(f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise UserError(f"split GGUF {parts[0].name}: part{'s' * (len(missing) > 1)} {', '.join(missing)} "
                        f"missing from {path.parent}: download {'them' if len(missing) > 1 else 'it'} beside the others")
    return parts


class _Reader:
    """Sequential reads over a file's first bytes, reading more as the header needs it."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "rb")
        self.buffer = b""
        self.pos = 0

    def fill(self, n: int) -> None:
        """Make the next `n` bytes available in the buffer."""
        while self.pos + n > len(self.buffer):
            more = self.file.read(max(_READ_STEP, self.pos + n - len(self.buffer)))
            if not more:
                raise UserError(f"{self.path} is truncated: it ends inside its header: download it again")
            self.buffer = self.buffer[self.pos:] + more
            self.pos = 0

    def take(self, n: int) -> bytes:
        self.fill(n)
        data = self.buffer[self.pos:self.pos + n]
        self.pos += n
        return data

    def strings(self, n: int) -> list[str]:
        """n strings in a row (a vocabulary, its merges): the header's bulk, read in one tight loop."""
        out = []
        length_at = struct.Struct("<Q").unpack_from
        for _ in range(n):
            if self.pos + 8 > len(self.buffer):
                self.fill(8)
            (length,) = length_at(self.buffer, self.pos)
            if self.pos + 8 + length > len(self.buffer):
                if length > 1 << 30:
                    raise UserError(f"{self.path} is corrupt (a {length}-byte string in its header): download it again")
                self.fill(8 + length)
            start = self.pos + 8
            out.append(self.buffer[start:start + length].decode("utf-8", errors="replace"))
            self.pos = start + length
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > 1 << 30:
            raise UserError(f"{self.path} is corrupt (a {n}-byte string in its header): download it again")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, n = self.scalar("<I"), self.scalar("<Q")
            if item_kind in _SCALARS:  # one unpack for the whole array (token types, scores)
                fmt = _SCALARS[item_kind]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{n}{fmt[1]}", self.take(n * size)))
            if item_kind == _STRING:
                return self.strings(n)
            return [self.value(item_kind) for _ in range(n)]
        raise UserError(f"{self.path} is corrupt (unknown metadata value type {kind}): download it again")


def read_header(path: Path) -> tuple[dict[str, Any], list[GGUFTensor], int]:
    """(metadata, tensors, bytes before the tensor data) of one GGUF file."""
    # Here, not at the top: the gguf package takes ~40 ms to import, and every command's parser loads this module.
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        reader = _Reader(path)
    except OSError as err:
        raise UserError(f"cannot read GGUF file {path}: {err.strerror}") from err
    with reader.file:
        try:
            magic = reader.take(4)
        except UserError:
            magic = b""
        if magic != b"GGUF":
            raise UserError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        version = reader.scalar("<I")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version > 0xFFFF else ""
            raise UserError(f"{path}: GGUF version {version}{hint} is not supported (versions 2 and 3 are)")
        n_tensors, n_kv = reader.scalar("<Q"), reader.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("<I"))
        entries = []
        for _ in range(n_tensors):
            name = reader.string()
            n_dims = reader.scalar("<I")
            dims = [reader.scalar("<Q") for _ in range(n_dims)]
            type_id, offset = reader.scalar("<I"), reader.scalar("<Q")
            entries.append((name, dims, type_id, offset))
        end_of_header = reader.pos + reader.file.tell() - len(reader.buffer)
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT)) or _DEFAULT_ALIGNMENT
    data_start = -(-end_of_header // alignment) * alignment
    size = path.stat().st_size
    tensors = []
    for name, dims, type_id, offset in entries:
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise UserError(f"{path}: tensor {name} has GGML type id {type_id}, which the installed gguf package "
                            "does not know: upgrade it (pip install -U gguf)") from None
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        numel = 1
        for d in dims:
            numel *= d
        if not dims or dims[0] % block:
            raise UserError(f"{path}: tensor {name} has rows of {dims[0] if dims else 0} values, not a multiple of "
                            f"its {ggml_type.name} block of {block}: the file is corrupt")
        tensor = GGUFTensor(name, ggml_type.name, tuple(reversed(dims)), path, data_start + offset,
                            numel // block * type_size)
        if tensor.begin + tensor.nbytes > size:
            raise UserError(f"{path} is truncated: tensor {name} ends at byte {tensor.begin + tensor.nbytes} but the "
                            f"file has {size} bytes: download it again")
        tensors.append(tensor)
    return metadata, tensors, data_start
