"""--tensor-parallel T over MLX's distributed group (`--transport mlx`, here MLX's TCP ring on loopback,
cluster/mlx_group_sum.py): pure tensor parallelism (T = ranks) gives the bits `--transport mpi` gives
(the same sum: gathered, added in member order in float32), its logits (the head split by vocabulary)
and its greedy text, as `batch` gives it (T = 4: the ring's sends reach neighbours only, so member 2's
payloads go by MPI); a hybrid (1 < T < ranks) is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, assert_far_from_uniform, long_prompt, make_tiny_model, mpiexec
from test_tensor_parallel import NINE_HEADS, one_error_line

PROMPT = long_prompt()
SUM_WORKER = REPO / "tests" / "mlx_group_sum_worker.py"
SHAPES = 4  # mlx_group_sum_worker.SHAPES


def ordered_sum(parts: list[np.ndarray]) -> np.ndarray:
    total = parts[0].astype(np.float32).copy()
    for part in parts[1:]:
        total += part.astype(np.float32)  # member order, float32, one rounding per add
    return total


@pytest.mark.parametrize("ranks", [2, 3])
def test_sum_over_mlx_is_the_rank_ordered_float32_sum(ranks, tmp_path):
    """Every member holds numpy's member-ordered float32 sum (partials of magnitudes 1e-4 .. 1e4, so that
    on 3 ranks the order of the adds shows in the bits), bfloat16 partials summed in float32 and rounded
    back, and the first member's router choices."""
    out = tmp_path / "sums.npz"
    job = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, str(SUM_WORKER), "exact", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert job.returncode == 0, job.stderr
    got = np.load(out)
    assert str(got["kind"]) == "MlxGroupSum" and int(got["calls"]) == SHAPES + 1
    for i in range(SHAPES):
        parts = [got[f"m{m}_partial{i}"] for m in range(ranks)]
        expected = ordered_sum(parts)
        if ranks > 2:
            assert not np.array_equal(expected, ordered_sum(parts[::-1]))
        for m in range(ranks):
            assert got[f"m{m}_sum{i}"].dtype == np.float32 and got[f"m{m}_sum{i}"].shape == parts[0].shape
            assert np.array_equal(got[f"m{m}_sum{i}"], expected), (i, m)
    import mlx.core as mx  # here: as the runtime rounds the float32 sum back to bfloat16

    halves = np.array(mx.array(ordered_sum([got[f"m{m}_halves_partial"] for m in range(ranks)]))
                      .astype(mx.bfloat16).astype(mx.float32))
    for m in range(ranks):
        assert str(got[f"m{m}_halves_dtype"]) == "mlx.core.bfloat16"
        assert np.array_equal(got[f"m{m}_halves"], halves), m
        assert np.array_equal(got[f"m{m}_choices"], np.arange(8, dtype=np.uint32).reshape(1, 8)), m


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_hung_member_ends_the_job_under_the_watchdog(ranks):
    """A member that stops (SIGSTOP) before a sum: the others, blocked in MLX's gather (which cannot time
    out), end the job within --watchdog 2 s through the transport's deadline, with one line each: on 2
    ranks naming the stopped one, on more saying that one of the group is silent."""
    proc = subprocess.Popen(["mpiexec", "-n", str(ranks), sys.executable, str(SUM_WORKER), "hang", "1", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.monotonic()
    assert proc.returncode != 0, err
    stops = [line for line in err.splitlines() if line.startswith("member 1 stops at ")]
    assert stops, err
    after = ended - float(stops[0].rsplit(" ", 1)[1])
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    named = "got nothing from rank 1 " if ranks == 2 else f"in a group sum over MLX with ranks 0-{ranks - 1}"
    assert errors and all(named in e and "--watchdog 2" in e for e in errors), err
    assert "returned without" not in err, err
    # within the watchdog's 2 s of the others' wait, which began before member 1 stopped where it was the last to
    # reach the sum (the end came 1.2 s after its stop once in CI): no lower bound
    assert after < 10, f"the job ended {after:.1f} s after member 1 stopped"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    from test_moe import make_qwen3_moe

    root = tmp_path_factory.mktemp("tpmlx")
    make_qwen3_moe(root / "qwen3_moe", num_attention_heads=9, num_key_value_heads=3, moe_intermediate_size=64)
    return {"llama": make_tiny_model("llama", root / "llama", **NINE_HEADS), "qwen3_moe": root / "qwen3_moe"}


def worker_logits(folder, ranks: int, transport: str, tmp_path) -> np.ndarray:
    """[whole prompt, token by token] logits of one stage of T = ranks (tests/tensor_parallel_worker.py)."""
    out = tmp_path / f"logits-{transport}-{ranks}.npy"
    job = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable,
                          str(REPO / "tests" / "tensor_parallel_worker.py"), str(folder), str(out),
                          ",".join(map(str, PROMPT)), transport],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert job.returncode == 0, job.stderr
    return np.load(out)


@pytest.mark.parametrize("kind, ranks", [("llama", 2), ("llama", 3), ("llama", 4), ("qwen3_moe", 2)])
def test_logits_over_mlx_equal_mpi_bit_for_bit(models, kind, ranks, tmp_path):
    over_mpi = worker_logits(models[kind], ranks, "mpi", tmp_path)
    over_mlx = worker_logits(models[kind], ranks, "mlx", tmp_path)
    assert_far_from_uniform(over_mpi[0])
    assert np.array_equal(over_mlx, over_mpi), np.abs(over_mlx - over_mpi).max()


def generate(ranks: int, folder, prompt: str, *flags: str) -> subprocess.CompletedProcess:
    return mpiexec(ranks, "generate", "--model", str(folder), "--prompt", prompt, "--max-tokens", "16",
                   "--no-chat-template", "--tensor-parallel", str(ranks), *flags)


@pytest.mark.parametrize("kind, dtype", [("llama", "float32"), ("qwen3_moe", "bfloat16")])
def test_greedy_text_over_mlx_equals_mpi_and_batch(models, kind, dtype, tmp_path):
    """generate --transport mlx --tensor-parallel 2 writes what --transport mpi writes, and what batch
    (over MPI, micro-batched) writes for each prompt; the stats line has the group sums."""
    folder = models[kind]
    prompts = ["The capital of France", "def hello(world):\n"]
    texts = []
    for prompt in prompts:
        over_mlx = generate(2, folder, prompt, "--dtype", dtype, "--transport", "mlx", "--mlx-backend", "ring")
        over_mpi = generate(2, folder, prompt, "--dtype", dtype, "--transport", "mpi")
        for job in (over_mlx, over_mpi):
            assert job.returncode == 0, job.stderr
        assert over_mlx.stdout.strip() and over_mlx.stdout == over_mpi.stdout
        assert "group sums" in over_mlx.stderr, over_mlx.stderr
        texts.append(over_mlx.stdout[:-1])
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": 16}) + "\n" for i, p in enumerate(prompts)))
    job = mpiexec(2, "batch", "--model", str(folder), "--input", str(inp), "--output", str(out), "--dtype", dtype,
                  "--no-chat-template", "--quiet", "--tensor-parallel", "2")
    assert job.returncode == 0, job.stderr
    # (generate's stdout is read as text: its line ends, a random model's '\r' too, arrive as '\n')
    got = {r["id"]: r["text"].replace("\r\n", "\n").replace("\r", "\n")
           for r in map(json.loads, out.read_text().splitlines())}
    assert got == dict(enumerate(texts))


def test_hybrid_over_mlx_is_one_line(models):
    job = mpiexec(4, "generate", "--model", str(models["llama"]), "--prompt", "hi", "--max-tokens", "2",
                  "--no-chat-template", "--tensor-parallel", "2", "--transport", "mlx", timeout=60)
    one_error_line(job, "--tensor-parallel 2 on 4 ranks", "--transport mpi")
