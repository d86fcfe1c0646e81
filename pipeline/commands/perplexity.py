"""`perplexity`: a text's perplexity under the model, with llama.cpp's protocol (runtime/perplexity.py),
every rank busy; for comparing quants, weight settings and kernels with llama-perplexity's figures."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from . import flags
from ..cluster import mpi
from ..util.errors import UserError

DEFAULT_CONTEXT = 512  # llama-perplexity's -c in its documentation's figures


def add_parser(commands) -> None:
    command = commands.add_parser(
        "perplexity", help="a text's perplexity under the model, as llama.cpp's llama-perplexity measures it",
        description="Run with `mpiexec -n N python -m pipeline perplexity --text FILE`. llama.cpp's protocol: the "
                    "text (one trailing newline dropped) tokenized whole, with a BOS where the model's tokenizer "
                    "adds one; cut into non-overlapping chunks of --context tokens (the rest left out), the first "
                    "token of each replaced by that BOS; each chunk run from an empty cache, and only its second "
                    "half scored: the next-token log-probabilities at positions --context/2 to --context - 2. "
                    "Prints the running perplexity after each chunk as [1]x,[2]y,... and "
                    "`Final estimate: PPL = X +/- Y`, where PPL = exp(mean NLL) and Y is the standard error of "
                    "the mean NLL times PPL. Several chunks go round the ring at once (--batch), so every rank "
                    "works; the figure does not depend on the number of ranks or --batch.")
    command.add_argument("--text", type=Path, required=True, metavar="FILE", help="the text file (UTF-8), e.g. wiki.test.raw")
    command.add_argument("--context", type=int, default=DEFAULT_CONTEXT, metavar="TOKENS",
                         help=f"tokens per chunk, as llama-perplexity's -c (default {DEFAULT_CONTEXT}); the text "
                              "needs at least two chunks")
    command.add_argument("--batch", type=int, default=None, metavar="N",
                         help="chunks in progress at once (default: the number of ranks, one per micro-batch)")
    command.add_argument("--quiet", action="store_true", help="no progress bar: each running value as it comes")
    flags.add_model_arg(command)
    flags.add_weights_args(command)
    flags.add_cluster_args(command, transports=False)


def validate(args: argparse.Namespace) -> None:
    flags.check_model_folder(args)
    if args.int8_activations is True and args.dtype != "float32":
        raise UserError(f"--int8-activations needs --dtype float32 (got --dtype {args.dtype})")
    flags.validated_cluster_args(args)
    if args.context < 3:  # a chunk of 3 tokens scores one
        raise UserError(f"--context must be at least 3 tokens, got {args.context}")
    if args.batch is not None and args.batch < 1:
        raise UserError(f"--batch must be >= 1, got {args.batch}")


def run(args: argparse.Namespace, comm) -> int:
    # Here, not at the top: cli imports every command's module to build its parser, and these load MLX,
    # which `pipeline plan` must not (start-up time).
    from ..checkpoints.tokenizer import Tokenizer
    from ..runtime.job import load_ring_stage, plan_ring_job
    from ..runtime.perplexity import chunks, measure, read_text, scored_per_chunk, text_tokens
    from ..runtime.rank_figures import matmuls_label, per_rank, rank_figures, rss_label
    from ..runtime.scheduler import follow, stop_followers
    from ..runtime.trace import Timeline

    rank, size = comm.Get_rank(), comm.Get_size()
    settings = flags.job_settings(args)
    # Scores need every logit on rank 0: the last rank holds no share of the LM head.
    settings = dataclasses.replace(settings, ring=dataclasses.replace(settings.ring, head_share="off"))
    job = plan_ring_job(settings, comm)
    plan, transport = job.plan, job.transport

    def prepare():
        """Rank 0, before any weights are read: the text's chunks, or one line on what is wrong with it."""
        if rank != 0:
            return None
        model_context = plan.config.max_position_embeddings
        if args.context >= model_context:
            raise UserError(f"--context must be below the model's context ({model_context}), got {args.context}")
        text = read_text(args.text)
        tokenizer = Tokenizer.from_folder(plan.folder)
        ids, bos = text_tokens(tokenizer, text)
        return tokenizer, chunks(ids, args.context, bos), len(ids)

    prepared = mpi.checkpoint(comm, prepare)
    stage = load_ring_stage(settings, job, comm, progress=rank == 0 and not args.quiet)
    timeline = Timeline(rank, keep_spans=False)
    comm.Barrier()
    timeline.restart()
    if rank == 0:
        from tqdm import tqdm  # here, not at the top: slow to import (start-up time, as above)

        tokenizer, token_chunks, token_count = prepared
        progress = tqdm(total=len(token_chunks), unit="chunk", desc="perplexity", file=sys.stderr,
                        disable=args.quiet, dynamic_ncols=True)

        def on_chunk(estimate) -> None:
            if args.quiet:  # nothing else writes: llama-perplexity's running values as they come
                sys.stdout.write(f"[{len(estimate.chunks)}]{estimate.perplexity:.4f},")
                sys.stdout.flush()
            progress.set_postfix_str(f"PPL {estimate.perplexity:.4f}", refresh=False)
            progress.update(1)

        batch = args.batch or size
        try:
            estimate, stats = measure(stage, transport, tokenizer, token_chunks, max_batch=batch,
                                      microbatches=min(job.microbatches, batch), group_rows=job.group_rows,
                                      timeline=timeline, on_chunk=on_chunk)
        finally:  # on an exception, the abort hook ends every rank: no STOP to wait on
            progress.close()
        stop_followers(transport, timeline)
        print(("" if args.quiet else estimate.running()) + "\n" + estimate.final(), flush=True)
    else:
        follow(stage, transport, timeline, job.group_rows)
    timeline.finish()

    figures = comm.gather(rank_figures(stage, matmuls=matmuls_label(job.group_rows)), root=0)
    if rank == 0:
        evaluated = len(token_chunks) * args.context
        print(f"[pipeline] perplexity: {len(token_chunks)} chunks of {args.context} tokens ({token_count} in the text; "
              f"{len(token_chunks) * scored_per_chunk(args.context)} scored) in {stats.wall_s:.2f} s: "
              f"{evaluated / stats.wall_s:.1f} tok/s ({batch} in progress; matmuls "
              f"{per_rank([f.matmuls for f in figures])}; layers per rank "
              f"{','.join(str(end - start) for start, end in plan.ranges)}); "
              f"weights {per_rank([f.weights for f in figures])}, BLAS {per_rank([f.blas for f in figures])}, "
              f"peak RSS {rss_label(figures, kv_cache=False)}", file=sys.stderr, flush=True)
    return 0
