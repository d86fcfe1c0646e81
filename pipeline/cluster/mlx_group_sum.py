"""--tensor-parallel over MLX's distributed group (`--transport mlx`): the group's sum, the router's
choice from the first member, and the link the leader's commands and the head's slices travel by.

MLX 0.32 cannot split a ring or JACCL group ("Group split not supported"), so MLX's group is the job's
whole: only pure tensor parallelism (T = ranks) runs over it (runtime/tensor_group.py refuses a hybrid).

What travels where. mpiexec started the job and MPI stays its control plane, as for MLX's transport
(transport.py MlxTransport): a leader's command headers and layouts go by MPI, since a mate waits for
the next one without a watchdog, maybe for hours (a server), and MPI's wait sleeps where MLX's receive
busy-polls a core and cannot time out. The bulk goes by MLX: each group sum, the router's choices, a
command's hidden states and the head's slices of logits. The ring backend carries sends and receives
between neighbours only: a payload to or from a member that is not one (T >= 4 on the ring) goes by
MPI instead; the sums, gathers, reach every member on any backend.

The sum is ours, as GroupSum's over MPI (cluster/tensor_group.py): each member's float32 partial is
gathered to every member (`mx.distributed.all_gather`: bytes copied, not added), then every member adds
the parts in member order in float32, so that all members hold the same bits, the bits an MPI group sum
gives, whatever the batch. MLX's `all_sum` promises neither (its ring rounds differently with the
message's length). A sum evaluates the layer's partial first, then gathers and adds under the watchdog's
deadline (MLX's waits block and cannot time out): a member that stops answering ends the job naming it;
one whose process has ended closes its sockets, and MLX's error ends the job.

Ranks that job.share_cores bound to a core each are unbound once MLX's group is up (`unbind`): MLX's ring
ran at half the speed with them bound (docs/tensor-parallel.md).
"""

from __future__ import annotations

import os
import socket
import time

import mlx.core as mx

from .transport import MlxTransport
from ..util import cores


EVERY_MEMBER = -1  # a wait on the whole group (a gather), not on one peer


class MlxGroupLink(MlxTransport):
    """The group's link under `--transport mlx`: MpiTransport's buffers (headers, layouts) and
    MlxTransport's payloads, the latter by MPI where the ring cannot reach the peer directly."""

    def __init__(self, comm, group, backend: str, watchdog_s: float = 0.0, hosts: list[str] | None = None,
                 own_core: bool = False, processes: list[tuple[str, str, int]] | None = None):
        super().__init__(comm, group, watchdog_s, hosts, own_core, processes)
        self.backend = backend

    def direct(self, peer: int) -> bool:
        """Whether MLX's send and receive reach `peer` (the ring's: its neighbours only)."""
        return self.backend != "ring" or (peer - self.rank) % self.size in (1, self.size - 1)

    def silence(self, peer: int, sending: bool = False) -> str:
        """The watchdog's line; `peer` EVERY_MEMBER: a gather, in which any member may be the silent one."""
        if peer != EVERY_MEMBER:
            return super().silence(peer, sending)
        who = f"rank {self.rank}" + (f" ({self.hosts[self.rank]})" if self.hosts else "")
        return (f"{who} waited {self.watchdog_s:g} s (--watchdog {self.watchdog_s:g}) in a group sum over MLX with "
                f"ranks 0-{self.size - 1}: one of them is hung or its link is down; aborting the job")

    def send_hidden(self, hidden: mx.array, dest: int) -> None:
        if self.direct(dest):
            super().send_hidden(hidden, dest)
        else:
            super(MlxTransport, self).send_hidden(hidden, dest)  # MpiTransport's: by MPI

    def recv_hidden(self, shape: tuple[int, ...], dtype: mx.Dtype, source: int) -> mx.array:
        if self.direct(source):
            return super().recv_hidden(shape, dtype, source)
        return super(MlxTransport, self).recv_hidden(shape, dtype, source)


class MlxGroupSum:
    """The group sum over MLX's group, as runtime/tensor_group.py's Group holds it (GroupSum's calls):
    called with a layer's partial output, `from_first` with a router's choices; `seconds` and `calls`
    counted from the moment this member's partial is computed (waiting for the others included)."""

    in_graph = False

    def __init__(self, link: MlxGroupLink):
        self.link = link
        self.group = link.group
        self.size = link.size
        # named if a gather hangs: the other member of two; of more, any of them may be the silent one
        self.peer = 1 - link.rank if self.size == 2 else EVERY_MEMBER
        self.seconds = 0.0
        self.calls = 0

    def gather(self, array: mx.array) -> mx.array:
        """Every member's `array` (evaluated), [members, elements], in member order."""
        return mx.distributed.all_gather(array.reshape(1, -1), group=self.group, stream=mx.cpu)

    def __call__(self, partial: mx.array) -> mx.array:
        dtype = partial.dtype
        mine = partial.astype(mx.float32) if dtype != mx.float32 else partial
        mx.eval(mine)
        start = time.perf_counter()
        parts = self.gather(mine)
        total = parts[0]
        for m in range(1, self.size):  # member order, float32: every member the same bits
            total = total + parts[m]
        with self.link.watched(self.peer):
            mx.eval(total)
        out = total.reshape(partial.shape)
        if dtype != mx.float32:
            out = out.astype(dtype)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out

    def from_first(self, array: mx.array) -> mx.array:
        """The group's first member's `array` (integers: a router's top-k choices) on every member."""
        mx.eval(array)
        first = self.gather(array)[0]
        with self.link.watched(self.peer):
            mx.eval(first)
        return first.reshape(array.shape)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def open_mlx_group(comm, backend: str, watchdog_s: float, hosts: list[str], own_core: bool,
                   processes: list[tuple[str, str, int]]) -> tuple[MlxGroupLink, MlxGroupSum]:
    """Collective over `comm` (the job's every rank: MLX's group cannot be split): MLX's group over
    it, the link and the sum."""
    from .mlx_group import init_group, resolve_backend  # MLX's distributed group, set up from MPI

    backend = comm.bcast(resolve_backend(backend), root=0)
    placement = comm.allgather((socket.gethostname(), cores.cpus_allowed()))
    link = MlxGroupLink(comm, init_group(comm, backend), backend, watchdog_s, hosts, own_core, processes)
    link.unbound = unbind(placement, comm.Get_rank())
    return link, MlxGroupSum(link)


def unbind(placement: list[tuple[str, frozenset[int]]], rank: int) -> bool:
    """Where this host's ranks are bound to a core each (job.share_cores), every thread of this one may
    run on all their CPUs again, SCHED_OTHER: MLX's ring over a loaded 2-core host decoded the default
    model at T = 2 2.4-4.4 tok/s bound vs 5.1-8.8 unbound (PIPELINE_BIND=0) in 4 of 4 pairs, where
    unbinding only the threads MLX's init starts did not help. Returns whether it did. placement: (host,
    CPUs allowed) of every rank of the group."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    host = placement[rank][0]
    cpus = frozenset().union(*(allowed for name, allowed in placement if name == host))
    if cpus == placement[rank][1]:
        return False
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:  # a thread that ended meanwhile: leave it
            pass
    return True
