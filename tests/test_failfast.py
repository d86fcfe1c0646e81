"""Fail fast, never hang, with real mpiexec (MPICH) and mpirun (Open MPI, when installed):
a rank killed by a signal ends the job within seconds with a line naming it; a rank that stops
answering is caught by the watchdog, which names it; a rank idling in receive barely uses CPU."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO
from test_launch import HAVE_OPENMPI

MPIS = ["mpich", pytest.param("openmpi", marks=pytest.mark.skipif(
    not HAVE_OPENMPI, reason="Open MPI is not installed (apt-get install openmpi-bin; .ci/run installs it)"))]


def start_ping(mpi: str, ranks: int, *args: str, pause: float = 0.2,
               launcher: list[str] | None = None) -> tuple[subprocess.Popen, dict[int, int]]:
    """A long `ping` job through launch/run.py (or `launcher`, e.g. mpiexec and the console script);
    returns it once every rank has reported its pid."""
    launcher = launcher or [sys.executable, str(REPO / "launch" / "run.py"), "--mpi", mpi, "-n", str(ranks)]
    proc = subprocess.Popen([*launcher, "ping", "--rounds", "1000000", "--pause", str(pause), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    pids: dict[int, int] = {}
    deadline = time.monotonic() + 60
    while len(pids) < ranks and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.match(r"(\d+)\s+\S+\s+(\d+)$", line.strip())
        if m:
            pids[int(m.group(1))] = int(m.group(2))
    if len(pids) < ranks:
        proc.kill()
        pytest.fail(f"the job did not start: {proc.communicate()[1]}")
    time.sleep(1.0)  # let a few rounds go round
    return proc, pids


def finish(proc: subprocess.Popen, since: float) -> tuple[float, str]:
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the job hung")
    return time.monotonic() - since, err


@pytest.mark.parametrize("mpi", MPIS)
def test_a_killed_rank_ends_the_job_and_is_named(mpi):
    proc, pids = start_ping(mpi, 3)
    start = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    elapsed, err = finish(proc, start)
    assert proc.returncode != 0
    assert elapsed < 10, f"took {elapsed:.1f} s"
    named = [line for line in err.splitlines() if line.startswith("error: rank 1 ")]
    assert named and f"pid {pids[1]}" in named[0] and "signal 9 (SIGKILL)" in named[0], err
    print(f"{mpi}: job ended {elapsed:.2f} s after SIGKILL of rank 1")


CONSOLE_SCRIPT = Path(sys.executable).parent / "pipeline"


@pytest.mark.skipif(not CONSOLE_SCRIPT.is_file(), reason="the pipeline console script is not installed (pip install -e .)")
def test_the_console_script_names_a_killed_rank_too():
    """`mpiexec -n N pipeline ...` runs each rank under the supervisor, as `python -m pipeline` does."""
    proc, pids = start_ping("mpich", 2, launcher=["mpiexec", "-n", "2", str(CONSOLE_SCRIPT)])
    start = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    elapsed, err = finish(proc, start)
    named = [line for line in err.splitlines() if line.startswith("error: rank 1 ")]
    assert named and f"pid {pids[1]}" in named[0] and "signal 9 (SIGKILL)" in named[0], err


@pytest.mark.parametrize("mpi", MPIS)
def test_watchdog_names_a_rank_that_stops_answering(mpi):
    # Rank 2 has waited for rank 1 since before rank 0 sent the round rank 1 never forwarded: by
    # the pause, so rank 2's watchdog fires first and its abort ends the job before rank 0's does.
    proc, pids = start_ping(mpi, 3, "--watchdog", "2", pause=1.0)
    start = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)  # alive but silent: no launcher notices this
    try:
        elapsed, err = finish(proc, start)
    finally:
        try:
            os.kill(pids[1], signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode != 0
    assert elapsed < 10, f"took {elapsed:.1f} s"
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors and "got nothing from rank 1" in errors[0] and "--watchdog 2" in errors[0], err
    assert not any("got nothing from rank 0" in e or "got nothing from rank 2" in e for e in errors), err
    print(f"{mpi}: watchdog (2 s) ended the job {elapsed:.2f} s after rank 1 stopped")


@pytest.mark.parametrize("transport", ["mpi", "mlx"])
def test_a_rank_waiting_for_activations_does_not_spin(transport):
    """Rank 1 waits ~3 s for rank 0's next message; its CPU time while waiting stays far below."""
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "pipeline", "ping", "--rounds", "2",
                             "--pause", "3", "--transport", transport],
                            capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    row = [line.split() for line in result.stdout.splitlines() if line.startswith("1 ")][-1]  # the wait table
    waited, cpu = float(row[2]), float(row[3])
    assert waited > 2.5
    assert cpu < 0.25 * waited, result.stdout
    print(f"{transport}: rank 1 waited {waited:.2f} s using {cpu:.2f} s of CPU ({100 * cpu / waited:.1f}%)")


@pytest.mark.parametrize("send", ["t.isend_message(1, Kind.FORWARD, [0], [4096], hidden).wait()",  # batch
                                  "t.send_message(1, Kind.FORWARD, [0], [4096], hidden)"])  # generate
def test_watchdog_guards_a_send_the_peer_never_takes(send):
    """Rank 1 hangs without receiving; rank 0's 16 MB message (past MPI's eager limit, so the send
    waits for the receiver) must end the job under the watchdog, naming rank 1."""
    script = (
        "import time\n"
        "from mpi4py import MPI\n"
        "import mlx.core as mx\n"
        "from pipeline.cluster import mpi\n"
        "from pipeline.cluster.transport import Kind, MpiTransport\n"
        "comm = MPI.COMM_WORLD\n"
        "mpi.abort_on_unhandled_exception(comm)\n"
        "t = MpiTransport(comm, watchdog_s=2.0)\n"
        "if comm.rank == 1:\n"
        "    time.sleep(60)\n"
        "hidden = mx.zeros((1, 4096, 1024))\n"
        f"{send}\n"
        "print('sent', flush=True)\n"
    )
    start = time.monotonic()
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", script], capture_output=True,
                            text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "sent" not in result.stdout
    assert elapsed < 20, f"took {elapsed:.1f} s"
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "rank 0 could not send to rank 1 for 2 s" in errors[0], result.stderr


def test_a_killed_supervisor_is_named():
    """SIGKILL of the light parent process a rank runs under (supervise.py): the rank says so."""
    proc, pids = start_ping("mpich", 3)
    with open(f"/proc/{pids[1]}/stat") as stat:
        supervisor = int(stat.read().rsplit(")", 1)[1].split()[1])
    start = time.monotonic()
    os.kill(supervisor, signal.SIGKILL)
    elapsed, err = finish(proc, start)
    assert proc.returncode != 0
    assert elapsed < 10, f"took {elapsed:.1f} s"
    named = [line for line in err.splitlines() if line.startswith("error: rank 1 ")]
    assert named and f"pid {pids[1]}" in named[0] and f"supervisor process (pid {supervisor})" in named[0], err


def test_an_idle_server_notices_a_hung_rank_and_health_says_so(tiny_models):
    """A stopped rank, which no launcher notices: an idle server's heartbeat does not come back round
    the ring, rank 0's watchdog ends the job naming the rank (after the next heartbeat, watchdog / 4,
    then the watchdog), and from that moment /health answers 503 with the reason, not 200."""
    marker = f"hung-probe-{os.getpid()}"
    proc = subprocess.Popen(["mpiexec", "-n", "2", sys.executable, "-m", "pipeline", "serve", "--port", "0",
                             "--model", str(tiny_models["llama"]), "--model-name", marker, "--watchdog", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    rank1 = None
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+) ", proc.stdout.readline()).group(1))
        rank1 = next(pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                     if marker in _read(f"/proc/{pid}/cmdline") and "PMI_RANK=1\0" in _read(f"/proc/{pid}/environ")
                     and "PIPELINE_SUPERVISED=" in _read(f"/proc/{pid}/environ"))
        answers: list[tuple[int, str]] = []

        def poll():  # what a load balancer sees, every 10 ms, until the server is gone
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        answers.append((r.status, r.read().decode()))
                except urllib.error.HTTPError as e:
                    answers.append((e.code, e.read().decode()))
                except OSError:
                    return
                time.sleep(0.01)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        start = time.monotonic()
        os.kill(rank1, signal.SIGSTOP)
        elapsed, err = finish(proc, start)
        poller.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        if rank1 is not None:
            try:
                os.kill(rank1, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    assert elapsed < 2 * 1.25 + 5, f"took {elapsed:.1f} s:\n{err}"
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors and "got nothing from rank 1" in errors[0] and "--watchdog 2" in errors[0], err
    assert answers and answers[0][0] == 200, answers[:3]
    ending = [body for status, body in answers if status == 503]
    assert ending and "got nothing from rank 1" in ending[0], answers[-3:]
    print(f"the job ended {elapsed:.2f} s after rank 1 stopped; /health 503 for {len(ending)} polls first")


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""
