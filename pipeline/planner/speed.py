"""The cluster speed model of `pipeline plan`: each rank's layers, bytes and fit, and decode tok/s
predicted by a stated roofline.

Decode roofline (`plan_cluster`): decoding is memory-bound, so a stage's time for a step is the bytes
it reads divided by its host's memory bandwidth: its non-expert weights (always), for MoE layers
the distinct experts its tokens chose (m tokens choosing k of E experts uniformly and
independently touch E*(1-(1-k/E)^m) experts), and each sequence's KV cache at the full context.
Each hop moves m hidden states (m*hidden*dtype bytes) over a link of --link-gbs plus
--link-latency-us. One stream visits the stages in turn: tok/s = 1 / (sum of stage times + hops).
A batch of B sequences decoded as k = min(B, stages) micro-batches keeps the stages busy at once:
tok/s = B / max(one micro-batch's round trip, k * the slowest stage or link).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ..models.config import ModelConfig
from ..util.errors import UserError
from .memory import GIB, RankBytes, kv_layer_bytes, live_points, rank_bytes
from .partition import layer_counts, layer_ranges
from .shapes import Architecture, Counts, architecture, count_params
from .weights_bytes import ModelBytes, Precision, model_bytes


@dataclass
class Hardware:
    memory_gib: list[float] | None  # None: unknown, fit not checked
    bandwidth_gbs: list[float]
    link_gbs: float = 5.0
    link_latency_us: float = 100.0
    tflops: list[float] | None = None
    reserve_gib: float = 0.0
    prefix_cache_gb: float = 0.0  # serve's --prefix-cache-gb: each rank's prefix cache holds up to this


@dataclass
class RankPlan:
    rank: int
    start: int
    end: int
    bytes: RankBytes  # weights as held + KV cache (memory.py: the same count preflight and the stats line use)
    memory_gib: float | None
    reserve_gib: float = 0.0

    @property
    def weight_bytes(self) -> int:
        return self.bytes.weights

    @property
    def kv_bytes(self) -> int:
        return self.bytes.kv_cache

    @property
    def needed(self) -> int:
        return self.bytes.total

    @property
    def headroom(self) -> float | None:
        return None if self.memory_gib is None else self.memory_gib * GIB - self.needed

    @property
    def fits(self) -> bool | None:
        return None if self.memory_gib is None else self.headroom >= self.reserve_gib * GIB


class SpeculativeSpeed(NamedTuple):
    """Predicted single-stream speculative decoding: `drafts` tokens drafted per trip by `drafter`
    ("ngram": prompt lookup, free; "mtp": the model's MTP module on rank 0)."""
    drafts: int
    drafter: str
    tps: float


class EvenSplit(NamedTuple):
    """An even layer split that also fits, and its batch tok/s (higher than the memory-proportional one's)."""
    counts: list[int]
    batch_tps: float


@dataclass
class ClusterPlan:
    arch: Architecture
    precision: Precision
    hardware: Hardware
    counts: Counts
    mb: ModelBytes
    ranks: list[RankPlan]
    context: int
    batch: int
    stage_ms: list[float]  # per rank, one token (batch 1)
    single_tps: float
    batch_tps: float
    one_host_tps: float  # the whole model read at one host's bandwidth
    even_split: EvenSplit | None = None  # where an even split also fits and decodes a batch faster
    speculative: list[SpeculativeSpeed] | None = None  # --draft-acceptance: one per drafts and drafter
    draft_acceptance: float = 0.0

    @property
    def fits(self) -> bool | None:
        verdicts = [r.fits for r in self.ranks]
        return None if None in verdicts else all(verdicts)


def plan_cluster(config: ModelConfig, hosts: int, precision: Precision, hardware: Hardware,
                 context: int | None = None, batch: int | None = None, draft_tokens: list[int] = (),
                 draft_acceptance: float = 0.0) -> ClusterPlan:
    """context: tokens per sequence for the KV cache (default: 8192, or the model's context if shorter).
    draft_tokens, draft_acceptance: also predict single-stream speculative decoding with K drafts
    for each K (prompt lookup, drafting free; and the model's MTP module where it has one)."""
    arch = architecture(config)
    mb = model_bytes(arch, precision)
    context = min(8192, config.max_position_embeddings) if context is None else context
    if context < 1:
        raise UserError(f"--context must be >= 1, got {context}")
    if context > config.max_position_embeddings:
        raise UserError(f"--context {context} is longer than the model's context "
                        f"({config.max_position_embeddings} tokens)")
    batch = hosts if batch is None else batch
    if batch < 1:
        raise UserError(f"--batch must be >= 1, got {batch}")
    counts = layer_counts(mb, hosts, hardware.memory_gib)
    ranks = _rank_plans(arch, mb, precision, hardware, counts, context, batch)
    times = _Timing(arch, mb, precision, hardware, layer_ranges(counts), context)
    one_host = _Timing(arch, mb, precision, Hardware(None, [max(hardware.bandwidth_gbs)],
                                                     tflops=hardware.tflops and [max(hardware.tflops)]),
                       [(0, len(mb.layers))], context)
    plan = ClusterPlan(arch, precision, hardware, count_params(arch), mb, ranks, context, batch,
                       [1e3 * times.stage(r, 1) for r in range(hosts)], times.single_stream(),
                       times.batch(batch), one_host.single_stream())
    if draft_tokens:
        plan.draft_acceptance = draft_acceptance
        plan.speculative = [SpeculativeSpeed(k, "ngram", times.speculative(k, draft_acceptance)) for k in draft_tokens]
        if arch.unused:  # an MTP module: drafting costs its reads
            plan.speculative += [SpeculativeSpeed(k, "mtp", times.speculative(k, draft_acceptance, times.mtp_seconds(k)))
                                 for k in draft_tokens]
    if hardware.memory_gib and len(set(hardware.memory_gib)) > 1:
        even = layer_counts(mb, hosts)
        even_ranks = _rank_plans(arch, mb, precision, hardware, even, context, batch)
        even_tps = _Timing(arch, mb, precision, hardware, layer_ranges(even), context).batch(batch)
        if all(r.fits for r in even_ranks) and even_tps > plan.batch_tps * 1.01:
            plan.even_split = EvenSplit(even, even_tps)
    return plan


def _rank_plans(arch, mb, precision, hardware, counts, context, batch) -> list[RankPlan]:
    kv = kv_layer_bytes(arch, precision.dtype_bytes, context, batch, live_points(hardware.prefix_cache_gb))
    ranges = layer_ranges(counts)
    return [RankPlan(r, start, end, rank_bytes(mb.layers, mb.ends, kv, (start, end), r, len(ranges),
                                               prefix_cache=round(hardware.prefix_cache_gb * 1e9)),
                     hardware.memory_gib[r] if hardware.memory_gib else None, hardware.reserve_gib)
            for r, (start, end) in enumerate(ranges)]


class DecodeTiming:
    """The decode roofline of the module docstring over stages of layers (`ranges`), given each
    stage's seconds per step (`stage`) and a hop's (`hop`): single-stream, speculative and batch
    tok/s. Subclasses: this module's pipeline ranks, layouts.py's stages of tensor-parallel groups."""

    arch: Architecture
    mb: ModelBytes
    ranges: list[tuple[int, int]]
    kv_read: list[float]  # per layer: bytes of one sequence's cache read per step

    def stage(self, s: int, m: int, sequences: int | None = None) -> float:
        raise NotImplementedError

    def hop(self, m: int) -> float:
        raise NotImplementedError

    def bytes_read(self, s: int, m: int, sequences: int) -> float:
        """Bytes stage s reads in one decode step of m tokens of `sequences` sequences: its layers'
        fixed weights, each sequence's cache, the distinct experts its tokens choose, and on the
        first stage the LM head."""
        start, end = self.ranges[s]
        read = 0.0
        for i in range(start, end):
            read += self.mb.fixed_read[i] + sequences * self.kv_read[i]
            e = self.mb.experts[i]
            if e:
                k = min(self.arch.top_k, e)
                read += e * (1 - (1 - k / e) ** m) * self.mb.expert_bytes[i]
        if s == 0:
            read += self.mb.head_read
        return read

    @property
    def hops(self) -> int:
        return len(self.ranges) if len(self.ranges) > 1 else 0  # the ring returns to rank 0

    def single_stream(self) -> float:
        return 1 / (sum(self.stage(s, 1) for s in range(len(self.ranges))) + self.hops * self.hop(1))

    def speculative(self, drafts: int, acceptance: float, draft_seconds: float = 0.0) -> float:
        """Single-stream tok/s when each trip checks `drafts` drafted tokens, each accepted with
        probability `acceptance` once the ones before it were: (1 - a^(K+1)) / (1 - a) tokens per
        trip, the trip reading the experts its K+1 positions choose; draft_seconds: the drafting
        itself (the MTP module, on rank 0), per trip."""
        a, k = acceptance, drafts
        tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
        trip = sum(self.stage(s, k + 1, sequences=1) for s in range(len(self.ranges))) + self.hops * self.hop(k + 1)
        return tokens / (trip + draft_seconds)

    def batch(self, b: int) -> float:
        n = len(self.ranges)
        k = min(b, n)
        m = math.ceil(b / k)
        stages = [self.stage(s, m) for s in range(n)]
        link = self.hop(m) if self.hops else 0.0
        round_trip = sum(stages) + self.hops * link
        return b / max(round_trip, k * max(max(stages), link))


class _Timing(DecodeTiming):
    """The decode roofline of the module docstring, for one layer split of pipeline ranks."""

    def __init__(self, arch, mb, precision, hardware, ranges, context):
        self.arch, self.mb, self.hw, self.ranges = arch, mb, hardware, ranges
        self.kv_read = [arch.kv_read_bytes(i, context, precision.dtype_bytes) for i in range(len(arch.layers))]
        self.hidden_bytes = (arch.hidden_values or arch.config.hidden_size) * precision.dtype_bytes
        n = len(ranges)
        self.bandwidth = hardware.bandwidth_gbs if len(hardware.bandwidth_gbs) == n else hardware.bandwidth_gbs[:1] * n

    def stage(self, r: int, m: int, sequences: int | None = None) -> float:
        """Seconds for rank r to run one decode step of m tokens of `sequences` sequences (default:
        one token each; a speculative chunk is m tokens of one sequence, which reads its cache once)."""
        start, end = self.ranges[r]
        read = self.bytes_read(r, m, m if sequences is None else sequences)
        params = sum(self.mb.active_params[start:end]) + (self.mb.head_params if r == 0 else 0)
        seconds = read / (self.bandwidth[r] * 1e9)
        if self.hw.tflops:
            flops = self.hw.tflops[r] if len(self.hw.tflops) == len(self.ranges) else self.hw.tflops[0]
            seconds = max(seconds, 2 * params * m / (flops * 1e12))
        return seconds

    def hop(self, m: int) -> float:
        return m * self.hidden_bytes / (self.hw.link_gbs * 1e9) + self.hw.link_latency_us * 1e-6

    def mtp_seconds(self, drafts: int) -> float:
        """Rank 0 running the MTP module (one more decoder layer shaped like the last, plus the
        head) once per drafted token."""
        last = len(self.mb.layers) - 1
        e = self.mb.experts[last]
        read = self.mb.fixed_read[last] + self.mb.head_read + (min(self.arch.top_k, e) * self.mb.expert_bytes[last] if e else 0)
        return drafts * read / (self.bandwidth[0] * 1e9)
