"""Tensor parallelism inside a stage (--tensor-parallel T): what one rank of a stage's group of T
holds of each layer, and the hook through which a layer asks for the group's sum.

Llama family (llama, mistral, qwen2, qwen3) and Qwen3-MoE here; DeepSeek V3/V3.2 and Kimi K2 (MLA,
DeepSeekMoE) in tensor_parallel_mla.py, which the functions below hand those families to; other
families refuse T > 1 by name (`check_family`).

Per layer, member m of a group of T holds:
- attention: query heads [q0, q1), split as evenly as the count allows (9 heads over 2: 5 and 4), and
  the key/value heads those query heads read, each once. Where they read them unevenly (SmolLM2's 9
  query / 3 KV heads over 2 ranks: member 0's heads 0-2 read KV head 0, its heads 3-4 KV head 1), the
  query heads are padded to a uniform grouped-query attention (`PaddedAttention`: copies of a head
  fill the slots, their outputs dropped before o_proj), one attention and one cache a layer. q/k norms
  are per head, held whole. o_proj: the input columns of the member's heads.
- MLP: gate/up rows (output features) and down's columns (input features) [i0, i1), cut on units of
  up to 256 features so that a quantized row's groups (32/64/128) and int8 blocks are never cut.
- Qwen3-MoE: the router whole on every member, its top-k choices the first member's (`group_choice`);
  every expert's gate/up rows and down columns [e0, e1) of its intermediate features, as a dense MLP's;
  or, with `Shard.experts` (--expert-parallel), whole experts [e0, e1) of the E (expert_parallel.py).
- biases of o_proj and down_proj on member 0 only (added once, before the sum, in rank order).
Each layer's attention and MLP output is then that member's partial sum; `group_sum` (a callable the
runtime injects: models never talk to other ranks) returns the group's total, the same bits on every
member. Norms, RoPE and everything else stay whole on every member.

The weights are cut after the format adapters, each group of tensors as soon as it is read
(checkpoints/weights.py load_slice's `cut`), on the arrays MLX holds: an affine-quantized row is `bits`
bits a value and one scale/bias per group, so columns [b, e) are words [b*bits/32, e*bits/32) and groups
[b/g, e/g). A matrix held in its GGUF blocks (checkpoints/quants.py: the file's row bytes, or IQ4_NL/IQ4_XS/
Q6_K's codes, scales and d arrays; expert stacks alike) is cut on whole blocks (32 or 256 values), each of its
arrays' last axis in proportion: a byte range of every row. Where a member's share would end inside a block,
the load stops in one line on every member naming the tensor and a --tensor-parallel that works
(`check_block_cuts`): the edge cannot move to the block's, as a member's input columns are its own heads'
outputs or MLP features. Only the cut arrays are kept (copies), so a rank holds its share and a group; a
GGUF's ranks read only their shares' bytes (checkpoints/share_reads.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..util.errors import UserError
from .cache import KVCache
from .config import ModelConfig
from .experts import SwitchGLU
from ..kernels import attention, qmm
from .layers import MLP, Attention, attend, summed
from .packing import kept_rows, positions, segments
from .qwen3_moe import SparseMoeBlock, num_experts
from .expert_parallel import ExpertParallelMoeBlock, expert_share
from . import tensor_parallel_mla as mla

SUPPORTED_FAMILIES = ("llama", "qwen3_moe", "deepseek_v3", "deepseek_v32")  # registry module names sharded here
# (deepseek_v3, deepseek_v32: MLA and DeepSeekMoE, in tensor_parallel_mla.py)
MLP_UNITS = (256, 128, 64, 32, 16)  # the widest unit of intermediate features that still gives every member some


@dataclass(frozen=True)
class Shard:
    """Member `member` of a group of `size` ranks; experts: MoE layers' routed experts divided among the group
    whole (--expert-parallel, expert_parallel.py) rather than each sliced by its intermediate features."""
    member: int
    size: int
    experts: bool = False


def check_family(config: ModelConfig, module_name: str, size: int) -> None:
    """One line refusing T > 1 for a family whose layers are not sharded here."""
    if size > 1 and module_name not in SUPPORTED_FAMILIES:
        raise UserError(f"--tensor-parallel is not supported for {config.model_type} yet; "
                        f"run with --tensor-parallel 1")


def check_expert_parallel(config: ModelConfig, shard: Shard) -> None:
    """One line refusing --expert-parallel where its MoE layers cannot divide their experts yet (MLA families)."""
    if shard.experts and mla.is_mla_family(config):
        raise UserError(f"--expert-parallel is not supported for {config.model_type} yet (Qwen3-MoE only); "
                        f"run without it (every expert sliced across the group)")


def even_split(count: int, parts: int, member: int) -> tuple[int, int]:
    """[begin, end) of `member`'s share of `count` items over `parts`: the first count % parts one more."""
    base, extra = divmod(count, parts)
    begin = member * base + min(member, extra)
    return begin, begin + base + (member < extra)


@dataclass(frozen=True)
class Segment:
    q: tuple[int, int]  # query heads [begin, end)
    kv: tuple[int, int]  # the key/value heads [begin, end) they read, each by (q end - begin) / (kv end - begin)


@dataclass(frozen=True)
class HeadShare:
    q: tuple[int, int]  # query heads [begin, end)
    kv: tuple[int, int]  # the key/value heads [begin, end) they read
    segments: tuple[Segment, ...]  # runs of those query heads that read their key/value heads evenly


def head_share(n_heads: int, n_kv_heads: int, shard: Shard) -> HeadShare:
    """The member's query heads, the key/value heads they read, and (T not dividing the groups) the runs
    of query heads that read them evenly: 9 query / 3 KV heads over 2 ranks, member 0 holds query heads
    0-4 reading KV heads 0 (3 of them) and 1 (2 of them): two segments, each a uniform grouped-query
    attention, each KV head held once."""
    q0, q1 = even_split(n_heads, shard.size, shard.member)
    if q1 <= q0:
        raise UserError(f"--tensor-parallel {shard.size} is more than the model's {n_heads} query heads: "
                        f"use at most {n_heads}")
    per = n_heads // n_kv_heads
    segments: list[Segment] = []
    for kv in range(q0 // per, (q1 - 1) // per + 1):
        begin, end = max(q0, kv * per), min(q1, (kv + 1) * per)
        last = segments[-1] if segments else None
        if last is not None and last.q[1] - last.q[0] == (last.kv[1] - last.kv[0]) * (end - begin):
            segments[-1] = Segment((last.q[0], end), (last.kv[0], kv + 1))  # same count: the same segment
        else:
            segments.append(Segment((begin, end), (kv, kv + 1)))
    return HeadShare((q0, q1), (q0 // per, (q1 - 1) // per + 1), tuple(segments))


def mlp_share(intermediate: int, shard: Shard) -> tuple[int, int]:
    """[begin, end) of the member's intermediate features, cut on whole units (MLP_UNITS)."""
    unit = next((u for u in MLP_UNITS if intermediate % u == 0 and intermediate // u >= shard.size), None)
    if unit is None:
        raise UserError(f"--tensor-parallel {shard.size}: the MLP's {intermediate} features cannot be cut "
                        f"into {shard.size} shares of whole blocks; use a smaller --tensor-parallel")
    begin, end = even_split(intermediate // unit, shard.size, shard.member)
    return begin * unit, end * unit


def shard_modules(model: nn.Module, config: ModelConfig, shard: Shard) -> None:
    """Replace each layer's attention and MLP projections of `model` (a TransformerSlice, not yet
    loaded) with ones of the member's shapes, so its share's arrays load into it."""
    if mla.is_mla_family(config):  # DeepSeek V3/V3.2, Kimi K2: MLA and DeepSeekMoE
        check_expert_parallel(config, shard)
        return mla.shard_modules(model, config, shard, MLA_TOOLS)
    hd, hidden = config.head_dim, config.hidden_size
    heads = head_share(config.num_attention_heads, config.num_key_value_heads, shard)
    i0, i1 = mlp_share(config.intermediate_size, shard)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not Attention or type(mlp) not in (MLP, SparseMoeBlock):
            raise UserError(f"--tensor-parallel is not supported for {config.model_type} yet; "
                            f"run with --tensor-parallel 1")
        nq, nkv = heads.q[1] - heads.q[0], heads.kv[1] - heads.kv[0]
        attn.n_heads, attn.n_kv_heads = nq, nkv
        qkv_bias = "bias" in attn.q_proj
        attn.q_proj = nn.Linear(hidden, nq * hd, bias=qkv_bias)
        attn.k_proj = nn.Linear(hidden, nkv * hd, bias=qkv_bias)
        attn.v_proj = nn.Linear(hidden, nkv * hd, bias=qkv_bias)
        attn.o_proj = nn.Linear(nq * hd, hidden, bias="bias" in attn.o_proj and shard.member == 0)
        if len(heads.segments) > 1:  # its query heads read their key/value heads unevenly
            attn.__class__ = PaddedAttention
            attn.pad(heads, config.num_attention_heads // config.num_key_value_heads)
        if type(mlp) is SparseMoeBlock and shard.experts:  # whole experts [e0, e1) here, the router whole
            e0, e1 = expert_share(num_experts(config), shard.size, shard.member)
            mlp.switch_mlp = SwitchGLU(hidden, int(config.raw["moe_intermediate_size"]), e1 - e0)
            mlp.__class__ = ExpertParallelMoeBlock
            mlp.expert_begin, mlp.expert_end = e0, e1
            continue
        if type(mlp) is SparseMoeBlock:  # every expert sliced by its intermediate features, the router whole
            e0, e1 = mlp_share(int(config.raw["moe_intermediate_size"]), shard)
            mlp.switch_mlp = SwitchGLU(hidden, e1 - e0, mlp.gate.weight.shape[0])
            mlp.__class__ = ShardedMoeBlock
            continue
        bias = "bias" in mlp.gate_proj
        mlp.gate_proj = nn.Linear(hidden, i1 - i0, bias=bias)
        mlp.up_proj = nn.Linear(hidden, i1 - i0, bias=bias)
        mlp.down_proj = nn.Linear(i1 - i0, hidden, bias="bias" in mlp.down_proj and shard.member == 0)


class PaddedAttention(Attention):
    """A member's attention whose query heads read their key/value heads unevenly (head_share: 9 query /
    3 KV heads over 2, member 0's heads 0-2 read KV head 0, its heads 3-4 KV head 1), run as one uniform
    grouped-query attention: its query heads laid out `per` to a key/value head (the most any of its KV
    heads is read by), the slots a KV head's own query heads leave filled with copies of one of them
    (one take), the copies' outputs dropped before o_proj (a slice or a take). Each real head's
    attention is the bits it had alone (the kernel rounds each head on its own, attention_kernels.cpp),
    its projections' rows too; o_proj is one product over the member's heads. One attention, one set
    of projections, one KV cache a layer, where segments ran one each per segment."""

    def pad(self, heads: HeadShare, per_kv: int) -> None:
        (q0, q1), (kv0, kv1) = heads.q, heads.kv
        reads = {kv: [h - q0 for h in range(max(q0, kv * per_kv), min(q1, (kv + 1) * per_kv))]
                 for kv in range(kv0, kv1)}
        self.per = max(len(own) for own in reads.values())
        slots = [own[i] if i < len(own) else own[0] for own in reads.values() for i in range(self.per)]
        real = [kv * self.per + i for kv, own in enumerate(reads.values()) for i in range(len(own))]
        self._slots = mx.array(slots, dtype=mx.uint32)  # underscores: not parameters
        self._real = None if real == list(range(len(real))) else mx.array(real, dtype=mx.uint32)

    def __call__(self, x: mx.array, caches: list[KVCache], lengths: list[int], last_only: bool = False,
                 full: list[bool] | None = None) -> mx.array:
        """As Attention's, over the padded query heads (see the class)."""
        _, T, H = x.shape
        x = x.reshape(T, H)
        offsets = positions(lengths, caches)
        if last_only:
            last, kept = kept_rows(lengths, full)
        if last_only and kept[-1][1] < T:
            k, v = self.k_proj(x), self.v_proj(x)
            q = self.q_proj(x[last])
        else:
            q, k, v = qmm.products([self.q_proj, self.k_proj, self.v_proj], x)
        heads, hd = self.n_kv_heads * self.per, self.head_dim
        q = mx.take(q.reshape(q.shape[0], self.n_heads, hd), self._slots, axis=1)
        k, v = k.reshape(T, self.n_kv_heads, hd), v.reshape(T, self.n_kv_heads, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if last_only:
            q, k = self.rope.rotate([q], offsets[last]), self.rope.rotate([k], offsets)
        else:
            qk = self.rope.rotate([q, k], offsets)
            q, k = qk[:, :heads], qk[:, heads:]
        rows = [e - b for b, e in kept] if last_only else list(lengths)
        kernel = attention.kernel(q, (hd,))
        if kernel is not None:
            out = attention.attend_and_append(kernel, q, k, v, caches, rows, lengths, self.scale)
        else:
            attention.note_fallback()
            k, v, q = k.transpose(1, 0, 2), v.transpose(1, 0, 2), q.transpose(1, 0, 2)
            outputs, qb = [], 0
            for (begin, end), cache, t in zip(segments(lengths), caches, rows):
                ks, vs = cache.update_and_fetch(k[None, :, begin:end], v[None, :, begin:end])
                outputs.append(attend(q[None, :, qb:qb + t], ks, vs, self.scale, cache.offset - t).squeeze(0))
                qb += t
            out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=1)
            out = out.transpose(1, 0, 2).reshape(out.shape[1], -1)
        if self._real is None:  # the real heads first: the copies' columns cut off
            out = out[:, :self.n_heads * hd]
        else:
            out = mx.take(out.reshape(out.shape[0], heads, hd), self._real, axis=1).reshape(out.shape[0], -1)
        return summed(self, self.o_proj(out))[None]


class ShardedMoeBlock(SparseMoeBlock):
    """Qwen3-MoE's routed experts on one member: the router computed whole, its top-k choices taken from
    the group's first member (`group_choice`, so the members never disagree on a near tie, even on CPUs
    that round differently), each chosen expert's slice of intermediate features run here; the weighted
    sum over the k experts is this member's partial output."""

    group_sum = None  # as Attention's
    group_choice = None  # the runtime's: the group's first member's array, on every member

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.reshape(-1, x.shape[-1])
        indices, weights = self.route(tokens, self.group_choice)
        routed = self.switch_mlp(tokens, indices)  # [tokens, k, hidden]
        out = (routed * weights[..., None].astype(routed.dtype)).sum(axis=1)
        return summed(self, out).reshape(x.shape)


def set_group_sum(model: nn.Module, group_sum: Callable[[mx.array], mx.array] | None,
                  group_choice: Callable[[mx.array], mx.array] | None = None) -> None:
    """The callables each layer's attention and MLP pass their partial output to (None: T = 1, no sum),
    and a MoE layer its top-k choices (the group's first member's, on every member)."""
    for layer in model.layers:
        layer.self_attn.group_sum = group_sum
        layer.mlp.group_sum = group_sum
        if isinstance(layer.mlp, (ShardedMoeBlock, ExpertParallelMoeBlock)):
            layer.mlp.group_choice = group_choice
        for module in (layer.self_attn, layer.mlp):  # MLA's router and indexer (tensor_parallel_mla.py)
            if hasattr(module, "take_choices_from"):
                module.take_choices_from(group_choice)


def shard_weights(weights: dict[str, mx.array], config: ModelConfig, shard: Shard,
                  names: list[str] | None = None) -> None:
    """Cut the loaded arrays `names` (default: all) of `weights` to the member's share, in place: each
    cut array a copy, evaluated, so the whole one is freed. Each array is cut on its own (the loader
    calls this for each group of tensors as it is read: checkpoint_style or module-local names, any name
    holding `layers.N.`), so what a rank keeps resident never grows past its share and one group."""
    mla_cut = mla.is_mla_family(config)
    heads = None if mla_cut else head_share(config.num_attention_heads, config.num_key_value_heads, shard)
    cut = []
    for name in list(weights) if names is None else names:
        match = _PARAMETER.match(name)
        if match is None or name not in weights:
            continue
        layer, module, part = match.groups()
        whole = weights.pop(name)
        check_block_cuts(module, part, whole, config, shard)
        pieces = mla.cut(module, part, whole, config, shard, MLA_TOOLS) if mla_cut else \
            _cut(module, part, whole, config, shard, heads)
        for new_module, array in pieces:  # none: a bias held once
            weights[f"{layer}.{new_module}.{part}"] = array
            cut.append(array)
    mx.eval(cut)


_PARAMETER = re.compile(r"^(.*layers\.\d+)\.(.+)\.([^.]+)$")  # (layer prefix, module, parameter)
_HEADS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "self_attn.q_norm", "self_attn.k_norm")  # cut by heads


def _cut(module: str, part: str, array: mx.array, config: ModelConfig, shard: Shard, heads: HeadShare):
    """(module, array) pairs the member holds of one loaded array of `module` (a parameter `part`)."""
    hd, first = config.head_dim, shard.member == 0
    moe = int(config.raw.get("moe_intermediate_size") or 0)
    if module in ("mlp.gate_proj", "mlp.up_proj"):
        return [(module, _rows(array, part, mlp_share(config.intermediate_size, shard)))]
    if module == "mlp.down_proj":
        keep = part != "bias" or first
        return [(module, _columns(module, array, part, mlp_share(config.intermediate_size, shard),
                                  config.intermediate_size))] if keep else []
    if shard.experts and module.startswith("mlp.switch_mlp."):  # whole experts [e0, e1): the stack's first axis
        e0, e1 = expert_share(num_experts(config), shard.size, shard.member)
        return [(module, array if part == "ggml_type" else mx.array(array[e0:e1]))]
    if module in ("mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj"):  # [experts, out, in]
        return [(module, _rows(array, part, mlp_share(moe, shard)))]
    if module == "mlp.switch_mlp.down_proj":
        return [(module, _columns(module, array, part, mlp_share(moe, shard), moe))]
    if module not in _HEADS:
        return [(module, array)]  # held whole
    if module in ("self_attn.q_norm", "self_attn.k_norm"):  # per head: held whole
        return [(module, array)]
    heads_of = heads.kv if module in ("self_attn.k_proj", "self_attn.v_proj") else heads.q
    rows = (heads_of[0] * hd, heads_of[1] * hd)
    if module != "self_attn.o_proj":
        return [(module, _rows(array, part, rows))]
    if part != "bias" or first:
        return [(module, _columns(module, array, part, rows, config.num_attention_heads * hd))]
    return []


def _rows(array: mx.array, part: str, rows: tuple[int, int]) -> mx.array:
    """Rows [begin, end) of a matrix (or of each expert's, [experts, out, in]), or of a bias vector."""
    if part == "ggml_type":  # a GGUF type held as row bytes: its one-element type id
        return array
    if array.ndim == 1:
        return mx.array(array[rows[0]:rows[1]])  # a copy: the whole array is freed
    return mx.array(array[..., rows[0]:rows[1], :])


def _columns(module: str, array: mx.array, part: str, columns: tuple[int, int], in_features: int) -> mx.array:
    """Input columns [begin, end) of one array of a matrix (or of each expert's) split by its inputs: float as
    they are; every quantized layout on its own units, its last axis in proportion to the columns: MLX's packed
    words and per-group scales/biases on whole groups, and a tensor held in its GGUF blocks (the file's row
    bytes, or a native type's codes/scales/d arrays: `block_values`) on whole blocks, a byte range of every row;
    a bias (the outputs') whole."""
    begin, end = columns
    if part in ("bias", "ggml_type"):
        return array
    floating = array.dtype in (mx.float32, mx.float16, mx.bfloat16)
    if part == "weight" and floating:
        return mx.array(array[..., begin:end])
    width = array.shape[-1]
    block = block_values(array, part, in_features)
    if block is None:  # MLX's packed words: whole words (the scales' groups are checked with them)
        bits = width * 32 // in_features
        if (begin * bits) % 32 or (end * bits) % 32:
            raise UserError(f"--tensor-parallel: the shares of {module}'s {in_features} inputs cut its packed "
                            f"words; use another --tensor-parallel")
    elif (begin % block or end % block) and not floating:  # (check_block_cuts says so first, on every member)
        raise UserError(f"--tensor-parallel: the shares of {module}'s {in_features} inputs cut its GGUF blocks of "
                        f"{block} values; use a smaller --tensor-parallel")
    elif begin % block or end % block:  # the same line on every rank it fails on
        raise UserError(f"--tensor-parallel: the shares of {module}'s {in_features} inputs cut its quantization "
                        f"groups of {block}; use a smaller --tensor-parallel or --group-size")
    if (begin * width) % in_features or (end * width) % in_features:
        raise UserError(f"--tensor-parallel: {module}'s {part} ({width} per row) cannot be cut at inputs "
                        f"{begin}-{end} of {in_features}; run with --tensor-parallel 1")
    return mx.array(array[..., begin * width // in_features:end * width // in_features])


# GGUF types held in their own blocks (checkpoints/quants.py), told apart by their arrays: part -> dtype -> values
# per block. The file's row bytes (uint8 weights: the K-quants, ternary and grid i-quants, 256 values a block; the
# tied Q8_0's 34 bytes per 32); IQ4_NL's fp16 d per 32 (uint16 scales), IQ4_XS's 8 header bytes per 256 (int8
# scales), Q6_K's int8 scales (two int64 per 256) and d bytes (uint8 biases, two per 256); MLX mxfp4's uint8
# scale per 32 values. Their codes (uint32 weights) are cut with them.
_HELD_BLOCKS = {"scales": {mx.uint16: 32, mx.int8: 256, mx.int64: 256, mx.uint8: 32}, "biases": {mx.uint8: 256}}


def block_values(array: mx.array, part: str, in_features: int) -> int | None:
    """The values per block of one array of a quantized matrix with `in_features` inputs: its columns are cut on
    multiples of it; None: MLX's packed codes (uint32), cut with their scales."""
    if part == "weight" and array.dtype == mx.uint8:  # the file's row bytes: Q8_0's 34 per 32, else per 256
        return 32 if array.shape[-1] * 32 == in_features * 34 else 256
    if part == "weight":
        return None
    held = _HELD_BLOCKS.get(part, {}).get(array.dtype)
    if held is not None:
        return held
    return in_features // array.shape[-1]  # MLX's float scales/biases: one per group


def column_cuts(module: str, config: ModelConfig, size: int, experts: bool = False) -> tuple[int, list] | None:
    """(input features, [begin, end) of each member of a group of `size`) of a matrix `module` cut by its input
    columns (o_proj, down_proj, the sliced experts' down_proj; MLA's too), or None: not cut by columns."""
    if mla.is_mla_family(config):
        shares = [mla.share_of(module, "weight", config, Shard(m, size), MLA_TOOLS) for m in range(size)]
        if shares[0] is None or shares[0][0] != -1:
            return None
        return mla.in_features_of(module, config), [(b, e) for _, b, e in shares]
    if module == "self_attn.o_proj":
        hd = config.head_dim
        cuts = [head_share(config.num_attention_heads, config.num_key_value_heads, Shard(m, size)).q for m in range(size)]
        return config.num_attention_heads * hd, [(b * hd, e * hd) for b, e in cuts]
    if module == "mlp.down_proj":
        return config.intermediate_size, [mlp_share(config.intermediate_size, Shard(m, size)) for m in range(size)]
    if module == "mlp.switch_mlp.down_proj" and not experts:
        moe = int(config.raw["moe_intermediate_size"])
        return moe, [mlp_share(moe, Shard(m, size)) for m in range(size)]
    return None


def check_block_cuts(module: str, part: str, array: mx.array, config: ModelConfig, shard: Shard) -> None:
    """One line, on every member alike, where a member's share of `module`'s input columns would cut a block of
    its held layout (the whole group's shares checked, not just this member's): it names the tensor and the
    largest smaller --tensor-parallel whose shares fall on block edges. The edges cannot move to the nearest block
    edge: a member's columns of o_proj are its attention heads' outputs (which it alone computes), of down_proj
    the MLP features its gate/up rows make, so the shares of every projection of a layer must agree."""
    if part in ("bias", "ggml_type") or array.dtype in (mx.float32, mx.float16, mx.bfloat16):
        return
    cuts = column_cuts(module, config, shard.size, shard.experts)
    if cuts is None:
        return
    problem = block_cut_problem(module, cuts, block_values(array, part, cuts[0]), config, shard)
    if problem:
        raise UserError(problem)


def block_cut_problem(module: str, cuts: tuple[int, list], block: int | None, config: ModelConfig, shard: Shard,
                      blocks: str = "GGUF blocks") -> str | None:
    """check_block_cuts' line for a matrix `module` whose group shares `cuts` (column_cuts') of a matrix held in
    `blocks` of `block` input values (None: no blocks), or None where the shares fall on block edges (preflight
    asks it from the checkpoint's index, before any weight is read)."""
    if block is None:
        return None
    in_features, shares = cuts
    if all(b % block == 0 and e % block == 0 for b, e in shares):
        return None
    works = 1
    for size in range(shard.size - 1, 1, -1):
        try:
            smaller = column_cuts(module, config, size, shard.experts)
        except UserError:
            continue
        if all(b % block == 0 and e % block == 0 for b, e in smaller[1]):
            works = size
            break
    edges = ", ".join(f"{b}-{e}" for b, e in shares)
    return (f"--tensor-parallel {shard.size}: the shares of {module} ({edges} of its {in_features} inputs) "
            f"cut its {blocks} of {block} values; use --tensor-parallel {works}")


MLA_TOOLS = mla.Tools(even_split, mlp_share, _rows, _columns)  # what tensor_parallel_mla.py borrows from here


def share_fractions(config: ModelConfig, shard: Shard) -> tuple[float, float]:
    """The fractions of a layer's weights and of its KV cache that `shard` holds (preflight's accounting):
    its projections' rows or columns as held (repeated KV heads included, biases and norms whole)."""
    if shard.size == 1:
        return 1.0, 1.0
    if mla.is_mla_family(config):
        check_expert_parallel(config, shard)
        return mla.share_fractions(config, shard, MLA_TOOLS)
    hd, hidden = config.head_dim, config.hidden_size
    heads = head_share(config.num_attention_heads, config.num_key_value_heads, shard)
    i0, i1 = mlp_share(config.intermediate_size, shard)
    nq, nkv = heads.q[1] - heads.q[0], heads.kv[1] - heads.kv[0]
    whole = 2 * hidden * hd * (config.num_attention_heads + config.num_key_value_heads) + 2 * hidden
    held = 2 * hidden * hd * (nq + nkv) + 2 * hidden
    experts = num_experts(config)  # (transformers 5 writes num_local_experts)
    if experts and shard.experts:  # the router whole, whole experts [e0, e1) (expert_parallel.py)
        moe = int(config.raw["moe_intermediate_size"])
        e0, e1 = expert_share(experts, shard.size, shard.member)
        whole, held = whole + hidden * experts * (1 + 3 * moe), held + hidden * (experts + 3 * moe * (e1 - e0))
    elif experts:  # Qwen3-MoE (every layer sparse, as published): the router whole, each expert sliced
        moe = int(config.raw["moe_intermediate_size"])
        e0, e1 = mlp_share(moe, shard)
        whole, held = whole + hidden * experts * (1 + 3 * moe), held + hidden * experts * (1 + 3 * (e1 - e0))
    else:
        whole, held = whole + 3 * hidden * config.intermediate_size, held + 3 * hidden * (i1 - i0)
    return held / whole, nkv / config.num_key_value_heads
