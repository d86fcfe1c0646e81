"""The multi-rank commands, from parsed arguments to exit status. Each step that can fail on
a user's input runs as a collective checkpoint, so every rank learns of a failure anywhere."""

from __future__ import annotations

import argparse
import resource
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

from . import blas, cores, mpi
from .config import ModelConfig
from .errors import UserError
from .models import family_for
from .partition import LAYER_OVERHEAD_BYTES, balanced_counts, check_ranks, layer_ranges, parse_split
from .stage import Stage, serve, stop_ring
from .transport import MlxTransport, MpiTransport
from .weights import (Checkpoint, available_memory_bytes, choose_dense, head_nbytes_in_memory, is_quantized,
                      layer_nbytes, layer_nbytes_in_memory)

if TYPE_CHECKING:
    from .plan import MemoryPlan


@dataclass
class Plan:
    folder: Path
    config: ModelConfig
    checkpoint: Checkpoint
    ranges: list[tuple[int, int]]
    dense: list[bool] | None = None  # per rank: MLX-quantized weights dequantized at load
    host_memory: "MemoryPlan | None" = None  # generate --host-memory: the planner's split and fit check


def resolve_model_folder(model: Path | None, comm) -> Path:
    """The --model folder, or the default model (converted once per host: the first rank on
    each host converts while the others on that host wait, then all reuse the cache)."""
    if model is not None:
        return model
    from mpi4py import MPI

    from .default_model import default_model_dir

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
    memory = comm.allgather((socket.gethostname(), available_memory_bytes())) if mode == "auto" else None
    folder = resolve_model_folder(args.model, comm)
    config = ModelConfig.from_folder(folder)
    family_for(config)
    checkpoint = Checkpoint(folder)
    ranks, layers = comm.Get_size(), config.num_hidden_layers
    host_memory = None
    if getattr(args, "host_memory", None):
        from .plan import MemoryPlan

        host_memory = MemoryPlan.for_job(config, args, ranks)
    if args.split:
        counts = parse_split(args.split, layers, ranks)
    elif host_memory:
        counts = host_memory.counts()
    else:
        check_ranks(layers, ranks)
        per_layer, ends = layer_nbytes(checkpoint, layers)
        counts = balanced_counts(per_layer, ranks, rank0_extra_bytes=ends, layer_overhead_bytes=LAYER_OVERHEAD_BYTES)
    dense = [False] * ranks
    if mode != "quantized" and is_quantized(checkpoint):
        itemsize = getattr(mx, getattr(args, "dtype", "float32")).size
        counts, dense = plan_weights_in_memory(mode, checkpoint, config, counts, memory,
                                               fixed=bool(args.split or host_memory), itemsize=itemsize,
                                               last_rank_head=last_rank_head)
    return Plan(folder, config, checkpoint, layer_ranges(counts), dense, host_memory)


def plan_weights_in_memory(mode: str, checkpoint: Checkpoint, config: ModelConfig, counts: list[int],
                           memory: list[tuple[str, int]] | None, fixed: bool, itemsize: int = 4,
                           last_rank_head: float = 0.0):
    """(layer counts, dense per rank) for --weights-in-memory fp32|auto on a quantized model.
    fp32: every rank dense, layers balanced by dense bytes. auto: the same if every host's
    ranks fit in its free memory (see `choose_dense`), else the quantized balance with ranks
    made dense, in rank order, while their host has room."""
    layers, ranks = config.num_hidden_layers, len(counts)

    def shares(counts: list[int], dense: bool) -> list[int]:
        per_layer, ends = layer_nbytes_in_memory(checkpoint, config, layers, dense, itemsize)
        head = 0
        if last_rank_head:
            head = round(last_rank_head * head_nbytes_in_memory(checkpoint, config, dense, itemsize))
        bounds = [sum(counts[:r]) for r in range(ranks + 1)]
        return [sum(per_layer[bounds[r]:bounds[r + 1]]) + (ends if r == 0 else 0) + (head if r == ranks - 1 else 0)
                for r in range(ranks)]

    dense_counts = counts
    if not fixed:
        per_layer, ends = layer_nbytes_in_memory(checkpoint, config, layers, True, itemsize)
        dense_counts = balanced_counts(per_layer, ranks, rank0_extra_bytes=ends, layer_overhead_bytes=LAYER_OVERHEAD_BYTES)
    if mode == "fp32":
        return dense_counts, [True] * ranks
    hosts, available = [h for h, _ in memory], [a for _, a in memory]
    if all(choose_dense(hosts, available, [0] * ranks, shares(dense_counts, True))):
        return dense_counts, [True] * ranks
    return counts, choose_dense(hosts, available, shares(counts, False), shares(counts, True))


def make_transport(args: argparse.Namespace, comm):
    """The transport of `--transport`, with the `--watchdog` on silent peers (collective)."""
    placement = comm.allgather((socket.gethostname(), cores.cpus_allowed()))
    hosts = [host for host, _ in placement]
    watchdog = getattr(args, "watchdog", 0.0)
    own_core = cores.has_own_core(placement, comm.Get_rank())
    if getattr(args, "transport", "mpi") == "mlx":
        from .mlx_group import init_group

        return MlxTransport(comm, init_group(comm, args.mlx_backend), watchdog, hosts, own_core)
    return MpiTransport(comm, watchdog, hosts, own_core)


def run_generate(args: argparse.Namespace, comm) -> int:
    from .engine import generate
    from .tokenizer import Tokenizer

    rank = comm.Get_rank()
    transport = make_transport(args, comm)
    plan = mpi.checkpoint(comm, lambda: plan_job(args, comm))

    def prepare_prompt():
        if rank != 0:
            return None, None
        tokenizer = Tokenizer.from_folder(plan.folder)
        ids = tokenizer.prompt_ids(args.prompt, system=args.system,
                                   use_chat_template=not args.no_chat_template)
        context = plan.config.max_position_embeddings
        if len(ids) >= context:
            raise UserError(f"the prompt has {len(ids)} tokens but the model's context is {context}: "
                            f"shorten it")
        if plan.host_memory:  # the planner's verdict, before any weights are read
            plan.host_memory.check(plan.ranges, min(len(ids) + args.max_tokens, context), plan.dense)
        return tokenizer, ids

    # Tokenize before loading weights so a bad prompt fails in seconds, not after the load.
    tokenizer, prompt_ids = mpi.checkpoint(comm, prepare_prompt)
    stage = mpi.checkpoint(comm, lambda: Stage.load(
        plan.config, plan.checkpoint, plan.ranges[rank], has_ends=rank == 0,
        dtype=getattr(mx, args.dtype), requantize=args.requantize, progress=rank == 0,
        dense=bool(plan.dense and plan.dense[rank])))

    if rank == 0:
        def write(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        try:
            result = generate(stage, transport, tokenizer, prompt_ids, args.sampling,
                              args.max_tokens, stop=args.stop, on_text=write)
        finally:
            stop_ring(transport)
        write("\n")
    else:
        serve(stage, transport)
        result = None

    memory = comm.gather((socket.gethostname(), peak_rss_bytes(), weights_label(stage), blas.describe(),
                          stage.weight_nbytes + stage.cache_nbytes, stage.kv_bytes_per_token), root=0)
    if rank == 0:
        print(stats_line(result, memory), file=sys.stderr, flush=True)
    return 0


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


def stats_line(result, memory: list[tuple]) -> str:
    """memory: per rank (host, peak RSS bytes[, weights label, BLAS description])."""
    # Peak RSS beside the bytes each rank owns (weights + KV cache): the overhead of the runtime.
    peaks = ", ".join(f"r{rank} {m[1] / 2**20:.0f} MiB" + (f" (owns {m[4] / 2**20:.0f})" if len(m) >= 6 else "")
                      for rank, m in enumerate(memory))
    if all(len(m) >= 6 for m in memory):
        peaks += f", KV {sum(m[5] for m in memory) / 1024:.1f} KiB/token"
    extra = ""
    if all(len(m) >= 4 for m in memory):
        extra = f", weights {per_rank([m[2] for m in memory])}, BLAS {per_rank([m[3] for m in memory])}"
    return (f"[pipeline] prompt {result.prompt_tokens} tokens, prefill {result.prefill_tps:.1f} tok/s, "
            f"decode {result.decode_tps:.1f} tok/s ({len(result.tokens)} tokens, {result.finish_reason}), "
            f"TTFT {result.prefill_s:.3f} s, peak RSS {peaks}{extra}")


def head_share_label(share: float | None, size: int) -> str:
    """'; LM head r1 23%' in the batch stats: the mean part of the vocabulary the last rank computed."""
    return "" if share is None else f"; LM head r{size - 1} {100 * share:.0f}%"


def matmuls_label(group_rows: int) -> str:
    """How a rank's matrix products take a micro-batch's sequences, for the stats line."""
    if group_rows == sys.maxsize:
        return "all rows packed"
    return f"batch-invariant, up to {group_rows} rows" if group_rows else "per sequence"


def run_batch(args: argparse.Namespace, comm) -> int:
    """`batch`: JSONL requests in, JSONL results out, every rank busy (see scheduler.py)."""
    from .batch import ResultsFile, check_paths, note, read_requests
    from .head_share import HeadSplit, head_share_fraction, head_share_rows
    from .scheduler import Scheduler, exact_group_rows, follow, stop_followers
    from .tokenizer import Tokenizer
    from .trace import Timeline, split_hint, summary_lines, write_chrome_trace

    rank, size = comm.Get_rank(), comm.Get_size()
    transport = make_transport(args, comm)
    group_rows = exact_group_rows(args.packed_matmuls)  # this rank's own: it depends on its BLAS
    head_fraction = head_share_fraction(args.head_share, comm.allgather(group_rows))
    plan = mpi.checkpoint(comm, lambda: plan_job(args, comm, last_rank_head=head_fraction))
    head_rows = head_share_rows(head_fraction, plan.config.vocab_size)

    def prepare():
        """Rank 0, before any weights are read: the input parsed (duplicate ids refused), the
        output locked and repaired, error records for lines that cannot run, what is left."""
        if rank != 0:
            return None
        check_paths(args)
        tokenizer = Tokenizer.from_folder(plan.folder)
        requests, bad = read_requests(args.input, args.sampling, args.max_tokens, args.system)
        results = ResultsFile(args.output)
        if results.repaired:
            note(f"{args.output}: {results.repaired}")
        skipped = sum(1 for r in requests if r.key in results.done)
        skipped += sum(1 for b in bad if b.key in results.done)
        errors = [b for b in bad if b.key not in results.done]
        for b in errors:
            results.write(b.record())
        todo = [r for r in requests if r.key not in results.done]
        if skipped:
            note(f"skipping {skipped} request{'s' if skipped != 1 else ''} already in {args.output}")
        if errors:
            note(f"{len(errors)} input line{'s' if len(errors) != 1 else ''} cannot run: error records written")
        return tokenizer, todo, results, len(errors)

    prepared = mpi.checkpoint(comm, prepare)
    todo_count = comm.bcast(len(prepared[1]) if rank == 0 else None, root=0)
    if todo_count == 0:
        if rank == 0:
            prepared[2].close()
            note(f"nothing to run: every request of {args.input} has a record in {args.output}")
        return 0

    stage = mpi.checkpoint(comm, lambda: Stage.load(
        plan.config, plan.checkpoint, plan.ranges[rank], has_ends=rank == 0,
        dtype=getattr(mx, args.dtype), requantize=args.requantize, progress=rank == 0 and not args.quiet,
        dense=bool(plan.dense and plan.dense[rank]), head_rows=head_rows if rank == size - 1 else 0))
    timeline = Timeline(rank, keep_spans=args.trace is not None)
    # Sequences sharing products: one micro-batch per rank, since smaller ones make smaller, less
    # efficient products. Each on its own: twice as many, so a late one never starves a stage (a
    # micro-batch's round trip alone takes as long as the ring needs for N of them).
    microbatches = args.microbatches or (size if group_rows or size == 1 else 2 * size)
    comm.Barrier()
    timeline.restart()
    stats = None
    if rank == 0:
        from tqdm import tqdm

        tokenizer, todo, results, bad_lines = prepared
        progress = tqdm(total=todo_count, unit="req", desc="batch", file=sys.stderr, disable=args.quiet,
                        dynamic_ncols=True)
        try:
            head_split = None
            if head_rows:
                head_split = HeadSplit(head_rows, None if args.head_share == "auto" else head_rows)
            stats = Scheduler(stage, transport, tokenizer, todo, results.write, max_batch=args.max_batch,
                              microbatches=microbatches, group_rows=group_rows,
                              use_chat_template=not args.no_chat_template, timeline=timeline,
                              progress=progress, head_split=head_split).run()
        finally:  # on an exception, the abort hook ends every rank: no STOP to wait on
            progress.close()
            results.close()
        stop_followers(transport, timeline)
    else:
        follow(stage, transport, timeline, group_rows)
    timeline.finish()

    summaries = comm.gather(timeline.summary(), root=0)
    memory = comm.gather((socket.gethostname(), peak_rss_bytes(), weights_label(stage), blas.describe(),
                          matmuls_label(group_rows)), root=0)
    if rank == 0:
        hosts = [m[0] for m in memory]
        print(f"[pipeline] batch: {stats.done} done, {stats.errors + bad_lines} error records, "
              f"{stats.generated_tokens} tokens generated in {stats.wall_s:.2f} s: {stats.tokens_per_s:.1f} tok/s "
              f"(prompts {stats.prompt_tokens} tokens; {microbatches} micro-batches, "
              f"max batch {args.max_batch}; matmuls {per_rank([m[4] for m in memory])}; layers per rank "
              f"{','.join(str(end - start) for start, end in plan.ranges)}"
              f"{head_share_label(stats.head_share, size)}); "
              f"weights {per_rank([m[2] for m in memory])}, BLAS {per_rank([m[3] for m in memory])}, "
              f"peak RSS " + ", ".join(f"r{r} {m[1] / 2**20:.0f} MiB" for r, m in enumerate(memory)),
              file=sys.stderr)
        for line in summary_lines(summaries, hosts if len(set(hosts)) > 1 else None):
            print(line, file=sys.stderr)
        hint = split_hint(summaries, [end - start for start, end in plan.ranges])
        if hint and stats.wall_s > 5:  # a few seconds of decoding say something; a blip does not
            print(hint, file=sys.stderr)
        sys.stderr.flush()
        if args.trace is not None:
            write_chrome_trace(args.trace, summaries, hosts)
            note(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)")
    return 0
