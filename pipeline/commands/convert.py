"""`convert`: a GGUF file into a model folder (single process, no MPI)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands) -> None:
    conv = commands.add_parser("convert", help="convert a GGUF file into a model folder")
    conv.add_argument("--gguf", type=Path, required=True, help="the .gguf file")
    conv.add_argument("--out", type=Path, required=True, help="the model folder to write")


def run(args: argparse.Namespace, comm=None) -> int:
    # Here, not at the top: cli imports every command's module to build its parser, and this loads MLX.
    from ..checkpoints.gguf_convert import convert_gguf

    print(convert_gguf(args.gguf, args.out, progress=True))
    return 0
