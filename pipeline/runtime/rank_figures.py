"""Each rank's figures for the closing stats line of generate, batch and serve: its host, peak
RSS, how its weights are held, its BLAS and its bytes as plan and preflight count them
(RankFigures, gathered on rank 0), and the labels that put them into the line."""

from __future__ import annotations

import resource
import socket
import sys
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from ..kernels import blas
from ..planner.memory import RankBytes, measured
from .stage import Stage


@dataclass(frozen=True)
class RankFigures:
    """What each rank reports for the closing stats line (rank_figures)."""
    host: str
    peak_rss: int  # bytes (peak_rss_bytes)
    weights: str  # how its weights are held (weights_label)
    blas: str  # its BLAS (blas.describe)
    held: RankBytes  # its bytes, as plan and preflight count them (memory.measured)
    kv_bytes_per_token: int = 0  # generate: its KV cache's bytes per position
    invariant_rows: int = 0  # generate: rows its products round alike whatever the batch (blas.invariant_rows)
    matmuls: str = ""  # batch: how its products take a micro-batch's sequences (matmuls_label)
    group_sum_ms: float = 0.0  # --tensor-parallel: its ms in group sums per forward step (tensor_group.Group)


def rank_figures(stage: Stage, **extra) -> RankFigures:
    """This rank's figures; extra: the fields a command adds (kv_bytes_per_token, invariant_rows, matmuls)."""
    return RankFigures(socket.gethostname(), peak_rss_bytes(), weights_label(stage), blas.describe(), measured(stage),
                       **extra)


def rss_label(figures: list[RankFigures], kv_cache: bool = True) -> str:
    """'r0 403 MiB (weights 297.1 MiB + KV cache 1.4 MiB), r1 ...': each rank's peak RSS beside
    the bytes it holds; the difference is the runtime's own."""
    return ", ".join(f"r{r} {f.peak_rss / 2**20:.0f} MiB ({f.held.describe(kv_cache)})" for r, f in enumerate(figures))


def peak_rss_bytes() -> int:
    """This process's peak resident memory. On Linux, VmHWM: unlike ru_maxrss it is not
    inherited through fork + exec from a large parent process."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def weights_label(stage: Stage) -> str:
    """How this rank's weights live in memory: 'quantized' if any module is, else the float
    dtype of its largest weights (e.g. 'fp32')."""
    if any("scales" in m for m in stage.model.modules()):
        return "quantized"
    _, biggest = max(tree_flatten(stage.model.parameters()), key=lambda kv: kv[1].size)
    return {mx.float32: "fp32", mx.float16: "fp16", mx.bfloat16: "bf16"}.get(biggest.dtype, str(biggest.dtype))


def per_rank(values: list[str]) -> str:
    """'fp32' when every rank says the same, else 'r0 fp32, r1 quantized'."""
    if len(set(values)) == 1:
        return values[0]
    return ", ".join(f"r{rank} {v}" for rank, v in enumerate(values))


def head_share_label(share: float | None, size: int) -> str:
    """'; LM head r1 23%' in the batch stats: the mean part of the vocabulary the last rank computed."""
    return "" if share is None else f"; LM head r{size - 1} {100 * share:.0f}%"


def group_sums_label(figures: list[RankFigures]) -> str:
    """'; group sums 1.23 ms/token (most of any rank)' under --tensor-parallel: the time a forward step's
    sums (two a layer: exchange and add, waiting for the slowest member included) took, else ''."""
    most = max((f.group_sum_ms for f in figures), default=0.0)
    return f"; group sums {most:.2f} ms/token (most of any rank)" if most else ""


def matmuls_label(group_rows: int) -> str:
    """How a rank's matrix products take a micro-batch's sequences, for the stats line."""
    if group_rows == sys.maxsize:
        return "all rows packed"
    return f"batch-invariant, up to {group_rows} rows" if group_rows else "per sequence"
