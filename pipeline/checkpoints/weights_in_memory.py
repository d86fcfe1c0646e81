"""How a rank's weights live in memory (--weights-in-memory): MLX-quantized as stored, or dequantized
once at load (weights.dequantize_slice), and which ranks can afford the dense copy, from each host's
available memory. Plain numbers: no MLX (the planner's layer split makes this choice).

MLX's CPU quantized matmul does not use BLAS and costs about as much per row as a whole
matvec, so prefill and batches run many times faster on weights dequantized once at load and
multiplied by the BLAS; a dense copy costs 32/bits times the memory, hence a per-rank choice.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys


def is_quantized(checkpoint) -> bool:
    """Whether the checkpoint (any reader) holds MLX-quantized tensors: a choice to make."""
    return any(name.endswith(".scales") for name in checkpoint.tensors)


def available_memory_bytes() -> int | None:
    """Memory this host can still give, in bytes; None where nothing says (choose_dense then
    counts no room). Linux: MemAvailable, capped by a cgroup (v2 or v1) limit; macOS:
    macos_available_bytes."""
    if sys.platform == "darwin":
        return macos_available_bytes()
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
            return None
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


def macos_available_bytes() -> int | None:
    """psutil's available memory if it is installed, else vm_stat's free, inactive, speculative and
    purgeable pages (memory macOS hands out without swapping); None if neither answers."""
    try:
        import psutil  # optional: vm_stat answers without it
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True).stdout
    except OSError:
        return None
    page = re.search(r"page size of (\d+)", out)
    page_bytes = int(page.group(1)) if page else 16384  # Apple silicon's page size
    pages = 0
    for key in ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable"):
        count = re.search(rf"{key}:\s+(\d+)", out)
        pages += int(count.group(1)) if count else 0
    return pages * page_bytes if pages else None


def choose_dense(hosts: list[str], available: list[int | None], quantized_bytes: list[int],
                 dense_bytes: list[int], fraction: float = 0.75) -> list[bool]:
    """Which ranks hold their weights dense: per host, in rank order, while the host's
    quantized weights plus the dense ranks' extra bytes stay within `fraction` of its
    available memory (the rest is left for KV caches, activations and everything else).
    A host whose memory is unknown (None: available_memory_bytes read nothing) has no room."""
    budget = {}
    for host, avail in zip(hosts, available):
        avail = avail or 0
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
