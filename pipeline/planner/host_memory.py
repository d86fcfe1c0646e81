"""`generate --host-memory`: the planner's layer split for the job's hosts, and whether each rank's
weights and KV cache fit its host's memory, checked before anything is loaded."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from ..checkpoints.model_files import find
from ..models.config import ModelConfig
from ..util.errors import UserError
from .memory import GIB, kv_layer_bytes, rank_bytes, size
from .partition import layer_counts
from .shapes import Architecture, architecture
from .stored_formats import checkpoint_format
from .weights_bytes import ModelBytes, Precision, model_bytes, with_mtp


def parse_per_host(text: str, flag: str, count: int | None, unit: str = "hosts",
                   allow_one: bool = False) -> list[float]:
    """`512,512,256,256` -> floats, one per host/rank (or one for all, where `allow_one`)."""
    try:
        values = [float(part) for part in str(text).split(",")]
    except ValueError:
        raise UserError(f"{flag} {text!r} must be comma-separated numbers, e.g. 512,512,256,256") from None
    if any(not v > 0 or math.isinf(v) for v in values):
        raise UserError(f"{flag} {text!r}: every value must be a positive number")
    if count is not None and len(values) != count and not (allow_one and len(values) == 1):
        raise UserError(f"{flag} {text!r} has {len(values)} value{'s' * (len(values) != 1)} but there are "
                        f"{count} {unit}: give one per {unit.removesuffix('s')}")
    if count is not None and len(values) == 1 and count > 1:
        values = values * count
    return values


@dataclass
class MemoryPlan:
    """`generate --host-memory`: the planner's split and its fit verdict, before loading."""
    memory_gib: list[float]
    mb: ModelBytes  # weights as loaded
    dense_mb: ModelBytes  # with MLX-quantized weights dequantized (ranks --weights-in-memory makes dense)
    arch: Architecture
    dtype_bytes: int  # of the KV cache

    @classmethod
    def for_job(cls, config: ModelConfig, host_memory: str, ranks: int, folder: Path, dtype: str,
                quantize: int | None, group_size: int, int8: bool, mtp: bool) -> "MemoryPlan":
        """host_memory: --host-memory (GiB per rank); folder: the model's, resolved (or its GGUF file); the
        weights as the job holds them: floats in `dtype`, --quantize and --group-size, int8: the job's
        --int8-activations as resolved, mtp: rank 0 holds the MTP module too (--draft mtp). No defaults
        here: the job passes its settings (runtime/settings.py holds the flags' defaults)."""
        memory = parse_per_host(host_memory, "--host-memory", ranks, unit="ranks")
        precision = Precision(checkpoint_format(config, find(folder), quantize, group_size), dtype=dtype,
                              quantize=quantize, group_size=group_size, int8=int8)
        arch = architecture(config)
        mb, dense_mb = model_bytes(arch, precision), model_bytes(arch, replace(precision, dense=True))
        if mtp:
            mb, dense_mb = with_mtp(mb), with_mtp(dense_mb)
        return cls(memory, mb, dense_mb, arch, precision.dtype_bytes)

    def counts(self) -> list[int]:
        return layer_counts(self.mb, len(self.memory_gib), self.memory_gib)

    def check(self, ranges: list[tuple[int, int]], tokens: int, dense: list[bool] | None = None) -> None:
        """UserError (one line) unless every rank's weights + KV cache for `tokens` fit its memory."""
        short = []
        kv = kv_layer_bytes(self.arch, self.dtype_bytes, tokens)
        for r, span in enumerate(ranges):
            mb = self.dense_mb if dense and dense[r] else self.mb
            held = rank_bytes(mb.layers, mb.ends, kv, span, r, len(ranges))
            if held.total > self.memory_gib[r] * GIB:
                short.append(f"rank {r} needs {size(held.total)} ({held.describe()}) "
                             f"but has {self.memory_gib[r]:g} GiB")
        if short:
            raise UserError(f"the model does not fit in --host-memory: {'; '.join(short)}; add hosts or memory, "
                            f"or hold the weights in fewer bytes (--dtype bfloat16, --quantize 4)")
