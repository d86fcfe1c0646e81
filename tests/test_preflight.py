"""`python -m pipeline preflight` under real mpiexec: one table, a problem line naming the rank
for each mismatch, exit 1; per-rank model folders simulated with MPMD (`A : B : C`)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, mpiexec
from pipeline.checkpoints import weights_in_memory
from pipeline.checkpoints.weights_in_memory import available_memory_bytes, choose_dense
from pipeline.commands.preflight import RankReport, evaluate
from pipeline.planner.weights_bytes import ModelBytes


def mpmd(*folders) -> subprocess.CompletedProcess:
    """One rank per folder: `mpiexec -n 1 ... --model A : -n 1 ... --model B : ...`."""
    cmd = ["mpiexec"]
    for i, folder in enumerate(folders):
        cmd += ([":"] if i else []) + ["-n", "1", sys.executable, "-m", "pipeline", "preflight", "--model", str(folder)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_all_ranks_ready(tiny_models):
    result = mpiexec(2, "preflight", "--model", str(tiny_models["llama"]))
    assert result.returncode == 0, result.stderr
    table = result.stdout.strip().splitlines()
    assert table[0].split()[:3] == ["rank", "host", "python"] and len(table) == 3  # printed once
    assert "0-" in table[1] and table[1].endswith("OK") and table[2].endswith("OK")
    assert "preflight: all 2 ranks ready" in result.stderr


def test_a_mismatched_model_folder_on_one_rank(tiny_models, tmp_path):
    good = tiny_models["llama"]
    changed = tmp_path / "changed"
    shutil.copytree(good, changed)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    weights = changed / "model.safetensors"
    with open(weights, "ab") as f:
        f.write(b"\0" * 16)
    (changed / "tokenizer.json").unlink()

    result = mpmd(good, changed, tmp_path / "absent")
    assert result.returncode == 1
    assert len(result.stdout.strip().splitlines()) == 4 and "Traceback" not in result.stderr
    problems = [line for line in result.stderr.splitlines() if line.startswith("problem: ")]
    text = "\n".join(problems)
    assert "rank 1 (" in text and "config.json differs from rank 0's" in text
    assert "model.safetensors is " in text and "tokenizer.json is missing" in text
    assert "rank 2 (" in text and "absent does not exist" in text
    assert not any(p.startswith("problem: rank 0") for p in problems)
    assert "preflight: 5 problems on 3 ranks" in result.stderr


def held(layers: list[int], ends: int) -> ModelBytes:
    n = len(layers)
    return ModelBytes(layers, ends, fixed_read=[0] * n, expert_bytes=[0] * n, experts=[0] * n, head_read=0,
                      active_params=[0] * n, head_params=0)


def report(rank, available, **kw) -> RankReport:
    base = dict(rank=rank, host=f"studio-{rank + 1}", python="3.12.1",
                packages={n: "1" for n in ("pipeline", "mlx", "mpi4py", "numpy", "tokenizers", "jinja2")},
                mpi_library="Open MPI v5.0.6", available=available, metal_limit=None, folder="/m",
                files={"config.json": 10, "model.safetensors": 1000}, config_sha256="ab" * 32,
                num_layers=4, held=held([100 * 2**30] * 4, 20 * 2**30), dense_held=held([400 * 2**30] * 4, 80 * 2**30),
                kv_layer_bytes=[2**30] * 4, disk_layer_bytes=[100] * 4, disk_ends_bytes=20)
    base.update(kw)
    return RankReport(**base)


def test_memory_and_version_problems_name_the_rank():
    reports = [report(0, 512 * 2**30), report(1, 96 * 2**30),
               report(2, 512 * 2**30, python="3.11.9", packages={**report(0, 0).packages, "mlx": "2"}),
               report(3, None)]
    table, problems = evaluate(reports, split=None)
    assert any("rank 1 (studio-2): its slice (layers 1-1) needs 111.1 GiB (weights 100.0 GiB fp32 + KV cache "
               "1.0 GiB, +10%) but only 96.0 GiB" in p for p in problems), problems
    assert "rank 2 (studio-3): Python 3.11.9, rank 0 has 3.12.1" in problems
    assert "rank 2 (studio-3): mlx 2, rank 0 has 1" in problems
    assert len(problems) == 3
    rows = table.splitlines()
    assert rows[4].split()[-1] == "OK" and "unknown" in rows[4]  # free memory unknown is no problem
    _, problems = evaluate(reports, split="1,1,1")
    assert problems[0] == "--split '1,1,1' has 3 counts but the job has 4 ranks"


def test_weights_in_memory_auto_is_decided_as_the_job_decides_it():
    """A quantized model under --weights-in-memory auto: dequantized on the ranks whose host has
    room (layer_split.plan_weights_in_memory), packed elsewhere, and the table says which."""
    reports = [report(r, memory * 2**30, quantized=True) for r, memory in enumerate((2000, 2000, 300, 2000))]
    table, problems = evaluate(reports, split="1,1,1,1", weights_in_memory="auto")
    assert not problems, problems
    rows = table.splitlines()[1:]
    assert ["quantized" in row for row in rows] == [False, False, True, False], table
    assert "400.0 GiB fp32" in rows[1] and "100.0 GiB quantized" in rows[2]
    table, _ = evaluate(reports, split="1,1,1,1", weights_in_memory="quantized")
    assert all("quantized" in row for row in table.splitlines()[1:])


# -- free memory, as preflight and the job's --weights-in-memory auto both read it -----------------------------

VM_STAT = """Mach Virtual Memory Statistics: (page size of 4096 bytes)
Pages free:                               12345.
Pages active:                            500000.
Pages inactive:                          200000.
Pages speculative:                         3000.
Pages throttled:                              0.
Pages wired down:                        100000.
Pages purgeable:                           1000.
"""


def on_macos(monkeypatch, vm_stat: str | None, psutil_available: int | None = None) -> None:
    """sys.platform darwin, psutil installed with that reading or missing, vm_stat's output or no vm_stat."""
    monkeypatch.setattr(weights_in_memory.sys, "platform", "darwin")
    psutil = None  # a None in sys.modules makes `import psutil` raise ImportError
    if psutil_available is not None:
        psutil = type("psutil", (), {"virtual_memory": staticmethod(
            lambda: type("memory", (), {"available": psutil_available})())})
    monkeypatch.setitem(sys.modules, "psutil", psutil)

    def run(cmd, **kw):
        assert cmd == ["vm_stat"]
        if vm_stat is None:
            raise FileNotFoundError("vm_stat")
        return subprocess.CompletedProcess(cmd, 0, stdout=vm_stat, stderr="")
    monkeypatch.setattr(weights_in_memory.subprocess, "run", run)


def test_free_memory_on_macos_from_vm_stat(monkeypatch):
    """Without psutil: vm_stat's free + inactive + speculative + purgeable pages, in its page size."""
    on_macos(monkeypatch, VM_STAT)
    assert available_memory_bytes() == (12345 + 200000 + 3000 + 1000) * 4096
    on_macos(monkeypatch, VM_STAT.replace(" (page size of 4096 bytes)", ""))  # Apple silicon's pages
    assert available_memory_bytes() == (12345 + 200000 + 3000 + 1000) * 16384


def test_free_memory_on_macos_from_psutil_where_installed(monkeypatch):
    on_macos(monkeypatch, VM_STAT, psutil_available=48 * 2**30)
    assert available_memory_bytes() == 48 * 2**30


def test_free_memory_unknown_is_none_and_no_room(monkeypatch):
    """Nothing to read: None, which preflight shows as unknown and the split reads as no room for a dense copy."""
    on_macos(monkeypatch, None)
    assert available_memory_bytes() is None
    on_macos(monkeypatch, "")
    assert available_memory_bytes() is None
    assert choose_dense(["a", "b"], [None, 1000], [10, 10], [50, 50]) == [False, True]


def on_linux(monkeypatch, files: dict[str, str], sysconf_pages: int | None = None) -> None:
    """sys.platform linux, with these files readable (/proc/meminfo, cgroup's) and no others."""
    monkeypatch.setattr(weights_in_memory.sys, "platform", "linux")

    def read(path, *args, **kw):
        if path not in files:
            raise FileNotFoundError(path)
        return io.StringIO(files[path])

    def sysconf(name):
        if sysconf_pages is None:
            raise ValueError(name)
        return sysconf_pages if name == "SC_AVPHYS_PAGES" else 4096
    monkeypatch.setattr(weights_in_memory, "open", read, raising=False)
    monkeypatch.setattr(weights_in_memory.os, "sysconf", sysconf)


@pytest.mark.parametrize("cgroup", ["none", "v2", "v2 max", "v1"])
def test_free_memory_on_linux_capped_by_the_cgroup(monkeypatch, cgroup):
    meminfo = {"/proc/meminfo": "MemTotal:       33554432 kB\nMemAvailable:    8388608 kB\n"}
    files = {"none": {},
             "v2": {"/sys/fs/cgroup/memory.max": f"{4 * 2**30}\n", "/sys/fs/cgroup/memory.current": f"{2**30}\n"},
             "v2 max": {"/sys/fs/cgroup/memory.max": "max\n", "/sys/fs/cgroup/memory.current": f"{2**30}\n"},
             "v1": {"/sys/fs/cgroup/memory/memory.limit_in_bytes": f"{6 * 2**30}\n",
                    "/sys/fs/cgroup/memory/memory.usage_in_bytes": f"{2**30}\n"}}[cgroup]
    on_linux(monkeypatch, {**meminfo, **files})
    expected = {"none": 8, "v2": 3, "v2 max": 8, "v1": 5}[cgroup] * 2**30
    assert available_memory_bytes() == expected


def test_free_memory_on_linux_without_meminfo(monkeypatch):
    on_linux(monkeypatch, {}, sysconf_pages=1000)
    assert available_memory_bytes() == 1000 * 4096
    on_linux(monkeypatch, {})
    assert available_memory_bytes() is None
