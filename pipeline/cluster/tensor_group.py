"""The communicators of --tensor-parallel T, and the group's sum.

Consecutive ranks form a stage's group: ranks [s*T, (s+1)*T) are stage s, the first of them its
leader. `split` makes one MPI sub-communicator per stage (its ranks in job order) and one of the
stage leaders (the ring runs over it; the other ranks get none).

`GroupSum` adds up the group members' partial outputs of a layer: each rank's float32 partial is
gathered to every rank (a non-blocking Iallgather polled under the --watchdog, as transport.py waits),
then every rank adds them in rank order in float32 with numpy, so that all members hold the same bits
and a given T gives the same bits whatever the batch or the number of stages. A library all-reduce
promises neither (MLX 0.32's ring all_sum rounds differently with the message's length).

`sum_channel` gives the in-graph sum (kernels/group_sum.py, which the runtime prefers) what it needs of
MPI: a communicator of the sums' own (a duplicate of the group's, so that no sum ever matches a
leader's command), its C handles, the library mpi4py loaded, and the watchdog's messages per member.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .transport import MpiTransport


@dataclass
class Communicators:
    size: int  # T
    stage: int
    member: int
    group: object  # MPI communicator of the stage's T ranks (member order)
    leaders: object | None  # MPI communicator of the stage leaders; None on the other members


def split(comm, size: int) -> Communicators:
    """Collective over `comm`: its ranks in stages of `size` consecutive ranks (size divides comm's)."""
    from mpi4py import MPI  # here, not at the top: after cli binds the launcher's MPI (mpi.use_the_launchers_mpi)

    rank = comm.Get_rank()
    stage, member = divmod(rank, size)
    group = comm.Split(stage, member)
    leaders = comm.Split(0 if member == 0 else MPI.UNDEFINED, rank)
    return Communicators(size, stage, member, group, None if leaders == MPI.COMM_NULL else leaders)


def sum_channel(link: MpiTransport) -> tuple[object, dict | str]:
    """Collective over the group: (a duplicate of its communicator, kept open by the caller, and what
    kernels/group_sum.py open_sum takes to sum over it, or why it cannot: a phrase)."""
    from mpi4py import MPI  # as in split

    comm = link.comm.Dup()
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return comm, "MPI was not initialized with MPI_THREAD_MULTIPLE"
    sizes = {MPI._sizeof(kind) for kind in (MPI.Comm, MPI.Datatype, MPI.Request)}
    if sizes not in ({4}, {8}):
        return comm, f"MPI handles of {sorted(sizes)} bytes"
    library = mpi_library()
    if not library:
        return comm, "the MPI library mpi4py loaded was not found in /proc/self/maps"
    members = range(link.size)
    return comm, dict(
        library=library, pointer_handles=sizes == {8}, comm=MPI._handleof(comm), byte_type=MPI._handleof(MPI.BYTE),
        member=link.rank, size=link.size, watchdog_s=link.watchdog_s,
        spin_s=GroupSum.SPIN_S if link.spin_s == link.OWN_CORE_SPIN_S else 0.0, yield_s=link.spin_s,
        silent_recv=[link.silence(m, sending=False) if m != link.rank else "" for m in members],
        silent_send=[link.silence(m, sending=True) if m != link.rank else "" for m in members],
        pids=[link.local_pids.get(m, 0) for m in members],
        gone=[link.gone(m) if m in link.local_pids else "" for m in members])


def mpi_library() -> str:
    """The path of the MPI library this process has loaded (libmpi.so.12: MPICH; libmpi.so.40: Open MPI;
    libmpi_abi.so: the MPI 5 ABI), or "" (no /proc, or none mapped)."""
    try:
        with open("/proc/self/maps") as f:
            fields = [line.split(None, 5) for line in f]
    except OSError:
        return ""
    paths = dict.fromkeys(parts[5].strip() for parts in fields if len(parts) == 6 and parts[5].startswith("/"))
    for path in paths:
        name = os.path.basename(path)
        if name.startswith(("libmpi.so", "libmpi_abi.so")):
            return path
    return ""


class GroupSum:
    """The callable a sharded layer hands its partial output to (models/tensor_parallel.py): returns
    the group's sum, the same bits on every member. Counts its calls and the seconds spent exchanging
    and adding (from the moment this rank's partial is computed: waiting for a slower member counts)."""

    SPIN_S = 0.002
    alike = False  # as kernels/group_sum.py InGraphSum's

    def __init__(self, link: MpiTransport):
        self.link = link  # an MpiTransport over the group's communicator: its polling wait and watchdog
        self.comm = link.comm
        self.size = self.comm.Get_size()
        self.peer = (self.comm.Get_rank() + 1) % self.size  # named if the exchange hangs
        # a member with a core of its own spins on the exchange (~14 us for 2 x 576 floats on one host, where
        # MPI's yielding or sleeping waits took 100-900 us); one sharing its core must let the others run
        self.spin_s = self.SPIN_S if link.spin_s == link.OWN_CORE_SPIN_S else 0.0
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, partial: mx.array) -> mx.array:
        dtype = partial.dtype
        mine = partial.astype(mx.float32) if dtype != mx.float32 else partial
        mx.eval(mine)
        start = time.perf_counter()
        mine = np.ascontiguousarray(mine)
        parts = np.empty((self.size, *mine.shape), dtype=np.float32)
        request = self.comm.Iallgather(mine, parts)
        until = time.perf_counter() + self.spin_s
        while not request.Test() and time.perf_counter() < until:
            pass  # the members finish the same layer within microseconds of each other: no yield, no sleep
        self.link.wait_for(request, self.peer, sending=False)  # then as the transport waits, under the watchdog
        total = parts[0].copy()
        for part in parts[1:]:  # rank order, float32: every member the same bits
            total += part
        out = mx.array(total)
        if dtype != mx.float32:
            out = out.astype(dtype)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out

    def from_first(self, array: mx.array) -> mx.array:
        """The group's first member's `array` (integers: a router's top-k choices) on every member: where the
        members are `alike` (kernels/group_sum.py), the member's own, which is the first member's."""
        if self.alike:
            return array
        mx.eval(array)
        mine = np.ascontiguousarray(array)
        request = self.comm.Ibcast(mine, root=0)
        until = time.perf_counter() + self.spin_s
        while not request.Test() and time.perf_counter() < until:
            pass
        self.link.wait_for(request, 0, sending=False)
        return mx.array(mine)
