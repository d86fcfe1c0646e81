"""Under a real Slurm: munged, slurmctld and slurmd started here by hand (no systemd) for one node
with this machine's cores, configured in a temporary folder. The sbatch templates as their headers
say (the default model, the README's environment activated, no key on any command line, a drain on
scancel), srun as the launcher (--mpi=pmi2; without it, one line instead of N copies), and a rank
killed under srun ending the job within the watchdog.

Needs slurm-wlm and munge (apt-get install slurm-wlm munge; .ci/run installs them) and root (the
daemons run as root). Under CI=true a missing one fails instead of skipping."""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, mpiexec

SBIN = "/usr/sbin:/sbin"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scancel", "squeue", "sinfo", "scontrol")
WATCHDOG_S = 4  # the short --watchdog of these tests' jobs


def _missing() -> list[str]:
    found = lambda name: shutil.which(name) or shutil.which(name, path=SBIN)  # noqa: E731
    return [name for name in DAEMONS + CLIENTS if not found(name)]


def _why_not() -> str | None:
    if _missing():
        return f"Slurm is not installed (no {', '.join(_missing())}): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the Slurm daemons these tests start run as root"
    return None


if _why_not() and os.environ.get("CI") != "true":
    pytest.skip(_why_not(), allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemon(name: str) -> str:
    return shutil.which(name) or shutil.which(name, path=SBIN)


class Cluster:
    """One node, this machine, with its cores; every file in `root`."""

    def __init__(self, root: Path):
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.pids: dict[str, int] = {}
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}

    def start(self) -> None:
        munge = self.root / "munge"
        for sub in ("etc", "lib", "log", "run"):
            (munge / sub).mkdir(parents=True, mode=0o700)
        (munge / "run").chmod(0o755)
        key = munge / "etc" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        socket_path = munge / "run" / "munge.socket"
        subprocess.run([_daemon("munged"), "--force", f"--socket={socket_path}", f"--key-file={key}",
                        f"--log-file={munge / 'log' / 'munged.log'}", f"--pid-file={munge / 'run' / 'munged.pid'}",
                        f"--seed-file={munge / 'lib' / 'munged.seed'}"], check=True, timeout=30)
        self.pids["munged"] = self._pid(munge / "run" / "munged.pid")
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir()
        (self.root / "slurm.conf").write_text(f"""\
ClusterName=pipeline-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={self.root / 'state'}
SlurmdSpoolDir={self.root / 'spool'}
SlurmctldPidFile={self.root / 'slurmctld.pid'}
SlurmdPidFile={self.root / 'slurmd.pid'}
SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}
SlurmdLogFile={self.root / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
InactiveLimit=0
KillWait=30
FirstJobId={random.randrange(10**6, 6 * 10**7)}
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")
        # -c: no state, so job ids would start at 1 again, and MPICH would find the shared memory that a
        # killed rank of an earlier job 1 left in /dev/shm (named after the job) and hang in MPI_Init:
        # hence a random FirstJobId above (below MaxJobId, 67043328)
        subprocess.run([_daemon("slurmctld"), "-c", "-i"], env=self.env, check=True, timeout=30)
        self.pids["slurmctld"] = self._pid(self.root / "slurmctld.pid")
        subprocess.run([_daemon("slurmd"), "-c"], env=self.env, check=True, timeout=30)
        self.pids["slurmd"] = self._pid(self.root / "slurmd.pid")
        deadline = time.monotonic() + 60
        while self.run("sinfo", "-h", "-o", "%T").stdout.strip() != "idle":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node never came up: {self.logs()}")
            time.sleep(0.5)

    def _pid(self, path: Path) -> int:
        deadline = time.monotonic() + 10
        while not path.exists() or not path.read_text().strip():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no pid file {path}: {self.logs()}")
            time.sleep(0.05)
        return int(path.read_text().split()[0])

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.rglob("*.log")))

    def stop(self) -> None:
        """Every job cancelled, then the daemons this cluster started, by their pids."""
        if "slurmctld" in self.pids:
            self.run("scancel", "--user", "root", "--full")
            deadline = time.monotonic() + 30
            while self.run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    def run(self, *command: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                              env=env or self.env)

    def job_done(self, job: str) -> bool:
        return not self.run("squeue", "-h", "-j", job).stdout.strip()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = _why_not()
    if why:  # CI=true: a skip would hide that the Slurm tests never ran
        pytest.fail(f"{why} (CI=true: .ci/run installs slurm-wlm and munge)")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def batch_env(cluster: Cluster, **extra: str) -> dict[str, str]:
    """A login shell's environment: no virtual environment active, no PYTHONPATH. The job itself
    activates the README's environment: the checkout's .venv, or VENV (this Python's, if elsewhere)."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin:" + SBIN, "HOME": os.environ.get("HOME", "/root"),
           "LANG": "C.UTF-8", "SLURM_CONF": cluster.env["SLURM_CONF"]}
    if sys.prefix != sys.base_prefix and Path(sys.prefix) != REPO / ".venv":
        env["VENV"] = sys.prefix
    elif sys.prefix == sys.base_prefix:  # no virtual environment: this Python's own bin on the PATH
        env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    return {**env, **extra}


def sbatch(cluster: Cluster, template: str, *options: str, env: dict[str, str],
           wait: bool = False) -> tuple[str, Path, Path, int | None]:
    """Submit launch/TEMPLATE: (job id, its output and error files, and with wait=True its exit status,
    polled more often than `sbatch --wait` does)."""
    out, err = cluster.root / "job-%j.out", cluster.root / "job-%j.err"
    result = cluster.run("sbatch", "--parsable", f"--output={out}", f"--error={err}", *options,
                         str(REPO / "launch" / template), env=env)
    assert result.returncode == 0 and re.fullmatch(r"\d+(;\S+)?", result.stdout.strip()), result
    job = result.stdout.strip().split(";")[0]
    out, err = cluster.root / f"job-{job}.out", cluster.root / f"job-{job}.err"
    status = None
    if wait:
        wait_for(lambda: cluster.job_done(job), 300, lambda: f"job {job} did not end:\n{read(out)}\n{read(err)}")
        shown = cluster.run("scontrol", "show", "job", job).stdout  # kept MinJobAge (300 s) after the end
        status = int(re.search(r"\bExitCode=(\d+):", shown).group(1))
    return job, out, err, status


def wait_for(what, timeout: float, message) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            pytest.fail(message())
        time.sleep(0.2)


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def command_lines() -> dict[int, str]:
    """Every process's command line, as `ps` shows it to any user of the host."""
    lines = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
    return lines


def test_sbatch_pipeline_answers_with_the_default_model(cluster):
    """`sbatch --nodes=1 --ntasks-per-node=2 launch/pipeline.sbatch`, no MODEL, from a shell without
    the environment: preflight on 2 ranks, then the default model's answer."""
    job, out, err, status = sbatch(cluster, "pipeline.sbatch", "--nodes=1", "--ntasks-per-node=2", wait=True,
                                   env=batch_env(cluster, MAX_TOKENS="8", PROMPT="The capital of France is"))
    assert status == 0 and cluster.job_done(job), (read(out), read(err))
    stdout, stderr = read(out), read(err)
    assert "preflight: all 2 ranks ready" in stderr, (stdout, stderr)
    table = [line.split() for line in stdout.splitlines()[1:3]]
    assert [row[0] for row in table] == ["0", "1"] and all(row[-1] == "OK" for row in table), stdout
    answer = stdout.splitlines()[3:]
    assert answer and answer[0].strip(), stdout
    stats = [line for line in stderr.splitlines() if line.startswith("[pipeline] prompt")]
    assert stats and "(8 tokens" in stats[0], (stdout, stderr)
    assert "Traceback" not in stderr and "error" not in stderr.lower(), stderr


def test_sbatch_without_the_environment_is_one_line(cluster, tmp_path):
    """No virtual environment where VENV points and a python3 without mpi4py: one line, no traceback."""
    if subprocess.run(["/usr/bin/python3", "-c", "import mpi4py"], capture_output=True).returncode == 0:
        pytest.skip("the system's python3 has mpi4py")
    env = batch_env(cluster, VENV=str(tmp_path / "no-venv"))
    env["PATH"] = "/usr/bin:/bin:" + SBIN
    job, out, err, status = sbatch(cluster, "pipeline.sbatch", "--nodes=1", "--ntasks-per-node=2", env=env, wait=True)
    assert status != 0
    lines = read(err).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the ranks' Python /usr/bin/python3 cannot import "), lines
    assert "mpi4py" in lines[0] and "VENV" in lines[0]


def _post(url: str, body: dict, key: str | None, stream: bool = False):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    return urllib.request.urlopen(request, timeout=120)


def test_serve_sbatch_keeps_the_key_off_command_lines_and_drains_on_scancel(cluster):
    key = "sk-test-" + secrets.token_hex(12)
    port = _free_port()
    job, out, err, _ = sbatch(cluster, "serve.sbatch", "--nodes=1", "--ntasks-per-node=2",
                           env=batch_env(cluster, PIPELINE_API_KEY=key, PORT=str(port), WATCHDOG=str(WATCHDOG_S)))
    try:
        wait_for(lambda: "is up" in read(out) or cluster.job_done(job), 180,
                 lambda: f"the server did not come up:\n{read(out)}\n{read(err)}")
        assert "is up" in read(out), (read(out), read(err))
        assert key in read(out)  # the batch output file: where the user looks for it

        shown = {pid: line for pid, line in command_lines().items() if key in line}
        assert not shown, f"the API key is on a command line: {shown}"
        ranks = [line for line in command_lines().values() if "-m pipeline serve" in line]
        assert len(ranks) >= 2, ranks  # the check above saw the running job

        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(f"{base}/completions", {"model": "default", "prompt": "Hi", "max_tokens": 2}, None)
        assert refused.value.code == 401
        answer = json.load(_post(f"{base}/completions", {"model": "default", "prompt": "The capital of France is",
                                                         "max_tokens": 4}, key))
        assert answer["choices"][0]["text"], answer

        stream = _post(f"{base}/completions", {"model": "default", "max_tokens": 96, "stream": True,
                                               "prompt": "The numbers from 1 to 100: 1, 2, 3, 4,"}, key, stream=True)
        first = stream.readline()
        assert first.startswith(b"data: "), first
        cancelled = time.monotonic()
        assert cluster.run("scancel", job).returncode == 0
        rest = stream.read().decode()
        chunks = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
        assert rest.rstrip().endswith("data: [DONE]"), rest[-500:]
        reasons = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
        assert len(chunks) > 10 and reasons[-1] in ("length", "stop"), rest[-500:]  # in flight, ran to its end
        wait_for(lambda: cluster.job_done(job), 40, lambda: f"the job outlived the drain:\n{read(err)}")
        ended = time.monotonic() - cancelled
    finally:
        cluster.run("scancel", job)
    stderr = read(err)
    assert "SIGTERM: taking no new requests" in stderr, stderr
    assert re.search(r"serve: 2 requests done, 0 failed", stderr), stderr
    assert ended < 30, f"{ended:.1f} s: SIGKILL at KillWait"
    assert "Killed" not in stderr and "Traceback" not in stderr, stderr
    print(f"scancel: the stream finished and the job ended {ended:.1f} s after")


def test_srun_pmi2_runs_one_job_and_srun_without_it_says_so(cluster, tiny_models):
    args = ["generate", "--model", str(tiny_models["llama"]), "--prompt", "The capital of France",
            "--max-tokens", "8", "--no-chat-template"]
    env = {**cluster.env, "PYTHONPATH": str(REPO)}
    expected = mpiexec(2, *args)
    assert expected.returncode == 0, expected.stderr
    got = cluster.run("srun", "--mpi=pmi2", "-n", "2", sys.executable, "-m", "pipeline", *args, env=env, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout == expected.stdout  # one 2-rank job: the answer once

    copies = cluster.run("srun", "-n", "2", sys.executable, "-m", "pipeline", *args, env=env, timeout=120)
    assert copies.returncode != 0 and not copies.stdout, copies.stdout
    errors = [line for line in copies.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "srun started 2 separate copies" in errors[0], copies.stderr
    assert "srun --mpi=pmi2" in errors[0]


def _rank_pids(marker: str) -> dict[int, int]:
    """The ranks (the supervised processes, not their supervisors) of the job whose command line has
    `marker`: Slurm task id -> pid."""
    ranks = {}
    for pid, line in command_lines().items():
        if marker not in line:
            continue
        try:
            environ = dict(item.split("=", 1) for item in
                           Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
        except OSError:
            continue
        if "SLURM_PROCID" in environ and ("PIPELINE_SUPERVISED" in environ or environ.get("PIPELINE_SUPERVISE") == "0"):
            ranks[int(environ["SLURM_PROCID"])] = pid
    return ranks


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_dead_rank_under_srun_ends_the_serve_job_within_the_watchdog(cluster, tiny_models, how):
    """srun without --kill-on-bad-exit lets the other tasks run on. A killed rank: its supervisor ends
    the step through srun's PMI at once (the watchdog here is long, so that nothing else could end it
    in time). A hung one (SIGSTOP: no launcher sees it): an idle rank 0's heartbeat does not come back,
    and its watchdog ends the job, naming the rank (after the next heartbeat, watchdog / 4, then the
    watchdog). Either way /health stops answering."""
    port = _free_port()
    watchdog = 60 if how == signal.SIGKILL else WATCHDOG_S
    env = {**cluster.env, "PYTHONPATH": str(REPO)}
    srun = subprocess.Popen(["srun", "--mpi=pmi2", "-n", "2", sys.executable, "-m", "pipeline", "serve",
                             "--model", str(tiny_models["llama"]), "--port", str(port), "--watchdog", str(watchdog)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        lines = []
        threading.Thread(target=lambda: lines.extend(srun.stdout), daemon=True).start()
        wait_for(lambda: any(line.startswith("serving ") for line in lines) or srun.poll() is not None, 90,
                 lambda: f"the server did not start: {lines}")
        assert srun.poll() is None, (lines, srun.stderr.read())
        ranks = _rank_pids(f"--port {port}")
        assert set(ranks) == {0, 1}, ranks
        health = f"http://127.0.0.1:{port}/health"
        assert urllib.request.urlopen(health, timeout=10).status == 200
        killed = time.monotonic()
        os.kill(ranks[1], how)
        try:
            _, err = srun.communicate(timeout=WATCHDOG_S * 2 + 20)  # the killed case: far less than its watchdog
        except subprocess.TimeoutExpired:
            pytest.fail("the job outlived its rank 1 by far more than the watchdog")
        ended = time.monotonic() - killed
    finally:
        if srun.poll() is None:
            srun.kill()
        if how == signal.SIGSTOP:
            try:
                os.kill(ranks[1], signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert srun.returncode != 0
    limit = 5 if how == signal.SIGKILL else WATCHDOG_S * 1.25 + 5
    assert ended < limit, f"{ended:.1f} s:\n{err}"
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors and "rank 1" in errors[0], err
    if how == signal.SIGSTOP:
        assert "got nothing from rank 1" in errors[0] and f"--watchdog {WATCHDOG_S}" in errors[0], err
    with pytest.raises(OSError):
        urllib.request.urlopen(health, timeout=5)
    print(f"{how.name}: srun ended {ended:.1f} s after rank 1 was {'killed' if how == signal.SIGKILL else 'stopped'}")
