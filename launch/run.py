#!/usr/bin/env python3
"""Start a pipeline job with whichever MPI is installed.

    launch/run.py --hostfile hosts generate --model ~/models/Kimi-K2 --prompt "Hello"
    launch/run.py --hostfile hosts --iface bridge0 preflight --model ~/models/Kimi-K2
    launch/run.py -n 2 --dry-run ping            # one host, two ranks; print the command only

Everything after the launcher's own options is a `python -m pipeline` command line. The
launcher:

- reads the hostfile in either dialect (`host slots=N` or `host:N`), rejects syntax errors,
  duplicate hosts and too few slots with one line, and hands the MPI its hosts inline (Open MPI
  --host, MPICH -hosts, both `host:N`), so the command line stands alone: --dry-run prints one that
  runs when pasted, and no temporary file is left behind;
- detects Open MPI or MPICH (Hydra) from `mpirun`/`mpiexec --version` (or --mpi, or
  $PIPELINE_MPIEXEC naming the launcher binary);
- adds Open MPI's --allow-run-as-root only when run as root, and --oversubscribe only for
  more ranks than cores on this machine with no hostfile (MPICH needs neither);
- with --iface, pins MPI's TCP traffic to that interface (Open MPI: btl_tcp_if_include and
  oob_tcp_if_include; MPICH: -iface) and tells --transport mlx's ring to listen on it too;
- with --mlx-hostfile (what `mlx.distributed_config --backend jaccl` writes), hands every rank
  its RDMA devices for --transport mlx, so no device file has to be copied to the hosts;
- forwards the environment the ranks need (PYTHONPATH, PIPELINE_*, MLX_*, JACCL_*, HF_*,
  MPI4PY_*, OMP_NUM_THREADS, and each --env) by name (MPICH -genvlist, Open MPI -x NAME): the
  values travel in the environment, never on a command line, where `ps` would show every user
  of the host a PIPELINE_API_KEY;
- checks that the Python the ranks will run imports the package and mpi4py (one `error:` line if
  not), then becomes the MPI launcher (same pid), so the signals a batch script or a terminal
  sends reach it.

Inside a Slurm allocation (sbatch, salloc) leave out --hostfile: both MPIs read the allocation.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.util.errors import UserError  # noqa: E402
from pipeline.cluster.hostfile import Host, check_slots, read_hostfile  # noqa: E402

FORWARD_PREFIXES = ("PIPELINE_", "MLX_", "JACCL_", "HF_", "MPI4PY_", "TRANSFORMERS_")
FORWARD_NAMES = ("PYTHONPATH", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
_CANDIDATES = {
    "openmpi": ("mpirun", "mpiexec", "mpirun.openmpi", "mpiexec.openmpi", "orterun", "prterun"),
    "mpich": ("mpiexec", "mpirun", "mpiexec.hydra", "mpiexec.mpich", "mpirun.mpich"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/run.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hostfile", type=Path, metavar="FILE", help="hosts, one per line: 'HOST slots=N' or 'HOST:N'")
    p.add_argument("-n", "--np", type=int, dest="ranks",
                   help="number of ranks (default: every slot of the hostfile)")
    p.add_argument("--mpi", choices=["auto", "openmpi", "mpich"], default="auto",
                   help="which MPI launches the job (default: detect)")
    p.add_argument("--iface", metavar="IF", help="network interface for MPI's TCP traffic, e.g. bridge0 (Thunderbolt bridge)")
    p.add_argument("--mlx-hostfile", type=Path, metavar="JSON",
                   help="the JSON hostfile `mlx.distributed_config --backend jaccl` wrote: its RDMA devices "
                        "go to every rank for --transport mlx (hosts in the same order as --hostfile)")
    p.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="also set/forward this variable on every rank (repeatable)")
    p.add_argument("--python", metavar="PATH",
                   help="Python on the hosts (default: the one running this launcher, at the same path everywhere)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the pipeline command and its options, e.g. generate --model DIR --prompt TEXT")
    return p


def detect_mpi(wanted: str) -> tuple[str, str, str]:
    """(flavor, launcher binary, version line) of the MPI to use."""
    explicit = os.environ.get("PIPELINE_MPIEXEC")
    names = [explicit] if explicit else list(dict.fromkeys(
        _CANDIDATES["mpich"] + _CANDIDATES["openmpi"] if wanted == "auto" else _CANDIDATES[wanted]))
    seen = []
    for name in names:
        path = shutil.which(name)
        if not path:
            continue
        flavor, version = _flavor_of(path)
        seen.append(f"{name} ({flavor or 'unknown'})")
        if flavor and (wanted == "auto" or flavor == wanted):
            return flavor, path, version
    what = "an MPI launcher" if wanted == "auto" else {"openmpi": "Open MPI's mpirun", "mpich": "MPICH's mpiexec"}[wanted]
    found = f" (found: {', '.join(seen)})" if seen else ""
    raise UserError(f"cannot find {what} on PATH{found}: install Open MPI (brew install open-mpi; "
                    f"apt-get install openmpi-bin) or MPICH (pip install mpich), or set PIPELINE_MPIEXEC")


def _flavor_of(path: str) -> tuple[str | None, str]:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None, ""
    text = out.stdout + out.stderr
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if "Open MPI" in text or "OpenRTE" in text or "open-mpi" in text:
        return "openmpi", first
    if "HYDRA" in text or "MPICH" in text or "Intel(R) MPI" in text:
        version = re.search(r"Version:\s*(\S+)", text)
        return "mpich", f"MPICH (Hydra) {version.group(1)}" if version else first
    return None, first


def openmpi_major(version_line: str) -> int:
    m = re.search(r"(\d+)\.\d+", version_line)
    return int(m.group(1)) if m else 4


def physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


def forwarded_env(extra: list[str], iface: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARD_PREFIXES) or k in FORWARD_NAMES}
    pythonpath = os.environ.get("PYTHONPATH", "")
    if not _pipeline_installed():  # running from a checkout: the ranks need it on their path
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), pythonpath) if p)
    for item in extra:
        name, eq, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UserError(f"--env {item!r}: expected NAME or NAME=VALUE")
        if eq:
            env[name] = value
        elif name in os.environ:
            env[name] = os.environ[name]
        else:
            raise UserError(f"--env {name}: it is not set here, so there is nothing to forward (use NAME=VALUE)")
    if iface:
        env["PIPELINE_IFACE"] = iface
    return env


def jaccl_devices(path: Path, ranks: int) -> str:
    """The device list (rank -> peer -> RDMA device) from mlx.distributed_config's hostfile."""
    import json

    try:
        hosts = json.loads(path.read_text())["hosts"]
        devices = [h["rdma"] for h in hosts]
    except FileNotFoundError:
        raise UserError(f"--mlx-hostfile {path} does not exist") from None
    except (ValueError, KeyError, TypeError):
        raise UserError(f"--mlx-hostfile {path}: expected the JSON of `mlx.distributed_config --backend jaccl` "
                        f"(hosts with 'rdma' device lists)") from None
    if len(devices) != ranks or any(not isinstance(d, list) or len(d) != ranks for d in devices):
        raise UserError(f"--mlx-hostfile {path} describes {len(devices)} hosts but the job has {ranks} ranks "
                        f"(one rank per host, in the same order)")
    return json.dumps(devices)


def _pipeline_installed() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("pipeline")
    return spec is not None and spec.origin is not None and not spec.origin.startswith(str(REPO) + os.sep)


def inline_hosts(hosts: list[Host]) -> str:
    """The hosts and their slots as both MPIs take them on the command line: `a:1,b:2`."""
    return ",".join(f"{h.name}:{h.slots}" for h in hosts)


def build_command(flavor: str, launcher: str, version: str, ranks: int, hosts: list[Host] | None,
                  iface: str | None, env: dict[str, str], python: str, command: list[str],
                  is_root: bool, cores: int) -> list[str]:
    cmd = [launcher, "-n", str(ranks)]
    if flavor == "openmpi":
        if hosts:
            cmd += ["--host", inline_hosts(hosts)]
        if is_root:
            cmd += ["--allow-run-as-root"]
        if hosts is None and ranks > cores and "SLURM_JOB_ID" not in os.environ:
            cmd += ["--oversubscribe"]
        if iface:
            oob = ["--prtemca", "oob_tcp_if_include", iface] if openmpi_major(version) >= 5 else \
                ["--mca", "oob_tcp_if_include", iface]
            cmd += ["--mca", "btl_tcp_if_include", iface] + oob
        for name in sorted(env):  # by name: mpirun takes the value from its environment
            cmd += ["-x", name]
    else:
        if hosts:
            cmd += ["-hosts", inline_hosts(hosts)]
        if iface:
            cmd += ["-iface", iface]
        if env:  # by name: mpiexec takes the values from its environment
            cmd += ["-genvlist", ",".join(sorted(env))]
    return cmd + [python, "-m", "pipeline", *command]


def printed_command(cmd: list[str], env: dict[str, str]) -> str:
    """The command as a shell line: the values this launcher chose or was given (NAME=VALUE before the
    command, which puts them in its environment, not on its command line), then the command. What the
    ranks inherit from this shell (a PIPELINE_API_KEY exported here) stays out of the line."""
    chosen = [f"{name}={value}" for name, value in sorted(env.items()) if os.environ.get(name) != value]
    return " ".join([*map(shlex.quote, chosen), shlex.join(cmd)])


PROBE = ("import importlib.util as u; "
         "print(' '.join(n for n in ('pipeline', 'mpi4py') if u.find_spec(n) is None))")


def check_python(python: str, env: dict[str, str]) -> None:
    """The Python the ranks will start imports the package and mpi4py (checked here: every host has it
    at the same path); else one line naming what is missing, instead of a traceback from every rank."""
    try:
        probe = subprocess.run([python, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                               timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"cannot run the ranks' Python {python}: {getattr(e, 'strerror', None) or e}") from None
    missing = probe.stdout.split()
    if probe.returncode != 0 or missing:
        what = " and ".join(missing) if missing else "anything (it fails to start)"
        raise UserError(f"the ranks' Python {python} cannot import {what}: activate the environment the "
                        f"README sets up (. .venv/bin/activate in the checkout; the sbatch templates take "
                        f"VENV=DIR), or name another with --python")


def run(cmd: list[str], env: dict[str, str]) -> int:
    """Become the launcher: a signal for this process (scancel, a batch script's trap, Ctrl-C) is then
    mpiexec's to pass on to the ranks."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(cmd[0], cmd, {**os.environ, **env})
    except OSError as e:
        print(f"error: cannot start {cmd[0]}: {e.strerror}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if not command:
            raise UserError("give the pipeline command to run, e.g. generate --model DIR --prompt TEXT")
        hosts = read_hostfile(args.hostfile) if args.hostfile else None
        if hosts is not None:
            ranks = args.ranks or sum(h.slots for h in hosts)
            check_slots(hosts, ranks, f"hostfile {args.hostfile}")
        elif args.ranks:
            ranks = args.ranks
        elif os.environ.get("SLURM_NTASKS"):
            ranks = int(os.environ["SLURM_NTASKS"])
        else:
            raise UserError("give --hostfile FILE, or -n RANKS to run on this machine")
        if ranks < 1:
            raise UserError(f"-n must be >= 1, got {ranks}")
        flavor, launcher, version = detect_mpi(args.mpi)
        env = forwarded_env(args.env, args.iface)
        if args.mlx_hostfile:
            env["PIPELINE_JACCL_DEVICES"] = jaccl_devices(args.mlx_hostfile, ranks)
        python = args.python or sys.executable
        if args.python is None or os.path.exists(args.python):  # else it is only on the hosts
            check_python(python, env)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    cmd = build_command(flavor, launcher, version, ranks, hosts, args.iface, env, python,
                        command, is_root=os.geteuid() == 0, cores=physical_cores())
    if flavor == "openmpi" and command[:1] == ["serve"]:
        print("note: Open MPI's mpirun kills the ranks about 3 s after SIGTERM (scancel, a time limit), so "
              "serve's drain is cut short; MPICH's mpiexec (--mpi mpich) lets requests in progress finish",
              file=sys.stderr)
    if args.dry_run:
        print(f"# {version}")
        print(printed_command(cmd, env))
        return 0
    return run(cmd, env)


if __name__ == "__main__":
    sys.exit(main())
