"""A multi-rank job's set-up, shared by the commands that run a model (generate, batch, serve):
the model folder, the split of its layers over the ranks, the transport between them, and the
figures every rank reports at the end. Each step that can fail on a user's input runs as a
collective checkpoint, so every rank learns of a failure anywhere."""

from __future__ import annotations

import argparse
import resource
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..kernels import blas, qmm
from ..util import cores, huge_pages
from ..models.config import ModelConfig
from ..util.errors import UserError
from ..planner.memory import measured, rank_bytes
from ..models.registry import family_for
from ..planner.partition import LAYER_OVERHEAD_BYTES, balanced_counts, check_ranks, layer_ranges, parse_split
from ..planner.host_memory import MemoryPlan
from ..planner.weights_bytes import ModelBytes, held_and_dense, with_mtp
from .stage import Stage
from ..cluster.transport import MlxTransport, MpiTransport, this_process
from ..checkpoints.model_files import open_checkpoint
from ..checkpoints.weights import Checkpoint, available_memory_bytes, choose_dense, is_quantized, layer_nbytes


@dataclass
class Plan:
    folder: Path
    config: ModelConfig
    checkpoint: Checkpoint
    ranges: list[tuple[int, int]]
    dense: list[bool] | None = None  # per rank: MLX-quantized weights dequantized at load
    host_memory: MemoryPlan | None = None  # generate --host-memory: the planner's split and fit check


def resolve_model_folder(model: Path | None, comm) -> Path:
    """The --model folder, or the default model (converted once per host: the first rank on
    each host converts while the others on that host wait, then all reuse the cache)."""
    if model is not None:
        return model
    from mpi4py import MPI

    from ..checkpoints.default_model import default_model_dir

    host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
    error = None
    if host_comm.Get_rank() == 0:
        try:
            default_model_dir(progress=comm.Get_rank() == 0)
        except UserError as e:
            error = e
    host_comm.Barrier()
    host_comm.Free()
    if error:
        raise error
    return default_model_dir(progress=False)


def plan_job(args: argparse.Namespace, comm, last_rank_head: float = 0.0) -> Plan:
    """Read the model's config and tensor index and split its layers over the ranks.
    Every rank computes the same plan from the same files. last_rank_head: the part of the LM head
    the last rank holds besides its layers (batch, head_share.py), counted in its memory."""
    mode = getattr(args, "weights_in_memory", "quantized")
    # Collective, so before anything that can fail on one rank only.
    if getattr(args, "int8_activations", False) is None:  # by default on where every rank can (qmm.int8_by_default)
        args.int8_activations = all(comm.allgather(qmm.int8_by_default(None, getattr(args, "dtype", "float32"))))
    memory = fast_quantized = None
    if mode == "auto":
        gathered = comm.allgather((socket.gethostname(), available_memory_bytes(),
                                   getattr(args, "dtype", "float32") == "float32" and qmm.expected()))
        memory, fast_quantized = [(h, a) for h, a, _ in gathered], [f for _, _, f in gathered]
    folder = resolve_model_folder(args.model, comm)
    checkpoint = open_checkpoint(folder, getattr(args, "requantize", None))
    config = checkpoint.model_config()
    family = family_for(config)
    if getattr(args, "draft", "none") != "none" and not family.drafts:
        raise UserError(f"{config.model_type} keeps compressed caches that cannot drop a rejected draft's "
                        f"positions: run it without --draft")
    if getattr(args, "draft", "none") == "mtp":
        from ..models.mtp import check_mtp

        check_mtp(checkpoint, config, folder)
    ranks, layers = comm.Get_size(), config.num_hidden_layers
    host_memory = None
    if getattr(args, "host_memory", None):
        host_memory = MemoryPlan.for_job(config, args, ranks, folder)
    if args.split:
        counts = parse_split(args.split, layers, ranks)
    elif host_memory:
        counts = host_memory.counts()
    else:
        check_ranks(layers, ranks)
        per_layer, ends = layer_nbytes(checkpoint, layers)
        if getattr(args, "draft", "none") == "mtp":  # rank 0 holds the MTP module too
            from ..models.mtp import mtp_nbytes

            ends += mtp_nbytes(checkpoint, config)
        counts = balanced_counts(per_layer, ranks, rank0_extra_bytes=ends, layer_overhead_bytes=LAYER_OVERHEAD_BYTES)
    dense = [False] * ranks
    if mode != "quantized" and is_quantized(checkpoint):
        held, dense_held = held_and_dense(config, folder, getattr(args, "dtype", "float32"),
                                          int8=bool(getattr(args, "int8_activations", False)))
        if getattr(args, "draft", "none") == "mtp":
            held, dense_held = with_mtp(held), with_mtp(dense_held)
        counts, dense = plan_weights_in_memory(mode, held, dense_held, counts, memory,
                                               fixed=bool(args.split or host_memory), last_rank_head=last_rank_head,
                                               fast_quantized=fast_quantized)
    return Plan(folder, config, checkpoint, layer_ranges(counts), dense, host_memory)


def plan_weights_in_memory(mode: str, held: ModelBytes, dense_held: ModelBytes, counts: list[int],
                           memory: list[tuple[str, int]] | None, fixed: bool, last_rank_head: float = 0.0,
                           fast_quantized: list[bool] | None = None):
    """(layer counts, dense per rank) for --weights-in-memory fp32|auto on a quantized model, from
    its bytes held packed (`held`) and dequantized (`dense_held`; weights_bytes.model_bytes_of). fp32: every
    rank dense, layers balanced by dense bytes. auto: the same if every host's ranks fit in its free
    memory (see `choose_dense`), else the quantized balance with ranks made dense, in rank order,
    while their host has room; but where every rank has pipeline's quantized kernels
    (`fast_quantized`, qmm.py), every rank keeps its weights quantized: they decode faster than
    fp32 and prefill as fast. preflight decides with this too."""
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


def share_cores(comm) -> None:
    """This host's cores shared among its ranks: each bound to its share where the launcher left
    them free, its threads SCHED_BATCH on a single CPU (cores.py), and as many BLAS threads (blas.py)."""
    from mpi4py import MPI

    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    cpus = cores.bind(host)
    blas.note_binding(cores.describe(cpus, batch=cores.schedule_as_batch()))
    blas.set_threads_for_ranks(host.Get_size())
    host.Free()


def load_stage(args: argparse.Namespace, plan: Plan, rank: int, progress: bool, head_rows: int = 0) -> Stage:
    """This rank's layers of the planned split, held as the weight flags say; on rank 0 with
    --draft mtp, DeepSeek's MTP module too (it reads rank 0's embedding, head and final states)."""
    dense = bool(plan.dense and plan.dense[rank])
    int8 = bool(getattr(args, "int8_activations", False))
    # rearranged in the buffers they were read into where those are in huge pages (else the products
    # would walk small pages: 1B Llama decode -5%), into new huge pages otherwise
    in_place = huge_pages.active()
    stage = Stage.load(plan.config, plan.checkpoint, plan.ranges[rank], has_ends=rank == 0,
                       dtype=getattr(mx, args.dtype), requantize=args.requantize, progress=progress,
                       dense=dense, head_rows=head_rows, int8_in_place=in_place if int8 else None)
    if getattr(args, "dtype", "float32") == "float32":
        qmm.load()  # the kernels' extension (attention, quantized products): built now, not at the first token
    if rank == 0 and getattr(args, "draft", "none") == "mtp":
        from ..checkpoints.mtp import load_mtp

        stage.mtp = load_mtp(plan.config, plan.checkpoint, getattr(mx, args.dtype), args.requantize, dense, progress)
    if int8:  # int8 products (int8_kernels.cpp); none without the kernels
        config = plan.config
        # the last rank's share of the LM head computes as rank 0's head does, or both stay float32
        share = config.vocab_size % qmm.INT8_BLOCK == 0 and not (plan.dense and plan.dense[0])
        for module in (stage.model, stage.mtp):  # what was not repacked while loading: the head, MTP
            if module is not None:
                qmm.use_int8(module, tied_head=bool(config.tie_word_embeddings), head_share=share,
                             in_place=in_place)
    return stage


def rank_figures(stage: Stage, *extra) -> tuple:
    """What each rank reports for the closing stats line: (host, peak RSS bytes, weights label,
    BLAS description, its bytes (memory.RankBytes, as plan and preflight count them), *extra)."""
    return (socket.gethostname(), peak_rss_bytes(), weights_label(stage), blas.describe(), measured(stage), *extra)


def rss_label(figures: list[tuple], kv_cache: bool = True) -> str:
    """'r0 403 MiB (weights 297.1 MiB + KV cache 1.4 MiB), r1 ...': each rank's peak RSS beside
    the bytes it holds; the difference is the runtime's own."""
    return ", ".join(f"r{r} {f[1] / 2**20:.0f} MiB ({f[4].describe(kv_cache)})" for r, f in enumerate(figures))


@dataclass
class RingJob:
    """What batch and serve set up before their scheduler starts: the transport, the split, and how
    the ring shares work (exact products, the LM head's share on the last rank, micro-batches)."""
    transport: object
    plan: Plan
    group_rows: int  # rows of different sequences one product may hold on this rank (scheduler.exact_group_rows)
    head_fraction: float  # the part of the LM head the last rank holds (head_share.py)
    head_rows: int
    microbatches: int


def plan_ring_job(args: argparse.Namespace, comm) -> RingJob:
    """Collective: the transport and the plan, before anything big is read."""
    from ..cluster import mpi
    from .head_share import head_share_fraction, head_share_rows
    from .scheduler import exact_group_rows

    transport = make_transport(args, comm)
    group_rows = exact_group_rows(args.packed_matmuls)  # this rank's own: it depends on its BLAS
    head_fraction = head_share_fraction(args.head_share, comm.allgather(group_rows))
    plan = mpi.checkpoint(comm, lambda: plan_job(args, comm, last_rank_head=head_fraction))
    if not family_for(plan.config).head_share:  # DeepSeek V4: the head reads collapsed streams
        head_fraction = 0.0
    size = comm.Get_size()
    # Sequences sharing products: one micro-batch per rank, since smaller ones make smaller, less
    # efficient products. Each on its own: twice as many, so a late one never starves a stage (a
    # micro-batch's round trip alone takes as long as the ring needs for N of them).
    microbatches = args.microbatches or (size if group_rows or size == 1 else 2 * size)
    return RingJob(transport, plan, group_rows, head_fraction, head_share_rows(head_fraction, plan.config.vocab_size),
                   microbatches)


def load_ring_stage(args: argparse.Namespace, job: RingJob, comm, progress: bool) -> Stage:
    """Collective: this rank's layers, and on the last rank its share of the LM head."""
    from ..cluster import mpi

    rank = comm.Get_rank()
    head_rows = job.head_rows if rank == comm.Get_size() - 1 else 0
    return mpi.checkpoint(comm, lambda: load_stage(args, job.plan, rank, progress=progress, head_rows=head_rows))


def head_split(args: argparse.Namespace, job: RingJob):
    """Rank 0's control of the LM head's share (None: not shared)."""
    from .head_share import HeadSplit

    if not job.head_rows:
        return None
    return HeadSplit(job.head_rows, None if args.head_share == "auto" else job.head_rows)


def prefix_cache(args: argparse.Namespace, job: RingJob):
    """Rank 0's prefix cache for --prefix-cache-gb (None when 0): as many positions as the rank
    with the most cached bytes per position holds in that many GB."""
    from ..planner.shapes import architecture
    from .prefix_cache import PrefixCache

    gb = getattr(args, "prefix_cache_gb", 0.0)
    if not gb or not family_for(job.plan.config).prefix_cache:
        return None  # DeepSeek V4: a compressed cache cannot be cut back to a shorter prefix
    per_layer = architecture(job.plan.config).kv_values * getattr(mx, args.dtype).size
    per_position = max(per_layer * (end - start) for start, end in job.plan.ranges)
    return PrefixCache(int(gb * 1e9 // per_position) if per_position else 0)


def make_transport(args: argparse.Namespace, comm):
    """The transport of `--transport`, with the `--watchdog` on silent peers (collective)."""
    placement = comm.allgather((socket.gethostname(), cores.cpus_allowed()))
    hosts = [host for host, _ in placement]
    watchdog = getattr(args, "watchdog", 0.0)
    own_core = cores.has_own_core(placement, comm.Get_rank())
    processes = comm.allgather(this_process())  # a waiting rank notices a killed peer on its host
    if getattr(args, "transport", "mpi") == "mlx":
        from ..cluster.mlx_group import init_group

        return MlxTransport(comm, init_group(comm, args.mlx_backend), watchdog, hosts, own_core, processes)
    return MpiTransport(comm, watchdog, hosts, own_core, processes)


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
    from mlx.utils import tree_flatten

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


def matmuls_label(group_rows: int) -> str:
    """How a rank's matrix products take a micro-batch's sequences, for the stats line."""
    if group_rows == sys.maxsize:
        return "all rows packed"
    return f"batch-invariant, up to {group_rows} rows" if group_rows else "per sequence"
