"""pipeline: an MPI pipeline-parallel runtime for language models too big for one machine."""

__version__ = "0.1.0"

# Before anything imports mlx.core, which binds its BLAS symbols as it loads (see blas.py).
from . import blas as _blas  # noqa: E402

_blas.load()
