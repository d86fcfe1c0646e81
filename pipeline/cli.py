"""`python -m pipeline <command>` (or `pipeline <command>`): the parser, and the start of every command.

Each command is one module of pipeline/commands/ with `add_parser(subparsers)`, an optional
`validate(args)`, and `run(args, comm) -> exit status`. Every rank parses the same argv, so argument
errors are found on all ranks at once; only rank 0 prints them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys

from .cluster import mpi
from .kernels import blas
from .util import private_tmp
from .util.errors import UserError

# In the order `--help` lists them.
COMMANDS = ("generate", "batch", "serve", "perplexity", "plan", "convert", "preflight", "ping")
LOCAL = ("plan", "convert")  # single-process commands: no MPI


class _Parser(argparse.ArgumentParser):
    """argparse that raises UserError instead of printing usage on every rank and exiting."""

    def error(self, message):
        raise UserError(f"{self.prog}: {message}")


def command_module(name: str):
    return importlib.import_module(f"pipeline.commands.{name}")


def program_name() -> str:
    """`pipeline` when run as the installed console script, else `python -m pipeline`."""
    return "pipeline" if os.path.basename(sys.argv[0] or "") == "pipeline" else "python -m pipeline"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=program_name(), description="Pipeline-parallel LLM inference over MPI ranks.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        command_module(name).add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in LOCAL:
        try:
            args = _validated(build_parser().parse_args(argv))
            return command_module(args.command).run(args)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    mpi.use_the_launchers_mpi()
    from mpi4py import MPI  # here, not at the top: after the launcher's MPI is bound, just above

    comm = MPI.COMM_WORLD
    mpi.abort_on_unhandled_exception(comm)
    mpi.route_interrupts(comm)
    from .runtime.job import share_cores  # here, not at the top: it loads MLX, which `pipeline plan` must not

    share_cores(comm)
    tmp_problem = private_tmp.use()  # before anything compiles an MLX kernel
    blas.report_problems(comm, tmp_problem)  # no OpenBLAS or no shim: one line with the fix, from rank 0
    parser = build_parser()

    def parse() -> argparse.Namespace:
        if comm.Get_rank() == 0:
            return _validated(parser.parse_args(argv))
        with contextlib.redirect_stdout(io.StringIO()):  # --help prints once, on rank 0
            return _validated(parser.parse_args(argv))

    args = mpi.checkpoint(comm, parse)
    return command_module(args.command).run(args, comm)


def _validated(args: argparse.Namespace) -> argparse.Namespace:
    validate = getattr(command_module(args.command), "validate", None)
    if validate is not None:
        validate(args)
    return args
