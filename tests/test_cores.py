"""Where ranks run (cores.py): each bound to its share of its host's CPUs where the launcher left
them free, and polling for messages only with a core to itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, mpiexec
from pipeline.util.cores import describe, has_own_core, share

TWO = frozenset({0, 1})


def test_each_rank_gets_its_own_share_of_a_free_host():
    eight = frozenset(range(8))
    assert share(eight, [eight] * 2, 0) == [0, 1, 2, 3] and share(eight, [eight] * 2, 1) == [4, 5, 6, 7]
    assert share(eight, [eight] * 3, 2) == [4, 5]  # 8 // 3 each; CPUs 6-7 left over
    assert share(TWO, [TWO] * 2, 1) == [1]
    assert share(frozenset({2, 5}), [frozenset({2, 5})] * 2, 1) == [5]  # a cpuset: its own CPU numbers
    assert share(TWO, [TWO], 0) is None  # alone on the host
    assert share(TWO, [TWO] * 3, 0) is None  # more ranks than CPUs: the kernel shares them
    assert share(frozenset({0}), [frozenset({0}), frozenset({1})], 0) is None  # the launcher bound them
    assert describe([3]) == "1 CPU/rank" and describe([4, 5, 6, 7]) == "4 CPUs/rank" and describe(None) == ""
    assert describe([3], batch=True) == "1 CPU/rank, SCHED_BATCH" and describe(None, batch=True) == "SCHED_BATCH"


def test_polling_waits_only_where_each_rank_has_a_core():
    """Receives poll without sleeping (transport.MpiTransport.OWN_CORE_SPIN_S) only when the ranks
    of a host are no more than the CPUs they may run on together: bound one per core, or all free
    on enough cores; never when they share cores (polling would take the working rank's CPU)."""
    assert has_own_core([("a", TWO), ("a", TWO)], 0)  # 2 ranks free on 2 cores
    assert has_own_core([("a", frozenset({0})), ("a", frozenset({1}))], 1)  # bound one per core
    assert not has_own_core([("a", TWO)] * 3, 2)  # 3 ranks on 2 cores
    assert not has_own_core([("a", frozenset({0})), ("a", frozenset({0}))], 0)  # both bound to core 0
    # other hosts' ranks do not count against this one's cores
    assert has_own_core([("a", frozenset({0})), ("b", frozenset({0})), ("b", frozenset({0}))], 0)
    assert not has_own_core([("a", frozenset({0})), ("b", frozenset({0})), ("b", frozenset({0}))], 1)


AFFINITY = """
import json, os, threading
from mpi4py import MPI
from pipeline.runtime.job import share_cores as _share_cores
comm = MPI.COMM_WORLD
_share_cores(comm)
def placement():
    return [sorted(os.sched_getaffinity(0)), os.sched_getscheduler(0) == os.SCHED_BATCH]
later = []
thread = threading.Thread(target=lambda: later.append(placement()))  # a thread started after
thread.start(); thread.join()
print(json.dumps([comm.rank, placement(), later[0]]))
"""


def affinities(n: int, launcher_cpus: list[int] | None = None, **env: str) -> dict[int, tuple[list, list]]:
    """rank -> ([CPUs it may run on, whether SCHED_BATCH] of its main thread, and of a thread it
    starts afterwards). launcher_cpus: the job started bound to these, as `taskset` would."""
    bind = (lambda: os.sched_setaffinity(0, launcher_cpus)) if launcher_cpus else None
    result = subprocess.run(["mpiexec", "-n", str(n), sys.executable, "-c", AFFINITY], capture_output=True,
                            text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env},
                            preexec_fn=bind)
    assert result.returncode == 0, result.stderr
    found = re.findall(r"\[\d+, \[\[[\d, ]*\], \w+\], \[\[[\d, ]*\], \w+\]\]", result.stdout)  # lines may run together
    return {rank: (main, later) for rank, main, later in map(json.loads, found)}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 CPUs this process may use")
def test_ranks_bind_themselves_and_say_so(tiny_models):
    """Real mpiexec (MPICH leaves ranks unbound): 2 ranks on a host with 2+ free CPUs bind to
    separate halves, threads started later included, and the stats line says so; more ranks
    than CPUs, or PIPELINE_BIND=0, leave the kernel to place them. A rank left with one CPU runs
    its threads SCHED_BATCH (cores.schedule_as_batch); one with more does not."""
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    one = half == 1  # each rank of 2 left with a single CPU
    assert affinities(2) == {0: ([cpus[:half], one], [cpus[:half], one]),
                             1: ([cpus[half:2 * half], one], [cpus[half:2 * half], one])}
    assert affinities(2, PIPELINE_BIND="0") == {0: ([cpus, False], [cpus, False]), 1: ([cpus, False], [cpus, False])}
    assert affinities(1) == {0: ([cpus, False], [cpus, False])}  # alone with its CPUs: left as it is
    assert affinities(1, launcher_cpus=cpus[-1:]) == {0: ([cpus[-1:], True], [cpus[-1:], True])}  # one CPU
    if len(cpus) + 1 <= 4:
        assert all(main == [cpus, False] for main, _ in affinities(len(cpus) + 1).values())
    args = ("generate", "--model", str(tiny_models["llama"]), "--prompt", "hi", "--max-tokens", "3")
    result = mpiexec(2, *args, env={"OPENBLAS_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    said = f"bound, {describe(cpus[:half], batch=one)}"
    assert f"{said})" in result.stderr or f"{said}," in result.stderr
