"""Which CPUs a rank runs on: its share of its host's cores, whether it has one to itself, and how
its threads are scheduled there.

Binding. MPICH's `mpiexec` leaves ranks unbound, and the kernel then moves them between cores
(measured on 2 cores, a 2-rank batch job: `mpiexec -bind-to core` 5-12% faster in 4 of 4 paired
runs while the machine was busy; this self-binding faster in 6 of 8, median +2%). So when the
launcher left every rank of a host free on the same CPUs and there are at least as many CPUs as
ranks, each rank binds itself to its own equal share (local rank i gets the i-th share), the same
share of cores its BLAS threads get (blas.threads_for). A launcher's binding (Open MPI's
`--bind-to`, Slurm's `--cpu-bind`, `taskset`) is left alone, as is a host with more ranks than
CPUs. `PIPELINE_BIND=0` turns it off, and the scheduling below.

Polling. A rank with a core to itself waits for messages by polling (transport.MpiTransport).

Scheduling. A rank on one CPU runs two busy threads there: Python's, which builds MLX's graph and
dispatches its ops, and MLX's CPU stream worker, which runs them. Under the default policy every
dispatch wakes the idle worker, whose wakeup preempts the dispatcher; the worker runs the one op
and sleeps again: two context switches per op (measured: ~280k per rank in a 2-rank SmolLM2 batch
job of 8 s). Such a rank makes its threads SCHED_BATCH, whose wakeups do not preempt, so the
worker runs the queued ops when the dispatcher waits: 28k switches per rank, the job 6-9% faster
in 3 of 3 paired runs. A rank with more CPUs (its threads on different ones) is left as it is.
"""

from __future__ import annotations

import os

from .switches import turned_off

BIND_ENV = "PIPELINE_BIND"


def cpus_allowed() -> frozenset[int]:
    """The CPUs this process may run on (its binding, or cgroup cpuset)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS): the machine's CPUs
        return frozenset(range(os.cpu_count() or 1))


def has_own_core(placement: list[tuple[str, frozenset[int]]], rank: int) -> bool:
    """Whether `rank` has a core to itself: no more ranks on its host than the CPUs they may run on
    together (each bound to its own, or all free to use all). Waiting by polling then takes no
    one's CPU. placement: (host, CPUs allowed) of every rank."""
    mine = [cpus for host, cpus in placement if host == placement[rank][0]]
    return len(mine) <= len(frozenset().union(*mine))


def share(allowed: frozenset[int], host_allowed: list[frozenset[int]], local_rank: int) -> list[int] | None:
    """The CPUs local rank `local_rank` of a host should bind to, or None to leave it as it is.
    host_allowed: what every rank of the host may run on now, by local rank."""
    ranks = len(host_allowed)
    if ranks < 2 or any(cpus != allowed for cpus in host_allowed) or len(allowed) < ranks:
        return None  # alone, already placed by the launcher, or more ranks than CPUs
    per_rank = len(allowed) // ranks
    return sorted(allowed)[local_rank * per_rank:(local_rank + 1) * per_rank]


def bind(host_comm) -> list[int] | None:
    """Collective over a host's ranks: bind this rank (every thread of it) to its share of the
    host's CPUs, as `share` says. Returns the CPUs bound to, or None."""
    allowed = cpus_allowed()
    host_allowed = host_comm.allgather(allowed)
    if _left_alone():
        return None
    cpus = share(allowed, host_allowed, host_comm.Get_rank())
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return None
    try:  # sched_setaffinity(0) binds one thread: bind each one this process already has
        for tid in _threads():
            os.sched_setaffinity(tid, cpus)
    except OSError:  # a thread that ended meanwhile, or a kernel that refuses: leave the rest
        pass
    return cpus


def schedule_as_batch() -> bool:
    """Make every thread of this process SCHED_BATCH if it may run on one CPU only (see the module
    docstring; threads started later inherit it). Returns whether it did."""
    if _left_alone():
        return False
    if len(cpus_allowed()) != 1 or not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        for tid in _threads():
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
    except OSError:
        return False
    return True


def _left_alone() -> bool:
    """PIPELINE_BIND=0 (or off/no/none): neither binding nor scheduling is touched."""
    return turned_off(BIND_ENV)


def _threads() -> list[int]:
    """This process's thread ids (0, the calling thread, where /proc is missing)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def describe(cpus: list[int] | None, batch: bool = False) -> str:
    """For the stats line, the same on every rank of an evenly shared host: '1 CPU/rank', with
    ', SCHED_BATCH' if its threads are, or ''."""
    parts = [f"{len(cpus)} CPU{'s' if len(cpus) != 1 else ''}/rank"] if cpus else []
    return ", ".join(parts + (["SCHED_BATCH"] if batch else []))
