"""--tensor-parallel: a rank reads only its share of each tensor from a GGUF file.

A member's share of a matrix (models/tensor_parallel.py) is a range of its rows (output features:
q/k/v, gate/up, the LM head's vocabulary slice) or of its columns (input features: o_proj, down_proj).
Rows are contiguous in the file; a column share is a run of bytes in every row, `stride` bytes apart,
cut on the type's blocks (Q4_1: 32 values in 20 bytes; Q4_K, Q6_K, IQ4_XS and the i-quants: 256 values), so
it is read row by row (`StridedTensor`), whatever the rank then holds (MLX's layout, or the file's blocks).
A Qwen3-MoE expert stack [experts, rows, columns]: each expert's share of rows (gate/up) is a run of bytes an
expert, its share of columns (down) a run of every row, whole experts (--expert-parallel) one run.
`narrowed` swaps the index entries of the shared tensors for entries of their shares while a rank
loads (the decoders then read, decode and hold the share only); `widen` pads each share back to its
tensor's shape with zeros (untouched memory, never read from the file) so that the cut
(tensor_parallel.shard_weights) takes it out exactly as it takes a share of a whole tensor.

Where a share of a row is smaller than a page (4 KiB on Linux, 16 KiB on macOS), a column share still
touches every page of the tensor: the pages hold several rows, or the share's bytes of one row straddle
them (`pages_read` counts them; benchmarks/share_read_bytes.py reports them per rank). Other readers
(safetensors: its tensors are mapped, and the cut's copy reads the share's pages only) are read as before;
MLA families (DeepSeek, Kimi) read whole tensors and cut them.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import mmap
import re

import mlx.core as mx
import numpy as np

from ..models.expert_parallel import expert_share
from ..models.qwen3_moe import num_experts
from ..models import tensor_parallel_mla as mla
from ..models.tensor_parallel import MLA_TOOLS, Shard, head_share, mlp_share
from .gguf_file import GGUFTensor
from .safetensors_checkpoint import Checkpoint

_LAYER = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.(weight|scales|biases|bias)$")
_PARAMETER = re.compile(r"^model\.layers\.\d+\.(.+)\.(weight|scales|biases)$")
_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.switch_mlp\.(gate|up|down)_proj\.(weight|scales|biases)$")


def read_shares(names, config, shard: Shard, vocab_slice: tuple[int, int] | None = None,
                has_ends: bool = False) -> dict[str, tuple[int, int, int, int]]:
    """checkpoint name -> (axis, begin, end, of): the rows (-2) or columns (-1) of its matrix (HF layout, [out,
    in]: `of` rows or columns in all) that member `shard` holds, for the dense layers' projections (tensor_parallel.shard_weights' cuts,
    the union of a segmented attention's) and the LM head's vocabulary slice (vocab_slice; rank 0: an
    untied head's rows only, its tied embedding whole). Qwen3-MoE's expert stacks: each expert's rows or columns
    (-2, -1), or whole experts (-3, --expert-parallel). MLA families (DeepSeek, Kimi): tensor_parallel_mla.share_of's."""
    if mla.is_mla_family(config):
        return _mla_shares(names, config, shard, vocab_slice, has_ends)
    hd = config.head_dim
    heads = head_share(config.num_attention_heads, config.num_key_value_heads, shard)
    i0, i1 = mlp_share(config.intermediate_size, shard)
    shares = {}
    experts = num_experts(config)
    moe = int(config.raw.get("moe_intermediate_size") or 0)
    for name in names:
        m, stack = _LAYER.match(name), _EXPERTS.match(name)
        if stack and experts and shard.experts:  # whole experts [e0, e1) (--expert-parallel): one run of bytes
            shares[name] = (-3, *expert_share(experts, shard.size, shard.member), experts)
        elif stack and moe:  # each expert's rows (gate/up) or columns (down) of its intermediate features
            shares[name] = (-1 if stack.group(1) == "down" else -2, *mlp_share(moe, shard), moe)
        elif m:
            module, part = m.groups()
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                q = module == "self_attn.q_proj"
                (h0, h1), count = (heads.q, config.num_attention_heads) if q else (heads.kv, config.num_key_value_heads)
                shares[name] = (-2, h0 * hd, h1 * hd, count * hd)
            elif module == "self_attn.o_proj" and part != "bias":
                shares[name] = (-1, heads.q[0] * hd, heads.q[1] * hd, config.num_attention_heads * hd)
            elif module in ("mlp.gate_proj", "mlp.up_proj"):
                shares[name] = (-2, i0, i1, config.intermediate_size)
            elif module == "mlp.down_proj" and part != "bias":
                shares[name] = (-1, i0, i1, config.intermediate_size)
        else:
            _head_share(shares, name, config, vocab_slice, has_ends)
    return shares


def _head_share(shares: dict, name: str, config, vocab_slice: tuple[int, int] | None, has_ends: bool) -> None:
    """The LM head's vocabulary slice, where `name` is the head's (see read_shares)."""
    if vocab_slice is not None and not (has_ends and config.tie_word_embeddings):
        head = "model.embed_tokens." if config.tie_word_embeddings else "lm_head."
        if name.startswith(head) and not name.endswith(".ggml_type"):
            shares[name] = (-2, *vocab_slice, config.vocab_size)


def _mla_shares(names, config, shard: Shard, vocab_slice: tuple[int, int] | None, has_ends: bool) -> dict:
    """read_shares for the MLA families: each layer's arrays as tensor_parallel_mla.share_of cuts them (the
    heads' rows of q_b_proj / q_proj, o_proj's columns, the MLPs' and experts' features), `of` its last member's end."""
    shares = {}
    last = Shard(shard.size - 1, shard.size, shard.experts)
    for name in names:
        m = _PARAMETER.match(name)
        if m is None:
            _head_share(shares, name, config, vocab_slice, has_ends)
            continue
        module, part = m.groups()
        share = mla.share_of(module, part, config, shard, MLA_TOOLS)
        if share is not None:
            shares[name] = (*share, mla.share_of(module, part, config, last, MLA_TOOLS)[2])
    return shares


@dataclass(frozen=True)
class StridedTensor(GGUFTensor):
    """A share of a GGUF tensor that is not one run of bytes: `shape`'s rows of `nbytes // rows` bytes each,
    `stride` bytes apart (a column share: a run of each row; a share of each expert's rows in a stack: each
    expert's run of rows read as one long row, `shape` (experts, 1, rows x columns): `Narrowed.shape` gives the
    held arrays their rows back)."""
    stride: int = 0


@dataclass(frozen=True)
class Narrowed:
    """How a read share sits in its tensor: along `axis` (-3: a stack's experts, -2: rows, -1: columns, 0: a
    vector), `before` and `after` entries of the held array's axis were not read; shape: the held share's shape
    where the arrays read have another (a stack's rows read as one row an expert)."""
    axis: int
    before: int
    after: int
    shape: tuple[int, ...] | None = None


def _block(ggml_type: str) -> tuple[int, int]:
    """(values, bytes) of one block of a GGUF type (floats: one value)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # the gguf package: only where GGUF files are read

    return GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]


def narrow_tensor(tensor: GGUFTensor, axis: int, begin: int, end: int) -> GGUFTensor | None:
    """The share [begin, end) of a GGUF tensor's rows (axis -2; of each expert's in a stack [experts, rows,
    columns]), of its columns (-1: of every row, on whole blocks), of a stack's experts (-3) or of a vector (0),
    or None where it cannot be read narrowed (columns not on whole blocks)."""
    row_bytes = tensor.nbytes // tensor.rows
    if len(tensor.shape) == 1:  # a vector: bytes [begin, end) of its one row
        values, size = _block(tensor.ggml_type)
        if begin % values or end % values:
            return None
        return replace(tensor, shape=(end - begin,), begin=tensor.begin + begin // values * size,
                       nbytes=(end - begin) // values * size)
    if axis == -3 and len(tensor.shape) == 3:  # whole experts: one run of bytes
        per = tensor.shape[1] * row_bytes
        return replace(tensor, shape=(end - begin, *tensor.shape[1:]), begin=tensor.begin + begin * per,
                       nbytes=(end - begin) * per)
    if axis == -2 and len(tensor.shape) == 2:
        return replace(tensor, shape=(end - begin, tensor.cols), begin=tensor.begin + begin * row_bytes,
                       nbytes=(end - begin) * row_bytes)
    if axis == -2 and len(tensor.shape) == 3:  # rows [begin, end) of each expert: a run of bytes an expert
        experts, rows = tensor.shape[:2]
        return StridedTensor(tensor.name, tensor.ggml_type, (experts, 1, (end - begin) * tensor.cols), tensor.file,
                             tensor.begin + begin * row_bytes, experts * (end - begin) * row_bytes,
                             stride=rows * row_bytes)
    if axis != -1 or len(tensor.shape) > 3:
        return None
    values, size = _block(tensor.ggml_type)
    if begin % values or end % values:
        return None
    share = (end - begin) // values * size
    return StridedTensor(tensor.name, tensor.ggml_type, (*tensor.shape[:-1], end - begin), tensor.file,
                         tensor.begin + begin // values * size, tensor.rows * share, stride=row_bytes)


@contextmanager
def narrowed(checkpoint, shares: dict[str, tuple[int, int, int, int]]):
    """While loading: the entries of `checkpoint` (a GGUFCheckpoint) named in `shares` (checkpoint name ->
    (axis, begin, end, of) of its HF matrix: read_shares) replaced by their shares'.
    Yields {name: Narrowed} for `widen`; other checkpoints, and entries that cannot be narrowed, as they are."""
    tensors = getattr(checkpoint, "tensors", {})
    if not hasattr(checkpoint, "gguf"):
        with _narrowed_safetensors(checkpoint, shares) as placed:
            yield placed
        return
    originals, placed = {}, {}
    if shares:
        checkpoint.random_access()  # the prefetch reads the shares' spans; no read-ahead into the others'
    for name, (axis, begin, end, _) in shares.items():
        entry = tensors.get(name)
        if entry is None or entry.part == "ggml_type" or len(entry.source) != 1 or entry.how not in ("exact", "requantized", "native", "float",
                                                                         "dequantized") or entry.transform:
            continue
        tensor = entry.source[0]
        vector = len(tensor.shape) == 1
        if len(tensor.shape) != len(entry.shape) or (axis == -3 and len(tensor.shape) != 3):
            continue
        share = narrow_tensor(tensor, 0 if vector else axis, begin, end)
        if share is None:
            continue
        full, held = entry.shape, None
        if vector or axis in (-2, -3):
            held_axis = 0 if vector else len(full) + axis
            shape = tuple(end - begin if i == held_axis else d for i, d in enumerate(full))
            before, after = begin, (full[held_axis] - end)
            if axis == -2 and len(full) == 3:
                held = shape  # read as (experts, 1, a row per expert)
        else:  # columns: the held array's last axis (packed words, groups, blocks' bytes, or values) in proportion
            width = full[-1] * (end - begin) // tensor.cols
            before = full[-1] * begin // tensor.cols
            shape, after = (*full[:-1], width), full[-1] - before - width
            if before * tensor.cols != full[-1] * begin or width * tensor.cols != full[-1] * (end - begin):
                continue  # the held layout's units do not fall on the share's edges: read it whole
        heads = entry.unpermute_heads
        if heads and axis == -2:  # Llama q/k: llama.cpp's permutation is within each head, the share whole heads
            per = tensor.shape[0] // heads
            heads = (end - begin) // per
        originals[name] = entry
        tensors[name] = replace(entry, shape=shape, source=(share,), unpermute_heads=heads)
        placed[name] = Narrowed(0 if vector else axis, before, after, held)
    # a GGUF tensor decodes into all its parts at once (the others wait in the reader): its parts are read
    # narrowed all together or not at all, its type id (native blocks) from the narrowed source too
    for name in list(originals):
        module = name.rsplit(".", 1)[0]
        if name not in originals:
            continue  # reverted with a sibling
        source = originals[name].source
        parts = [n for n in tensors if n.rsplit(".", 1)[0] == module and originals.get(n, tensors[n]).source == source]
        if any(n not in placed and not n.endswith(".ggml_type") for n in parts):
            for n in parts:
                if n in originals:
                    tensors[n] = originals.pop(n)
                    placed.pop(n, None)
            continue
        kind = f"{module}.ggml_type"
        if kind in tensors and kind not in originals:
            originals[kind] = tensors[kind]
            # (its heads too: whichever part is read first decodes them all, Llama q/k unpermuted by its entry's)
            tensors[kind] = replace(tensors[kind], source=tensors[name].source, unpermute_heads=tensors[name].unpermute_heads)
    try:
        yield placed
    finally:
        tensors.update(originals)


_STORED = ("U32", "F32", "F16", "BF16")  # stored as the modules hold them (an MLX triple, floats): cut as stored


@contextmanager
def _narrowed_safetensors(checkpoint, shares: dict[str, tuple[int, int, int, int]]):
    """`narrowed` for a safetensors folder: a share is copied out of a mapping of the file without read-ahead
    (the loader's prefetch reads the shares' spans): a row share as one run of bytes, a column share row by
    row (only the pages holding it are read), its entry spanning first to last share byte."""
    if not isinstance(checkpoint, Checkpoint):
        yield {}
        return
    tensors, originals, columns, placed = checkpoint.tensors, {}, {}, {}
    for name, (axis, begin, end, in_features) in shares.items():
        info = tensors.get(name)
        if info is None or info.dtype not in _STORED or not info.shape:
            continue
        full, item = info.shape, info.nbytes // max(1, _count(info.shape))
        if len(full) == 1 or axis == -2:
            held_axis = len(full) - (1 if len(full) == 1 else 2)
            rows = _count(full[held_axis + 1:]) * item  # bytes per row (a vector: per value)
            if len(full) > 2:
                continue  # stacked experts: rows within each expert are not contiguous
            share = replace(info, shape=tuple(end - begin if i == held_axis else d for i, d in enumerate(full)),
                            begin=info.begin + begin * rows, end=info.begin + end * rows)
            columns[name] = (0, share.shape[-1], share, share)  # the share's rows: one run of bytes
            placed[name] = Narrowed(0 if len(full) == 1 else -2, begin, full[held_axis] - end)
        else:
            lo, width = full[-1] * begin // in_features, full[-1] * (end - begin) // in_features
            if lo * in_features != full[-1] * begin or width * in_features != full[-1] * (end - begin):
                continue
            share = replace(info, shape=(*full[:-1], width), begin=info.begin + lo * item,
                            end=info.end - (full[-1] - lo - width) * item)
            columns[name] = (lo, lo + width, info, share)
            placed[name] = Narrowed(-1, lo, full[-1] - lo - width)
        originals[name] = info
        tensors[name] = share
    whole_read, maps = checkpoint.read, {}

    def read(name: str):
        if name not in columns:
            return whole_read(name)
        lo, hi, info, _ = columns[name]
        if info.file not in maps:
            with open(info.file, "rb") as f:
                maps[info.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            maps[info.file].madvise(mmap.MADV_RANDOM)  # the prefetch reads the shares' spans, no more
        item = info.nbytes // _count(info.shape)
        rows, row_bytes = _count(info.shape[:-1]), info.shape[-1] * item
        span = np.frombuffer(maps[info.file], np.uint8, (rows - 1) * row_bytes + (hi - lo) * item,
                             info.begin + lo * item)
        # each row's share copied out: only the pages holding it are read (the whole tensor's mapping,
        # mapped_files.py, would read every page of it)
        share = np.ascontiguousarray(np.lib.stride_tricks.as_strided(span, (rows, (hi - lo) * item), (row_bytes, 1)))
        raw = {"U32": np.uint32, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}[info.dtype]
        array = mx.array(share.view(raw).reshape(*info.shape[:-1], hi - lo))
        return array.view(mx.bfloat16) if info.dtype == "BF16" else array

    checkpoint.read = read
    try:
        yield placed
    finally:
        del checkpoint.read
        tensors.update(originals)
        for mapped in maps.values():
            mapped.close()


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def widen(weights: dict[str, mx.array], names: list[str], placed: dict[str, Narrowed]) -> None:
    """The read shares among `names` padded back to their tensors' shapes (zeros where not read), in place."""
    for name in names:
        where = placed.get(name)
        if where is None or name not in weights:
            continue
        array = weights[name]
        if array.ndim < 1 or (array.size == 1 and array.ndim == 1 and name.endswith(".ggml_type")):
            continue
        if where.shape is not None:  # a stack's rows read as one row an expert
            array = array.reshape(where.shape)
        axis = where.axis % array.ndim
        pads = [(0, 0)] * array.ndim
        pads[axis] = (where.before, where.after)
        weights[name] = mx.pad(array, pads)


def pages_read(tensors, page: int) -> int:
    """Bytes of the distinct `page`-sized pages that reading `tensors` (GGUF tensors, or shares of them:
    `narrow_tensor`'s, a strided share's runs each) touches: what a mapping faults in, at the least."""
    firsts, lasts = {}, {}
    for t in tensors:
        stride = getattr(t, "stride", 0)
        run = t.nbytes // t.rows if stride else t.nbytes
        starts = t.begin + np.arange(t.rows if stride else 1, dtype=np.int64) * stride
        firsts.setdefault(t.file, []).append(starts // page)
        lasts.setdefault(t.file, []).append((starts + run - 1) // page)
    pages = 0
    for file in firsts:
        first, last = np.concatenate(firsts[file]), np.concatenate(lasts[file])
        order = np.argsort(first, kind="stable")
        first, last = first[order], last[order]
        covered = np.concatenate([[-1], np.maximum.accumulate(last)[:-1]])  # the furthest page counted before
        pages += int(np.clip(last - np.maximum(first, covered + 1) + 1, 0, None).sum())
    return pages * page
