"""The multi-rank commands, from parsed arguments to exit status. Each step that can fail on
a user's input runs as a collective checkpoint, so every rank learns of a failure anywhere."""

from __future__ import annotations

import argparse
import resource
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from . import mpi
from .config import ModelConfig
from .errors import UserError
from .models import family_for
from .partition import balanced_counts, check_ranks, layer_ranges, parse_split
from .stage import Stage, serve, stop_ring
from .transport import MpiTransport
from .weights import Checkpoint, layer_nbytes


@dataclass
class Plan:
    folder: Path
    config: ModelConfig
    checkpoint: Checkpoint
    ranges: list[tuple[int, int]]


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


def plan_job(args: argparse.Namespace, comm) -> Plan:
    """Read the model's config and tensor index and split its layers over the ranks.
    Every rank computes the same plan from the same files."""
    folder = resolve_model_folder(args.model, comm)
    config = ModelConfig.from_folder(folder)
    family_for(config)
    checkpoint = Checkpoint(folder)
    ranks, layers = comm.Get_size(), config.num_hidden_layers
    if args.split:
        counts = parse_split(args.split, layers, ranks)
    else:
        check_ranks(layers, ranks)
        per_layer, ends = layer_nbytes(checkpoint, layers)
        counts = balanced_counts(per_layer, ranks, rank0_extra_bytes=ends)
    return Plan(folder, config, checkpoint, layer_ranges(counts))


def run_generate(args: argparse.Namespace, comm) -> int:
    from .engine import generate
    from .tokenizer import Tokenizer

    rank = comm.Get_rank()
    transport = MpiTransport(comm)
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
        return tokenizer, ids

    # Tokenize before loading weights so a bad prompt fails in seconds, not after the load.
    tokenizer, prompt_ids = mpi.checkpoint(comm, prepare_prompt)
    stage = mpi.checkpoint(comm, lambda: Stage.load(
        plan.config, plan.checkpoint, plan.ranges[rank], has_ends=rank == 0,
        dtype=getattr(mx, args.dtype), progress=rank == 0))

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

    memory = comm.gather((socket.gethostname(), peak_rss_bytes()), root=0)
    if rank == 0:
        print(stats_line(result, memory), file=sys.stderr, flush=True)
    return 0


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def stats_line(result, memory: list[tuple[str, int]]) -> str:
    peaks = ", ".join(f"r{rank} {rss / 2**20:.0f} MiB" for rank, (_, rss) in enumerate(memory))
    return (f"[pipeline] prompt {result.prompt_tokens} tokens, prefill {result.prefill_tps:.1f} tok/s, "
            f"decode {result.decode_tps:.1f} tok/s ({len(result.tokens)} tokens, {result.finish_reason}), "
            f"TTFT {result.prefill_s:.3f} s, peak RSS {peaks}")
