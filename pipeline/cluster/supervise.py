"""Name the rank that a signal killed.

When a rank dies of a signal (SIGKILL from the out-of-memory killer, a segfault, a `kill`),
mpiexec tears the job down within a second, but MPICH's notice names only a PID, and sometimes
the PID of a rank it killed while cleaning up rather than the one that died first.

So every rank of `mpiexec ... python -m pipeline` (or of the `pipeline` console script) runs
under a small supervisor: the process that mpiexec started stays a light parent (it has imported
nothing but this module), runs the real rank as its child (a fresh interpreter with the same arguments, environment and file
descriptors, so MPI's PMI connection is inherited), passes on the signals it receives, and if
the child dies of a signal the supervisor did not pass on, prints

    error: rank 2 (studio-3, pid 4242) was killed by signal 9 (SIGKILL): out of memory? ...

and ends the job itself (`end_job`, through the process manager: MPICH's mpiexec or `srun --mpi=pmi2`):
MPICH's mpiexec cleans up after a rank that fails, but a launcher that does not (`mpiexec
-disable-auto-cleanup`, Slurm's srun without --kill-on-bad-exit) or is slow to would leave the
other ranks waiting on the dead one until their --watchdog (300 s by default), wherever they are:
in the ring, or telling it to stop; an idle server would answer /health for that long. It then exits with 128 + the
signal, which mpiexec sees as that rank failing. If the supervisor is
killed (mpiexec cleaning up, or a `kill -9` of the wrong pid), the child says so, naming its rank,
and exits at once: PR_SET_PDEATHSIG delivers SIGUSR1 on Linux, a watcher thread notices
elsewhere (and backs the signal up on Linux). PIPELINE_SUPERVISE=0 turns it off.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from ..util import huge_pages
from ..util.switches import turned_off

_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")
_CHILD = "PIPELINE_SUPERVISED"
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def launched_rank() -> str | None:
    for name in _RANK_ENV[:3]:
        if name in os.environ:
            return os.environ[name]
    return None


def _command() -> list[str] | None:
    """The arguments that run this command again in a fresh interpreter: `-m pipeline ...` as given,
    or for the installed console script (`mpiexec -n N pipeline generate ...`) the same as a module.
    None in any other program that imports the package."""
    argv = getattr(sys, "orig_argv", [])
    for i, (a, b) in enumerate(zip(argv, argv[1:])):
        if a == "-m" and b == "pipeline":
            return argv[i:]
    if sys.argv and os.path.basename(sys.argv[0]) == "pipeline" and os.path.isfile(sys.argv[0]):
        return ["-m", "pipeline", *sys.argv[1:]]
    return None


def wanted() -> bool:
    """True in the process mpiexec started for `python -m pipeline ...` or the `pipeline` console
    script (not yet supervised)."""
    return (_command() is not None and launched_rank() is not None and _CHILD not in os.environ
            and os.environ.get("PIPELINE_SUPERVISE", "1") != "0")


def restart_with_huge_pages() -> None:
    """`python -m pipeline ...` run without mpiexec: start again (same pid, arguments and descriptors)
    with glibc's huge-page tunable, read only at process start (huge_pages.py); under mpiexec the
    supervisor gives it to the rank it starts. Returns where there is nothing to do."""
    argv = _command()
    if argv is None or launched_rank() is not None or _CHILD in os.environ or not huge_pages.wanted():
        return
    if argv[:2] == ["-m", "pipeline"] and os.path.basename(sys.argv[0] or "") == "pipeline":
        argv = [sys.argv[0], *sys.argv[1:]]  # the console script as itself: its help names it so
    os.execve(sys.executable, [sys.executable, *argv], huge_pages.environment(dict(os.environ)))


def supervise() -> None:
    """Run this rank as a child process and exit with its status (never returns)."""
    argv = _command()
    env = huge_pages.environment({**os.environ, _CHILD: str(os.getpid())})
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    child = subprocess.Popen([sys.executable, *argv], env=env, close_fds=False, preexec_fn=preexec)
    passed_on: set[int] = set()

    def pass_on(signum, _frame):
        passed_on.add(signum)
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in _FORWARDED:
        signal.signal(sig, pass_on)
    while True:
        try:
            status = child.wait()
            break
        except InterruptedError:
            continue
    if status >= 0:
        os._exit(status)
    sig = -status
    if sig not in passed_on:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        hint = {signal.SIGKILL: ": out of memory? (check with `python -m pipeline preflight`)",
                signal.SIGSEGV: ": a crash in native code",
                signal.SIGBUS: ": a crash in native code (or a model file changed while mapped)"}.get(sig, "")
        sys.stderr.write(f"error: rank {launched_rank()} ({socket.gethostname()}, pid {child.pid}) was "
                         f"killed by signal {sig} ({name}){hint}; ending the job\n")
        sys.stderr.flush()
        end_job(128 + sig)
    os._exit(128 + sig)


def end_job(status: int) -> None:
    """Ask the process manager to end every rank of the job now, as MPI_Abort does: under MPICH's
    mpiexec, and under `srun --mpi=pmi2` (whose plugin also speaks PMI-1, the wire MPICH's ranks use),
    a rank's connection to it is the inherited descriptor $PMI_FD, and `cmd=abort` on it ends the
    job (srun: the step, SIGKILL to every task) whatever its clean-up setting: srun without
    --kill-on-bad-exit would otherwise let the other ranks run on. The rank that used the connection
    is gone, so nothing else writes to it. Elsewhere (Open MPI's PMIx) this does nothing: the
    launcher's own clean-up, or the other ranks' --watchdog, ends the job."""
    fd = os.environ.get("PMI_FD", "")
    if not fd.isdigit() or turned_off("PIPELINE_PMI_ABORT"):  # off: for a process manager whose abort misbehaves
        return
    # The abort ends mpiexec at once, and the line just written could be lost on the way (seen 2 in
    # 3 times): its proxy forwards what ranks write asynchronously, so it is given a moment first.
    time.sleep(LAST_WORD_S)
    try:
        os.write(int(fd), f"cmd=abort exitcode={status}\n".encode())
    except OSError:
        pass  # the process manager is gone already


LAST_WORD_S = 0.5  # how long end_job leaves mpiexec to pass on a rank's last line
_PARENT_DIED = signal.SIGUSR1  # what PR_SET_PDEATHSIG sends the child (SIGKILL would leave it no last word)


def _die_with_parent() -> None:  # in the child, between fork and exec (Linux)
    import ctypes  # here, in the forked child: the supervisor stays a light parent, without ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, _PARENT_DIED)  # PR_SET_PDEATHSIG


def watch_parent() -> None:
    """In the supervised child: if the supervisor dies, name this rank in one line and exit."""
    if _CHILD not in os.environ:
        return

    parent = int(os.environ[_CHILD])

    def orphaned() -> None:
        sys.stderr.write(f"error: rank {launched_rank()} ({socket.gethostname()}, pid {os.getpid()}) lost its "
                         f"supervisor process (pid {parent}): it was killed; ending the job\n")
        sys.stderr.flush()
        end_job(1)
        os._exit(1)

    if sys.platform.startswith("linux"):
        def on_signal(signum, frame):
            if os.getppid() != parent:  # else a SIGUSR1 the supervisor passed on: not ours to act on
                orphaned()

        signal.signal(_PARENT_DIED, on_signal)

    def watch():  # also while the main thread is busy in native code, where the handler cannot run
        while os.getppid() == parent:
            time.sleep(0.5)
        orphaned()

    threading.Thread(target=watch, name="pipeline-supervisor-watch", daemon=True).start()
