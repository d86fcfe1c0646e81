"""Two hosts on one machine: two network namespaces joined by a veth pair, one MPI rank in each,
MPI over TCP across the veth (issue 34's check of the planner's TCP terms on a link we can measure).

    ip netns add tpbench<PID>-a / tpbench<PID>-b (PID: this process's, so that two runs at once do not
    collide); a veth pair, one end in each, both renamed tpveth0; 10.99.0.1/24 in -a, 10.99.0.2/24 in -b
    (addresses exist only inside the namespaces: the pair has no route out, nothing leaves the machine);
    lo up in each. Torn down on leaving the `with` block, on SIGTERM / SIGHUP / SIGINT, at exit; a
    later run removes what a killed one (SIGKILL) left: tpbench<PID>-* whose PID is no longer running.

MPICH's Hydra starts the job from inside tpbench-a (`ip netns exec tpbench-a mpiexec -f HOSTFILE
-iface tpveth0 -launcher ssh -launcher-exec LAUNCH`), where 10.99.0.1 is local (forked there) and
10.99.0.2 is "reached" by LAUNCH, a script that runs Hydra's proxy command under `ip netns exec
tpbench-b`. Each rank gets one core (taskset: a's on CPU 0, b's on CPU 1) and one BLAS thread.
MPI itself runs over UCX's TCP transport on tpveth0 (UCX_TLS=tcp,self): left to itself UCX would
carry the bytes through shared memory, as both namespaces are one machine (measured: a 2-rank
ping-pong of 45 MB moved 45 KB over the veth that way, 45 MB with tcp). `traffic()` reads the veth's
byte counters so a run can show its bytes crossed it.

Needs root (ip netns). Run alone it sets the two hosts up, runs a ping-pong across them (mpi4py
Send/Recv, one-way latency and bandwidth), shows the counters and the TCP connections (`ss`), and
tears the namespaces down:

    sudo python benchmarks/netns_hosts.py [--sizes 8,8192,1048576]

Under mpiexec, `--worker pingpong` is that ping-pong's rank code.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFIX_NS = "tpbench"
NAMESPACES = (f"{PREFIX_NS}{os.getpid()}-a", f"{PREFIX_NS}{os.getpid()}-b")  # this process's two hosts
ADDRESSES = ("10.99.0.1", "10.99.0.2")
IFACE = "tpveth0"
PREFIX = 24
# The environment each rank runs with: MPI over TCP on the veth only, one BLAS thread per rank.
MPI_ENV = {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": IFACE,
           "OPENBLAS_NUM_THREADS": "1"}

LAUNCH = """#!/bin/sh
# Hydra's ssh launcher calls this as: LAUNCH [ssh options] HOST COMMAND; run COMMAND in HOST's namespace
# on HOST's core.
while [ $# -gt 0 ]; do
  case "$1" in
{cases}
    *) shift ;;
  esac
done
echo "launch: no known host in the arguments" >&2
exit 1
"""
CASE = """    {address}) shift; exec taskset -c {cpu} ip netns exec {ns} sh -c "$*" ;;"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _stale_namespaces() -> list[str]:
    """tpbench<PID>-a/-b namespaces whose PID is not a running process (a run killed by SIGKILL)."""
    out = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"({PREFIX_NS}(\d+)-[ab])\b", line.strip())
        if m and not Path(f"/proc/{m[2]}").exists():
            out.append(m[1])
    return out


def _end_processes(ns: str) -> None:
    """SIGTERM the processes still in namespace ns (a job this run started there and left, e.g. on Ctrl-C):
    only ours are in it, the namespace being this run's own."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass


def _raise_exit(signum, frame):  # SIGTERM / SIGHUP: leave the `with` block (and so tear down) as Ctrl-C does
    raise SystemExit(128 + signum)


class TwoHosts:
    """Context manager: the two namespaces and the veth exist inside `with`, and are gone after it
    (also on an exception). `mpiexec(argv)` is the command that runs argv as 2 ranks, one per host."""

    def __init__(self, cpus: tuple[int, int] = (0, 1)):
        self.cpus = cpus
        self.tmp: Path | None = None
        self.ends = (f"tp{os.getpid()}a", f"tp{os.getpid()}b")  # the veth's ends before the move (<= 15 chars)
        self._signals: dict = {}

    def __enter__(self) -> "TwoHosts":
        if os.geteuid() != 0:
            raise SystemExit("error: two hosts in network namespaces need root (ip netns add); run as root")
        if not shutil.which("ip"):
            raise SystemExit("error: no `ip` command (iproute2) to make network namespaces")
        for ns in _stale_namespaces():  # what a killed run left
            _end_processes(ns)
            _ip("netns", "del", ns, check=False)
        self.teardown()
        atexit.register(self.teardown)
        self._signals = {}
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._signals[sig] = signal.signal(sig, _raise_exit)
            except ValueError:  # not the main thread: atexit and `with` still tear down
                pass
        try:
            for ns in NAMESPACES:
                _ip("netns", "add", ns)
            _ip("link", "add", self.ends[0], "type", "veth", "peer", "name", self.ends[1])
            for ns, end, address in zip(NAMESPACES, self.ends, ADDRESSES):
                _ip("link", "set", end, "netns", ns)
                _ip("-n", ns, "link", "set", end, "name", IFACE)
                _ip("-n", ns, "addr", "add", f"{address}/{PREFIX}", "dev", IFACE)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", IFACE, "up")
            self.tmp = Path(tempfile.mkdtemp(prefix="tpbench-"))
            launch = self.tmp / "launch.sh"
            launch.write_text(LAUNCH.format(cases="\n".join(
                CASE.format(address=a, cpu=c, ns=ns) for a, c, ns in zip(ADDRESSES, self.cpus, NAMESPACES))))
            launch.chmod(0o755)
            (self.tmp / "hosts").write_text("".join(a + "\n" for a in ADDRESSES))
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()
        for sig, handler in self._signals.items():
            signal.signal(sig, handler)
        self._signals = {}
        atexit.unregister(self.teardown)

    def teardown(self) -> None:
        for ns in NAMESPACES:  # deleting a namespace deletes the veth end in it, and so the pair
            if ns in _ip("netns", "list", check=False).stdout:
                _end_processes(ns)
                _ip("netns", "del", ns, check=False)
        if Path(f"/sys/class/net/{self.ends[0]}").exists():  # a pair made but not yet moved
            _ip("link", "del", self.ends[0], check=False)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def mpiexec(self, argv: list[str], env: dict | None = None) -> list[str]:
        """The command running argv as 2 ranks: rank 0 in tpbench-a on cpus[0], rank 1 in tpbench-b
        on cpus[1]. Run it with `environment(env)`."""
        assert self.tmp is not None
        mpiexec = shutil.which("mpiexec") or "mpiexec"
        return ["ip", "netns", "exec", NAMESPACES[0], "taskset", "-c", str(self.cpus[0]), mpiexec,
                "-launcher", "ssh", "-launcher-exec", str(self.tmp / "launch.sh"), "-iface", IFACE,
                "-f", str(self.tmp / "hosts"), "-n", "2", "-ppn", "1", *argv]

    @staticmethod
    def environment(base: dict | None = None) -> dict:
        return {**(base if base is not None else os.environ), **MPI_ENV}

    @staticmethod
    def traffic() -> dict[str, int]:
        """Bytes received by each namespace's veth end so far (/proc/net/dev inside it)."""
        out = {}
        for ns in NAMESPACES:
            text = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/dev"], capture_output=True,
                                  text=True).stdout
            for line in text.splitlines():
                if line.strip().startswith(IFACE + ":"):
                    out[ns] = int(line.split(":", 1)[1].split()[0])
        return out

    @staticmethod
    def connections() -> list[str]:
        """Established TCP connections in the first namespace (`ss -tn`), e.g. MPI's to 10.99.0.2."""
        if not shutil.which("ss"):
            return []
        text = subprocess.run(["ip", "netns", "exec", NAMESPACES[0], "ss", "-tnH", "state", "established"],
                              capture_output=True, text=True).stdout
        return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def ping_rtt(hosts: TwoHosts, count: int = 50, interval: float = 0.01) -> dict:
    """ICMP round trip across the veth (kernel to kernel, no MPI): `ping` from the first namespace to the
    second's address; min / avg / max / mdev in us (None where there is no `ping`)."""
    if not shutil.which("ping"):
        return {"rtt_us": None, "why": "no ping command"}
    proc = subprocess.run(["ip", "netns", "exec", NAMESPACES[0], "ping", "-q", "-c", str(count), "-i", str(interval),
                           ADDRESSES[1]], capture_output=True, text=True)
    m = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms", proc.stdout)
    if not m:
        return {"rtt_us": None, "why": (proc.stdout + proc.stderr)[-300:]}
    return {"count": count, **{k: 1e3 * float(v) for k, v in zip(("min_us", "avg_us", "max_us", "mdev_us"), m.groups())}}


def pingpong(hosts: TwoHosts, sizes: list[int], python: str = sys.executable, timeout: float = 120) -> dict:
    """One-way seconds per message size across the two hosts (rank 0 -> 1 -> 0, the median trip halved), the veth's
    received bytes over the run, and the fitted latency (smallest message) and bandwidth (largest)."""
    before = hosts.traffic()
    cmd = hosts.mpiexec([python, str(Path(__file__).resolve()), "--worker", "pingpong",
                         "--sizes", ",".join(map(str, sizes))])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=hosts.environment(), timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"ping-pong across the namespaces failed:\n{proc.stderr[-3000:]}")
    after = hosts.traffic()
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    seconds = {int(k): v for k, v in result["one_way_s"].items()}
    small, large = min(seconds), max(seconds)
    latency = seconds[small]
    gbs = (large - small) / (seconds[large] - seconds[small]) / 1e9 if seconds[large] > seconds[small] else None
    return {"one_way_s": seconds, "mean_one_way_s": {int(k): v for k, v in result["mean_one_way_s"].items()},
            "latency_us": latency * 1e6, "gbs": gbs,
            "namespaces": result["namespaces"], "veth_rx_bytes": {ns: after[ns] - before.get(ns, 0) for ns in after},
            "payload_bytes": result["payload_bytes"]}


def _pingpong_worker(sizes: list[int]) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
    namespaces = comm.gather(os.readlink("/proc/self/ns/net"), root=0)
    out, mean, payload = {}, {}, 0
    for size in sizes:
        buf = np.zeros(size, np.uint8)
        iters = max(20, min(2000, int(2e8 // max(size, 1) // 100)))
        for timed in (False, True):  # a warm-up pass, then the timed one
            comm.Barrier()
            trips = []
            for _ in range(iters if timed else max(5, iters // 10)):
                start = time.perf_counter()
                if rank == 0:
                    comm.Send(buf, dest=peer)
                    comm.Recv(buf, source=peer)
                else:
                    comm.Recv(buf, source=peer)
                    comm.Send(buf, dest=peer)
                trips.append(time.perf_counter() - start)
        # the median round trip, halved: a loaded machine's descheduled trips (a rank off its core for
        # milliseconds) are the machine's, not the link's; the mean is kept beside it
        out[size] = sorted(trips)[len(trips) // 2] / 2
        mean[size] = sum(trips) / len(trips) / 2
        payload += 2 * size * (iters + max(5, iters // 10))
    if rank == 0:
        print(json.dumps({"one_way_s": out, "mean_one_way_s": mean, "namespaces": namespaces,
                          "payload_bytes": payload}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8,8192,1048576", help="message sizes in bytes (default 8,8192,1048576)")
    parser.add_argument("--worker", choices=["pingpong"], default=None,
                        help="run as one rank of the ping-pong (started by mpiexec, not by hand)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker == "pingpong":
        _pingpong_worker(sizes)
        return 0
    with TwoHosts() as hosts:
        rtt = ping_rtt(hosts)
        print("ping round trip (us):", {k: round(v, 1) for k, v in rtt.items() if isinstance(v, float)})
        result = pingpong(hosts, sizes)
        for size, s in result["one_way_s"].items():
            print(f"{size:>9} B one way {s * 1e6:9.1f} us  {size / s / 1e9:7.3f} GB/s")
        print(f"latency {result['latency_us']:.1f} us, bandwidth {result['gbs']:.2f} GB/s; ranks in namespaces "
              f"{result['namespaces']}; veth bytes received {result['veth_rx_bytes']} for "
              f"{result['payload_bytes']} payload bytes")
        print("TCP connections in", NAMESPACES[0], ":", *hosts.connections(), sep="\n  ")
    print("namespaces removed:", not any(ns in _ip("netns", "list").stdout for ns in NAMESPACES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
