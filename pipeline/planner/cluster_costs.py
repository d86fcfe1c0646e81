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
  MoE) and one for the LM head's split vocabulary (argmax / sampling combined on rank 0).

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
  bridge Geerling's ~300 us. Not fitted: the TCP run of issue 34's benchmark (two network namespaces
  joined by a veth pair) is where these are to be checked.
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


class LinkTerms(NamedTuple):
    name: str
    latency_us: float  # one message, one way
    gbs: float  # GB/s one rank's port moves

    def group_sum_seconds(self, host: HostTerms, ranks: int, values: int) -> float:
        """One group sum over `ranks` ranks of `values` float32 values per rank (0 for one rank)."""
        if ranks <= 1:
            return 0.0
        return self.latency_us * 1e-6 + (ranks - 1) * values * PARTIAL_BYTES / (self.gbs * 1e9 * host.link_fraction)

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
# Linux CPU ranks (this runtime): quantized products read 16-23 GB/s of the ~31 GB/s two threads read on the
# development machine (docs/speed.md), about 0.6; a CPU rank ends no GPU command buffer, so the group sums are
# assumed to reach the link's figures (link_fraction 1) until issue 34's TCP benchmark measures them.
LINUX_CPU = HostTerms("Linux CPU", bandwidth_fraction=0.6, link_fraction=1.0)

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
