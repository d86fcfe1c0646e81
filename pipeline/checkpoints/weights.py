"""Reading a rank's tensors, and only those, from a model folder's safetensors files.

We parse the safetensors headers ourselves (an 8-byte header length, a JSON header of
name -> dtype/shape/byte range, then raw bytes) to index every tensor, check each file holds
the bytes its header promises (naming the file when one is truncated), and split layers by
bytes. The bytes themselves are mapped (mapped_files.py: arrays over the page cache's pages, no
copy), or where that is not available read by MLX (`mx.load`, lazily: at evaluation, straight into
the array's own memory, and only for the arrays evaluated), so a rank reads exactly its
tensors' bytes with no copy in between; loading.py evaluates them in groups.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..kernels import qmm
from ..kernels.int8_layout import packed_layout
from ..models import deepseek_v4_names
from ..util.errors import UserError
from .formats import Requantize
from .int8_repack import Int8WhileLoading

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
    "F8_E8M0": (np.uint8, mx.uint8),  # ue8m0 scales: exponent bytes, 2 ** (byte - 127)
    "BOOL": (np.bool_, mx.bool_),
}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ENDS = ("model.embed_tokens.", "model.norm.", "lm_head.", "model.hc_head.")


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int
    key: str = ""  # its name in the file (the index's names are canonical_tensors')

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
        from ..models.config import ModelConfig

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
        info = self.tensors[name]
        if self._mapped is None:
            from ..kernels import mapped_files

            self._mapped = mapped_files.available()
        if self._mapped and info.dtype != "F64":  # F64 is read as float32
            from ..kernels.mapped_files import mapped_array

            try:
                array = mapped_array(info.file, info.begin, info.shape, _DTYPES[info.dtype][1])
            except RuntimeError:  # cannot map (mmap refused, an MLX build whose buffers cannot wrap pages)
                array = None
            if array is not None:
                return array
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
            return self.read(name)
        return array

    def _read_with_numpy(self, name: str, info: TensorInfo) -> mx.array:
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

    def spans(self, name: str) -> list[tuple[Path, int, int]]:
        """The byte ranges (file, begin, end) reading `name` reads."""
        info = self.tensors[name]
        return [(info.file, info.begin, info.end)]


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


# ---- checkpoint names -> the names the loader works with ----------------------------------------
# Every layout is read under one set of names, transformers' in-memory ones (`model.layers.N.X`,
# `model.embed_tokens.weight`, `lm_head.weight`): a rank finds its layers by those, and the format
# adapters and modules see the same names whatever the folder's publisher wrote.

# Multimodal wrappers (Kimi K2.5): the language model under a prefix, the vision tower and its
# projector beside it, never read. transformers 5 saves Kimi K2.5 as published but with "layers"
# spelled "blocks" (its conversion renames blocks -> layers everywhere, and saving inverts that).
_WRAPPED = ((re.compile(r"^language_model\.model\.(?:layers|blocks)\."), "model.layers."),
            (re.compile(r"^language_model\.model\."), "model."),
            (re.compile(r"^language_model\.lm_head\."), "lm_head."),
            (re.compile(r"^model\.language_model\."), "model."))
_NEVER_RUN = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


def canonical_tensors(tensors: dict) -> dict:
    """A checkpoint's tensors under the loader's names (see above; DeepSeek's own names are mapped by
    models/deepseek_v4_names.py); a wrapper's vision tower and projector are left out, so no rank
    ever reads them."""
    native = deepseek_v4_names.uses_native_names(tensors)
    renamed = {}
    for name, info in tensors.items():
        new = deepseek_v4_names.transformers_name(name) if native else _wrapped_name(name)
        if new is not None:
            renamed[new] = info
    return renamed


def _wrapped_name(name: str) -> str | None:
    if name.startswith(_NEVER_RUN):
        return None
    for pattern, prefix in _WRAPPED:
        if pattern.match(name):
            return pattern.sub(prefix, name, count=1)
    return name


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


def _head_prefix(config) -> str:
    """Checkpoint prefix of the LM head's tensors: the embedding's, when tied."""
    return "model.embed_tokens." if config.tie_word_embeddings else "lm_head."


def head_tensor_names(checkpoint: Checkpoint, config) -> list[str]:
    """The checkpoint tensors of the LM head."""
    return sorted(name for name in checkpoint.tensors if name.startswith(_head_prefix(config)))


def _keep_head_rows(weights: dict[str, mx.array], rows: int, prefix: str) -> None:
    """The LM head's tensors (weight, and scales/biases if quantized: one row per vocabulary
    entry) cut to their last `rows` rows, renamed to the `head_share` module."""
    for name in [n for n in weights if n.startswith(prefix)]:
        array = weights.pop(name)
        weights["head_share." + name[len(prefix):]] = mx.array(array[-rows:])  # a copy: the rest is freed


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


def load_slice(model: nn.Module, checkpoint: Checkpoint, dtype: mx.Dtype,
               requantize: Requantize | None = None, progress: bool = False, int8_in_place: bool | None = None
               ) -> list[str]:
    """Load this rank's tensors into `model` (a TransformerSlice), floats cast to `dtype`,
    through the format adapters (expert stacking, FP8, INT4, re-quantization).
    int8_in_place: not None, the layers' quantized matrices take the int8 layout as they are read
    (int8_repack.Int8WhileLoading; True: in the buffers they were read into).
    Returns the checkpoint names read, so callers (and tests) can see exactly what was loaded."""
    from .loading import load_tensors

    after_group = int8 = None
    if int8_in_place is not None:
        int8 = Int8WhileLoading(model, lambda name: int8_in_place or checkpoint.in_huge_pages(name))

        def after_group(weights: dict, names: list[str]) -> None:
            int8(weights, {name: local_name(name, model.start) for name in names})

    names = owned_tensor_names(checkpoint, model.start, model.end, model.has_ends)
    if model.head_rows:  # the last rank's share of the LM head (head_share.py), and the final norm
        norm = [name for name in checkpoint.tensors if name.startswith("model.norm.")]
        names = sorted(set(names) | set(head_tensor_names(checkpoint, model.config)) | set(norm))
    weights = {local_name(name, model.start): array
               for name, array in load_tensors(checkpoint, names, dtype, requantize,
                                               getattr(model, "keeps_float32", None), progress,
                                               after_group=after_group).items()}
    checkpoint.loaded(names)
    if model.head_rows:
        _keep_head_rows(weights, model.head_rows, _head_prefix(model.config).removeprefix("model."))
    fill_module(model, weights, f"weights in {checkpoint.folder}")
    if int8 is not None:
        int8.mark(model)
    return names


def fill_module(module: nn.Module, weights: dict[str, mx.array], what: str) -> None:
    """Put loaded arrays (module-local names) into `module`: its layers quantized as the arrays are,
    every parameter required, then each submodule's `after_load`. `what` names the source in the
    one-line error when the arrays do not fit the module config.json describes."""
    try:
        _quantize_like(module, weights)
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise UserError(f"{what} do not match config.json: {e}") from None
    weights.clear()
    for sub in module.modules():
        if hasattr(sub, "after_load"):
            sub.after_load()
    mx.eval(module.parameters())


def _quantize_like(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Swap Linear/Embedding/SwitchLinear modules for quantized ones where the loaded tensors
    are MLX-quantized (a `.scales` beside a packed uint32 `.weight`). Group size and bits
    follow from the shapes: the module knows its input width."""
    modules = dict(model.named_modules())
    settings = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        path = name[: -len(".scales")]
        module = modules.get(path)
        if module is None or not hasattr(module, "to_quantized"):
            continue
        in_features = module.weight.shape[-1]
        packed = weights[path + ".weight"].shape[-1]
        layout = packed_layout(in_features, packed, scales.shape[-1])
        if layout is None:
            # The module's input width comes from config.json; the packed shapes fit no MLX layout of it.
            raise ValueError(f"{path}.weight is packed as {packed} uint32 with {scales.shape[-1]} scales per row, "
                             f"which no MLX quantization of {in_features} inputs (from config.json) gives")
        group_size, bits = layout
        # e8m0 byte scales, no biases: MLX's mxfp4 / mxfp8 (a GGUF's MXFP4, DeepSeek V4's FP4 and FP8)
        mode = "affine" if path + ".biases" in weights else {4: "mxfp4", 8: "mxfp8"}.get(bits, "affine")
        settings[path] = {"group_size": group_size, "bits": bits, "mode": mode}
    if settings:
        nn.quantize(model, class_predicate=lambda path, _: settings.get(path, False))
        qmm.use_in(model)  # their products through pipeline's kernels where built (qmm.py)


# ---- how a rank's weights live in memory (--weights-in-memory) ------------------------------
# MLX's CPU quantized matmul does not use BLAS and costs about as much per row as a whole
# matvec, so prefill and batches run many times faster on weights dequantized once at load and
# multiplied by the BLAS; a dense copy costs 32/bits times the memory, hence a per-rank choice.

WEIGHTS_IN_MEMORY = ("quantized", "fp32", "auto")


def is_quantized(checkpoint: Checkpoint) -> bool:
    return any(name.endswith(".scales") for name in checkpoint.tensors)


def dequantize_slice(model: nn.Module, dtype: mx.Dtype) -> int:
    """Replace each MLX-quantized module of `model` by its dense equivalent, weights
    dequantized to `dtype`, one module at a time (the packed copy is freed as it goes).
    Returns the number of modules replaced."""
    from mlx.utils import tree_unflatten

    paths = [path for path, module in model.named_modules() if _is_quantized_module(module)]
    for path in paths:  # by path, so no list keeps the packed modules alive
        module = model
        for part in path.split("."):
            module = module[int(part)] if isinstance(module, list) else module[part]
        dense = _dense_module(module, dtype)
        mx.eval(dense.parameters())
        model.update_modules(tree_unflatten([(path, dense)]))
        del module, dense
        mx.clear_cache()  # give the packed copy back now, not after the whole slice is dense
    return len(paths)


def _is_quantized_module(module: nn.Module) -> bool:
    return isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or \
        type(module).__name__ == "QuantizedSwitchLinear"


def _dense_module(module: nn.Module, dtype: mx.Dtype) -> nn.Module:
    weight = mx.dequantize(module.weight, module.scales, module.get("biases"), group_size=module.group_size,
                           bits=module.bits, mode=getattr(module, "mode", "affine")).astype(dtype)
    if isinstance(module, nn.QuantizedLinear):
        out_features, in_features = weight.shape
        dense = nn.Linear(in_features, out_features, bias="bias" in module)
        if "bias" in module:
            dense.bias = module.bias.astype(dtype)
    elif isinstance(module, nn.QuantizedEmbedding):
        dense = nn.Embedding(*weight.shape)
    else:
        from ..models.experts import SwitchLinear

        experts, out_features, in_features = weight.shape
        dense = SwitchLinear(in_features, out_features, experts)
    dense.weight = weight  # the random init above is lazy and never computed
    return dense


def available_memory_bytes() -> int:
    """Memory this host can still give: MemAvailable, capped by a cgroup (v2 or v1) limit."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 0
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = open(limit_file).read().strip()
            usage = int(open(usage_file).read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            available = min(available, max(0, int(limit) - usage))
        break
    return available


def choose_dense(hosts: list[str], available: list[int], quantized_bytes: list[int],
                 dense_bytes: list[int], fraction: float = 0.75) -> list[bool]:
    """Which ranks hold their weights dense: per host, in rank order, while the host's
    quantized weights plus the dense ranks' extra bytes stay within `fraction` of its
    available memory (the rest is left for KV caches, activations and everything else)."""
    budget = {}
    for host, avail in zip(hosts, available):
        budget[host] = min(budget.get(host, avail), avail)  # ranks of a host read the same pool
    for host in budget:
        budget[host] = budget[host] * fraction - sum(q for h, q in zip(hosts, quantized_bytes) if h == host)
    dense = []
    for host, q, d in zip(hosts, quantized_bytes, dense_bytes):
        fits = d - q <= budget[host]
        if fits:
            budget[host] -= d - q
        dense.append(fits)
    return dense
