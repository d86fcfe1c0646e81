"""--tensor-parallel: a rank reads only its share of each tensor, from a GGUF file or a safetensors folder.

A member's share of a matrix (models/tensor_parallel.py) is a range of its rows (output features:
q/k/v, gate/up, the LM head's vocabulary slice) or of its columns (input features: o_proj, down_proj).
Rows are contiguous in the file; a column share is a run of bytes in every row, `stride` bytes apart,
cut on the type's blocks (Q4_1: 32 values in 20 bytes; Q4_K, Q6_K, IQ4_XS and the i-quants: 256 values), so
it is read row by row (`StridedTensor`), whatever the rank then holds (MLX's layout, or the file's blocks).
An expert stack [experts, rows, columns] (GGUF, MLX folders): each expert's share of rows (gate/up) is a run of
bytes an expert, its share of columns (down) a run of every row, whole experts (--expert-parallel) one run;
Hugging Face's tensors of one expert each are each a matrix, and under --expert-parallel another member's experts
are not read at all. DeepSeek's FP8 weights carry one scale per 128 x 128 block: a share is widened to the blocks
it touches (T = 3 of 256 features reads 128 or 256 of them), their scales read with them. A DeepSeek GGUF's
kv_b_proj, joined at load from attn_k_b and attn_v_b, reads the member's heads of both.
`narrowed` swaps the index entries of the shared tensors for entries of their shares while a rank
loads (the decoders then read, decode and hold the share only); `widen` pads each share back to its
tensor's shape with zeros (untouched memory, never read from the file) so that the cut
(tensor_parallel.shard_weights) takes it out exactly as it takes a share of a whole tensor (a share read wider,
as FP8's blocks, included).

Where a share of a row is smaller than a page (4 KiB on Linux, 16 KiB on macOS), a column share still
touches every page of the tensor: the pages hold several rows, or the share's bytes of one row straddle
them (`pages_read` counts them; benchmarks/share_read_bytes.py reports them per rank, for GGUF files and
safetensors folders).
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
from .gguf_checkpoint import run_spans
from .gguf_file import GGUFTensor
from .safetensors_checkpoint import Checkpoint, from_bytes

_LAYER = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.(weight|scales|biases|bias)$")
# a layer's parameter; compressed-tensors INT4's packed words and group scales (Kimi K2) stand for weight and scales
_PARAMETER = re.compile(r"^model\.layers\.\d+\.(.+)\.(weight|scales|biases|weight_packed|weight_scale)$")
_AS_PART = {"weight_packed": "weight", "weight_scale": "scales"}
# an expert stack [experts, rows, columns] (MLX folders, GGUF), or Hugging Face's tensors of one expert each
_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.switch_mlp\.(?P<proj>gate|up|down)_proj\.(?P<part>\w+)$")
_ONE_EXPERT = re.compile(r"^(?P<prefix>model\.layers\.\d+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\."
                         r"(?P<part>\w+)$")
# the parts of an expert's matrix cut as it is (an INT4 weight_shape is not; FP8 scales follow their weight: _fp8_blocks)
_EXPERT_PARTS = ("weight", "scales", "biases", "weight_packed", "weight_scale")
FP8_BLOCK = 128  # DeepSeek's FP8 weights: one weight_scale_inv per 128 x 128 block
_FLOATS = ("F32", "F16", "BF16", "F8_E4M3")  # safetensors dtypes re-quantized by --quantize (others held as stored)


def read_shares(names, config, shard: Shard, vocab_slice: tuple[int, int] | None = None,
                has_ends: bool = False, whole_blocks: bool = True) -> dict[str, tuple[int, int, int, int]]:
    """checkpoint name -> (axis, begin, end, of): the rows (-2) or columns (-1) of its matrix (HF layout, [out,
    in]: `of` rows or columns in all) that member `shard` holds, for the dense layers' projections (tensor_parallel.shard_weights' cuts,
    the union of a segmented attention's) and the LM head's vocabulary slice (vocab_slice; rank 0: an
    untied head's rows only, its tied embedding whole). Qwen3-MoE's expert stacks: each expert's rows or columns
    (-2, -1), or whole experts (-3, --expert-parallel); Hugging Face's tensors of one expert each likewise, under
    --expert-parallel (-3, e0, e1, experts): held whole where the expert is the member's, else not read at all.
    MLA families (DeepSeek, Kimi): tensor_parallel_mla.share_of's. An FP8 weight's share is widened to whole
    128 x 128 blocks (the cut takes the share out after loading) and its weight_scale_inv gets the blocks' share
    (whole_blocks=False: the shares the cut takes, for accounting)."""
    shares = _mla_shares(names, config, shard, vocab_slice, has_ends) if mla.is_mla_family(config) else \
        _attention_mlp_shares(names, config, shard, vocab_slice, has_ends)
    if whole_blocks:
        _fp8_blocks(shares, names)
    return shares


def _attention_mlp_shares(names, config, shard: Shard, vocab_slice, has_ends: bool) -> dict:
    hd = config.head_dim
    heads = head_share(config.num_attention_heads, config.num_key_value_heads, shard)
    i0, i1 = mlp_share(config.intermediate_size, shard)
    shares = {}
    experts = num_experts(config)
    moe = int(config.raw.get("moe_intermediate_size") or 0)
    for name in names:
        m, stack = _LAYER.match(name), _EXPERTS.match(name) or _ONE_EXPERT.match(name)
        if stack and stack["part"] not in _EXPERT_PARTS:
            stack = None
        if stack and experts and shard.experts:  # whole experts [e0, e1) (--expert-parallel): one run of bytes
            shares[name] = (-3, *expert_share(experts, shard.size, shard.member), experts)
        elif stack and moe:  # each expert's rows (gate/up) or columns (down) of its intermediate features
            shares[name] = (-1 if stack["proj"] == "down" else -2, *mlp_share(moe, shard), moe)
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


def _fp8_blocks(shares: dict, names) -> None:
    """An FP8 weight's share (with a `weight_scale_inv` beside it) widened to whole blocks, and its scales' share."""
    for name in [n for n in shares if n + "_scale_inv" in names]:
        axis, begin, end, of = shares[name]
        if axis == -3:  # a tensor of one expert (--expert-parallel): its scales go where it goes
            shares[name + "_scale_inv"] = shares[name]
            continue
        first, last = begin // FP8_BLOCK, -(-end // FP8_BLOCK)
        shares[name] = (axis, first * FP8_BLOCK, min(last * FP8_BLOCK, of), of)
        shares[name + "_scale_inv"] = (axis, first, last, -(-of // FP8_BLOCK))


def _head_share(shares: dict, name: str, config, vocab_slice: tuple[int, int] | None, has_ends: bool) -> None:
    """The LM head's vocabulary slice, where `name` is the head's (see read_shares)."""
    if vocab_slice is not None and not (has_ends and config.tie_word_embeddings):
        head = "model.embed_tokens." if config.tie_word_embeddings else "lm_head."
        if name.startswith(head) and not name.endswith(".ggml_type"):
            shares[name] = (-2, *vocab_slice, config.vocab_size)


def _mla_shares(names, config, shard: Shard, vocab_slice: tuple[int, int] | None, has_ends: bool) -> dict:
    """read_shares for the MLA families: each layer's arrays as tensor_parallel_mla.share_of cuts them (the
    heads' rows of q_b_proj / q_proj, o_proj's columns, the MLPs' and experts' features: a Hugging Face tensor of
    one expert as the stack's), `of` its last member's end."""
    shares = {}
    last = Shard(shard.size - 1, shard.size, shard.experts)
    for name in names:
        m = _PARAMETER.match(name)
        if m is None:
            _head_share(shares, name, config, vocab_slice, has_ends)
            continue
        module, part = m.groups()
        module, part = re.sub(r"^mlp\.experts\.\d+\.", "mlp.switch_mlp.", module), _AS_PART.get(part, part)
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
    where the arrays read have another (a stack's rows read as one row an expert). read: the entries read along
    the axis, where the arrays held from them may count it in other units (an FP8 or float share re-quantized at
    load: its packed words and groups, in proportion)."""
    axis: int
    before: int
    after: int
    shape: tuple[int, ...] | None = None
    read: int = 0


def _block(ggml_type: str) -> tuple[int, int]:
    """(values, bytes) of one block of a GGUF type (floats: one value)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # the gguf package: only where GGUF files are read

    return GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]


def held_block(checkpoint, name: str, in_features: int, group_size: int | None) -> tuple[int, str] | None:
    """(input values a block, what the blocks are) of the matrix `name` (its `.weight`) as a rank will hold it, from
    the checkpoint's index alone (preflight; the loader's check_block_cuts sees the held arrays): a GGUF type's
    blocks where held in them, MLX's quantization groups (stored, or made by --quantize: `group_size`), or None
    (floats: cut anywhere)."""
    entry = checkpoint.tensors.get(name)
    if entry is None:
        return None
    layout = getattr(entry, "layout", None)
    if hasattr(entry, "source"):  # a GGUF file's entry
        if layout is None or not layout.quantized:
            return None
        if layout.kind == "native" or entry.dtype == "U8":  # the file's blocks: codes, or row bytes
            return _block(entry.source[0].ggml_type)[0], "GGUF blocks"
        return layout.group_size, "quantization groups"
    scales = checkpoint.tensors.get(name[: -len("weight")] + "scales")
    if scales is not None and scales.shape and in_features % scales.shape[-1] == 0:
        return in_features // scales.shape[-1], "quantization groups"
    if group_size and entry.dtype in _FLOATS:
        return group_size, "quantization groups"
    return None


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
def narrowed(checkpoint, shares: dict[str, tuple[int, int, int, int]], group_size: int | None = None):
    """While loading: the entries of `checkpoint` (a GGUFCheckpoint, or a safetensors folder's Checkpoint) named
    in `shares` (checkpoint name -> (axis, begin, end, of) of its HF matrix: read_shares) replaced by their shares'.
    group_size: the load re-quantizes float and FP8 weights in groups of this many (--quantize).
    Yields {name: Narrowed} for `widen`; other checkpoints, and entries that cannot be narrowed, as they are."""
    tensors = getattr(checkpoint, "tensors", {})
    if not hasattr(checkpoint, "gguf"):
        with _narrowed_safetensors(checkpoint, shares, group_size) as placed:
            yield placed
        return
    originals, placed = {}, {}
    if shares:
        checkpoint.random_access()  # the prefetch reads the shares' spans; no read-ahead into the others'
    for name, (axis, begin, end, _) in shares.items():
        entry = tensors.get(name)
        if entry is not None and entry.how == "mla_kv_b" and axis == -2:  # kv_b_proj from attn_k_b and attn_v_b
            _narrow_kv_b(tensors, name, begin, end, originals, placed)
            continue
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


def _narrow_kv_b(tensors: dict, name: str, begin: int, end: int, originals: dict, placed: dict) -> None:
    """DeepSeek GGUF's kv_b_proj, joined at load from attn_k_b [heads, latent, nope] and attn_v_b [heads, v, latent]
    (gguf_checkpoint.py): its rows [begin, end) are whole heads, each a run of bytes of both (heads outermost)."""
    entry = tensors[name]
    per = entry.shape[0] // entry.source[0].shape[0]  # nope + v rows a head
    if begin % per or end % per:
        return
    source = tuple(narrow_tensor(t, -3, begin // per, end // per) for t in entry.source)
    originals[name] = entry
    tensors[name] = replace(entry, shape=(end - begin, entry.shape[1]), source=source)
    placed[name] = Narrowed(-2, begin, entry.shape[0] - end)


@dataclass(frozen=True)
class Runs:
    """The bytes of a share of a safetensors tensor: `rows` runs of `nbytes // rows` bytes, `stride` bytes apart
    from `begin` (one run: stride 0), in `file` (`pages_read` counts their pages as a StridedTensor's)."""
    file: object
    begin: int
    nbytes: int
    rows: int
    stride: int


def share_runs(info, axis: int, lo: int, hi: int) -> tuple[tuple[int, ...], Runs]:
    """The held shape and the bytes of entries [lo, hi) along `axis` of a row-major tensor `info`: a run of
    bytes for each index of the axes before `axis` (rows of a matrix: one run; its columns: a run a row; rows of
    each expert of a stack: a run an expert; whole experts: one run)."""
    shape, axis = info.shape, axis % len(info.shape)
    item = info.nbytes // max(1, _count(shape))
    inner = _count(shape[axis + 1:]) * item  # bytes of one entry along the axis
    outer = _count(shape[:axis])
    held = (*shape[:axis], hi - lo, *shape[axis + 1:])
    stride = shape[axis] * inner if outer > 1 else 0
    return held, Runs(info.file, info.begin + lo * inner, outer * (hi - lo) * inner, outer, stride)


@dataclass
class SafetensorsReads:
    """What a member reads of a safetensors folder's shared tensors: `runs` {name: (held shape, Runs)} of each share
    read narrowed, `placed` {name: Narrowed} for `widen` (under the names the loader holds them by too), `absent`:
    tensors of experts another member holds (--expert-parallel), not read at all."""
    runs: dict
    placed: dict
    absent: set


def safetensors_reads(tensors: dict, shares: dict[str, tuple[int, int, int, int]],
                      group_size: int | None = None) -> SafetensorsReads:
    """The shares of `tensors` (a Checkpoint's index) that are read narrowed, and how (see _narrowed_safetensors).
    The parts of one matrix (an MLX triple, an FP8 weight and its scales, INT4 packed words and scales) are
    narrowed all together or not at all."""
    runs, placed, absent = {}, {}, set()
    for name, (axis, begin, end, of) in shares.items():
        info = tensors.get(name)
        if info is None or info.dtype in ("F64", "BOOL") or not info.shape:
            continue
        one_expert = _ONE_EXPERT.match(name)
        if axis == -3 and len(info.shape) == 2:  # a tensor of one expert: the member's whole, another's not read
            if one_expert and not begin <= int(one_expert["expert"]) < end:
                absent.add(name)
            continue
        if len(info.shape) == 1:
            axis = -1
        n = info.shape[axis]
        lo, hi = n * begin // of, n * end // of  # in the stored units along the axis (packed words, groups)
        if lo * of != n * begin or hi * of != n * end:
            continue  # the share's edges fall inside a stored unit: read it whole
        if group_size and axis == -1 and name.endswith(".weight") and info.dtype in _FLOATS and (lo % group_size
                                                                                              or hi % group_size):
            continue  # re-quantized at load: a share that is no whole groups is read whole (the cut refuses it)
        runs[name] = share_runs(info, axis, lo, hi)
        placed[name] = Narrowed(axis if len(info.shape) > 1 else 0, lo, n - hi, read=hi - lo)
    _together(shares, tensors, runs, placed, absent)
    for name in list(placed):  # where the loader holds a matrix under other names: those of its parts too
        for held_name in _held_names(name, tensors):
            placed.setdefault(held_name, placed[name])
    return SafetensorsReads(runs, placed, absent)


@contextmanager
def _narrowed_safetensors(checkpoint, shares: dict[str, tuple[int, int, int, int]], group_size: int | None):
    """`narrowed` for a safetensors folder: a share in one run of bytes (rows of a matrix, whole experts) is read
    as a tensor of its own (mapped, no copy); one in runs (columns: a run a row; each expert's rows of a stack: a run
    an expert) is copied out of a mapping of the file without read-ahead (the loader's prefetch reads the shares'
    spans, and only the pages holding them are read). A Hugging Face tensor of an expert another member holds
    (--expert-parallel) is not read at all: zeros of its shape, which the cut drops."""
    if not isinstance(checkpoint, Checkpoint):
        yield {}
        return
    tensors = checkpoint.tensors
    plan = safetensors_reads(tensors, shares, group_size)
    placed, absent, runs = plan.placed, plan.absent, {}
    originals = {name: tensors[name] for name in (*plan.runs, *absent)}
    for name, (held, share_bytes) in plan.runs.items():
        if share_bytes.rows == 1:  # one run: a tensor of its own
            tensors[name] = replace(tensors[name], shape=held, begin=share_bytes.begin,
                                    end=share_bytes.begin + share_bytes.nbytes, whole=False)
        else:
            runs[name] = (held, share_bytes)
    whole_read, whole_spans, maps = checkpoint.read, checkpoint.spans, {}

    def spans(name: str) -> list[tuple]:
        """What the loader's prefetch asks the kernel for: a share's runs (each alone where 16 KiB or longer,
        else first to last byte, as a GGUF file's), nothing of an absent expert."""
        if name in absent:
            return [(originals[name].file, originals[name].begin, originals[name].begin)]
        return run_spans(runs[name][1]) if name in runs else whole_spans(name)

    def read(name: str):
        if name in absent:
            info = originals[name]
            return from_bytes(np.zeros(info.nbytes, np.uint8), info.dtype, info.shape)
        packed = name[: -len("shape")] + "packed"
        if name.endswith(".weight_shape") and packed in placed:  # compressed-tensors INT4: the share's [out, in]
            whole_read(name)  # (read as the whole read reads it: a few bytes)
            held = plan.runs[packed][0]
            return mx.array([held[0], held[-1] * 8], mx.int32)
        if name not in runs:
            return whole_read(name)
        held, share = runs[name]
        info = originals[name]
        if info.file not in maps:
            with open(info.file, "rb") as f:
                maps[info.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            maps[info.file].madvise(mmap.MADV_RANDOM)  # the prefetch reads the shares' spans, no more
        run = share.nbytes // share.rows
        span = np.frombuffer(maps[info.file], np.uint8, (share.rows - 1) * share.stride + run, share.begin)
        # each run copied out: only the pages holding it are read (the whole tensor's mapping, mapped_files.py,
        # would read every page of it)
        copied = np.ascontiguousarray(np.lib.stride_tricks.as_strided(span, (share.rows, run), (share.stride, 1)))
        checkpoint.bytes_read += share.nbytes
        return from_bytes(copied.reshape(-1), info.dtype, held)

    checkpoint.read, checkpoint.spans = read, spans
    try:
        yield placed
    finally:
        del checkpoint.read, checkpoint.spans
        tensors.update(originals)
        for mapped in maps.values():
            mapped.close()


def _matrix(name: str) -> str:
    """The module whose matrix a tensor is part of (an MLX triple's weight/scales/biases, an FP8 weight's scales)."""
    return name.rsplit(".", 1)[0]


def _together(shares: dict, tensors: dict, runs: dict, placed: dict, absent: set) -> None:
    """Parts of one matrix narrowed all together or read whole all together (a part whose share could not be read
    narrowed reverts its siblings): the loader combines them as they come."""
    wanted: dict[str, list[str]] = {}
    for name in shares:
        if name in tensors:
            wanted.setdefault(_matrix(name), []).append(name)
    for parts in wanted.values():
        if all(p in placed or p in absent for p in parts) or not any(p in placed for p in parts):
            continue
        for p in parts:
            runs.pop(p, None)
            placed.pop(p, None)


def _held_names(name: str, tensors: dict) -> list[str]:
    """Names the loader holds a narrowed tensor's matrix under that `widen` must find (format_adapters): a weight
    re-quantized at load (FP8 or float) as weight, scales and biases; compressed-tensors INT4's packed words and
    scales as an MLX triple; Hugging Face's tensors of one expert in their stack (`mlp.switch_mlp`)."""
    module, part = name.rsplit(".", 1)
    names = []
    if part in ("weight", "weight_packed"):
        names = [f"{module}.weight", f"{module}.scales", f"{module}.biases"]
    elif part == "weight_scale":
        names = [f"{module}.scales", f"{module}.biases"]
    names = [n for n in names if n == name or n not in tensors]  # stored parts have their own
    one = _ONE_EXPERT.match(name)
    if one:
        names += [f"{one['prefix']}.switch_mlp.{one['proj']}_proj.{n.rsplit('.', 1)[1]}" for n in names]
    return [n for n in names if n != name]


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
        before, after, n = where.before, where.after, array.shape[axis]
        if where.read and n != where.read:  # held in other units than read (re-quantized: packed words, groups)
            before, after = before * n // where.read, after * n // where.read
        pads = [(0, 0)] * array.ndim
        pads[axis] = (before, after)
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
