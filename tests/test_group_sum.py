"""--tensor-parallel's group sum in MLX's graph (kernels/group_sum_kernels.cpp, runtime/group_sums.py):
against numpy's rank-ordered float32 sum of known partials on 2 and 3 ranks, chained sums evaluated as one
graph, bfloat16 partials, the router's choices from the first member (or, on members alike, each its own,
nothing sent); a hung member ends the job under the
watchdog naming it; the Python sum as the fallback (PIPELINE_GROUP_SUM=0) gives the same bits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO

WORKER = REPO / "tests" / "group_sum_worker.py"
SHAPES = 4  # group_sum_worker.SHAPES


def run_worker(ranks: int, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, str(WORKER), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def ordered_sum(parts: list[np.ndarray]) -> np.ndarray:
    total = parts[0].astype(np.float32).copy()
    for part in parts[1:]:
        total += part.astype(np.float32)  # member order, float32, one rounding per add
    return total


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("kind", ["in-graph", "python"])
def test_sum_is_the_rank_ordered_float32_sum(ranks, kind, tmp_path):
    out = tmp_path / "sums.npz"
    # the members are alike here (one host, one build): on 3 ranks PIPELINE_OWN_CHOICES=0 sends the choices anyway
    env = {"PIPELINE_GROUP_SUM": "0"} if kind == "python" else {}
    if ranks == 3:
        env["PIPELINE_OWN_CHOICES"] = "0"
    job = run_worker(ranks, "exact", str(out), env=env)
    assert job.returncode == 0, job.stderr
    got = np.load(out)
    assert str(got["kind"]) == kind, job.stderr  # the in-graph sum ran where it was wanted, with no fallback
    if kind == "in-graph":
        assert "warning" not in job.stderr, job.stderr
    assert int(got["calls"]) == SHAPES + 1
    for i in range(SHAPES):
        parts = [got[f"m{m}_partial{i}"] for m in range(ranks)]
        expected = ordered_sum(parts)
        if ranks > 2:  # the partials' magnitudes (1e-4 .. 1e4) make the order of the adds show in the bits
            assert not np.array_equal(expected, ordered_sum(parts[::-1]))
        for m in range(ranks):
            assert got[f"m{m}_sum{i}"].dtype == np.float32
            assert np.array_equal(got[f"m{m}_sum{i}"], expected), (i, m)  # every member the same bits
    halves = ordered_sum([got[f"m{m}_halves_partial"] for m in range(ranks)])
    import mlx.core as mx  # here: as the runtime rounds the float32 sum back to bfloat16

    halves = np.array(mx.array(halves).astype(mx.bfloat16).astype(mx.float32))
    for m in range(ranks):
        assert np.array_equal(got[f"m{m}_halves"], halves), m
        # member m offered arange(8) * (m + 1): alike members keep their own, else the first member's arrive
        assert bool(got["alike"]) == (ranks == 2)
        first = m + 1 if ranks == 2 else 1
        assert np.array_equal(got[f"m{m}_choices"], first * np.arange(8, dtype=np.uint32).reshape(1, 8)), m


@pytest.mark.parametrize("ranks,stopped", [(2, 1), (3, 1)])
def test_a_hung_member_ends_the_job_naming_it(ranks, stopped):
    """A member that stops (SIGSTOP: alive, silent; no launcher notices) before a sum: the others, waiting
    in the in-graph sum, end the job within --watchdog 2 s (plus the abort's 0.2 s and a margin for a busy
    machine) with one line naming it."""
    proc = subprocess.Popen(["mpiexec", "-n", str(ranks), sys.executable, str(WORKER), "hang", str(stopped), "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.monotonic()
    assert proc.returncode != 0, err
    stops = [line for line in err.splitlines() if line.startswith(f"member {stopped} stops (in-graph) at ")]
    assert stops, err
    after = ended - float(stops[0].rsplit(" ", 1)[1])
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors and all(f"got nothing from rank {stopped} " in e and "--watchdog 2" in e for e in errors), err
    assert "returned without" not in err, err
    assert 2 <= after < 8, f"the job ended {after:.1f} s after member {stopped} stopped"
    print(f"{ranks} ranks: the job ended {after:.2f} s after member {stopped} stopped (--watchdog 2)")


@pytest.mark.skipif(not shutil.which("mpirun.openmpi"), reason="Open MPI is not installed (apt-get install openmpi-bin)")
def test_open_mpi_pointer_handles(tmp_path):
    """Open MPI's handles are pointers (MPICH's ints): the same sums, in the graph, on 3 ranks."""
    out = tmp_path / "sums.npz"
    job = subprocess.run(["mpirun.openmpi", *(["--allow-run-as-root"] if os.geteuid() == 0 else []), "--oversubscribe",
                          "-x", "MPI4PY_LIBMPI=libmpi.so.40", "-x", f"PYTHONPATH={REPO}", "-n", "3", sys.executable,
                          str(WORKER), "exact", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert job.returncode == 0, job.stderr
    got = np.load(out)
    assert str(got["kind"]) == "in-graph", job.stderr
    for i in range(SHAPES):
        expected = ordered_sum([got[f"m{m}_partial{i}"] for m in range(3)])
        assert all(np.array_equal(got[f"m{m}_sum{i}"], expected) for m in range(3)), i


def test_members_unlike_take_the_first_members_choices(tmp_path):
    """Members whose computing signatures differ (here one member's switch, as another CPU or build would)
    take the first member's choices: an MPMD job of 2 ranks, the second with PIPELINE_OWN_CHOICES=1 set."""
    out = tmp_path / "sums.npz"
    worker = [sys.executable, str(WORKER), "exact", str(out)]
    job = subprocess.run(["mpiexec", "-n", "1", *worker, ":", "-n", "1", "-env", "PIPELINE_OWN_CHOICES", "1", *worker],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert job.returncode == 0, job.stderr
    got = np.load(out)
    assert not bool(got["alike"])
    for m in range(2):
        assert np.array_equal(got[f"m{m}_choices"], np.arange(8, dtype=np.uint32).reshape(1, 8)), m
