"""Real `mpiexec` jobs: identical greedy output for 1-4 ranks, equal to transformers' own
greedy generation; clean failures on bad input; aborts instead of hangs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import transformers

from conftest import REPO, mpiexec

PROMPT = "The capital of France"


def transformers_greedy_text(folder, prompt: str, max_new_tokens: int) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1]:])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_identical_for_1_to_4_ranks_and_equal_to_transformers(tiny_models, kind):
    folder = tiny_models[kind]
    expected = transformers_greedy_text(folder, PROMPT, 16)
    outputs = {}
    for n in (1, 2, 3, 4):
        result = mpiexec(n, "generate", "--model", str(folder), "--prompt", PROMPT, "--max-tokens", "16",
                         "--no-chat-template")
        assert result.returncode == 0, result.stderr
        outputs[n] = result.stdout
        stats = [line for line in result.stderr.splitlines() if line.startswith("[pipeline]")]
        assert len(stats) == 1 and f"r{n - 1} " in stats[0] and "decode" in stats[0]
    assert outputs[1] == expected + "\n"
    assert outputs[2] == outputs[3] == outputs[4] == outputs[1]


def test_explicit_split_and_chat_template(tiny_models):
    folder = tiny_models["llama"]
    a = mpiexec(2, "generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "8", "--split", "1,3")
    b = mpiexec(2, "generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "8", "--split", "3,1")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


def test_sampling_with_seed_is_reproducible(tiny_models):
    args = ("generate", "--model", str(tiny_models["qwen3"]), "--prompt", "hi", "--max-tokens", "12",
            "--temp", "1.0", "--top-p", "0.9", "--top-k", "50", "--min-p", "0.01", "--repetition-penalty", "1.1")
    a = mpiexec(2, *args, "--seed", "7")
    b = mpiexec(1, *args, "--seed", "7")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout


def assert_fails_cleanly(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, result.stderr  # one line, printed once (not once per rank)
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_bad_inputs_fail_with_one_line(tiny_models, tmp_path):
    good = tiny_models["llama"]
    run = lambda *args, n=2: mpiexec(n, "generate", "--prompt", "hi", *args, timeout=60)

    assert_fails_cleanly(run("--model", str(tmp_path / "nope")), "does not exist")

    odd = tmp_path / "odd"
    shutil.copytree(good, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "model_type": "gpt_bigcode"}))
    assert_fails_cleanly(run("--model", str(odd)), "gpt_bigcode", "supported", "llama", "qwen3")

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    model = transformers.AutoModelForCausalLM.from_pretrained(good)
    model.save_pretrained(sharded, max_shard_size="30KB")
    shutil.copy(good / "tokenizer.json", sharded)
    shutil.copy(good / "tokenizer_config.json", sharded)
    shards = sorted(sharded.glob("model-*.safetensors"))
    shards[-1].unlink()
    assert_fails_cleanly(run("--model", str(sharded)), shards[-1].name, "missing")

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_fails_cleanly(run("--model", str(truncated)), "model.safetensors", "truncated")

    assert_fails_cleanly(run("--model", str(good), n=5), "5 ranks", "4 layers")
    assert_fails_cleanly(run("--model", str(good), "--split", "1,2"), "--split", "sums to 3", "4 layers")
    assert_fails_cleanly(run("--model", str(good), "--split", "1,1,2"), "3 counts", "2 ranks")
    assert_fails_cleanly(run("--model", str(good), "--prompt", "word " * 600), "context is 512")
    assert_fails_cleanly(run("--model", str(good), "--top-p", "1.5"), "top-p")
    assert_fails_cleanly(run("--model", str(good), "--temp", "-1"), "--temp")
    assert_fails_cleanly(run("--model", str(good), "--max-tokens", "0"), "--max-tokens")
    assert_fails_cleanly(run("--model", str(good), "--top-k", "x"), "--top-k")


def test_exception_on_one_rank_aborts_the_job_quickly():
    """A bug on rank 1 while rank 0 waits for its activations: the job ends within seconds,
    with the traceback printed once, instead of hanging."""
    script = (
        "from mpi4py import MPI\n"
        "import numpy as np\n"
        "from pipeline.cluster import mpi\n"
        "from pipeline.cluster.transport import MpiTransport\n"
        "comm = MPI.COMM_WORLD\n"
        "mpi.abort_on_unhandled_exception(comm)\n"
        "t = MpiTransport(comm)\n"
        "if comm.rank == 1:\n"
        "    raise RuntimeError('boom on rank one')\n"
        "t.recv(np.empty(4), source=1)\n"
    )
    start = time.monotonic()
    result = subprocess.run(["mpiexec", "-n", "3", sys.executable, "-c", script], capture_output=True,
                            text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert time.monotonic() - start < 20
    assert result.returncode != 0
    assert result.stderr.count("boom on rank one") == 1
    assert "rank 1" in result.stderr
