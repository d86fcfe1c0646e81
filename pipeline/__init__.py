"""pipeline: an MPI pipeline-parallel runtime for language models too big for one machine."""

__version__ = "0.1.0"

# A rank started by mpiexec as `python -m pipeline ...` runs under a supervisor that names it
# if a signal kills it (see supervise.py); this must happen before anything starts threads.
from . import supervise as _supervise  # noqa: E402

if _supervise.wanted():
    _supervise.supervise()
_supervise.watch_parent()

# Before anything imports mlx.core, which binds its BLAS symbols as it loads (see blas.py).
from . import blas as _blas  # noqa: E402

_blas.load()
