"""How ranks fail together.

- A bug (an unhandled exception) on any rank prints that rank's traceback once and aborts the
  whole MPI job, so no peer is left waiting forever on a message that will never come.
- A user mistake (`UserError`) found while setting up is shared with every rank at a
  collective checkpoint: rank 0 prints each distinct message once, and all ranks exit 1.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from typing import Callable, TypeVar

from ..util.errors import UserError

T = TypeVar("T")


class AbortJob(Exception):
    """A failure on one rank that must end the whole job at once (a silent peer, a transport
    that cannot connect): printed as one `error:` line, without a traceback, then MPI_Abort."""


class Interrupted(AbortJob):
    """SIGINT (Ctrl-C) reached a command that keeps its work: says what was kept and how to go on."""


def route_interrupts(comm) -> None:
    """SIGINT (Ctrl-C, or mpiexec passing it on) is rank 0's to handle: it decides, says what was
    kept and ends the job (the other ranks end with it). Once is enough: a second SIGINT (the
    terminal's and mpiexec's both arrive) must not cut that short."""
    if comm.Get_rank() != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return

    def interrupt_once(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt_once)


def abort_on_unhandled_exception(comm) -> None:
    def hook(exc_type, exc, tb):
        if exc_type is KeyboardInterrupt:
            print("pipeline: interrupted", file=sys.stderr)
        elif issubclass(exc_type, Interrupted):
            print(f"pipeline: {exc}", file=sys.stderr)  # says "interrupted: ..." itself
        elif issubclass(exc_type, AbortJob):
            print(f"error: {exc}", file=sys.stderr)
        else:
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            print(f"pipeline: rank {comm.Get_rank()} on {socket.gethostname()} failed:\n{text}",
                  file=sys.stderr, end="")
        abort(comm)

    sys.excepthook = hook


# How long a rank's last words get to reach mpiexec before MPI_Abort. MPICH's launcher kills every
# process on an abort and can exit before forwarding what they had already written (seen under
# load in CI: the job ended 0.3 s after its watchdog fired, with an empty stderr).
LAST_WORDS_S = 0.2


def abort(comm) -> None:
    """End the whole job with status 1, after what this rank printed has had time to get out."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(LAST_WORDS_S)
    comm.Abort(1)


class JobFailed(SystemExit):
    """Raised on every rank after a checkpoint found a user error; exits with status 1."""

    def __init__(self):
        super().__init__(1)


def checkpoint(comm, step: Callable[[], T]) -> T:
    """Run `step` on every rank; if it raises UserError on any of them, report and fail all."""
    error = None
    result = None
    try:
        result = step()
    except UserError as e:
        error = str(e)
    errors = comm.allgather(error)
    if any(errors):
        if comm.Get_rank() == 0:
            failed = [(rank, msg) for rank, msg in enumerate(errors) if msg]
            distinct = {msg for _, msg in failed}
            for msg in sorted(distinct):
                ranks = [rank for rank, m in failed if m == msg]
                where = "" if len(ranks) == comm.Get_size() else \
                    f" (rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))})"
                print(f"error{where}: {msg}", file=sys.stderr)
            sys.stderr.flush()
        raise JobFailed()
    return result


def use_the_launchers_mpi() -> None:
    """Before mpi4py loads: when Open MPI's mpirun started this process but mpi4py would load
    another MPI library first (Linux, where `pip install .` brings the MPICH wheel), point it at
    Open MPI's. Otherwise every rank fails in MPI_Init with an obscure PMIx error."""
    if sys.platform != "linux" or "OMPI_COMM_WORLD_SIZE" not in os.environ:
        return
    if os.environ.get("MPI4PY_LIBMPI") or os.environ.get("MPI4PY_MPIABI"):
        return  # the user chose
    os.environ["MPI4PY_LIBMPI"] = "libmpi.so.40"  # Open MPI 4 and 5; found on the loader's path
