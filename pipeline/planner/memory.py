"""A rank's memory, counted and named one way by `plan`, `preflight` and the stats line.

Three things take a rank's memory: its weights as held (after --quantize, --dtype and
--weights-in-memory), the KV cache of the tokens it keeps, and, on the last rank of a batch or
serve job, its share of the LM head (head_share.py). `plan` predicts them from config.json,
`preflight` from the model folder on each host, and the stats line measures them on the loaded
stage. All three build a `RankBytes` and print it with `size`, so their figures read alike and can
be compared line by line (tests/test_plan.py checks that the prediction equals the measurement).
"""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import Architecture

MIB, GIB = 2**20, 2**30
# With a prefix cache, each live sequence of a linear-attention family (Qwen3.5) keeps its linear states at
# up to this many prompt chunks' ends besides its current one (models/cache.py LinearAttentionState.points_max;
# tests/test_plan_linear_states.py checks they agree): its resume points.
POINTS_MAX = 8
DTYPE_LABEL = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # --dtype as the stats line names it


def size(n: float) -> str:
    """'97.2 MiB' below a GiB, '1.3 GiB' from one GiB up: a small model does not read as '0.0 GiB'."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


@dataclass(frozen=True)
class RankBytes:
    weights: int  # as held in memory, without the LM head share
    kv_cache: int = 0
    head_share: int = 0  # the last rank's rows of the LM head (batch and serve)
    held_as: str = ""  # how the weights are held: 'fp32', 'quantized', 'r0 fp32, r1 quantized', ...
    prefix_cache: int = 0  # serve's --prefix-cache-gb: the most the rank's prefix cache may hold

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.head_share + self.prefix_cache

    def describe(self, kv_cache: bool = True) -> str:
        """'weights 257.1 MiB fp32 + KV cache 1.4 MiB (+ LM head share 12.0 MiB)'; without the KV cache
        where it says nothing (a batch job's end, when every sequence has released its cache)."""
        text = f"weights {size(self.weights)}{' ' + self.held_as if self.held_as else ''}"
        text += f" + KV cache {size(self.kv_cache)}" if kv_cache else ""
        return (text + (f" + LM head share {size(self.head_share)}" if self.head_share else "")
                + (f" + prefix cache {size(self.prefix_cache)}" if self.prefix_cache else ""))


def rank_bytes(layer_bytes: list[int], ends_bytes: int, kv_layer_bytes: list[int], span: tuple[int, int],
               rank: int, ranks: int, head_bytes: int = 0, head_fraction: float = 0.0,
               held_as: str = "", prefix_cache: int = 0) -> RankBytes:
    """What rank `rank` of `ranks` holds for layers span = [start, end): those layers' weights (plus
    the embedding, final norm and LM head on rank 0: `ends_bytes`), their KV cache (`kv_layer_bytes`:
    per layer, for every token and sequence it will keep) and, on the last rank, `head_fraction` of
    the LM head's `head_bytes`; `prefix_cache`: the most its prefix cache may hold (--prefix-cache-gb)."""
    start, end = span
    weights = sum(layer_bytes[start:end]) + (ends_bytes if rank == 0 else 0)
    head = round(head_fraction * head_bytes) if rank == ranks - 1 and ranks > 1 else 0
    return RankBytes(weights, sum(kv_layer_bytes[start:end]), head, held_as, prefix_cache)


def kv_layer_bytes(arch: Architecture, dtype_bytes: int, tokens: int, sequences: int = 1,
                   points: int = 0) -> list[int]:
    """Per layer: the KV cache bytes of `sequences` sequences of `tokens` tokens, each also holding
    `points` resume points (a whole linear-attention state each: `live_points`)."""
    return [round((arch.kv_bytes(i, i + 1, tokens, dtype_bytes) + points * arch.linear_state_bytes(i, i + 1, dtype_bytes))
                  * sequences) for i in range(len(arch.layers))]


def live_points(prefix_cache_gb: float) -> int:
    """Resume points a live sequence keeps: POINTS_MAX with a prefix cache (the runtime keeps them only
    then: runtime/job.py load_ring_stage), else none."""
    return POINTS_MAX if prefix_cache_gb else 0



def measured(stage, held_as: str = "") -> RankBytes:
    """A loaded stage's bytes, as its arrays hold them (the stats line)."""
    from mlx.utils import tree_flatten  # here, not at the top: `pipeline plan` imports this module and loads no MLX

    head = sum(a.nbytes for _, a in tree_flatten(stage.model.head_share.parameters())) \
        if getattr(stage.model, "head_rows", 0) else 0
    return RankBytes(stage.weight_nbytes - head, stage.cache_nbytes, head, held_as)
