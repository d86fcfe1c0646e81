"""Hostfiles in both MPI dialects, the mpirun/mpiexec line launch/run.py builds for each MPI,
its one-line errors, and real jobs started through it (MPICH always, Open MPI when installed)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import REPO, mpiexec
from pipeline.util.errors import UserError
from pipeline.cluster.hostfile import check_slots, format_hostfile, parse_hostfile

spec = importlib.util.spec_from_file_location("launch_run", REPO / "launch" / "run.py")
launch_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch_run)

HAVE_OPENMPI = any(launch_run._flavor_of(p)[0] == "openmpi"
                   for p in filter(None, map(shutil.which, launch_run._CANDIDATES["openmpi"])))


def launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "launch" / "run.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_both_dialects_comments_and_bare_hosts():
    text = """
    # four Mac Studios on the Thunderbolt bridge
    studio-1 slots=1          # Open MPI
    10.0.5.2:2                # MPICH
    studio-3 slots=1 max_slots=1
    studio-4
    """
    hosts = parse_hostfile(text)
    assert [(h.name, h.slots, h.line) for h in hosts] == [
        ("studio-1", 1, 3), ("10.0.5.2", 2, 4), ("studio-3", 1, 5), ("studio-4", 1, 6)]
    assert format_hostfile(hosts, "openmpi") == "studio-1 slots=1\n10.0.5.2 slots=2\nstudio-3 slots=1\nstudio-4 slots=1\n"
    assert format_hostfile(hosts, "mpich") == "studio-1:1\n10.0.5.2:2\nstudio-3:1\nstudio-4:1\n"
    check_slots(hosts, 5)
    assert parse_hostfile((REPO / "hostfile.example").read_text())  # the shipped example parses


@pytest.mark.parametrize("text, fragments", [
    ("a slots=1\nb slots=two\n", ["hosts:2", "slots", "'two'"]),
    ("a slots=1\n\nb c d\n", ["hosts:3", "cannot read", "'b c d'"]),
    ("a slots=1\nb:0\n", ["hosts:2", ">= 1"]),
    ("a slots=1\nb cpus=4\n", ["hosts:2", "unknown setting 'cpus'"]),
    ("a slots=1\nb:1\na:2\n", ["hosts:3", "host a is listed twice", "line 1"]),
    ("# nothing\n", ["no hosts"]),
])
def test_hostfile_mistakes_name_the_line(text, fragments):
    with pytest.raises(UserError) as e:
        parse_hostfile(text, "hosts")
    for fragment in fragments:
        assert fragment in str(e.value)


def test_fewer_slots_than_ranks():
    with pytest.raises(UserError, match="has 3 slots on 2 hosts but the job needs 4 ranks"):
        check_slots(parse_hostfile("a slots=1\nb:2\n"), 4)


def test_commands_for_each_mpi():
    env = {"PYTHONPATH": "/src", "PIPELINE_IFACE": "bridge0"}
    build = launch_run.build_command
    hosts = parse_hostfile("studio-1 slots=1\nstudio-2:3\n")
    ompi = build("openmpi", "/usr/bin/mpirun", "mpirun (Open MPI) 4.1.4", 4, hosts, "bridge0", env,
                 "/usr/bin/python3", ["generate", "--prompt", "hi"], is_root=True, cores=1)
    assert ompi[:5] == ["/usr/bin/mpirun", "-n", "4", "--host", "studio-1:1,studio-2:3"]
    assert "--allow-run-as-root" in ompi and "--oversubscribe" not in ompi
    joined = " ".join(ompi)
    assert "--mca btl_tcp_if_include bridge0 --mca oob_tcp_if_include bridge0" in joined
    assert "-x PIPELINE_IFACE -x PYTHONPATH " in joined  # by name: no value on the command line
    assert ompi[-6:] == ["/usr/bin/python3", "-m", "pipeline", "generate", "--prompt", "hi"]
    ompi5 = " ".join(build("openmpi", "mpirun", "mpirun (Open MPI) 5.0.6", 2, None, "bridge0", {}, "py", ["ping"],
                           is_root=False, cores=1))
    assert "--prtemca oob_tcp_if_include bridge0" in ompi5
    assert "--allow-run-as-root" not in ompi5 and "--oversubscribe" in ompi5  # 2 ranks, 1 core, no hostfile

    mpich = build("mpich", "/usr/bin/mpiexec", "MPICH (Hydra) 5.0.2", 4, hosts, "bridge0", env,
                  "/usr/bin/python3", ["generate", "--prompt", "hi"], is_root=True, cores=1)
    assert mpich[:5] == ["/usr/bin/mpiexec", "-n", "4", "-hosts", "studio-1:1,studio-2:3"]
    assert "-iface bridge0" in " ".join(mpich) and "-genvlist PIPELINE_IFACE,PYTHONPATH " in " ".join(mpich)
    assert not any("/src" in arg or "bridge0" == arg for arg in mpich[mpich.index("-genvlist"):]), mpich
    assert not {"--allow-run-as-root", "--oversubscribe"} & set(mpich)
    assert mpich[-6:] == ["/usr/bin/python3", "-m", "pipeline", "generate", "--prompt", "hi"]


def test_dry_run_carries_the_hosts_of_either_dialect_inline(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("studio-1 slots=1\nstudio-2:1\n")
    result = launch("--mpi", "mpich", "--hostfile", str(hostfile), "--iface", "bridge0", "--env", "FOO=bar",
                    "--dry-run", "generate", "--prompt", "hi")
    assert result.returncode == 0, result.stderr
    command = result.stdout.splitlines()[-1]
    assert " -n 2 -hosts studio-1:1,studio-2:1 " in command and "-iface bridge0" in command, command
    assert command.startswith("FOO=bar ") and "-genvlist FOO," in command, command
    assert command.endswith("-m pipeline generate --prompt hi"), command


def test_no_value_of_the_environment_on_the_command_line(tmp_path):
    """A key the ranks inherit (serve.sbatch exports PIPELINE_API_KEY) is named, never written, in the
    command both MPIs get, and --dry-run leaves it out too: `ps` shows command lines to every user."""
    key = "sk-do-not-show-me-1234"
    for mpi in ("mpich", "openmpi"):
        command = launch_run.build_command(mpi, "mpiexec", "4.1.4", 2, None, None,
                                           {"PIPELINE_API_KEY": key, "PYTHONPATH": "/src"}, "py", ["serve"],
                                           is_root=False, cores=4)
        assert "PIPELINE_API_KEY" in " ".join(command) and key not in " ".join(command), command
    result = subprocess.run([sys.executable, str(REPO / "launch" / "run.py"), "--mpi", "mpich", "-n", "2",
                             "--env", "PIPELINE_API_KEY", "--dry-run", "serve"], capture_output=True, text=True,
                            timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "PIPELINE_API_KEY": key})
    assert result.returncode == 0, result.stderr
    assert key not in result.stdout and "PIPELINE_API_KEY" in result.stdout, result.stdout


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3") or subprocess.run(
    ["/usr/bin/python3", "-c", "import mpi4py"], capture_output=True).returncode == 0,
    reason="needs a system Python without mpi4py")
def test_a_python_without_mpi4py_is_one_line_before_launching():
    """The batch script's python3 outside the README's environment: one line, not a traceback per rank."""
    result = launch("--mpi", "mpich", "-n", "2", "--python", "/usr/bin/python3", "ping", "--rounds", "1")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: the ranks' Python /usr/bin/python3 cannot import mpi4py:"), lines
    assert ".venv/bin/activate" in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize("mpi", ["mpich", pytest.param("openmpi", marks=pytest.mark.skipif(
    not HAVE_OPENMPI, reason="Open MPI is not installed (apt-get install openmpi-bin)"))])
def test_dry_run_prints_a_command_that_runs_when_pasted(tiny_models, tmp_path, mpi):
    """What --dry-run prints, pasted into a shell after the launcher has exited (and its hostfile
    deleted), runs the job and prints what plain mpiexec prints."""
    args = ["generate", "--model", str(tiny_models["llama"]), "--prompt", "The capital of France",
            "--max-tokens", "8", "--no-chat-template"]
    expected = mpiexec(2, *args)
    assert expected.returncode == 0, expected.stderr
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    printed = launch("--mpi", mpi, "--hostfile", str(hostfile), "--dry-run", *args)
    assert printed.returncode == 0, printed.stderr
    hostfile.unlink()
    before = set(os.listdir(tempfile.gettempdir()))
    pasted = subprocess.run(["bash", "-c", printed.stdout], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert pasted.returncode == 0, (printed.stdout, pasted.stderr)
    assert pasted.stdout == expected.stdout
    assert not {name for name in set(os.listdir(tempfile.gettempdir())) - before if name.startswith("pipeline-")}


@pytest.mark.parametrize("text, fragment", [
    ("a slots=1\nb slots=x\n", ":2: slots must be"),
    ("a slots=1\nb:1\na slots=1\n", ":3: host a is listed twice"),
    ("a slots=1\nb:2\n", "has 3 slots on 2 hosts but the job needs 4 ranks"),
])
def test_launcher_rejects_bad_hostfiles_with_one_line(tmp_path, text, fragment):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(text)
    result = launch("--hostfile", str(hostfile), "-n", "4", "generate", "--prompt", "hi")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("mpi", ["mpich", pytest.param("openmpi", marks=pytest.mark.skipif(
    not HAVE_OPENMPI, reason="Open MPI is not installed (apt-get install openmpi-bin)"))])
def test_job_through_the_launcher_matches_plain_mpiexec(tiny_models, tmp_path, mpi):
    args = ["generate", "--model", str(tiny_models["llama"]), "--prompt", "The capital of France",
            "--max-tokens", "12", "--no-chat-template"]
    expected = mpiexec(3, *args)
    assert expected.returncode == 0, expected.stderr
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=3\n")
    result = launch("--mpi", mpi, "--hostfile", str(hostfile), *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.stdout
