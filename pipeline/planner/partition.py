"""Which contiguous layers each rank owns.

Rank 0 is both the first and the last stage of the ring, so the embedding and the final
norm + LM head count in its share. The balanced split minimises the largest share of bytes,
since the slowest (or fullest) stage bounds both speed and fit.
"""

from __future__ import annotations

from ..util.errors import UserError
from .weights_bytes import ModelBytes

# A layer costs time beyond its weights' products: attention per sequence and a few dozen small ops,
# in a batch job about what products with 28 MiB of weights take on a CPU node. Counting it balances
# small models' stages in time: SmolLM2's 108 MiB LM head weighs as 2.6 of its 13.5 MiB layers, not
# 8 (measured: rank 0 idle 13%, rank 1 3% at split 13,17; 14,16 faster in 4 of 4 paired runs). Real
# models' layers are GBs, so it changes nothing there.
LAYER_OVERHEAD_BYTES = 28 << 20


def layer_counts(mb: ModelBytes, ranks: int, memory_gib: list[float] | None = None) -> list[int]:
    """Contiguous layer counts per rank. With host memory, each rank's share of the resident
    weight bytes is proportional to its memory (rank 0's share includes embedding + head);
    without, the largest share is as small as possible. `generate --host-memory` uses this too."""
    check_ranks(len(mb.layers), ranks)
    return balanced_counts(mb.layers, ranks, rank0_extra_bytes=mb.ends, capacities=memory_gib,
                           layer_overhead_bytes=0 if memory_gib else LAYER_OVERHEAD_BYTES)



def balanced_counts(layer_bytes: list[int], ranks: int, rank0_extra_bytes: int = 0,
                    capacities: list[float] | None = None, layer_overhead_bytes: int = 0) -> list[int]:
    """Layer counts per rank (each >= 1) minimising the largest per-rank byte total (each layer
    counted `layer_overhead_bytes` more), or with `capacities` (e.g. each host's memory) the largest
    total relative to its rank's capacity, so that shares come out proportional to capacity."""
    layer_bytes = [b + layer_overhead_bytes for b in layer_bytes]
    num_layers = len(layer_bytes)
    check_ranks(num_layers, ranks)
    if capacities is not None and len(capacities) != ranks:
        raise ValueError(f"{len(capacities)} capacities for {ranks} ranks")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def load(rank: int, i: int, j: int) -> float:  # bytes of `rank` owning layers [i, j)
        total = prefix[j] - prefix[i] + (rank0_extra_bytes if rank == 0 else 0)
        return total if capacities is None else total / capacities[rank]

    # best[r][j]: smallest possible max-share when ranks 0..r own layers [0, j); exact DP,
    # cheap for any real model (layers <= a few hundred).
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(ranks)]
    cut = [[0] * (num_layers + 1) for _ in range(ranks)]
    for j in range(1, num_layers + 1):
        best[0][j] = load(0, 0, j)
    for r in range(1, ranks):
        for j in range(r + 1, num_layers + 1):
            for i in range(r, j):
                cost = max(best[r - 1][i], load(r, i, j))
                if cost < best[r][j]:
                    best[r][j], cut[r][j] = cost, i
    counts, j = [], num_layers
    for r in range(ranks - 1, 0, -1):
        i = cut[r][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return counts[::-1]


def parse_split(text: str, num_layers: int, ranks: int) -> list[int]:
    """`--split 10,10,10`: explicit layer counts per rank."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--split {text!r} must be comma-separated layer counts, e.g. 10,10,10") from None
    if len(counts) != ranks:
        raise UserError(f"--split {text!r} has {len(counts)} counts but the job has {ranks} ranks")
    if any(c < 1 for c in counts):
        raise UserError(f"--split {text!r}: every rank needs at least one layer")
    if sum(counts) != num_layers:
        raise UserError(f"--split {text!r} sums to {sum(counts)} but the model has {num_layers} layers")
    return counts


def check_ranks(num_layers: int, ranks: int) -> None:
    if ranks > num_layers:
        raise UserError(f"{ranks} ranks but the model has only {num_layers} layers: "
                        f"run with at most {num_layers} ranks")


def layer_ranges(counts: list[int]) -> list[tuple[int, int]]:
    """[start, end) per rank from layer counts."""
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges
