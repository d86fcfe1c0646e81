"""glibc's huge-page tunable for ranks (pipeline/util/huge_pages.py): added once, never over the user's
own setting, and a process started with it holds MLX's big buffers in transparent huge pages."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.util import huge_pages

REPO = Path(__file__).resolve().parents[1]


def test_environment_adds_the_tunable_once_and_leaves_the_users_own():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's tunable: Linux only")
    on = {"PIPELINE_HUGE_PAGES": "1"}  # whatever this machine's balloon does (see the next test)
    env = huge_pages.environment(on)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert huge_pages.environment(env) == env
    mine = {**on, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert huge_pages.environment(mine)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    theirs = {**on, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert huge_pages.environment(theirs) == theirs
    off = {"PIPELINE_HUGE_PAGES": "0"}
    assert huge_pages.environment(off) == off
    by_default = huge_pages.environment({})
    assert ("GLIBC_TUNABLES" in by_default) == (not huge_pages.free_blocks_go_to_host())


def _sys_tree(root: Path, order: str | None, features: str | None) -> Path:
    if order is not None:
        (root / "module/page_reporting/parameters").mkdir(parents=True)
        (root / "module/page_reporting/parameters/page_reporting_order").write_text(order + "\n")
    if features is not None:
        device = root / "bus/virtio/drivers/virtio_balloon/virtio3"
        device.mkdir(parents=True)
        (device / "features").write_text(features + "\n")
    return root


@pytest.mark.parametrize("order, features, reported", [
    ("9", "0110010100" + "0" * 54, True),  # bit 5: VIRTIO_BALLOON_F_REPORTING
    ("9", "0110000100" + "0" * 54, False),  # a balloon without reporting
    ("10", "0110010100" + "0" * 54, False),  # only blocks bigger than a huge page go back
    ("9", None, False),  # the kernel can report, no balloon does
    (None, "0110010100" + "0" * 54, False),  # a kernel without page reporting
])
def test_a_vm_that_hands_free_huge_blocks_to_its_host_is_recognized(tmp_path, order, features, reported):
    assert huge_pages.free_blocks_go_to_host(_sys_tree(tmp_path, order, features)) is reported


PROBE = r"""
import pipeline.kernels.blas, mlx.core as mx
from pipeline.util import huge_pages
def huge_kib():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
before = huge_kib()
x = mx.ones((96 << 20) // 4)
mx.eval(x)
print(huge_pages.active(), (huge_kib() - before) // 1024)
"""


def _probe(env: dict) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_process_started_with_it_holds_big_buffers_in_huge_pages():
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[never]" in setting or (os.confstr("CS_GNU_LIBC_VERSION") or "").split()[0] != "glibc":
        pytest.skip(f"transparent huge pages off ({setting.strip()}) or not glibc")
    plain = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "PIPELINE_HUGE_PAGES")}
    active, huge_mib = _probe(huge_pages.environment({**plain, "PIPELINE_HUGE_PAGES": "1"}))
    assert active and huge_mib >= 64  # of a 96 MiB buffer
    active, huge_mib = _probe(plain)
    assert not active
    if "[madvise]" in setting:  # only what is advised
        assert huge_mib < 16
