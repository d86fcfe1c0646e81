"""--tensor-parallel's group sum inside MLX's graph (group_sum_kernels.cpp, compiled into the kernels'
extension by build.py): `InGraphSum(partial)` returns the group's sum lazily, a node of the token's
graph that the CPU stream's worker evaluates by exchanging the members' float32 partials over MPI and
adding them in member order; `from_first` gives every member the first member's array (a router's
top-k choices). A token's graph, its 60 sums included (30 layers), is then evaluated once, where the
Python sum (cluster/tensor_group.py GroupSum) evaluated it in 60 pieces, each with a numpy round trip.

This module knows no MPI: the runtime (runtime/group_sums.py) hands it the library mpi4py loaded, the
C handles of a communicator of the sums' own, and the watchdog's messages. `PIPELINE_GROUP_SUM=0` turns
it off (the Python sum runs).
"""

from __future__ import annotations

import mlx.core as mx

from . import build
from ..util.switches import turned_off

ENV = "PIPELINE_GROUP_SUM"


class InGraphSum:
    """The group sum as runtime/tensor_group.py's Group holds it: called with a layer's partial output,
    `from_first` with a router's choices; `seconds` and `calls` as GroupSum counts them (the seconds
    from the moment this member's partial is computed until its sum is, waiting for the others included)."""

    in_graph = True

    def __init__(self, link):
        self.link = link  # the extension's PipelineGroupLink

    def __call__(self, partial: mx.array) -> mx.array:
        if partial.dtype == mx.float32:
            return self.link.sum(partial)
        return self.link.sum(partial.astype(mx.float32)).astype(partial.dtype)

    def from_first(self, array: mx.array) -> mx.array:
        return self.link.first(array)

    @property
    def seconds(self) -> float:
        return self.link.seconds

    @property
    def calls(self) -> int:
        return self.link.calls

    def reset(self) -> None:
        self.link.reset()


def open_sum(library: str, pointer_handles: bool, comm: int, byte_type: int, member: int, size: int,
             watchdog_s: float, spin_s: float, yield_s: float, silent_recv: list[str], silent_send: list[str],
             pids: list[int], gone: list[str]) -> InGraphSum | str:
    """The in-graph sum over a communicator given by its C handle, or why not (a phrase). library: the
    MPI library mpi4py loaded (its path); pointer_handles: Open MPI's (pointers) rather than MPICH's
    (ints). The messages and pids are per member: what the watchdog prints when that member is silent
    (receiving from it, sending to it) or its process (pid > 0: on this host) has ended."""
    if turned_off(ENV):
        return f"{ENV}=0"
    state = build.load()
    if state.module is None:
        return f"no kernels' extension ({state.why_not})"
    if not hasattr(state.module, "PipelineGroupLink"):
        return "the kernels' extension has no group sum"
    try:
        link = state.module.PipelineGroupLink(library, pointer_handles, comm, byte_type, member, size, watchdog_s,
                                              spin_s, yield_s, silent_recv, silent_send, pids, gone)
    except (RuntimeError, ValueError) as e:
        return str(e)
    return InGraphSum(link)
