"""How a rank's weights live in memory (--weights-in-memory): MLX-quantized as stored, or dequantized
once at load (weights.dequantize_slice), and which ranks can afford the dense copy, from each host's
available memory. Plain numbers: no MLX (the planner's layer split makes this choice).

MLX's CPU quantized matmul does not use BLAS and costs about as much per row as a whole
matvec, so prefill and batches run many times faster on weights dequantized once at load and
multiplied by the BLAS; a dense copy costs 32/bits times the memory, hence a per-rank choice.
"""

from __future__ import annotations

import os


def is_quantized(checkpoint) -> bool:
    """Whether the checkpoint (any reader) holds MLX-quantized tensors: a choice to make."""
    return any(name.endswith(".scales") for name in checkpoint.tensors)


def available_memory_bytes() -> int:
    """Memory this host can still give: MemAvailable, capped by a cgroup (v2 or v1) limit."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 0
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = open(limit_file).read().strip()
            usage = int(open(usage_file).read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            available = min(available, max(0, int(limit) - usage))
        break
    return available


def choose_dense(hosts: list[str], available: list[int], quantized_bytes: list[int],
                 dense_bytes: list[int], fraction: float = 0.75) -> list[bool]:
    """Which ranks hold their weights dense: per host, in rank order, while the host's
    quantized weights plus the dense ranks' extra bytes stay within `fraction` of its
    available memory (the rest is left for KV caches, activations and everything else)."""
    budget = {}
    for host, avail in zip(hosts, available):
        budget[host] = min(budget.get(host, avail), avail)  # ranks of a host read the same pool
    for host in budget:
        budget[host] = budget[host] * fraction - sum(q for h, q in zip(hosts, quantized_bytes) if h == host)
    dense = []
    for host, q, d in zip(hosts, quantized_bytes, dense_bytes):
        fits = d - q <= budget[host]
        if fits:
            budget[host] -= d - q
        dense.append(fits)
    return dense
