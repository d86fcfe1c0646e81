"""MLX's compiled CPU kernels in a folder no other user can write to.

On the CPU, `mx.compile` (RMSNorm, RoPE, SwiGLU in models/; `nn.silu`) writes each fused
kernel's C++ source and shared library under $TMPDIR/mlx/<version>/cpu/ (/tmp by default) and loads
a library it finds there: on a shared host, another user who made /tmp/mlx first could put a
library there, and every rank would run it. So each rank points TMPDIR at $PIPELINE_CACHE/tmp,
made and checked as the BLAS shim's folder is (private_folder.py), before anything compiles; where
that folder is refused, TMPDIR stays and the job's warnings say why. It runs after MPI has started, so
the MPI runtime's own session files stay where the launcher put them.
"""

from __future__ import annotations

import os
from pathlib import Path

from .paths import cache_root
from .private_folder import make_private_folder, unsafe_folder

ENV = "TMPDIR"


def folder() -> Path:
    return cache_root() / "tmp"


def use() -> str:
    """Point TMPDIR at the private folder; "" when done, else why not, for the job's warnings."""
    place = folder()
    try:
        make_private_folder(place)
    except OSError as e:
        return f"MLX compiles its kernels in the shared temporary folder ({place} cannot be made: {e})"
    why = unsafe_folder(place)
    if why:
        return (f"MLX compiles its kernels in the shared temporary folder ({place} is refused: {why}); "
                f"make it yours or set PIPELINE_CACHE")
    os.environ[ENV] = str(place)
    return ""
