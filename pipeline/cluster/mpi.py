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


_ending: list[str] = []  # why this process is ending the job, once it is (abort_on_unhandled_exception)


def job_ending() -> str | None:
    """Why this rank is ending the whole job (a silent or dead peer, a bug), from the moment it knows
    until MPI_Abort takes it down; None while the job runs. Rank 0's /health answers 503 with it."""
    return _ending[0] if _ending else None


def abort_on_unhandled_exception(comm) -> None:
    def hook(exc_type, exc, tb):
        _ending.append(f"{exc_type.__name__}: {exc}" if str(exc) else exc_type.__name__)
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


# What an MPI launcher tells each rank it starts (MPICH's Hydra and Slurm's pmi2 plugin, Open MPI,
# PMIx): a process with none of these was not started as a rank of a job.
_LAUNCHER_RANK = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def stop_unwired_srun_copies() -> None:
    """Before mpi4py loads: `srun -n N python -m pipeline ...` where srun's MPI plugin is none (Slurm's
    default MpiDefault) starts N separate one-rank jobs, each printing the whole answer. A task of a
    Slurm step of N tasks that no launcher gave a rank is such a copy: task 0 says so, in one line,
    and every copy exits 1."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if not tasks.isdigit() or int(tasks) < 2 or any(name in os.environ for name in _LAUNCHER_RANK):
        return
    if os.environ.get("SLURM_PROCID", "0") == "0":
        print(f"error: srun started {tasks} separate copies of this command, not one job of {tasks} ranks: "
              f"its MPI plugin is none here; run `srun --mpi=pmi2 ...` (the MPICH of the README's set-up), "
              f"or launch/run.py inside the allocation", file=sys.stderr, flush=True)
    sys.exit(1)


def use_the_launchers_mpi() -> None:
    """Before mpi4py loads: when Open MPI's mpirun started this process but mpi4py would load
    another MPI library first (Linux, where `pip install .` brings the MPICH wheel), point it at
    Open MPI's. Otherwise every rank fails in MPI_Init with an obscure PMIx error. And first: srun's
    unconnected copies stop (stop_unwired_srun_copies)."""
    stop_unwired_srun_copies()
    if sys.platform != "linux" or "OMPI_COMM_WORLD_SIZE" not in os.environ:
        return
    if os.environ.get("MPI4PY_LIBMPI") or os.environ.get("MPI4PY_MPIABI"):
        return  # the user chose
    os.environ["MPI4PY_LIBMPI"] = "libmpi.so.40"  # Open MPI 4 and 5; found on the loader's path
