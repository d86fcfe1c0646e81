"""Layouts of a cluster's ranks (issue 34): S stages of T ranks each (ranks = S x T; T = 1 is today's
pipeline, S = 1 pure tensor parallelism), what each rank holds and how fast each layout decodes,
predicted with the fitted terms of cluster_costs.py.

Under T, each rank of a stage holds (and reads per token) its share of the stage's layers
(`param_share`): query heads split as evenly as the head count allows (the busiest rank holds
ceil(H / T) of H), with the up-projections and the output projection by those heads; GQA key/value
heads split where T divides their count, else held whole on every rank (SmolLM2: 3 KV heads);
dense MLPs and shared experts split by their intermediate features; every routed expert sliced
across the group (as exo does: always balanced); the LM head split by vocabulary. Held whole on every
rank of the group: MLA's latent projections (q_a, kv_a and their norms) and its latent KV cache,
DeepSeek V4's shared key/value head and its compressors, the lightning indexers, the MoE routers,
every norm, the embedding (on the first stage, as today). The stage's layers are split among stages
in proportion to each group's smallest host (a stage of T ranks holds T x that host's memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..util.errors import UserError
from .cluster_costs import SUMS_PER_LAYER, HostTerms, LinkTerms
from .memory import GIB, RankBytes, live_points, rank_bytes
from .partition import layer_counts, layer_ranges
from .shapes import Architecture, Param, qwen3_5_layer_types
from .speed import DecodeTiming
from .weights_bytes import ModelBytes, Precision

# Held whole by every rank of a group, wherever they appear in a layer.
REPLICATED = (".indexer.", ".compressor.", "_hc.", "hc_head.", ".q_a_proj.", ".kv_a_proj_with_mqa.",
              "self_attn.kv_proj.", ".mlp.gate.", "shared_expert_gate.", "e_score_correction_bias")
SPLIT_BY_HEADS = (".q_proj.", ".q_b_proj.", ".kv_b_proj.", ".o_proj.", ".o_a_proj.", ".o_b_proj.", ".sinks")
MLP_PROJECTIONS = (".gate_proj.", ".up_proj.", ".down_proj.")
LINEAR_ATTENTION = (".in_proj_qkv.", ".in_proj_z.", ".in_proj_b.", ".in_proj_a.", ".conv1d.", ".dt_bias",
                    ".A_log", ".out_proj.")
GQA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "minimax_m2")


def check_tensor_parallel(t: int, hosts: int) -> None:
    if t < 1 or hosts % t:
        raise UserError(f"--tensor-parallel {t} must divide the {hosts} hosts (ranks = stages x T), "
                        f"e.g. {', '.join(str(d) for d in range(1, hosts + 1) if hosts % d == 0)}")


def _busiest(count: int, t: int) -> float:
    """The busiest rank's fraction of `count` units split as evenly as they go over t ranks."""
    return math.ceil(count / t) / count


def kv_heads_share(arch: Architecture, t: int) -> float:
    """A GQA rank's fraction of the key/value heads: 1/T where T divides them, else all (replicated)."""
    kv = arch.config.num_key_value_heads
    return 1 / t if kv % t == 0 else 1.0


def param_share(arch: Architecture, p: Param, t: int) -> float:
    """The fraction of tensor p that the busiest rank of a group of t ranks holds and reads."""
    if t == 1 or p.is_embedding:
        return 1.0
    name = p.name
    if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1] or any(m in name for m in REPLICATED):
        return 1.0
    if name.startswith("lm_head."):
        return _busiest(p.shape[0], t)
    if any(m in name for m in (".k_proj.", ".v_proj.")):
        return kv_heads_share(arch, t)
    if any(m in name for m in SPLIT_BY_HEADS):
        return _busiest(arch.config.num_attention_heads, t)
    if any(m in name for m in MLP_PROJECTIONS):
        features = p.shape[1] if ".down_proj." in name else p.shape[0]
        return _busiest(features, t)
    if ".linear_attn." in name and any(m in name for m in LINEAR_ATTENTION):
        return _busiest(int(arch.config.raw["linear_num_value_heads"]), t)
    return 1.0  # anything else (MiniMax's all-head QK norms, V4's hyper-connections) held whole


def kv_share(arch: Architecture, layer: int, t: int) -> float:
    """A rank's fraction of layer `layer`'s KV cache: MLA's latent (and V4's, GLM's) is whole on every rank."""
    if t == 1:
        return 1.0
    if arch.name in ("qwen3_5_moe", "qwen3_5_moe_text"):
        if qwen3_5_layer_types(arch.config)[layer] == "linear_attention":
            return _busiest(int(arch.config.raw["linear_num_value_heads"]), t)
        return kv_heads_share(arch, t)
    return kv_heads_share(arch, t) if arch.name in GQA_TYPES else 1.0


def shared_model_bytes(arch: Architecture, precision: Precision, t: int) -> ModelBytes:
    """ModelBytes of the busiest rank of a group of t: each tensor's resident bytes times its share."""
    b = precision.resident_bytes
    layers, fixed, expert_bytes, experts, active = [], [], [], [], []
    for params in arch.layers:
        layers.append(sum(b(p) * param_share(arch, p, t) for p in params))
        fixed.append(sum(b(p) * param_share(arch, p, t) for p in params if not p.experts))
        routed = [p for p in params if p.experts]
        expert_bytes.append(sum(b(p) // p.copies * param_share(arch, p, t) for p in routed))
        experts.append(routed[0].experts if routed else 0)
        active.append(0)
    ends = sum(b(p) * param_share(arch, p, t) for p in arch.ends)
    embedding = next(p for p in arch.ends if p.is_embedding)
    tied = arch.config.tie_word_embeddings
    head = sum(b(p) * param_share(arch, p, t) for p in arch.ends if not p.is_embedding)
    head_read = head + (b(embedding) * _busiest(embedding.shape[0], t) if tied else b(embedding) / embedding.shape[0])
    return ModelBytes([round(x) for x in layers], round(ends), [round(x) for x in fixed],
                      [round(x) for x in expert_bytes], experts, round(head_read), active, 0)


@dataclass
class Layout:
    stages: int
    tensor_parallel: int
    counts: list[int]  # layers per stage
    ranks: list[RankBytes]  # per stage: what each of its ranks holds (the busiest)
    stage_memory_gib: list[float] | None  # per stage: its group's smallest host (x T for the stage)
    single_tps: float
    batch_tps: float
    batch: int
    sums_ms: float  # per token, single stream: time in group sums
    speculative: list[tuple[int, float]] | None = None  # (drafts, tok/s) with --draft-acceptance

    @property
    def name(self) -> str:
        if self.stages == 1 and self.tensor_parallel > 1:
            return f"tensor 1 x {self.tensor_parallel}"
        if self.tensor_parallel == 1:
            return f"pipeline {self.stages} x 1"
        return f"hybrid {self.stages} x {self.tensor_parallel}"

    @property
    def fits(self) -> bool | None:
        if self.stage_memory_gib is None:
            return None
        return all(r.total <= m * GIB for r, m in zip(self.ranks, self.stage_memory_gib))


class _LayoutTiming(DecodeTiming):
    """Seconds per decode step of a layout, with the fitted host and link terms."""

    def __init__(self, arch: Architecture, precision: Precision, mb: ModelBytes, ranges, bandwidth, t: int,
                 host: HostTerms, link: LinkTerms, context: int):
        self.arch, self.mb, self.ranges, self.t, self.host, self.link = arch, mb, ranges, t, host, link
        self.bandwidth = bandwidth  # per stage: its group's slowest host, GB/s
        self.kv_read = [arch.kv_read_bytes(i, context, precision.dtype_bytes) * kv_share(arch, i, t)
                        for i in range(len(arch.layers))]
        self.hop_bytes = (arch.hidden_values or arch.config.hidden_size) * precision.dtype_bytes

    def sums(self, s: int) -> int:
        start, end = self.ranges[s]
        return SUMS_PER_LAYER * (end - start) + (1 if s == 0 else 0)  # + the LM head's vocabulary split

    def sum_seconds(self, s: int, m: int) -> float:
        start, end = self.ranges[s]
        layers = self.link.group_sum_seconds(self.host, self.t, m * self.arch.config.hidden_size)
        head = self.link.group_sum_seconds(self.host, self.t, 2 * m) if s == 0 else 0.0  # (argmax, value) per token
        return SUMS_PER_LAYER * (end - start) * layers + head

    def stage(self, s: int, m: int, sequences: int | None = None) -> float:
        read = self.bytes_read(s, m, m if sequences is None else sequences)
        return read / (self.bandwidth[s] * self.host.bandwidth_fraction * 1e9) + self.sum_seconds(s, m)

    def hop(self, m: int) -> float:
        return self.link.hop_seconds(self.host, m * self.hop_bytes)

def plan_layout(arch: Architecture, precision: Precision, t: int, bandwidth_gbs: list[float],
                memory_gib: list[float] | None, host: HostTerms, link: LinkTerms, context: int, batch: int = 16,
                draft_tokens: list[int] = (), draft_acceptance: float = 0.0, prefix_cache_gb: float = 0.0) -> Layout:
    """One layout of len(bandwidth_gbs) hosts as stages of t consecutive ranks; KV cache counted for
    `batch` sequences of `context` tokens. prefix_cache_gb (--prefix-cache-gb, per rank, as plan's main fit
    counts it): the budget in each rank's memory, and each live sequence's resume points in its KV cache
    (Qwen3.5's linear states at up to memory.POINTS_MAX prompt chunks' ends, split as the states are)."""
    hosts = len(bandwidth_gbs)
    check_tensor_parallel(t, hosts)
    stages = hosts // t
    groups = [range(s * t, (s + 1) * t) for s in range(stages)]
    group_memory = [min(memory_gib[h] for h in g) for g in groups] if memory_gib else None
    mb = shared_model_bytes(arch, precision, t)
    counts = layer_counts(mb, stages, group_memory)
    ranges = layer_ranges(counts)
    points = live_points(prefix_cache_gb)
    kv = [round((arch.kv_bytes(i, i + 1, context, precision.dtype_bytes)
                 + points * arch.linear_state_bytes(i, i + 1, precision.dtype_bytes)) * batch * kv_share(arch, i, t))
          for i in range(len(arch.layers))]
    ranks = [rank_bytes(mb.layers, mb.ends, kv, span, s, stages, prefix_cache=round(prefix_cache_gb * 1e9))
             for s, span in enumerate(ranges)]
    timing = _LayoutTiming(arch, precision, mb, ranges, [min(bandwidth_gbs[h] for h in g) for g in groups], t,
                           host, link, context)
    sums_ms = 1e3 * sum(timing.sum_seconds(s, 1) for s in range(stages))
    layout = Layout(stages, t, counts, ranks, group_memory, timing.single_stream(), timing.batch(batch), batch,
                    sums_ms)
    if draft_tokens:
        layout.speculative = [(k, timing.speculative(k, draft_acceptance)) for k in draft_tokens]
    return layout


def plan_layouts(arch: Architecture, precision: Precision, bandwidth_gbs: list[float],
                 memory_gib: list[float] | None, host: HostTerms, link: LinkTerms, context: int, batch: int = 16,
                 draft_tokens: list[int] = (), draft_acceptance: float = 0.0,
                 prefix_cache_gb: float = 0.0) -> list[Layout]:
    """Every layout of the hosts: T from 1 (pipeline) to the host count (pure tensor), T dividing it,
    where each stage has at least one layer."""
    hosts = len(bandwidth_gbs)
    return [plan_layout(arch, precision, t, bandwidth_gbs, memory_gib, host, link, context, batch,
                        draft_tokens, draft_acceptance, prefix_cache_gb)
            for t in range(1, hosts + 1) if hosts % t == 0 and hosts // t <= len(arch.layers)]
