"""Which group sum a --tensor-parallel group runs: the in-graph one (kernels/group_sum.py: a node of
MLX's graph, a token evaluated at once) where every member of the group can run it, else the Python one
(cluster/tensor_group.py GroupSum), with a warning saying why. The members must agree: an in-graph sum
on one member and a Python one on another would never meet. So must their choices: every member keeps
its own router's and indexer's choices (`alike`, no exchange) or every member takes the first member's."""

from __future__ import annotations

import sys

from ..cluster.tensor_group import GroupSum, sum_channel
from ..cluster.transport import MpiTransport
from ..kernels import group_sum
from ..util.switches import turned_off


def make_group_sum(link: MpiTransport):
    """Collective over the group (`link`'s communicator, under the watchdog): its sum."""
    comm, spec = sum_channel(link)
    chosen = spec if isinstance(spec, str) else group_sum.open_sum(**spec)
    whys = link.comm.allgather(chosen if isinstance(chosen, str) else "")
    alike = members_alike(link)
    if not any(whys):
        chosen.comm = comm  # the sums' communicator stays open as long as they run
        chosen.alike = alike
        return chosen
    if link.rank == 0 and not all(why == f"{group_sum.ENV}=0" for why in whys if why):
        why = next(f"member {m}: {why}" for m, why in enumerate(whys) if why)
        print(f"warning: --tensor-parallel's group sums run in Python, each cutting the token's graph "
              f"(slower): {why}", file=sys.stderr, flush=True)
    python_sum = GroupSum(link)
    python_sum.alike = alike
    return python_sum


def members_alike(link: MpiTransport) -> bool:
    """Collective: whether the group's members compute the same choices from the same inputs (the same
    kernels/group_sum.py computing_signature on all, PIPELINE_OWN_CHOICES not 0), so that each keeps its own
    instead of waiting for the first member's: one exchange less per MoE layer and token."""
    own = "" if turned_off(group_sum.OWN_CHOICES_ENV) else group_sum.computing_signature()
    signatures = link.comm.allgather(own)
    return bool(signatures[0]) and len(set(signatures)) == 1
