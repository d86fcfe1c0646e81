"""Big buffers in 2 MiB pages: glibc's malloc told to ask for transparent huge pages.

MLX's CPU allocator takes its buffers from malloc, and a rank's weights are a few hundred big ones.
In 4 KiB pages, loading them pays a page fault every 4 KiB (on a VM, with the host's own fault
behind it) and every weight a product streams walks a new TLB entry every 4 KiB. glibc (2.35+)
madvises its large blocks for transparent huge pages under the tunable `glibc.malloc.hugetlb=1`,
read once at process start, so ranks get it through their environment: the supervisor sets it for
the rank it starts (supervise.py), and a `python -m pipeline` run without mpiexec starts itself
again with it. Measured on the 2-core Zen 4 VM, fresh 64 MiB MLX buffers touched: 0.22-0.24 s
per 512 MiB in small pages, 0.085 s in huge ones; the 1B Llama's int8 decode 38.1 -> 40.7 tok/s
(median of 3) with its weights rearranged in the buffers they were read into (checkpoints/int8_repack.py).

Not on a VM that hands free 2 MiB blocks back to its host (virtio-balloon free page reporting at
order 9, the default): there every huge page is a block the host no longer backs, and its first
touch is the host's fault. Measured on such a VM (the 2-core test machine), one rank's load of a
bf16 1B Llama as fp32 (4.3 GB of fresh buffers): 5.4-19.9 s in huge pages against 1.6-2.8 s in
small ones, whose blocks the guest had kept. PIPELINE_HUGE_PAGES=1 uses them there anyway.

It changes nothing where the kernel's transparent huge pages are off ("never"), outside glibc, or
where the user set `glibc.malloc.hugetlb` themselves. PIPELINE_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def wanted(env: dict | None = None) -> bool:
    """Whether a process started with `env` should get the tunable: Linux, not set by the user, and
    PIPELINE_HUGE_PAGES=1, or not 0 and free memory stays with this machine."""
    env = os.environ if env is None else env
    choice = env.get("PIPELINE_HUGE_PAGES", "")
    return (sys.platform.startswith("linux") and choice != "0" and TUNABLE not in env.get("GLIBC_TUNABLES", "")
            and (choice == "1" or not free_blocks_go_to_host()))


def free_blocks_go_to_host(sys_root: Path = Path("/sys")) -> bool:
    """Whether this is a VM whose balloon reports free blocks of 2 MiB or less to its host (the
    kernel's page reporting, bound to a virtio balloon that offers it: feature bit 5)."""
    try:
        order = int((sys_root / "module/page_reporting/parameters/page_reporting_order").read_text())
    except (OSError, ValueError):
        return False
    if order > 9:
        return False
    for device in (sys_root / "bus/virtio/drivers/virtio_balloon").glob("virtio*"):
        try:
            features = (device / "features").read_text().strip()
        except OSError:
            continue
        if len(features) > 5 and features[5] == "1":  # VIRTIO_BALLOON_F_REPORTING
            return True
    return False


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
