"""The prompt cache on disk (serve --prompt-cache-dir): one rank's share of the prefix cache's entries
as files, so that a restarted server starts a request from the caches an earlier run kept.

Each rank stores, for an entry, the whole state of its own layers' caches in a file of its own, as the
caches name it (their `state_arrays`: a KV cache's keys and values, which grow with the positions; a
linear-attention layer's convolution window and recurrent memory, or DeepSeek V4's window of keys and
compressed series, fixed or not, each array with its own dtype: Stage.stored_arrays), named by
the model's identity, the entry's key (a hash of its token ids), the rank's layer range and its
tensor-parallel shard (member and T: under --tensor-parallel each member of a stage's group stores its
own share, on its leader's word, tensor_group.py). Rank 0 alone decides what is written, read and
removed, and tells the ring in order (scheduler.py); this module is what one rank does with its
files: the format, the checks, and a writer thread, with no MPI.

A file (format 2): 8 magic bytes, the header's length (8 bytes, little-endian), a JSON header (the
model's identity, the layer range, the shard, the entry key, the positions held, rank 0's copy of the
token ids, each array's name, dtype, shape and positions axis (None: a state that cannot be cut to a
shorter prefix), the payload's size and its BLAKE2b digest, of the positions and arrays' layout too), then the payload: each array's bytes in
order. An entry whose arrays all have a positions axis can start any shorter prefix; any other only
its whole length. Format 1's files (KV arrays of one dtype) are not read: the format is part of the
model's identity (their names differ) and of the magic bytes. No pickle: reading a file runs no code. A file that is truncated, belongs to
another model or rank, does not match its own name or fails its digest is skipped with one warning,
never trusted; the folder must be private to the user (private_folder.py), since another user's file
there could poison the keys and values.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import stat
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..util.errors import UserError
from ..util.private_folder import make_private_folder, unsafe_folder, writable_by_others

MAGIC = b"PLKV\x00\x02\r\n"  # format 2; the \r\n catches a file mangled by a text-mode copy
FORMAT = 2
SUFFIX = ".kv"
IDENTITY_SAMPLE = 1 << 20  # bytes hashed at each end of a weight file: a changed file changes the identity
WRITER_NICENESS = 19  # the writer thread's: a rank's core is the ring's first (a write slowed decode 2x at 0)
MAX_HEADER = 64 << 20  # a header longer than this is not ours (token ids of a 1M-token context fit)
# The arrays' dtypes as stored: numpy's, bfloat16 (which numpy lacks) as its raw uint16 bits.
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int64": np.int64,
          "int32": np.int32, "uint32": np.uint32, "uint8": np.uint8, "bool": np.bool_}


class StateArray(NamedTuple):
    """One named array of a cache's state as stored: `data` in numpy (bfloat16 as its raw uint16 bits),
    `dtype` the cache's dtype name, `axis` the positions axis where the array can be cut to a shorter
    prefix along it (it holds at least the entry's positions there: the store cuts it), else None."""
    name: str
    data: np.ndarray
    dtype: str
    axis: int | None


def model_identity(files: list[Path], settings: dict) -> str:
    """A hex digest naming the model as this rank computes with it: each file's name, size, and a
    hash of its first and last MiB (not the whole file: weights run to hundreds of GB), and the
    settings that change the cached values beyond float rounding (dtype, quantization, int8)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps({"format": FORMAT, **settings}, sort_keys=True).encode())
    for path in sorted(files, key=lambda p: p.name):
        size = path.stat().st_size
        digest.update(f"\0{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(IDENTITY_SAMPLE))
            if size > IDENTITY_SAMPLE:
                f.seek(max(IDENTITY_SAMPLE, size - IDENTITY_SAMPLE))
                digest.update(f.read(IDENTITY_SAMPLE))
    return digest.hexdigest()


def entry_key(tokens) -> int:
    """An entry's key: 63 bits of a hash of its token ids (an int64 on the ring). Two token lists
    with one key make one entry, the later replacing the earlier on every rank alike; rank 0 matches
    prompts against the token ids themselves, never the key."""
    data = np.asarray(list(tokens), dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class Stored:
    """What the start-up scan learned of one of this rank's files (its header, not its payload)."""
    key: int
    positions: int
    tokens: tuple[int, ...] | None  # rank 0's files carry the token ids; the other ranks' the key only
    last_used: float  # the file's modification time: refreshed when it is read
    whole: bool = False  # a state that cannot be cut: it starts only a prefix of all its positions

    @property
    def points(self) -> tuple[int, ...] | None:
        """Its resume points for the index (prefix_cache.StoredIndex): None where any length."""
        return (self.positions,) if self.whole else None


class Unusable(Exception):
    """A file that must not be used, and why (for the one warning)."""


class PromptCacheStore:
    """One rank's files in the folder: `model` (model_identity), `layers` (its [start, end) range),
    `shard` (its tensor-parallel shard, index and count)."""

    def __init__(self, folder: Path, model: str, layers: tuple[int, int], shard: tuple[int, int] = (0, 1)):
        self.folder = Path(folder)
        self.model, self.layers, self.shard = model, tuple(layers), tuple(shard)
        try:
            make_private_folder(self.folder)
        except OSError as e:
            raise UserError(f"--prompt-cache-dir {folder} cannot be made: {e.strerror or e}") from None
        why = unsafe_folder(self.folder)
        if why:
            raise UserError(f"--prompt-cache-dir is refused: {why}; another user could plant keys and values "
                            f"there (make it yours and chmod go-w, or name another folder)")
        self.pattern = re.compile(rf"{self.model[:16]}-([0-9a-f]{{16}})-L{self.layers[0]}-{self.layers[1]}"
                                  rf"-tp{self.shard[0]}of{self.shard[1]}{re.escape(SUFFIX)}")
        self.warnings: list[str] = []  # said once each, on stderr (kept for the tests)
        self._jobs: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self.written = 0  # files written so far
        self.written_bytes = 0
        self.write_s = 0.0  # seconds the writer spent (off the scheduler's thread)

    # -- names -------------------------------------------------------------------------------------------------

    def path(self, key: int) -> Path:
        return self.folder / (f"{self.model[:16]}-{key:016x}-L{self.layers[0]}-{self.layers[1]}"
                              f"-tp{self.shard[0]}of{self.shard[1]}{SUFFIX}")

    def warn(self, path: Path, why: str) -> None:
        line = f"warning: prompt cache: {path.name}: {why}; skipped, the request runs without it"
        self.warnings.append(line)
        print(line, file=sys.stderr, flush=True)

    # -- start-up --------------------------------------------------------------------------------------------

    def scan(self) -> dict[int, Stored]:
        """This rank's files for this model, layer range and shard, by key: headers checked against
        their names and sizes (a truncated file shows here), payloads left for `load`. Files of other
        models or splits are left alone; a half-written file of an earlier run is removed."""
        found = {}
        for path in sorted(self.folder.iterdir()):
            if path.name.startswith(self.model[:16]) and ".tmp" in path.name:
                _remove(path)  # a write cut short by a crash: never renamed into place
                continue
            match = self.pattern.fullmatch(path.name)
            if not match:
                continue
            try:
                with open(path, "rb") as f:
                    header, _ = self._header(f, int(match.group(1), 16))
                    mtime = os.fstat(f.fileno()).st_mtime
            except Unusable as e:
                self.warn(path, str(e))
                continue
            except OSError as e:
                self.warn(path, f"cannot be read ({e.strerror or e})")
                continue
            tokens = tuple(header["tokens"]) if header.get("tokens") is not None else None
            whole = any(a["axis"] is None for a in header["arrays"])
            found[header["key"]] = Stored(header["key"], header["positions"], tokens, mtime, whole)
        return found

    def _header(self, f, key: int) -> tuple[dict, int]:
        """The file's header, checked against what its name says and its size; and the payload's offset."""
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise Unusable("not a regular file")
        why = writable_by_others(st)
        if why:
            raise Unusable(f"another user could have written it: {why}")
        start = f.read(16)
        if len(start) >= 16 and start[:5] == MAGIC[:5] and start[5] != MAGIC[5]:
            raise Unusable(f"written in format {start[5]} of this program (this version reads {FORMAT})")
        if len(start) < 16 or start[:8] != MAGIC:
            raise Unusable("not a prompt-cache file of this format (truncated, or another program's)")
        (length,) = struct.unpack("<Q", start[8:])
        if length > MAX_HEADER:
            raise Unusable("its header is too long to be ours")
        raw = f.read(length)
        if len(raw) < length:
            raise Unusable("truncated in its header")
        try:
            header = json.loads(raw)
            expected = {"format": FORMAT, "model": self.model, "layers": list(self.layers),
                        "shard": list(self.shard), "key": key}
            if any(header.get(name) != value for name, value in expected.items()):
                raise Unusable("its header names another model, layer range, shard or entry than its file name")
            positions, payload = int(header["positions"]), int(header["payload_bytes"])
            arrays = header["arrays"]
            if (not isinstance(header["blake2b"], str) or not arrays
                    or any(a["dtype"] not in DTYPES or not isinstance(a["name"], str) for a in arrays)
                    or len({a["name"] for a in arrays}) != len(arrays)):
                raise Unusable("its header is not one this version writes")
            sizes = [int(np.prod(a["shape"], dtype=np.int64)) * np.dtype(DTYPES[a["dtype"]]).itemsize for a in arrays]
            if (sum(sizes) != payload or any(min(a["shape"], default=0) < 0 for a in arrays)
                    or any(a["axis"] is not None and a["shape"][a["axis"]] != positions for a in arrays)):
                raise Unusable("its header's arrays do not add up")
            if header.get("tokens") is not None and (len(header["tokens"]) != positions
                                                     or entry_key(header["tokens"]) != key):
                raise Unusable("its token ids do not match its key")
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise Unusable(f"its header cannot be read ({type(e).__name__})") from None
        offset = 16 + length
        if st.st_size != offset + payload:
            raise Unusable(f"{st.st_size} bytes where its header says {offset + payload} (truncated?)")
        return header, offset

    def remove(self, keys) -> None:
        """Remove these entries' files (queued behind the writes, so they stay in order)."""
        self._submit(("remove", list(keys)))

    # -- writing ---------------------------------------------------------------------------------------------

    def save(self, key: int, positions: int, arrays: list, dtype: str | None = None, tokens=None) -> None:
        """Queue an entry's file: `arrays` (StateArray each: views of the live caches, those with a
        positions axis cut to `positions` and all copied by the writer, off the caller's thread; nothing
        may write to them meanwhile; a bare numpy array is a KV cache's keys or values, [1, heads,
        >= positions, dim] in `dtype`); `tokens`: rank 0's token ids."""
        arrays = [a if isinstance(a, StateArray) else StateArray(str(i), a, dtype, 2) for i, a in enumerate(arrays)]
        self._submit(("save", key, positions, arrays, None if tokens is None else list(tokens)))

    def _submit(self, job) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_jobs, name="prompt-cache-writer", daemon=True)
            self._writer.start()
        self._jobs.put(job)

    def flush(self) -> None:
        """Wait until every queued write and removal is done."""
        if self._writer is not None:
            self._jobs.join()

    def close(self) -> None:
        self.flush()

    def _write_jobs(self) -> None:
        try:  # the scheduler's thread first: this one takes what CPU it leaves (Linux: niceness per thread)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except (AttributeError, OSError):
            pass
        while True:
            job = self._jobs.get()
            try:
                started = time.perf_counter()
                if job[0] == "save":
                    self._write(*job[1:])
                    self.written += 1
                else:
                    for key in job[1]:
                        _remove(self.path(key))
                self.write_s += time.perf_counter() - started
            except OSError as e:  # a full disk: the entry is not stored, and its load will fail (cold, not wrong)
                print(f"warning: prompt cache: cannot write to {self.folder}: {e.strerror or e}", file=sys.stderr,
                      flush=True)
            finally:
                self._jobs.task_done()

    def _write(self, key: int, positions: int, arrays: list[StateArray], tokens) -> None:
        """One array at a time (a layer's keys or values: the copy the writer holds stays small), the
        digest written into the header once the payload is all out (its hex has a fixed length)."""
        arrays = [a._replace(data=_cut(a.data, a.axis, positions)) for a in arrays]
        described = [{"name": a.name, "dtype": a.dtype, "shape": list(a.data.shape), "axis": a.axis} for a in arrays]
        fields = {"format": FORMAT, "model": self.model, "layers": list(self.layers), "shard": list(self.shard),
                  "key": key, "positions": positions, "tokens": tokens, "arrays": described,
                  "payload_bytes": sum(a.data.size * np.dtype(DTYPES[a.dtype]).itemsize for a in arrays),
                  "blake2b": "0" * 2 * hashlib.blake2b().digest_size}
        header = json.dumps(fields).encode()
        final = self.path(key)
        temporary = final.with_name(f"{final.name}.tmp{os.getpid()}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(header)) + header)
                digest = _layout_digest(positions, described)
                for array in arrays:
                    if not array.data.size:
                        continue  # (an empty state: nothing to write, and memoryview refuses its shape)
                    part = memoryview(np.ascontiguousarray(array.data, DTYPES[array.dtype]).reshape(-1)).cast("B")
                    digest.update(part)  # hashlib and write leave the GIL to the scheduler's thread
                    f.write(part)
                fields["blake2b"] = digest.hexdigest()
                f.seek(len(MAGIC) + 8)
                f.write(json.dumps(fields).encode())  # the same length: only the digest's hex changed
            os.replace(temporary, final)  # a reader sees the whole file or none
            self.written_bytes += fields["payload_bytes"]
        except BaseException:
            _remove(temporary)
            raise

    # -- reading ---------------------------------------------------------------------------------------------

    def load(self, key: int, positions: int) -> list[StateArray] | None:
        """An entry's arrays cut to its first `positions` positions (those with a positions axis; an
        entry with any other starts only its whole length), after every check (header, size, digest
        of the payload); None, with one warning, where any fails."""
        self.flush()  # an entry written by this run may still be in the writer's queue
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                header, offset = self._header(f, key)
                if header["positions"] < positions:
                    raise Unusable(f"it holds {header['positions']} positions, {positions} were asked for")
                if header["positions"] != positions and any(a["axis"] is None for a in header["arrays"]):
                    raise Unusable(f"its states resume only all its {header['positions']} positions, "
                                   f"{positions} were asked for")
                payload = bytearray(header["payload_bytes"])
                if f.readinto(payload) != len(payload):
                    raise Unusable("truncated in its payload")
            digest = _layout_digest(header["positions"], header["arrays"])
            digest.update(payload)
            if digest.hexdigest() != header["blake2b"]:
                raise Unusable("its payload does not match its checksum")
            os.utime(path)  # recently used: last out when the folder is over its bound
        except Unusable as e:
            self.warn(path, str(e))
            return None
        except OSError as e:
            self.warn(path, f"cannot be read ({e.strerror or e})")
            return None
        arrays, at = [], 0
        for a in header["arrays"]:
            dtype, count = np.dtype(DTYPES[a["dtype"]]), int(np.prod(a["shape"], dtype=np.int64))
            data = np.frombuffer(payload, dtype=dtype, count=count, offset=at).reshape(a["shape"])
            arrays.append(StateArray(a["name"], _cut(data, a["axis"], positions), a["dtype"], a["axis"]))
            at += count * dtype.itemsize
        return arrays


def _layout_digest(positions: int, arrays: list[dict]):
    """A BLAKE2b digest begun with the entry's positions and arrays' names, dtypes, shapes and axes, so
    that a header changed in them (a shape permuted, a dtype of the same size) fails the checksum too."""
    return hashlib.blake2b(json.dumps([positions, arrays]).encode())


def _cut(data: np.ndarray, axis: int | None, positions: int) -> np.ndarray:
    """An array's first `positions` positions along its positions axis (a view); a fixed state as it is."""
    if axis is None:
        return data
    return data[(slice(None),) * axis + (slice(0, positions),)]


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
