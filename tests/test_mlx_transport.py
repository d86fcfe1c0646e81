"""`--transport mlx`: hidden states over mlx.core.distributed (here MLX's TCP ring on loopback,
set up from MPI without mlx.launch), headers over MPI. Output must equal `--transport mpi`."""

from __future__ import annotations

import pytest

from conftest import mpiexec
from test_mpi_generate import assert_fails_cleanly

PROMPT = "The capital of France"


@pytest.mark.parametrize("kind, ranks, dtype", [("llama", 2, "float32"), ("llama", 3, "float32"),
                                                ("qwen3", 4, "bfloat16")])
def test_mlx_transport_output_equals_mpi(tiny_models, kind, ranks, dtype):
    args = ["generate", "--model", str(tiny_models[kind]), "--prompt", PROMPT, "--max-tokens", "16",
            "--no-chat-template", "--dtype", dtype]
    over_mpi = mpiexec(ranks, *args, "--transport", "mpi")
    over_mlx = mpiexec(ranks, *args, "--transport", "mlx", "--mlx-backend", "ring")
    assert over_mpi.returncode == 0, over_mpi.stderr
    assert over_mlx.returncode == 0, over_mlx.stderr
    assert over_mlx.stdout == over_mpi.stdout and over_mlx.stdout.strip()


def test_ping_over_mlx_carries_data_intact():
    result = mpiexec(3, "ping", "--transport", "mlx", "--rounds", "30", "--floats", "100000")
    assert result.returncode == 0, result.stderr
    assert "30 rounds of 390.6 KiB around 3 ranks over mlx" in result.stdout


def test_unavailable_backend_is_one_line():
    # No RDMA devices on this machine: JACCL is unavailable, and every rank says so at once.
    result = mpiexec(2, "ping", "--transport", "mlx", "--mlx-backend", "jaccl", timeout=60)
    assert_fails_cleanly(result, "jaccl")


@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_no_temporary_files_are_left(tiny_models, tmp_path, backend):
    """The ring hostfile and the JACCL device file each rank writes for MLX's init are gone at
    the end, whether the job ran (ring here) or stopped with an error (no RDMA devices here)."""
    import json

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    if backend == "jaccl":
        env["PIPELINE_JACCL_DEVICES"] = json.dumps([[None, "rdma_en3"], ["rdma_en3", None]])
    args = ["generate", "--model", str(tiny_models["llama"]), "--prompt", PROMPT, "--max-tokens", "4",
            "--no-chat-template", "--transport", "mlx", "--mlx-backend", backend]
    result = mpiexec(2, *args, env=env, timeout=60)
    if backend == "ring":
        assert result.returncode == 0, result.stderr
        assert result.stdout == mpiexec(2, *args[:-4]).stdout
    else:
        assert_fails_cleanly(result, "jaccl")
    assert not list(tmp.glob("pipeline-*"))  # (MLX keeps its compiled kernels in $TMPDIR/mlx)
