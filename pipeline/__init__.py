"""pipeline: an MPI pipeline-parallel runtime for language models too big for one machine."""

__version__ = "0.1.0"

import os as _os  # noqa: E402

# The quantized kernels' OpenMP threads (kernels/qmm.py) spin after each product for GOMP's default 300,000
# turns, taking the cores from OpenBLAS's threads, which run attention between the products (decode
# at a 256-token context fell from 24 to 20 tok/s once one-row products were threaded); 10,000 turns
# keep them ready for the next product without that (40 tok/s). libgomp reads it once, as it loads.
_os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# A rank started by mpiexec as `python -m pipeline ...` runs under a supervisor that names it
# if a signal kills it (see cluster/supervise.py); this must happen before anything starts threads. The
# supervisor, or a run without mpiexec starting itself again, gives the rank glibc's huge-page
# tunable (util/huge_pages.py).
from .cluster import supervise as _supervise  # noqa: E402

if _supervise.wanted():
    _supervise.supervise()
_supervise.restart_with_huge_pages()
_supervise.watch_parent()

# Before anything imports mlx.core, which binds its BLAS symbols as it loads (see kernels/blas.py).
from .kernels import blas as _blas  # noqa: E402

_blas.load()
