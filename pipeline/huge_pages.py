"""Big buffers in 2 MiB pages: glibc's malloc told to ask for transparent huge pages.

MLX's CPU allocator takes its buffers from malloc, and a rank's weights are a few hundred big ones.
In 4 KiB pages, loading them pays a page fault every 4 KiB (on a VM, with the host's own fault
behind it) and every weight a product streams walks a new TLB entry every 4 KiB. glibc (2.35+)
madvises its large blocks for transparent huge pages under the tunable `glibc.malloc.hugetlb=1`,
read once at process start, so ranks get it through their environment: the supervisor sets it for
the rank it starts (supervise.py), and a `python -m pipeline` run without mpiexec starts itself
again with it. Measured on the 2-core Zen 4 VM, fresh 64 MiB MLX buffers touched: 0.22-0.24 s
per 512 MiB in small pages, 0.085 s in huge ones; the 1B Llama's int8 decode 38.1 -> 40.7 tok/s
(median of 3) with its weights rearranged in the buffers they were read into (qmm.use_int8).

It changes nothing where the kernel's transparent huge pages are off ("never"), outside glibc, or
where the user set `glibc.malloc.hugetlb` themselves. PIPELINE_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def wanted(env: dict | None = None) -> bool:
    """Whether a process started with `env` should get the tunable (Linux, not turned off, not set)."""
    env = os.environ if env is None else env
    return (sys.platform.startswith("linux") and env.get("PIPELINE_HUGE_PAGES", "1") != "0"
            and TUNABLE not in env.get("GLIBC_TUNABLES", ""))


def environment(env: dict) -> dict:
    """`env` with the tunable added to GLIBC_TUNABLES where `wanted`."""
    if not wanted(env):
        return env
    tunables = env.get("GLIBC_TUNABLES", "")
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"}


def active() -> bool:
    """Whether this process's malloc gives its big blocks in huge pages: it started with the tunable
    on, under glibc, and the kernel's setting is not "never"."""
    if f"{TUNABLE}=1" not in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        return False
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
    except (ValueError, OSError):  # no such name: not glibc
        return False
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False
