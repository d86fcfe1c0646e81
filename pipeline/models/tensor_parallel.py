"""Tensor parallelism inside a stage (--tensor-parallel T): what one rank of a stage's group of T
holds of each layer, and the hook through which a layer asks for the group's sum.

Llama family (llama, mistral, qwen2, qwen3) only; other families refuse T > 1 by name (`check_family`).

Per layer, member m of a group of T holds:
- attention: query heads [q0, q1), split as evenly as the count allows (9 heads over 2: 5 and 4), and
  the key/value heads those query heads read. Where each of those key/value heads serves the same
  number of the member's query heads, they are held once each (grouped-query attention as usual);
  otherwise (SmolLM2's 9 query / 3 KV heads over 2 ranks: 3 + 2 and 1 + 3) one key/value head per query
  head, duplicated rows of k_proj/v_proj: the same numbers, the attention kernel's uniform grouping
  kept. q/k norms are per head, held whole. o_proj: the input columns of the member's heads.
- MLP: gate/up rows (output features) and down's columns (input features) [i0, i1), cut on units of
  up to 256 features so that a quantized row's groups (32/64/128) and int8 blocks are never cut.
- biases of o_proj and down_proj on member 0 only (added once, before the sum, in rank order).
Each layer's attention and MLP output is then that member's partial sum; `group_sum` (a callable the
runtime injects: models never talk to other ranks) returns the group's total, the same bits on every
member. Norms, RoPE and everything else stay whole on every member.

The weights are cut after the format adapters (checkpoints/weights.py load_slice), on the arrays MLX
holds: an affine-quantized row is `bits` bits a value and one scale/bias per group, so columns
[b, e) are words [b*bits/32, e*bits/32) and groups [b/g, e/g). Only the cut arrays are kept (copies),
so a rank holds its share; the whole tensor is read and converted first (the read of a row's share of
a strided tensor is not yet narrowed to its bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..util.errors import UserError
from .config import ModelConfig
from .layers import MLP, Attention

SUPPORTED_FAMILIES = ("llama",)  # registry module names whose layers are layers.Attention + layers.MLP
MLP_UNITS = (256, 128, 64, 32, 16)  # the widest unit of intermediate features that still gives every member some


@dataclass(frozen=True)
class Shard:
    """Member `member` of a group of `size` ranks."""
    member: int
    size: int


def check_family(config: ModelConfig, module_name: str, size: int) -> None:
    """One line refusing T > 1 for a family whose layers are not sharded here."""
    if size > 1 and module_name not in SUPPORTED_FAMILIES:
        raise UserError(f"--tensor-parallel is not supported for {config.model_type} yet; "
                        f"run with --tensor-parallel 1")


def even_split(count: int, parts: int, member: int) -> tuple[int, int]:
    """[begin, end) of `member`'s share of `count` items over `parts`: the first count % parts one more."""
    base, extra = divmod(count, parts)
    begin = member * base + min(member, extra)
    return begin, begin + base + (member < extra)


@dataclass(frozen=True)
class HeadShare:
    q: tuple[int, int]  # query heads [begin, end)
    kv: tuple[int, ...]  # the global key/value head each local key/value head holds


def head_share(n_heads: int, n_kv_heads: int, shard: Shard) -> HeadShare:
    q0, q1 = even_split(n_heads, shard.size, shard.member)
    if q1 <= q0:
        raise UserError(f"--tensor-parallel {shard.size} is more than the model's {n_heads} query heads: "
                        f"use at most {n_heads}")
    per = n_heads // n_kv_heads
    of = [h // per for h in range(q0, q1)]  # the key/value head of each local query head
    used = sorted(set(of))
    if len({of.count(kv) for kv in used}) == 1:
        return HeadShare((q0, q1), tuple(used))
    return HeadShare((q0, q1), tuple(of))  # uneven use: one key/value head per query head


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
    hd, hidden = config.head_dim, config.hidden_size
    heads = head_share(config.num_attention_heads, config.num_key_value_heads, shard)
    i0, i1 = mlp_share(config.intermediate_size, shard)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not Attention or type(mlp) is not MLP:
            raise UserError(f"--tensor-parallel is not supported for {config.model_type} yet; "
                            f"run with --tensor-parallel 1")
        nq, nkv = heads.q[1] - heads.q[0], len(heads.kv)
        attn.n_heads, attn.n_kv_heads = nq, nkv
        qkv_bias = "bias" in attn.q_proj
        attn.q_proj = nn.Linear(hidden, nq * hd, bias=qkv_bias)
        attn.k_proj = nn.Linear(hidden, nkv * hd, bias=qkv_bias)
        attn.v_proj = nn.Linear(hidden, nkv * hd, bias=qkv_bias)
        attn.o_proj = nn.Linear(nq * hd, hidden, bias="bias" in attn.o_proj and shard.member == 0)
        bias = "bias" in mlp.gate_proj
        mlp.gate_proj = nn.Linear(hidden, i1 - i0, bias=bias)
        mlp.up_proj = nn.Linear(hidden, i1 - i0, bias=bias)
        mlp.down_proj = nn.Linear(i1 - i0, hidden, bias="bias" in mlp.down_proj and shard.member == 0)


def set_group_sum(model: nn.Module, group_sum: Callable[[mx.array], mx.array] | None) -> None:
    """The callable each layer's attention and MLP pass their partial output to (None: T = 1, no sum)."""
    for layer in model.layers:
        layer.self_attn.group_sum = group_sum
        layer.mlp.group_sum = group_sum


def shard_weights(weights: dict[str, mx.array], config: ModelConfig, shard: Shard) -> None:
    """Cut the loaded arrays (module-local names, as load_slice holds them) to the member's share, in
    place: each cut array a copy, evaluated, so the whole one is freed."""
    hd, hidden = config.head_dim, config.hidden_size
    heads = head_share(config.num_attention_heads, config.num_key_value_heads, shard)
    q_rows = (heads.q[0] * hd, heads.q[1] * hd)
    kv = heads.kv
    if list(kv) == list(range(kv[0], kv[-1] + 1)):
        kv_rows = (kv[0] * hd, (kv[-1] + 1) * hd)
    else:
        kv_rows = mx.array([k * hd + j for k in kv for j in range(hd)], dtype=mx.int32)
    i_rows = mlp_share(config.intermediate_size, shard)
    cuts = {"self_attn.q_proj": ("rows", q_rows), "self_attn.k_proj": ("rows", kv_rows),
            "self_attn.v_proj": ("rows", kv_rows),
            "self_attn.o_proj": ("columns", q_rows, config.num_attention_heads * hd),
            "mlp.gate_proj": ("rows", i_rows), "mlp.up_proj": ("rows", i_rows),
            "mlp.down_proj": ("columns", i_rows, config.intermediate_size)}
    prefixes = sorted({name.rsplit(".", 1)[0] for name in weights if name.startswith("layers.")})
    for prefix in prefixes:
        module = prefix.split(".", 2)[-1] if prefix.count(".") >= 2 else ""
        cut = cuts.get(module)
        if cut is None:
            continue
        if cut[0] == "rows":
            _cut_rows(weights, prefix, cut[1])
        else:
            _cut_columns(weights, prefix, cut[1], cut[2], keep_bias=shard.member == 0)
    mx.eval([weights[name] for name in weights if name.startswith("layers.")])


def _take_rows(array: mx.array, rows) -> mx.array:
    if isinstance(rows, tuple):
        return mx.array(array[rows[0]:rows[1]])  # a copy: the whole array is freed
    return mx.take(array, rows, axis=0)


def _cut_rows(weights: dict, prefix: str, rows) -> None:
    for part in ("weight", "scales", "biases", "bias"):
        name = f"{prefix}.{part}"
        if name in weights:
            weights[name] = _take_rows(weights[name], rows)


def _cut_columns(weights: dict, prefix: str, columns: tuple[int, int], in_features: int, keep_bias: bool) -> None:
    begin, end = columns
    weight = weights[f"{prefix}.weight"]
    scales = weights.get(f"{prefix}.scales")
    if scales is None:
        weights[f"{prefix}.weight"] = mx.array(weight[:, begin:end])
    else:
        if scales.dtype not in (mx.float32, mx.float16, mx.bfloat16):
            raise UserError(f"--tensor-parallel: {prefix} is held in GGUF blocks that cannot be cut by input "
                            f"features yet; run with --tensor-parallel 1")
        bits = weight.shape[-1] * 32 // in_features
        group = in_features // scales.shape[-1]
        if begin % group or end % group or (begin * bits) % 32 or (end * bits) % 32:
            raise UserError(f"--tensor-parallel: {prefix}'s share [{begin}, {end}) of its inputs cuts its "
                            f"quantization groups of {group}; use another --tensor-parallel")
        weights[f"{prefix}.weight"] = mx.array(weight[:, begin * bits // 32:end * bits // 32])
        for part in ("scales", "biases"):
            name = f"{prefix}.{part}"
            if name in weights:
                weights[name] = mx.array(weights[name][:, begin // group:end // group])
    if not keep_bias:
        weights.pop(f"{prefix}.bias", None)
