"""The LM head split by vocabulary over a tensor-parallel stage's group (models/vocab_split.py,
runtime/tensor_group.py SplitHead): on the same final hidden states, the split head's logits are the
unsplit head's bit for bit, its greedy tokens exactly the unsplit argmax (ties: the lowest id), its
logprobs and top entries the unsplit ones within float32 rounding of the logsumexp, and sampling with a
seed draws what one rank's sampler draws; against transformers' log-softmax too. T = 2 and 3, an untied
(Llama) and a tied (Qwen3) tiny model and the default model (GGUF Q4_1, tied, int8 head)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from conftest import REPO, long_prompt, make_tiny_model, mpiexec

from pipeline.models.vocab_split import combine, vocab_share

PROMPT = long_prompt()[:48]
TOP = 5
NINE_HEADS = dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, intermediate_size=256)
# |combined logprob - float64's on the unsplit head's logits| (each slice's logsumexp in MLX float32, combined
# in float32), measured: up to 1.02e-6 (tiny models, 384 entries, logits up to |10|), 1.03e-4 on the default model (49152
# entries, logits up to 38; MLX's own logsumexp of the whole row is 1.98e-4 off there)
LOGPROB_TOLERANCE = {"tiny": 2e-6, "default": 1.5e-4}
# |ours - transformers' log-softmax| of the greedy tokens' fp32 logprobs, measured up to 1.6e-5 (llama T=3;
# qwen3 6.8e-6): the layers' rounding (test_tensor_parallel's logits tolerances)
ORACLE_TOLERANCE = 3e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tphead")
    return {kind: make_tiny_model(kind, root / kind, **NINE_HEADS) for kind in ("llama", "qwen3")}


def run_worker(folder, ranks: int, out, prompt: list[int], rows=None) -> dict:
    command = ["mpiexec", "-n", str(ranks), sys.executable, str(REPO / "tests" / "tensor_parallel_head_worker.py"),
               str(folder), str(out), ",".join(map(str, prompt)), str(TOP)] + ([str(rows)] if rows else [])
    job = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert job.returncode == 0, job.stderr
    return dict(np.load(out))


def reference_logprobs(logits: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
    """Whole logits -> float64 log-softmax (the tokens' and the rows' logsumexp), and token_logprob's top
    entries as the scheduler reports them."""
    import mlx.core as mx

    from pipeline.runtime.scheduler import token_logprob

    wide = logits.astype(np.float64)
    peak = wide.max(axis=-1, keepdims=True)
    lse = peak[:, 0] + np.log(np.exp(wide - peak).sum(axis=-1))
    picked = wide[np.arange(len(tokens)), tokens] - lse
    return picked, lse, [token_logprob(mx.array(row), int(token), TOP).top for row, token in zip(logits, tokens)]


def check_split_head(folder, ranks: int, tmp_path, prompt: list[int], size: str = "tiny") -> dict:
    split = run_worker(folder, ranks, tmp_path / f"split{ranks}.npz", prompt)
    whole = run_worker(folder, 1, tmp_path / f"whole{ranks}.npz", prompt, rows=tmp_path / f"split{ranks}.npz")
    assert np.array_equal(split["logits"], whole["logits"])  # the slices gathered: the unsplit head's bits
    assert np.array_equal(split["tokens"], whole["logits"].argmax(axis=-1))  # greedy: exactly the argmax
    assert np.array_equal(split["tokens"], whole["tokens"])
    expected, lse, tops = reference_logprobs(whole["logits"], split["tokens"])
    logprobs = split["max"] - split["logsumexp"]
    tolerance = LOGPROB_TOLERANCE[size]
    assert np.abs(logprobs - expected).max() <= tolerance, np.abs(logprobs - expected).max()
    for row, top in enumerate(tops):
        assert split["top_ids"][row].tolist() == [token for token, _ in top], row
        values = split["top_values"][row] - split["logsumexp"][row]
        exact = whole["logits"][row, split["top_ids"][row]].astype(np.float64) - lse[row]
        assert np.abs(values - exact).max() <= tolerance, row
    assert np.array_equal(split["sampled"], whole["sampled"])  # seeded: the sampler draws alike
    return split


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_split_head_equals_the_unsplit_head(tiny, kind, tmp_path):
    folder = tiny[kind]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        oracle = torch.log_softmax(reference(torch.tensor([PROMPT])).logits[0], dim=-1).numpy()
    for ranks in (2, 3):
        split = check_split_head(folder, ranks, tmp_path, PROMPT)
        picked = oracle[np.arange(len(PROMPT)), split["tokens"]]
        logprobs = split["max"] - split["logsumexp"]
        assert np.abs(logprobs - picked).max() <= ORACLE_TOLERANCE, (ranks, np.abs(logprobs - picked).max())
        assert np.array_equal(split["tokens"], oracle.argmax(axis=-1)), ranks  # far from ties here


def test_default_model_split_head(tmp_path):
    """GGUF Q4_1 with a tied embedding and the int8 head: rank 0 keeps its rows of the int8 copy only."""
    from pipeline.checkpoints.tokenizer import Tokenizer
    from pipeline.checkpoints.default_model import default_model_dir

    prompt = Tokenizer.from_folder(default_model_dir(progress=False)).prompt_ids(
        "What is the capital of France?", use_chat_template=True)
    check_split_head("default", 2, tmp_path, prompt, size="default")


def test_vocab_shares():
    assert [vocab_share(49152, 2, m) for m in range(2)] == [(0, 24576), (24576, 49152)]
    assert [vocab_share(384, 3, m) for m in range(3)] == [(0, 128), (128, 256), (256, 384)]
    # 151936 = 9496 units of 16 over 3: 3166, 3165, 3165 units; a vocabulary not of whole units ends short
    assert [vocab_share(151936, 3, m) for m in range(3)] == [(0, 50656), (50656, 101296), (101296, 151936)]
    assert vocab_share(100, 3, 2) == (80, 100)


def test_combine_ties_and_logsumexp():
    """Summaries of slices combined: the first index of the largest logit over the whole vocabulary even
    where slices tie (equal maxima in two slices, and twice within one), logsumexp and top entries as on
    the whole row."""
    import mlx.core as mx

    from pipeline.models.vocab_split import summary

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 40)).astype(np.float32)
    logits[0, [5, 25]] = 9.0  # a tie across slices: the lower id
    logits[1, [25, 35]] = 9.0  # a tie in the second and third slices
    logits[2, [21, 23]] = 9.0  # a tie within a slice
    logits[3, [3, 39]] = 9.0
    logits[4, :] = 1.0  # all equal: entry 0
    bounds = [(0, 16), (16, 32), (32, 40)]
    parts = [np.asarray(summary(mx.array(logits[:, b:e]), TOP)) for b, e in bounds]
    got = combine(parts, [b for b, _ in bounds], TOP)
    assert got.tokens.tolist() == logits.argmax(axis=-1).tolist() == [5, 25, 21, 3, 0, got.tokens[5]]
    lse = np.log(np.exp(logits.astype(np.float64)).sum(axis=-1))
    assert np.abs(got.logsumexp - lse).max() <= 2e-6
    order = np.lexsort((np.broadcast_to(np.arange(40), logits.shape), -logits), axis=-1)[:, :TOP]
    assert got.top_ids[[0, 1, 2, 3, 5]].tolist() == order[[0, 1, 2, 3, 5]].tolist()
    assert got.top_ids[0, :2].tolist() == [5, 25]


def test_stats_and_preflight_count_the_head_slices(tmp_path):
    """A hybrid of 2 stages x 2 (untied Llama, vocabulary 8192 so that the head, 4.5 MiB in fp32, shows at
    0.1 MiB): rank 0 holds its half of the head, rank 1 the other half (the stats line's LM head share),
    stage 1 none; preflight counts each rank's weights as the stats line does and rank 1's share in its need."""
    folder = make_tiny_model("llama", tmp_path / "llama", vocab_size=8192, **NINE_HEADS)
    pre = mpiexec(4, "preflight", "--model", str(folder), "--tensor-parallel", "2", "--weights-in-memory", "fp32")
    assert pre.returncode == 0, pre.stderr
    rows = [line.split() for line in pre.stdout.splitlines()[1:] if line.strip() and line.split()[0].isdigit()]
    planned = [float(row[row.index("MiB", 12) - 1]) for row in rows]
    needs = [float(row[row.index("MiB", 12) + 4]) for row in rows]  # weights ("MiB fp32"), KV cache, the need
    job = mpiexec(4, "generate", "--model", str(folder), "--prompt", "The capital of France", "--max-tokens", "4",
                  "--no-chat-template", "--tensor-parallel", "2", "--weights-in-memory", "fp32")
    assert job.returncode == 0, job.stderr
    measured = [float(m) for m in re.findall(r"\(weights ([0-9.]+) MiB", job.stderr)]
    shares = re.findall(r"r(\d+) [0-9.]+ MiB \(weights [^)]*?LM head share ([0-9.]+) MiB", job.stderr)
    assert planned == measured and len(measured) == 4, (planned, measured)
    half = 4096 * 144 * 4 / 2**20  # 2.25 MiB: half the head's rows
    assert shares == [("1", f"{half:.1f}")], job.stderr  # rank 1 only
    assert abs((needs[1] - needs[3]) - 1.1 * half) <= 0.15, needs  # stage 0's mate needs its share more


def test_default_model_head_share_in_preflight():
    """The default model (tied 8-bit embedding, int8 head): rank 1's slice as the stats line measures it
    (repacked for the int8 products) is what preflight adds to its need; rank 0's weights alike."""
    pre = mpiexec(2, "preflight", "--tensor-parallel", "2")
    assert pre.returncode == 0, pre.stderr
    rows = [line.split() for line in pre.stdout.splitlines()[1:] if line.strip() and line.split()[0].isdigit()]
    weights = [float(row[row.index("MiB", 12) - 1]) for row in rows]
    kv = [float(row[row.index("MiB", 12) + 2]) for row in rows]  # weights ("MiB quantized"), KV cache, the need
    needs = [float(row[row.index("MiB", 12) + 4]) for row in rows]
    job = mpiexec(2, "generate", "--tensor-parallel", "2", "--prompt", "What is the capital of France?",
                  "--max-tokens", "2")
    assert job.returncode == 0, job.stderr
    measured = [float(m) for m in re.findall(r"\(weights ([0-9.]+) MiB", job.stderr)]
    share = re.findall(r"LM head share ([0-9.]+) MiB", job.stderr)
    assert weights[0] == measured[0] and len(share) == 1, (weights, measured, job.stderr)
    assert abs(needs[1] / 1.1 - weights[1] - kv[1] - float(share[0])) <= 0.15, (needs, weights, kv, share)
