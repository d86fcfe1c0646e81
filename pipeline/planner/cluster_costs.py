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
- plus the host's `sum_overhead_us` per sum, whatever its bytes and whatever the link: the runtime's own
  work around a sum (the in-graph primitive's MPI calls and its add, MPI's progress) and the wait for the
  partner rank (the slower one: rank 0's extra work). Rule: the runtime's own per-sum time measured where
  the link costs next to nothing (2 ranks on one machine, MPI over shared memory, an idle machine), less
  that link's own latency and bytes (an MPI ping-pong beside it); the link's latency and bytes are then
  added for the link at hand (GROUP_SUMS: fit and checks). 0 on the M3 Ultra terms, whose `link_fraction`
  was fitted with it folded in;
- a pipeline hop costs the link's latency + its bytes / bandwidth + the host's `hop_overhead_us`: the
  runtime's own work per hop (per stage of the ring: the send and receive of the hidden state or the
  token, waking the waiting rank, a stage's per-step work). Same rule: pipeline 2 x 1 against 1 rank on
  one idle machine over shared memory (HOP_RUNS), less that link's latency and bytes. 0 on the M3 Ultra
  terms (no pipeline figure to fit it on).

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
  bridge Geerling's ~300 us. Checked by the TCP runs of issue 34's benchmark (benchmarks/tensor_parallel.py
  --parts hosts: two network namespaces joined by a veth pair, MPI over UCX's TCP, llama-1b at T = 2, 33
  sums of 8 KB a token), whose measured link (ping-pong medians: 8 B ~5 us one way, 8 KB ~7 us, 0.25-2 GB/s)
  is what the prediction of that run is given; GROUP_SUMS records such runs (tests/test_cluster_costs_tcp.py
  holds the prediction within 25% of an idle run's results file: 28.8 predicted, 25.6 measured, 1.13).
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
    hop_overhead_us: float = 0.0  # per pipeline hop besides the link's latency and bytes: the runtime's own
    # work per hop (see the module docstring)


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
        """A pipeline hop between stages: one message, as a group sum's bytes fare, + the host's own per hop."""
        return ((self.latency_us + host.hop_overhead_us) * 1e-6
                + bytes_ / (self.gbs * 1e9 * host.link_fraction))


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
    """A run's group sums as the runtime measured them (benchmarks/tensor_parallel.py, tensor 1 x 2 of llama-1b,
    2 one-core ranks on a 2-core machine, one stream: the stats line's 'group sums X ms/token', the most of any
    rank), and the link it ran on as an MPI ping-pong beside it measured it (one way, median trip)."""
    source: str  # benchmarks/results/<name>.json, and its "date"
    date: str
    load: str  # the machine's load average during the runs
    link: str  # "shared memory" (2 ranks on one machine) or "veth, TCP" (two network namespaces)
    sums_per_token: int  # 2 per layer + the LM head's
    sum_ms_per_token: float  # measured (median of the runs)
    message_us: float  # one sum's message (hidden_size x 4 B) one way on that link, measured (ping-pong median)
    role: str  # "fit": sum_overhead_us is this run's; "check": predicted from it; "recorded": kept, not checked

    @property
    def per_sum_us(self) -> float:
        return 1e3 * self.sum_ms_per_token / self.sums_per_token

    @property
    def overhead_us(self) -> float:
        """What a sum took beyond its message on the link."""
        return self.per_sum_us - self.message_us


# Shared memory: the 8 KB message one way 3.8-3.9 us, 8 B 1.1 us, 1 MiB 122-479 us (`mpiexec -n 2 -bind-to core
# python benchmarks/netns_hosts.py --worker pingpong --sizes 8,8192,1048576`, 2026-12-06 09:43 UTC, load 12: the
# median trip barely moves with the load, its mean does).
SHARED_MEMORY_8KB_US = 3.85
GROUP_SUMS = [
    # The idle machine's run (load 1.1-1.3, at 54f3fc1, the sum in MLX's graph): T = 2 decoded 26.4 and 24.8 tok/s
    # with 3.37 and 2.93 ms a token of sums: 95.5 us a sum, of which the link's 8 KB take 3.9 us.
    SumMeasurement("tensor_parallel_quiet", "2026-12-06T08:35:50+0000", "1.1-1.3", "shared memory", 33, 3.15,
                   SHARED_MEMORY_8KB_US, "fit"),  # 91.6 us a sum beyond the link
    # Two hosts (veth, MPI over UCX's TCP), idle (load 1.3-1.7, at 029359f): T = 2 decoded 29.1 tok/s (predicted
    # 32.6: 1.12, within issue 34's 25%) with 3.95 ms a token of sums: 120 us a sum, of which the link's 8 KB take
    # 5.9 us: 114 us beyond the link where the fit says 91.6 (+24%: UCX's TCP progress on top of the message;
    # 0.7 ms a token the prediction leaves out). Recorded, not fitted on (one run). (The run before at 2a9c11a,
    # load 1.5-1.8: 25.6 tok/s for 28.8 predicted, 4.57 ms of sums; a loaded one, load 13.6-15.2: 7.5 ms a sum,
    # the wait for the partner rank to get a core.)
    SumMeasurement("tensor_parallel_hosts", "2026-12-06T14:37:16+0000", "1.3-1.7", "veth, TCP", 33, 3.95,
                   5.89, "recorded"),
    # (The TCP runs of b862d90's Python sum, tensor_parallel_rerun / _llama: 1.8-1.96 ms a sum, the sum this
    # term was fitted on before the sum moved into the graph; not this runtime's any more.)
]

# Pipeline 2 x 1 against 1 rank, decode tok/s, in the same rounds on the idle machine (tensor_parallel_quiet,
# load 1.1-1.3): 1 rank 15.8, 16.0; pipeline 2 x 1 14.7, 15.0 (medians 15.9, 14.85). The pipeline reads the
# same weights in two halves and adds 2 hops a token (to the second stage, back to the first).
HOP_RUNS = {"source": "tensor_parallel_quiet", "one_rank_tps": 15.9, "pipeline_tps": 14.85, "hops": 2,
            "message_us": SHARED_MEMORY_8KB_US}


def hop_overhead_us(run: dict = HOP_RUNS) -> float:
    """Per hop, what the pipeline's token took beyond the one rank's, less the link's message."""
    return 1e6 * (1 / run["pipeline_tps"] - 1 / run["one_rank_tps"]) / run["hops"] - run["message_us"]


# Linux CPU ranks (this runtime): quantized products read 16-23 GB/s of the ~31 GB/s two threads read on the
# development machine (docs/speed.md), about 0.6; a CPU rank ends no GPU command buffer, so the group sums reach
# the link's figures (link_fraction 1), plus the runtime's own 91.6 us a sum (GROUP_SUMS' fit, the sum in MLX's
# graph since e53a7d1; was 1900 us fitted on the Python sum's TCP runs) and 2220 us a hop (HOP_RUNS).
LINUX_CPU = HostTerms("Linux CPU", bandwidth_fraction=0.6, link_fraction=1.0, sum_overhead_us=91.6,
                      hop_overhead_us=2220.0)

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
