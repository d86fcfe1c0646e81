"""`generate`: one prompt through the ring, its completion streamed to stdout by rank 0."""

from __future__ import annotations

import argparse
import sys

from . import flags
from ..cluster import mpi
from ..kernels import blas
from ..util.errors import UserError


def add_parser(commands) -> None:
    gen = commands.add_parser("generate", help="generate a completion for one prompt",
                              description="Run with `mpiexec -n N python -m pipeline generate ...`; "
                                          "the model's layers are split across the N ranks.")
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --no-chat-template)")
    flags.add_model_arg(gen)
    flags.add_sampling_args(gen)
    flags.add_draft_args(gen)
    gen.add_argument("--system", default=None, help="system message for the chat template")
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    flags.add_weights_args(gen)
    gen.add_argument("--host-memory", default=None, metavar="GIB,GIB,...",
                     help="memory of each rank's host in GiB, one value per rank (e.g. 512,512,256,256): "
                          "layers are split in proportion, as `plan` proposes, and a model that does not "
                          "fit stops with one line before anything is loaded")
    flags.add_cluster_args(gen)
    flags.add_tensor_parallel_arg(gen)


def validate(args: argparse.Namespace) -> None:
    flags.validated_generation_args(args)
    flags.validated_cluster_args(args)
    flags.validated_draft_args(args)
    flags.validated_tensor_parallel_arg(args)


def run(args: argparse.Namespace, comm) -> int:
    # Here, not at the top: cli imports every command's module to build its parser, and these load MLX,
    # which `pipeline plan` must not (start-up time).
    from ..runtime.engine import generate
    from ..runtime.speculative import make_drafter
    from ..runtime.job import load_stage, make_transport, plan_job
    from ..runtime.rank_figures import rank_figures
    from ..runtime.stage import follow_single_stream, stop_ring
    from ..runtime.tensor_group import follow_leader, form_group, stop_mates
    from ..checkpoints.tokenizer import Tokenizer

    rank = comm.Get_rank()
    settings = flags.job_settings(args)
    group = mpi.checkpoint(comm, lambda: form_group(comm, args.tensor_parallel, settings.transport.transport,
                                                    settings.transport.watchdog, settings.transport.mlx_backend))
    transport = make_transport(settings.transport, group.ring) if group.leads else None  # the ring: stage leaders
    plan = mpi.checkpoint(comm, lambda: plan_job(settings.weights, comm))

    def prepare_prompt():
        if rank != 0:
            return None, None
        tokenizer = Tokenizer.from_folder(plan.folder)
        ids = tokenizer.prompt_ids(args.prompt, system=args.system,
                                   use_chat_template=not args.no_chat_template)
        if not ids:
            raise UserError("the prompt is empty: give --prompt some text")
        context = plan.config.max_position_embeddings
        if len(ids) >= context:
            raise UserError(f"the prompt has {len(ids)} tokens but the model's context is {context}: "
                            f"shorten it")
        if plan.host_memory:  # the planner's verdict, before any weights are read
            plan.host_memory.check(plan.ranges, min(len(ids) + args.max_tokens, context), plan.dense)
        return tokenizer, ids

    # Tokenize before loading weights so a bad prompt fails in seconds, not after the load.
    tokenizer, prompt_ids = mpi.checkpoint(comm, prepare_prompt)
    stage = mpi.checkpoint(comm, lambda: load_stage(settings.weights, plan, rank, progress=rank == 0, group=group))

    if rank == 0:
        def write(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        try:
            result = generate(stage, transport, tokenizer, prompt_ids, args.sampling, args.max_tokens,
                              stop=args.stop, on_text=write,
                              drafter=make_drafter(args.draft, args.draft_tokens, args.ngram_max, args.ngram_min,
                                                   stage.mtp, stage.model))
        finally:
            stop_ring(transport)
            stop_mates(group)
        write("\n")
    elif group.leads:
        follow_single_stream(stage, transport)
        stop_mates(group)
        result = None
    else:
        follow_leader(stage, group)
        result = None

    figures = comm.gather(rank_figures(stage, kv_bytes_per_token=stage.kv_bytes_per_token,
                                       invariant_rows=blas.invariant_rows(),
                                       group_sum_ms=group.ms_per_step(stage)), root=0)
    if rank == 0:
        print(stats_line(result, figures), file=sys.stderr, flush=True)
    return 0


def stats_line(result, figures: list) -> str:
    """figures: each rank's rank_figures.RankFigures, with its KV bytes per token and batch-invariant rows."""
    from ..runtime.rank_figures import group_sums_label, per_rank, rss_label  # here, not at the top: it loads MLX, as in run

    peaks = rss_label(figures) + f", KV {sum(f.kv_bytes_per_token for f in figures) / 1024:.1f} KiB/token"
    draft = ""
    if result.draft is not None:
        # Exact where every rank's products are batch-invariant (the BLAS shim); else within float rounding.
        exact = ("exact" if all(f.invariant_rows for f in figures)
                 else "within float rounding (no batch-invariant BLAS kernel)")
        draft = f"; speculative: {result.draft.describe()}, {exact}"
    return (f"[pipeline] prompt {result.prompt_tokens} tokens, prefill {result.prefill_tps:.1f} tok/s, "
            f"decode {result.decode_tps:.1f} tok/s ({len(result.tokens)} tokens, {result.finish_reason}), "
            f"TTFT {result.prefill_s:.3f} s, peak RSS {peaks}, weights {per_rank([f.weights for f in figures])}, "
            f"BLAS {per_rank([f.blas for f in figures])}{draft}{group_sums_label(figures)}")
