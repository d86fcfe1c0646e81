"""The split of a model's layers over the ranks, and which ranks hold MLX-quantized weights
dequantized (--weights-in-memory): one decision, taken by the job (runtime/job.plan_job) and
checked ahead of it by `preflight`, so both give every rank the same layers and bytes."""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoints.weights_in_memory import choose_dense
from .memory import rank_bytes
from .partition import LAYER_OVERHEAD_BYTES, balanced_counts, check_ranks, layer_ranges, parse_split
from .weights_bytes import ModelBytes


@dataclass(frozen=True)
class SplitWeights:
    """What the split weighs: the checkpoint's bytes as stored, which the default split balances,
    and its bytes in memory, packed and dequantized, where --weights-in-memory has a choice."""
    stored_layers: list[int]  # per layer (tensor_names.layer_nbytes)
    stored_ends: int  # embedding, final norm and LM head, and the MTP module with --draft mtp: rank 0's
    held: ModelBytes | None = None  # packed (weights_bytes.held_and_dense); None: no choice to make
    dense_held: ModelBytes | None = None  # dequantized to --dtype


def split_layers(weights: SplitWeights, ranks: int, split: str | None, weights_in_memory: str,
                 memory: list[tuple[str, int | None]] | None = None, fast_quantized: list[bool] | None = None,
                 planned: list[int] | None = None, last_rank_head: float = 0.0) -> tuple[list[int], list[bool]]:
    """(layer counts, dense per rank): --split as given, else `planned` (the planner's counts for
    --host-memory), else balanced by stored bytes plus a fixed cost per layer; then, where the
    weights are MLX-quantized and --weights-in-memory is not `quantized`, plan_weights_in_memory.
    memory: (host, bytes available or None if unknown) per rank; fast_quantized: per rank, whether it
    has pipeline's quantized kernels (both asked of every rank under auto only)."""
    layers = len(weights.stored_layers)
    if split:
        counts = parse_split(split, layers, ranks)
    elif planned:
        counts = planned
    else:
        check_ranks(layers, ranks)
        counts = balanced_counts(weights.stored_layers, ranks, rank0_extra_bytes=weights.stored_ends,
                                 layer_overhead_bytes=LAYER_OVERHEAD_BYTES)
    if weights_in_memory == "quantized" or weights.held is None:
        return counts, [False] * ranks
    return plan_weights_in_memory(weights_in_memory, weights.held, weights.dense_held, counts, memory,
                                  fixed=bool(split or planned), last_rank_head=last_rank_head,
                                  fast_quantized=fast_quantized)


def plan_weights_in_memory(mode: str, held: ModelBytes, dense_held: ModelBytes, counts: list[int],
                           memory: list[tuple[str, int | None]] | None, fixed: bool, last_rank_head: float = 0.0,
                           fast_quantized: list[bool] | None = None):
    """(layer counts, dense per rank) for --weights-in-memory fp32|auto on a quantized model, from
    its bytes held packed (`held`) and dequantized (`dense_held`; weights_bytes.held_and_dense). fp32: every
    rank dense, layers balanced by dense bytes. auto: the same if every host's ranks fit in its free
    memory (see `choose_dense`), else the quantized balance with ranks made dense, in rank order,
    while their host has room; but where every rank has pipeline's quantized kernels
    (`fast_quantized`, qmm.py), every rank keeps its weights quantized: they decode faster than
    fp32 and prefill as fast."""
    ranks = len(counts)
    if mode == "auto" and fast_quantized and all(fast_quantized):
        return counts, [False] * ranks

    def shares(counts: list[int], mb: ModelBytes) -> list[int]:
        no_cache = [0] * len(mb.layers)
        return [rank_bytes(mb.layers, mb.ends, no_cache, span, r, ranks, mb.head, last_rank_head).total
                for r, span in enumerate(layer_ranges(counts))]

    dense_counts = counts
    if not fixed:
        dense_counts = balanced_counts(dense_held.layers, ranks, rank0_extra_bytes=dense_held.ends,
                                       layer_overhead_bytes=LAYER_OVERHEAD_BYTES)
    if mode == "fp32":
        return dense_counts, [True] * ranks
    hosts, available = [h for h, _ in memory], [a for _, a in memory]
    if all(choose_dense(hosts, available, [0] * ranks, shares(dense_counts, dense_held))):
        return dense_counts, [True] * ranks
    return counts, choose_dense(hosts, available, shares(counts, held), shares(counts, dense_held))
