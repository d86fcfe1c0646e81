"""--tensor-parallel T --expert-parallel: a Qwen3-MoE layer's routed experts divided among the stage's group
(expert parallelism) rather than every expert sliced by its intermediate features (tensor_parallel.py's
ShardedMoeBlock, the default).

Member m of a group of T holds whole experts [e0, e1) = even_split(E, T, m): contiguous, the first E % T
members one more (64 experts over 3: 22, 21, 21). The router runs whole on every member and its top-k
choices are the group's first member's (`group_choice`, as with slicing). Each member computes, for every
token, its own chosen experts' outputs times their routing weights; the experts it does not hold weigh 0.
The group's one sum after the MoE (rank-ordered float32) adds the members' partials: for a given T the
bits are the same run after run, but they differ from slicing's (each expert's output is whole on one
member, where slicing adds T partial products of it).

Only a member's own (token, expert) pairs are computed: the choices are evaluated at each MoE layer (one
cut of the token's graph a layer, where the in-graph sums otherwise let a token evaluate at once), the pairs
this member holds picked out, run through its experts, and put back at their places among the token's k
(the others zero), then summed over k in the same order as the whole layer sums them. (Keeping the graph
whole by running a choice held elsewhere as one of the token's own at weight 0 reads no more weights, but
the gathered products cost per row: measured 5.7 tok/s against slicing's 7.0 on the MoE benchmark.)
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .layers import summed
from .qwen3_moe import SparseMoeBlock


def expert_share(experts: int, size: int, member: int) -> tuple[int, int]:
    """[begin, end) of the whole experts member `member` of `size` holds: contiguous, the first experts % size
    members one more (tensor_parallel.even_split's rule)."""
    base, extra = divmod(experts, size)
    begin = member * base + min(member, extra)
    return begin, begin + base + (member < extra)


def own_pairs(indices: np.ndarray, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat positions among the [tokens, k] choices, local expert indices) of the choices `indices` that a
    member holding experts [begin, end) runs, in token then k order."""
    flat = indices.reshape(-1).astype(np.int64)
    positions = np.flatnonzero((flat >= begin) & (flat < end))
    return positions, flat[positions] - begin


class ExpertParallelMoeBlock(SparseMoeBlock):
    """Qwen3-MoE's routed experts on one member under expert parallelism: `switch_mlp` holds experts
    [expert_begin, expert_end) whole; the router whole, its top-k choices the group's first member's; the
    weighted sum over the k choices (those held elsewhere weigh 0) is this member's partial output."""

    group_sum = None  # as Attention's
    group_choice = None  # the runtime's: the group's first member's array, on every member
    expert_begin, expert_end = 0, 0  # set by tensor_parallel.shard_modules

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.reshape(-1, x.shape[-1])
        indices, weights = self.route(tokens, self.group_choice)
        mx.eval(indices)  # the pairs this member runs: a shape known only now
        positions, local = own_pairs(np.array(indices), self.expert_begin, self.expert_end)
        k = indices.shape[-1]
        routed = mx.zeros((tokens.shape[0] * k, tokens.shape[-1]), tokens.dtype)
        if positions.size:
            rows = mx.array(positions // k)
            own = self.switch_mlp(tokens[rows], mx.array(local[:, None], mx.uint32))[:, 0]  # [pairs, hidden]
            routed[mx.array(positions)] = own
        routed = routed.reshape(tokens.shape[0], k, -1)
        out = (routed * weights[..., None].astype(routed.dtype)).sum(axis=1)
        return summed(self, out).reshape(x.shape)
