"""--tensor-parallel T --expert-parallel: a Qwen3-MoE layer's experts divided among the stage's group, whole
(models/expert_parallel.py). Against transformers for T = 2 and 3 on a tiny Qwen3-MoE of 8 experts (over 3
ranks: 3 + 3 + 2) whose 9 query / 3 KV heads no T here divides evenly; the same greedy text run after run
and for a hybrid of 2 stages x 2; batch as generate; preflight's weights per rank as the job holds them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

from conftest import REPO, assert_far_from_uniform, long_prompt, mpiexec

from pipeline.models.expert_parallel import expert_share, own_pairs

PROMPT = long_prompt()
# max |ours - transformers| of fp32 logits on PROMPT (64 tokens, logits up to |6.4|), 8 experts of 64
# features, top 2, hidden 64, measured: T=2 1.18e-5 (token by token 1.29e-5), T=3 1.15e-5 (1.34e-5); 10
# experts top 3: T=2 0.67e-5 (0.76e-5), T=3 0.64e-5 (0.72e-5). As tensor_parallel's slicing (1.36e-5).
TOLERANCE = 1.5e-5


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from test_moe import make_qwen3_moe

    folder = tmp_path_factory.mktemp("ep") / "qwen3_moe"
    make_qwen3_moe(folder, num_attention_heads=9, num_key_value_heads=3, moe_intermediate_size=64)
    return folder


def test_expert_shares_and_own_pairs():
    """Whole experts, contiguous, the first E % T members one more; a member runs only the choices it holds."""
    assert [expert_share(64, 2, m) for m in range(2)] == [(0, 32), (32, 64)]
    assert [expert_share(8, 3, m) for m in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert [expert_share(64, 3, m) for m in range(3)] == [(0, 22), (22, 43), (43, 64)]
    indices = np.array([[5, 1, 3], [0, 2, 1], [7, 6, 4]], np.uint32)
    positions, local = own_pairs(indices, 3, 6)  # member 1 of 3 over 8: experts 3, 4, 5
    assert positions.tolist() == [0, 2, 8] and local.tolist() == [2, 0, 1]
    assert [own_pairs(indices, *expert_share(8, 3, m))[0].size for m in range(3)] == [4, 3, 2]


def worker_logits(folder, ranks: int, tmp_path) -> np.ndarray:
    """[whole prompt, token by token] logits of one stage of T = ranks (tests/expert_parallel_worker.py)."""
    out = tmp_path / f"logits{ranks}.npy"
    job = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, str(REPO / "tests" / "expert_parallel_worker.py"),
                          str(folder), str(out), ",".join(map(str, PROMPT))],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert job.returncode == 0, job.stderr
    return np.load(out)


def test_logits_match_transformers_for_2_and_3_ranks(moe, tmp_path):
    reference = transformers.AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
    assert_far_from_uniform(expected)
    for ranks in (2, 3):
        whole, incremental = worker_logits(moe, ranks, tmp_path)
        assert np.abs(whole - expected).max() <= TOLERANCE, (ranks, np.abs(whole - expected).max())
        assert np.abs(incremental - expected).max() <= TOLERANCE, (ranks, np.abs(incremental - expected).max())


def generate(ranks: int, folder, *flags: str, prompt: str = "The capital of France", tokens: int = 24):
    return mpiexec(ranks, "generate", "--model", str(folder), "--prompt", prompt, "--max-tokens", str(tokens),
                   "--no-chat-template", "--tensor-parallel", "2", "--expert-parallel", *flags)


def test_repeated_runs_and_hybrid_give_the_same_text(moe):
    one_stage, again, hybrid = generate(2, moe), generate(2, moe), generate(4, moe)
    for job in (one_stage, again, hybrid):
        assert job.returncode == 0, job.stderr
    assert one_stage.stdout.strip() and one_stage.stdout == again.stdout == hybrid.stdout
    assert "group sums" in one_stage.stderr


def test_batch_equals_generate(moe, tmp_path):
    prompts = ["The capital of France", "hello", "def hello(world):\n", "Pipeline parallel inference splits"]
    rows = [{"id": i, "prompt": p, "max_tokens": 10} for i, p in enumerate(prompts)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = {}
    for r in rows:
        job = generate(2, moe, prompt=r["prompt"], tokens=10)
        assert job.returncode == 0, job.stderr
        expected[r["id"]] = job.stdout[:-1]
    job = mpiexec(2, "batch", "--model", str(moe), "--input", str(inp), "--output", str(out), "--no-chat-template",
                  "--quiet", "--tensor-parallel", "2", "--expert-parallel")
    assert job.returncode == 0, job.stderr
    # (generate's stdout read as text: a \r in a random model's text reads as \n there)
    got = {r["id"]: r["text"].replace("\r\n", "\n").replace("\r", "\n")
           for r in map(json.loads, out.read_text().splitlines())}
    assert got == expected


def test_share_fractions_count_whole_experts(moe):
    """share_fractions (preflight's and plan's accounting) == the bytes a member's layer holds once loaded,
    for 8 experts over 3 (3, 3, 2 whole experts: members 0 and 1 hold equal shares) and over 2; slicing's
    (64 features over 3: 32, 16, 16) for comparison. Norms are left out of the fraction: within 3e-4."""
    from mlx.utils import tree_flatten

    from pipeline.checkpoints.model_files import locate
    from pipeline.models.tensor_parallel import Shard, share_fractions
    from pipeline.runtime.stage import Stage

    checkpoint = locate(moe).open(None)
    config = checkpoint.model_config()

    def held(shard) -> float:
        stage = Stage.load(config, checkpoint, (0, 1), has_ends=False, dtype=mx.float32, shard=shard)
        return sum(v.nbytes for _, v in tree_flatten(stage.model.layers[0].parameters()))

    whole = held(None)
    for size, experts in ((3, True), (2, True), (3, False)):
        fractions = [held(Shard(m, size, experts)) / whole for m in range(size)]
        planned = [share_fractions(config, Shard(m, size, experts))[0] for m in range(size)]
        assert np.allclose(fractions, planned, atol=3e-4), (size, experts, fractions, planned)
        if experts and size == 3:
            assert fractions[0] == fractions[1] > fractions[2]


def test_preflight_counts_whole_experts_per_member(moe):
    """8 experts over 3 ranks (3, 3, 2): preflight's weights per rank are what each rank holds."""
    flags = ("--tensor-parallel", "3", "--expert-parallel", "--weights-in-memory", "fp32")
    pre = mpiexec(3, "preflight", "--model", str(moe), *flags)
    assert pre.returncode == 0, pre.stderr
    rows = [line.split() for line in pre.stdout.splitlines()[1:] if line.strip()]
    planned = [float(row[rows[0].index("MiB", 12) - 1]) for row in rows]  # the weights column
    job = mpiexec(3, "generate", "--model", str(moe), "--prompt", "hello", "--max-tokens", "2", "--no-chat-template",
                  *flags)
    assert job.returncode == 0, job.stderr
    measured = [float(m) for m in re.findall(r"\(weights ([0-9.]+) MiB", job.stderr)]
    assert len(planned) == len(measured) == 3 and planned == measured, (planned, measured)
    assert measured[1] > measured[2]  # 3 experts vs 2 (rank 0 holds the ends too)


def test_mla_families_refuse_expert_parallel(tmp_path):
    """DeepSeek V3's MoE cannot divide its experts yet: one line naming the family, slicing still allowed."""
    from test_tensor_parallel_mla import make

    from pipeline.checkpoints.model_files import locate
    from pipeline.models.tensor_parallel import Shard, share_fractions
    from pipeline.util.errors import UserError

    make("deepseek_v3", tmp_path / "v3")
    config = locate(tmp_path / "v3").open(None).model_config()
    with pytest.raises(UserError, match="--expert-parallel is not supported for deepseek_v3 yet"):
        share_fractions(config, Shard(0, 2, True))
    share_fractions(config, Shard(0, 2))
