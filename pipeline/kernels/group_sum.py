"""--tensor-parallel's group sum inside MLX's graph (group_sum_kernels.cpp, compiled into the kernels'
extension by build.py): `InGraphSum(partial)` returns the group's sum lazily, a node of the token's
graph that the CPU stream's worker evaluates by exchanging the members' float32 partials over MPI and
adding them in member order; `from_first` gives every member the first member's array (a router's
top-k choices). A token's graph, its 60 sums included (30 layers), is then evaluated once, where the
Python sum (cluster/tensor_group.py GroupSum) evaluated it in 60 pieces, each with a numpy round trip.

This module knows no MPI: the runtime (runtime/group_sums.py) hands it the library mpi4py loaded, the
C handles of a communicator of the sums' own, and the watchdog's messages. `PIPELINE_GROUP_SUM=0` turns
it off (the Python sum runs).

A choice that members compute from the same bits with the same code on the same kind of CPU is the same
choice: where every member's `computing_signature` is the same (the runtime compares them once), each
member keeps its own choices and `from_first` sends nothing (`alike`); where they differ (CPUs of other
instruction sets, another build, other threads or switches), the first member's are sent, as before.
`PIPELINE_OWN_CHOICES=0` always sends them.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys

import mlx.core as mx

from . import build
from ..util.switches import turned_off

ENV = "PIPELINE_GROUP_SUM"
OWN_CHOICES_ENV = "PIPELINE_OWN_CHOICES"
# the environment that chooses kernels, their paths or their threads: pipeline's switches of kernels, the BLAS's
# and OpenMP's variables (not the per-rank or secret ones: those would only tell alike members apart)
_SIGNED_SWITCHES = ("PIPELINE_ATTENTION", "PIPELINE_BLAS", "PIPELINE_BLAS_SHIM", "PIPELINE_LAYER_KERNELS",
                    "PIPELINE_QMM", OWN_CHOICES_ENV)
_SIGNED_PREFIXES = ("OPENBLAS_", "OMP_", "GOTO_", "MKL_", "BLIS_")


def computing_signature() -> str:
    """What decides the bits of a member's router and indexer choices beyond their inputs (which the group
    sums make the same on every member): the CPU (model and instruction set flags), the kernels' extension
    (its file's digest: sources, compiler and flags), MLX's and Python's versions, and the environment
    that picks kernels and threads, and the CPUs this process may run on (its threads). Members with the same
    signature compute the same choices."""
    state = build.load()
    kernels = state.why_not or ""
    if state.path:
        with open(state.path, "rb") as f:
            kernels = hashlib.sha256(f.read()).hexdigest()
    env = sorted(f"{k}={v}" for k, v in os.environ.items() if k in _SIGNED_SWITCHES or k.startswith(_SIGNED_PREFIXES))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return "\n".join([platform.machine(), build.cpu_signature(), kernels, mx.__version__, sys.version,
                      f"cpus={cpus}", *env])


class InGraphSum:
    """The group sum as runtime/tensor_group.py's Group holds it: called with a layer's partial output,
    `from_first` with a router's choices; `seconds` and `calls` as GroupSum counts them (the seconds
    from the moment this member's partial is computed until its sum is, waiting for the others included)."""

    in_graph = True
    alike = False  # every member computes the same choices (runtime/group_sums.py): from_first sends nothing

    def __init__(self, link):
        self.link = link  # the extension's PipelineGroupLink

    def __call__(self, partial: mx.array) -> mx.array:
        if partial.dtype == mx.float32:
            return self.link.sum(partial)
        return self.link.sum(partial.astype(mx.float32)).astype(partial.dtype)

    def from_first(self, array: mx.array) -> mx.array:
        return array if self.alike else self.link.first(array)

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
