"""Attention of a step's new tokens over their sequences' KV caches: pipeline's kernel for every
sequence of the step in one MLX operation (attention_kernels.cpp, compiled into the quantized
products' extension by build.py), or MLX's scaled_dot_product_attention per sequence where the kernel
is absent.

On CPU, MLX's attention is a chain of small ops, and a batch ran it once per sequence and layer,
after six nodes per sequence to update its cache: a 16-sequence decode step of SmolLM2 took 155 ms,
80 ms with the kernel doing both. The kernel also rounds each query the same whatever shares the
call (its opening comment says how), so a query attended alone, in a prompt's chunk or in a
verified draft gives the same bits.

The kernel takes float32 queries, keys and values whose head sizes are multiples of 16 on the CPU
device; anything else, `PIPELINE_ATTENTION=0`, or no extension (build.py says why) goes to MLX.
"""

from __future__ import annotations

import mlx.core as mx

from . import qmm
from ..util.switches import turned_off

ENV = "PIPELINE_ATTENTION"
_used = {"pipeline": 0, "mlx": 0}


def kernel(q: mx.array, head_dims: tuple[int, ...]):
    """The extension if it computes this attention (float32 on the CPU, head sizes multiples of 16),
    else None."""
    if turned_off(ENV):
        return None
    module = qmm.extension_for(q)
    if module is None or not hasattr(module, "cached_attention") or any(d % 16 for d in head_dims):
        return None
    return module


def attend_and_append(module, q: mx.array, new_keys: mx.array, new_values: mx.array, caches: list, rows: list[int],
                      lengths: list[int], scale: float) -> mx.array:
    """The step's new keys and values [sum(lengths), kv heads, d] (sequence i's lengths[i] tokens, packed
    in order) into each sequence's cache (models/cache.KVCache), then the attention of q [sum(rows), heads, dk]
    (sequence i's rows[i] queries, its last tokens) over them, causally, all in one MLX operation
    returning [sum(rows), heads * dv]. The caches' buffers are updated in place where nothing else
    holds them (as MLX's slice updates do), else copied."""
    for cache, n in zip(caches, lengths):
        cache.reserve(n, new_keys.shape[1], new_keys.shape[2], new_values.shape[2], new_keys.dtype)
    q_begin, new_begin = [0], [0]
    for t, n in zip(rows, lengths):
        q_begin.append(q_begin[-1] + t)
        new_begin.append(new_begin[-1] + n)
    offsets = [cache.offset for cache in caches]
    _used["pipeline"] += 1
    outs = module.attend_and_append(q, new_keys, new_values, [c.keys for c in caches], [c.values for c in caches],
                                    q_begin, new_begin, offsets, scale)
    count = len(caches)
    for i, (cache, n) in enumerate(zip(caches, lengths)):
        cache.keys, cache.values = outs[1 + i], outs[1 + count + i]
        cache.offset += n
    return outs[0]


def note_fallback() -> None:
    _used["mlx"] += 1


def describe() -> str:
    """The stats line's phrase for attention ("" if this process ran none)."""
    if not _used["pipeline"] and not _used["mlx"]:
        return ""
    if _used["pipeline"]:
        return "pipeline's kernel" + (", some MLX's" if _used["mlx"] else "")
    return "MLX's"
