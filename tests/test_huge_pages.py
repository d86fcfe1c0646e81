"""glibc's huge-page tunable for ranks (pipeline/huge_pages.py): added once, never over the user's
own setting, and a process started with it holds MLX's big buffers in transparent huge pages."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import huge_pages

REPO = Path(__file__).resolve().parents[1]


def test_environment_adds_the_tunable_once_and_leaves_the_users_own():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's tunable: Linux only")
    env = huge_pages.environment({"PATH": "/bin"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert huge_pages.environment(env) == env
    mine = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert huge_pages.environment(mine)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    theirs = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert huge_pages.environment(theirs) == theirs
    off = {"PIPELINE_HUGE_PAGES": "0"}
    assert huge_pages.environment(off) == off


PROBE = r"""
import pipeline.blas, mlx.core as mx
from pipeline import huge_pages
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
    active, huge_mib = _probe(huge_pages.environment(plain))
    assert active and huge_mib >= 64  # of a 96 MiB buffer
    active, huge_mib = _probe(plain)
    assert not active
    if "[madvise]" in setting:  # only what is advised
        assert huge_mib < 16
