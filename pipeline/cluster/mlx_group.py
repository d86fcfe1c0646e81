"""Setting up `mlx.core.distributed` inside an MPI job, for `--transport mlx`.

mpirun/mpiexec starts the ranks; MLX's own launcher (`mlx.launch`) is not used. What it would
have set per rank we derive from MPI, the control plane:

- ring (TCP, any machines): MLX_RANK is the MPI rank; unless MLX_HOSTFILE is already set, each
  rank picks a free port on its address, the addresses are all-gathered over MPI and written to
  a JSON hostfile ([["ip:port"], ...], one entry per rank). The address is 127.0.0.1 when every
  rank is on one host, else the IPv4 address of $PIPELINE_IFACE (e.g. bridge0, the Thunderbolt
  bridge; launch/run.py --iface sets it), else what the host name resolves to.
- jaccl (RDMA over Thunderbolt 5, macOS 26.2+): MLX_IBV_DEVICES names the device file (per rank,
  its RDMA device towards each peer), or PIPELINE_JACCL_DEVICES holds that list itself
  (launch/run.py --mlx-hostfile takes it from the hostfile `mlx.distributed_config --backend jaccl`
  writes); MLX_RANK is the MPI rank and, unless set,
  MLX_JACCL_COORDINATOR is rank 0's address with a free port, broadcast over MPI.

The files written here (a ring hostfile, a JACCL device file) are read by `mx.distributed.init`
only, so they are removed, and their variables unset, as soon as it returns.

MLX's own `mpi` backend is not offered: it calls MPI_Init itself, which fails (Open MPI: "attempted
to initialize MPI more than once") in a process where mpi4py already has.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile

import mlx.core as mx

from . import mpi
from ..util.errors import UserError


def resolve_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    if any(os.environ.get(k) for k in ("MLX_IBV_DEVICES", "JACCL_IBV_DEVICES", "PIPELINE_JACCL_DEVICES")):
        return "jaccl"
    return "ring"


def _write_file_for_init(variable: str, prefix: str, text: str, written: dict[str, str]) -> None:
    """A temporary file holding `text`, named in the environment variable MLX reads it from;
    noted in `written` so that it goes once init has read it."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.environ[variable] = path
    written[variable] = path


def _write_jaccl_devices(rank: int, written: dict[str, str]) -> None:
    """PIPELINE_JACCL_DEVICES (the device list itself, as launch/run.py --mlx-hostfile passes it)
    -> a file for MLX_IBV_DEVICES, which JACCL wants as a path on every host."""
    devices = os.environ.get("PIPELINE_JACCL_DEVICES")
    if not devices or os.environ.get("MLX_IBV_DEVICES") or os.environ.get("JACCL_IBV_DEVICES"):
        return
    _write_file_for_init("MLX_IBV_DEVICES", f"pipeline-jaccl-{rank}-", devices, written)


def _remove_files_for_init(written: dict[str, str]) -> None:
    for variable, path in written.items():
        os.environ.pop(variable, None)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def init_group(comm, requested: str):
    """Every rank: the mx.distributed group whose rank i is MPI rank i (None for one rank)."""
    if comm.Get_size() == 1:
        return None
    backend = comm.bcast(resolve_backend(requested), root=0)
    rank = comm.Get_rank()
    written: dict[str, str] = {}  # variable -> the temporary file it names, removed after init
    try:
        return _init_group(comm, backend, rank, written)
    finally:
        _remove_files_for_init(written)


def _init_group(comm, backend: str, rank: int, written: dict[str, str]):
    def check_here():
        if backend == "jaccl":
            _write_jaccl_devices(rank, written)
        if not mx.distributed.is_available(backend):
            raise UserError(f"--transport mlx: MLX's {backend} backend is not available on "
                            f"{socket.gethostname()} (mlx {mx.__version__})")
        if os.environ.get("MLX_RANK", str(rank)) != str(rank):
            raise UserError(f"MLX_RANK={os.environ['MLX_RANK']} but this is MPI rank {rank}: "
                            f"unset MLX_RANK, the MPI rank is used")
        if backend == "jaccl" and not (os.environ.get("MLX_IBV_DEVICES") or os.environ.get("JACCL_IBV_DEVICES")):
            raise UserError("--mlx-backend jaccl needs MLX_IBV_DEVICES: the device file written by "
                            "`mlx.distributed_config --backend jaccl` (see docs/thunderbolt.md)")

    mpi.checkpoint(comm, check_here)
    os.environ["MLX_RANK"] = str(rank)
    need_ring_hosts = backend == "ring" and not os.environ.get("MLX_HOSTFILE")
    need_coordinator = backend == "jaccl" and not (os.environ.get("MLX_JACCL_COORDINATOR")
                                                   or os.environ.get("JACCL_COORDINATOR"))
    if comm.allreduce(need_ring_hosts or need_coordinator, op=_lor()):
        address = mpi.checkpoint(comm, lambda: _my_address(comm))
        endpoints = comm.allgather(f"{address}:{_free_port(address)}")
        if need_ring_hosts:
            _write_file_for_init("MLX_HOSTFILE", f"pipeline-mlx-ring-{rank}-",
                                 json.dumps([[endpoint] for endpoint in endpoints]), written)
        if need_coordinator:
            os.environ["MLX_JACCL_COORDINATOR"] = endpoints[0]

    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except Exception as e:  # a peer may already be waiting inside init for us: end the job now
        raise mpi.AbortJob(f"rank {rank} on {socket.gethostname()}: MLX's {backend} backend did not "
                           f"start: {e}") from None
    if (group.rank(), group.size()) != (rank, comm.Get_size()):
        raise mpi.AbortJob(f"MLX's {backend} group has this process as rank {group.rank()} of "
                           f"{group.size()}, MPI as rank {rank} of {comm.Get_size()}: check MLX_HOSTFILE "
                           f"or the device file")
    return group


def _lor():
    from mpi4py import MPI  # here, not at the top: after cli binds the launcher's MPI (mpi.use_the_launchers_mpi)

    return MPI.LOR


def _my_address(comm) -> str:
    """The address this rank's peers reach it at (collective: every rank calls it)."""
    hostnames = comm.allgather(socket.gethostname())
    iface = os.environ.get("PIPELINE_IFACE")
    if iface:
        return interface_address(iface)
    if len(set(hostnames)) == 1:
        return "127.0.0.1"
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = "127.0.0.1"
    if address.startswith("127."):
        raise UserError(f"{socket.gethostname()} resolves to {address}: tell the ranks which network "
                        f"to use, e.g. launch/run.py --iface bridge0 (or set PIPELINE_IFACE, or MLX_HOSTFILE)")
    return address


def interface_address(name: str) -> str:
    """The IPv4 address of a network interface, e.g. bridge0 or en0."""
    try:
        import psutil  # optional: where it is missing, the ioctl (Linux) or ipconfig (macOS) below answers

        for addr in psutil.net_if_addrs().get(name, []):
            if addr.family == socket.AF_INET:
                return addr.address
    except ImportError:
        pass
    if sys.platform == "linux":
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                return socket.inet_ntoa(packed[20:24])
            except OSError:
                pass
    else:
        out = subprocess.run(["ipconfig", "getifaddr", name], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    raise UserError(f"network interface {name} has no IPv4 address on {socket.gethostname()} "
                    f"(PIPELINE_IFACE / --iface)")


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]
