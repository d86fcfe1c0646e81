"""The speed model's fitted terms, in one place, with the measurements they are fitted on.

The decode roofline of speed.py reads each token's bytes at the host's full memory bandwidth; real
runs reach a fraction of it, and a tensor-parallel stage also pays for its group sums. The layouts
table (layouts.py) predicts every layout with these terms:

- a host reads `bandwidth_fraction` of its nominal memory bandwidth (fitted on one-node decode
  measurements, where there is no link at all);
- one group sum of a stage of T ranks costs the link's `latency_us` + (T - 1) x the partial's bytes /
  (the link's `gbs` x `link_fraction`): latency and bandwidth are public link figures, `link_fraction`
  (the share of that bandwidth a token's group sums reach in practice: small messages, each ending a
  GPU command buffer on a Mac) is fitted on one exo four-node figure and checked on the other two.
  The sum is the one issue 34 prescribes: every rank sends its float32 partial (hidden_size x 4 B per
  token) to each of the T - 1 others and adds the T partials in rank order in float32 itself, so every
  rank ends with the same bits and no broadcast follows (one latency; the T - 1 sends go out together
  but leave through one port, so their bytes add up). Two per layer (after attention, after the MLP or
  MoE) and one for the LM head's split vocabulary (argmax / sampling combined on rank 0);
- plus the host's `sum_overhead_us` per sum, whatever its bytes: the runtime's own work around a sum
  (evaluating the partial, copies in and out of MPI, MPI's progress) and the wait for the partner rank
  (the slower one: rank 0's extra work, a rank not on a CPU when the sum comes). Fitted for Linux CPU
  ranks over TCP on the two-host runs of benchmarks/tensor_parallel.py (TCP_SUMS); 0 on the M3 Ultra
  terms, whose `link_fraction` was fitted with it folded in.

Sources (figures as published; bit widths as we assume them, see MEASUREMENTS):
- exo 1.0 on 4 x M3 Ultra (2 x 512 + 2 x 256 GB), RDMA over Thunderbolt 5, tensor parallel: Jeff Geerling,
  "1.5 TB of VRAM on Mac Studio - RDMA over Thunderbolt 5", 2025-12-18,
  https://www.jeffgeerling.com/blog/2025/15-tb-vram-on-mac-studio-rdma-over-thunderbolt-5 (its charts are
  copied in exo's README, docs/benchmarks/jeffgeerling/, and his r/LocalLLaMA post "Kimi K2 Thinking at
  28.3 t/s on 4x Mac Studio cluster"): DeepSeek V3.1 21.1 (one node) / 27.8 (two) / 32.5 (four);
  Qwen3-235B-A22B 8-bit 19.5 / 26.2 / 31.9; Kimi K2 Thinking 21.6 (two) / 28.3 (four) tok/s.
- llama.cpp, DeepSeek R1 Q4_K_M on one M3 Ultra: 20.2 tok/s (as issue 34 quotes it; we found no primary
  page for it in the stored corpora).
- Thunderbolt 5 RDMA (JACCL-style verbs): single-digit microsecond latency (exo's Alex Cheema; Stabilise.io
  measured 5-9 us, as reported by aiexpert.news) and ~7.4-7.6 GB/s per rank of effective bandwidth (the
  TCCL PyTorch backend's benchmark, pytorch/pytorch#189856: "~7.6 GB/s per rank"; a JACCL cluster write-up
  on zingnex.cn: 7.4 GB/s). Geerling: RDMA took the latency "from 300us down to < 50us".
- TCP: 10 Gigabit Ethernet carries at most 1.25 GB/s (about 1.1 GB/s of payload); MPI over TCP on a
  switched LAN answers a small message in tens of microseconds (50 us assumed); over a Thunderbolt IP
  bridge Geerling's ~300 us. Checked by the TCP runs of issue 34's benchmark (benchmarks/tensor_parallel.py:
  two network namespaces joined by a veth pair, MPI over UCX's TCP, llama-1b at T = 2, 33 sums of 8 KB a
  token; TCP_SUMS): the veth answers in 30-43 us at 0.61-0.64 GB/s (the link terms' figures are of that
  order), but a token's sums took 60-65 ms, 1.8-1.96 ms a sum where latency and bytes give 43-56 us:
  the term the link figures lack is per sum, not per byte (`sum_overhead_us`).
"""

from __future__ import annotations

from typing import NamedTuple

PARTIAL_BYTES = 4  # a group sum adds float32 partials (issue 34: "add them in rank order in float32")
SUMS_PER_LAYER = 2  # after attention and after the MLP / MoE


class HostTerms(NamedTuple):
    """What a host's software stack reaches of its hardware's figures."""
    name: str
    bandwidth_fraction: float  # of the nominal memory bandwidth a decode step reaches
    link_fraction: float  # of the link's bandwidth a token's group sums reach
    sum_overhead_us: float = 0.0  # per group sum besides the link's latency and bytes: the runtime's own work
    # around it and the wait for the partner rank (see the module docstring)


class LinkTerms(NamedTuple):
    name: str
    latency_us: float  # one message, one way
    gbs: float  # GB/s one rank's port moves

    def group_sum_seconds(self, host: HostTerms, ranks: int, values: int) -> float:
        """One group sum over `ranks` ranks of `values` float32 values per rank (0 for one rank)."""
        if ranks <= 1:
            return 0.0
        return ((self.latency_us + host.sum_overhead_us) * 1e-6
                + (ranks - 1) * values * PARTIAL_BYTES / (self.gbs * 1e9 * host.link_fraction))

    def hop_seconds(self, host: HostTerms, bytes_: float) -> float:
        """A pipeline hop between stages: one message, as a group sum's bytes fare."""
        return self.latency_us * 1e-6 + bytes_ / (self.gbs * 1e9 * host.link_fraction)


# M3 Ultra running MLX: bandwidth_fraction is the geometric mean of measured / roofline tok/s over the three
# one-node figures (exo DeepSeek V3.1 4-bit 21.1, exo Qwen3-235B 8-bit 19.5, llama.cpp DeepSeek R1 Q4_K_M 20.2:
# 0.537, 0.551, 0.570); link_fraction is what makes exo's DeepSeek V3.1 on four nodes 32.5 tok/s with that
# fraction and the Thunderbolt 5 RDMA figures below (tests/test_plan_layouts.py recomputes both). Only about 8%
# of the link's bandwidth: a token's 122 sums of 28 KB each take ~17 ms in exo's run where the link's published
# latency and bandwidth would give ~2.4 ms. A constant cost per sum instead (fitted on the same figure: ~120 us)
# puts Qwen3-235B's 188 sums of 16 KB at -18%, outside the 15% the checks allow; this bytes-proportional form
# puts it at +7% (and Kimi K2 Thinking at -13%).
APPLE_MLX = HostTerms("M3 Ultra, MLX", bandwidth_fraction=0.5525, link_fraction=0.0826)


class SumMeasurement(NamedTuple):
    """A two-host tensor-parallel run's group sums (benchmarks/tensor_parallel.py, llama-1b at T = 2 in two
    network namespaces joined by a veth, MPI over UCX's TCP, one core per rank on a 2-core machine)."""
    source: str  # benchmarks/results/<name>.json, and its "date"
    date: str
    load: str  # the machine's load average during the runs
    sums_per_token: int  # 2 per layer + the LM head's
    sum_ms_per_token: float  # measured (median of the runs; the stats line's, the most of any rank)
    latency_us: float  # the veth, measured beside the runs (the benchmark's mpi4py ping-pong, one way)
    gbs: float
    partial_bytes: int  # hidden_size x 4 B
    role: str  # "fit": fits LINUX_CPU's sum_overhead_us; "check"

    @property
    def overhead_us(self) -> float:
        """What a sum took beyond the link's latency and its bytes."""
        return (1e3 * self.sum_ms_per_token / self.sums_per_token - self.latency_us
                - self.partial_bytes / (self.gbs * 1e3))


TCP_SUMS = [
    SumMeasurement("tensor_parallel_rerun", "2026-12-06T04:55:19+0000", "4-7", 33, 64.55, 42.70, 0.6145, 8192,
                   "fit"),  # 1900 us a sum
    SumMeasurement("tensor_parallel_llama", "2026-12-06T04:46:12+0000", "11-13", 33, 60.52, 30.35, 0.6421, 8192,
                   "check"),  # 1791 us (-6%)
    # (the first run, tensor_parallel.json at load 16-24: 201 ms a token, 5.8 ms a sum over a veth answering in
    # 286 us: the wait grows with the load, and an oversubscribed host is outside what these terms predict)
]

# Linux CPU ranks (this runtime): quantized products read 16-23 GB/s of the ~31 GB/s two threads read on the
# development machine (docs/speed.md), about 0.6; a CPU rank ends no GPU command buffer, so the group sums reach
# the link's figures (link_fraction 1), plus 1.9 ms a sum (TCP_SUMS' fit): the sums as the runtime ran them at
# b862d90 (an Iallgather of the evaluated float32 partial per sum); a faster sum is to be refitted on its own runs.
LINUX_CPU = HostTerms("Linux CPU", bandwidth_fraction=0.6, link_fraction=1.0, sum_overhead_us=1900.0)

THUNDERBOLT5_RDMA = LinkTerms("Thunderbolt 5 RDMA", latency_us=8.0, gbs=7.5)
TCP_ETHERNET = LinkTerms("TCP, 10 Gigabit Ethernet", latency_us=50.0, gbs=1.1)

TERM_SETS = {  # plan --cluster-terms
    "m3-ultra-rdma": (APPLE_MLX, THUNDERBOLT5_RDMA),
    "linux-tcp": (LINUX_CPU, TCP_ETHERNET),
}


class Measurement(NamedTuple):
    """A published decode figure the terms are fitted on or checked against."""
    model: str  # a bundled config's name (planner/configs)
    quantize: int | None  # --quantize bits as we assume the run held the weights (None: the checkpoint's own)
    group_size: int
    host_memory: tuple[int, ...]  # GiB per host the run used
    tensor_parallel: int
    tps: float
    role: str  # "fraction": fits bandwidth_fraction; "sum": fits link_fraction; "check": neither
    who: str


MEASUREMENTS = [
    # One node, no link: the bandwidth fraction. One 512 GB node ran DeepSeek V3.1, so it was at most 4-bit
    # there (8-bit is 713 GB; exo's README captions its four-node chart "8-bit", which one node cannot hold).
    Measurement("DeepSeek-V3.1", 4, 64, (512,), 1, 21.1, "fraction", "exo"),
    Measurement("Qwen3-235B-A22B", 8, 64, (512,), 1, 19.5, "fraction", "exo"),
    # Q4_K_M averages about 4.8 bits (404 GB for 671B): counted as MLX 4-bit, group 32 (0.625 B per value).
    Measurement("DeepSeek-R1", 4, 32, (512,), 1, 20.2, "fraction", "llama.cpp"),
    # Four nodes, pure tensor parallelism over RDMA: one fits the group sum, the others check it.
    Measurement("DeepSeek-V3.1", 4, 64, (512, 512, 256, 256), 4, 32.5, "sum", "exo"),
    Measurement("Kimi-K2-Thinking", None, 64, (512, 512, 256, 256), 4, 28.3, "check", "exo"),
    Measurement("Qwen3-235B-A22B", 8, 64, (512, 512, 256, 256), 4, 31.9, "check", "exo"),
    # Two nodes (the two 512 GB ones), also checks.
    Measurement("DeepSeek-V3.1", 4, 64, (512, 512), 2, 27.8, "check", "exo"),
    Measurement("Qwen3-235B-A22B", 8, 64, (512, 512), 2, 26.2, "check", "exo"),
    Measurement("Kimi-K2-Thinking", None, 64, (512, 512), 2, 21.6, "check", "exo"),
]
MEASURED_DTYPE = "bfloat16"  # MLX checkpoints keep scales, biases and unquantized tensors in bf16
MEASURED_CONTEXT = 1024  # a short chat: the benchmarks' prompts and answers are a few hundred tokens
