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

No data-dependent shapes (the token's graph, group sums included, is still evaluated at once): a chosen
expert held elsewhere is replaced by one of the token's own chosen experts (the first; expert e0 where it
chose none of this member's) at weight 0. The gathered products group a token's rows by expert, so a
member reads only the matrices of the experts it holds and was chosen for (at least one per token), and
multiplies k rows through them where it would need only its own: in decode (one token, reading weights
dominates) nearly the cost of its own experts; in a long prefill each member still multiplies all k rows
a token (no saving of arithmetic there, only of weights read).
"""

from __future__ import annotations

import mlx.core as mx

from .layers import summed
from .qwen3_moe import SparseMoeBlock


def expert_share(experts: int, size: int, member: int) -> tuple[int, int]:
    """[begin, end) of the whole experts member `member` of `size` holds: contiguous, the first experts % size
    members one more (tensor_parallel.even_split's rule)."""
    base, extra = divmod(experts, size)
    begin = member * base + min(member, extra)
    return begin, begin + base + (member < extra)


def own_choices(indices: mx.array, weights: mx.array, begin: int, end: int) -> tuple[mx.array, mx.array]:
    """(local expert indices, weights) of a member holding experts [begin, end) for the group's top-k choices
    `indices` [tokens, k] and their weights: a choice held elsewhere becomes the token's first own choice
    (local 0 where it has none) at weight 0, so the gathered product reads no expert this member lacks."""
    local = indices.astype(mx.int32) - begin
    mine = (local >= 0) & (local < end - begin)
    first = mx.argmax(mine.astype(mx.int32), axis=-1, keepdims=True)  # the first own choice (0 where none)
    fallback = mx.where(mx.take_along_axis(mine, first, axis=-1), mx.take_along_axis(local, first, axis=-1), 0)
    return mx.where(mine, local, fallback), mx.where(mine, weights, mx.zeros_like(weights))


class ExpertParallelMoeBlock(SparseMoeBlock):
    """Qwen3-MoE's routed experts on one member under expert parallelism: `switch_mlp` holds experts
    [expert_begin, expert_end) whole; the router whole, its top-k choices the group's first member's; the
    weighted sum over the k choices (those held elsewhere weigh 0) is this member's partial output."""

    group_sum = None  # as Attention's
    group_choice = None  # the runtime's: the group's first member's array, on every member
    expert_begin, expert_end = 0, 0  # set by tensor_parallel.shard_modules

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.reshape(-1, x.shape[-1])
        probs = mx.softmax(self.gate(tokens).astype(mx.float32), axis=-1)
        indices = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        if self.group_choice is not None:
            indices = self.group_choice(indices)
        weights = mx.take_along_axis(probs, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        local, weights = own_choices(indices, weights, self.expert_begin, self.expert_end)
        routed = self.switch_mlp(tokens, local)  # [tokens, k, hidden]
        out = (routed * weights[..., None].astype(routed.dtype)).sum(axis=1)
        return summed(self, out).reshape(x.shape)
