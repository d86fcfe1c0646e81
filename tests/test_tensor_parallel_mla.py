"""--tensor-parallel T for the DeepSeek V3 family (Kimi K2's too) and DeepSeek V3.2
(models/tensor_parallel_mla.py): MLA's heads split for the up-projections, attention and o_proj, the
latent projections and latent cache whole on every rank; the router and V3.2's indexer whole, their
top-k the first member's; routed experts, shared experts and dense MLPs sliced by their features.
Against transformers for T = 1, 2 and 3 on tiny models with 5 heads (T = 2: 3 + 2, T = 3: 2 + 2 + 1),
a dense first layer, MoE layers with a shared expert and group-limited routing; planted bugs in the
split fail the comparison; the same greedy text run after run, for 2 stages x 2, and in batch as in
generate; preflight counts what each rank holds, the replicated latents included."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from mlx.utils import tree_flatten

from conftest import INIT_STD, REPO, VOCAB_SIZE, assert_far_from_uniform, long_prompt, mpiexec, write_tokenizer

from pipeline.models.config import ModelConfig
from pipeline.models.registry import family_for
from pipeline.models.stage_slice import TransformerSlice
from pipeline.models.tensor_parallel import MLA_TOOLS, Shard, check_family, shard_modules
from pipeline.models.tensor_parallel_mla import heads_of, layer_fractions, layer_parameters
from pipeline.util.errors import UserError

PROMPT = long_prompt()
# 5 heads (no T > 1 here divides them), 48 expert features (3 units of 16: T = 3 gets 16 each), one shared
# expert, the first layer dense, 8 experts in 4 groups (top 3 of the best 2 groups)
SHAPE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=5,
             intermediate_size=128, moe_intermediate_size=48, n_routed_experts=8, num_experts_per_tok=3,
             n_group=4, topk_group=2, vocab_size=VOCAB_SIZE, q_lora_rank=32, kv_lora_rank=16,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
             n_shared_experts=1, max_position_embeddings=512, eos_token_id=2, bos_token_id=None,
             initializer_range=INIT_STD)
# V3.2: its indexer keeps 16 of up to 64 positions (32 indexer heads: no exact-zero ties at the boundary,
# see tests/test_new_models.py)
V32 = dict(index_topk=16, index_n_heads=32, index_head_dim=16)
# max |ours - transformers| of fp32 logits on PROMPT (64 tokens, logits up to |6.4|), whole prompt / token
# by token through the cache, measured: deepseek_v3 T=1 1.38e-5 / 1.36e-5, T=2 1.36e-5 / 1.34e-5, T=3
# 1.53e-5 / 1.60e-5; without a query latent (q_proj) T=1 2.21e-5, T=2 2.33e-5 / 2.26e-5; deepseek_v32 T=1
# 1.44e-5 / 1.53e-5, T=2 1.47e-5 / 1.44e-5, T=3 1.45e-5 / 1.41e-5; kimi_k2 T=2 as deepseek_v3's, bit for bit
TOLERANCE = {"deepseek_v3": 2e-5, "deepseek_v3_q_proj": 2.6e-5, "deepseek_v32": 2e-5, "kimi_k2": 2e-5}
RANKS = {"deepseek_v3": (1, 2, 3), "deepseek_v3_q_proj": (1, 2), "deepseek_v32": (1, 2, 3), "kimi_k2": (2,)}


def _perturb_and_save(model, folder):
    """Norms off one, router correction biases off zero (negative ones too): every term exercised."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(folder)
    write_tokenizer(folder)


def make(kind: str, folder) -> None:
    torch.manual_seed(0)
    if kind == "deepseek_v32":
        model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**SHAPE, **V32))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **{**SHAPE, "q_lora_rank": None if kind == "deepseek_v3_q_proj" else SHAPE["q_lora_rank"]}))
    _perturb_and_save(model, folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tp_mla")
    for kind in ("deepseek_v3", "deepseek_v3_q_proj", "deepseek_v32"):
        make(kind, root / kind)
    # Kimi K2: DeepSeek V3's architecture under its own model_type (transformers has none: V3's logits)
    shutil.copytree(root / "deepseek_v3", root / "kimi_k2")
    config = json.loads((root / "kimi_k2" / "config.json").read_text())
    (root / "kimi_k2" / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    return {kind: root / kind for kind in TOLERANCE}


def reference(folder) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].numpy()


def worker_logits(folder, ranks: int, tmp_path, plant: str | None = None) -> np.ndarray:
    """[whole prompt, token by token] logits of one stage of T = ranks (tests/tensor_parallel_worker.py;
    with a planted bug, tests/tensor_parallel_mla_worker.py)."""
    out = tmp_path / f"logits{ranks}{plant or ''}.npy"
    worker = "tensor_parallel_mla_worker.py" if plant else "tensor_parallel_worker.py"
    job = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, str(REPO / "tests" / worker),
                          str(folder), str(out), ",".join(map(str, PROMPT))], capture_output=True, text=True,
                         timeout=300, cwd=REPO, env={**os.environ, "PLANT": plant or ""})
    assert job.returncode == 0, job.stderr
    return np.load(out)


@pytest.mark.parametrize("kind", list(TOLERANCE))
def test_logits_match_transformers_for_1_2_3_ranks(models, kind, tmp_path):
    expected = reference(models["deepseek_v3" if kind == "kimi_k2" else kind])
    assert_far_from_uniform(expected)
    for ranks in RANKS[kind]:
        whole, incremental = worker_logits(models[kind], ranks, tmp_path)
        errors = np.abs(whole - expected).max(), np.abs(incremental - expected).max()
        print(kind, ranks, errors)
        assert max(errors) <= TOLERANCE[kind], (ranks, errors)


# each planted bug moves the logits by far more than the tolerance (measured: kv_b 10.4, o_proj 9.9,
# expert 6.5, indexer 7.6; tests/tensor_parallel_mla_worker.py plants them)
@pytest.mark.parametrize("plant", ["kv_b", "o_proj", "expert", "indexer"])
def test_a_wrong_split_is_caught(models, plant, tmp_path):
    kind = "deepseek_v32" if plant == "indexer" else "deepseek_v3"
    expected = reference(models[kind])
    whole, _ = worker_logits(models[kind], 2, tmp_path, plant)
    print(plant, np.abs(whole - expected).max())
    assert np.abs(whole - expected).max() > 100 * TOLERANCE[kind]


def generate(ranks: int, folder, *flags: str, prompt: str = "The capital of France") -> subprocess.CompletedProcess:
    return mpiexec(ranks, "generate", "--model", str(folder), "--prompt", prompt, "--max-tokens", "24",
                   "--no-chat-template", *flags)


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v32"])
def test_same_text_run_after_run_and_batch_equals_generate(models, kind, tmp_path):
    """--tensor-parallel 2: the same greedy text twice, on one stage of 2 and on 2 stages x 2; a batch's
    sequences (micro-batched through the group's sums) each get the text generate gives it alone. V3.2:
    24 new tokens take the sequences past the indexer's 16 positions, where it chooses."""
    folder = models[kind]
    one_stage = generate(2, folder, "--tensor-parallel", "2")
    again = generate(2, folder, "--tensor-parallel", "2")
    hybrid = generate(4, folder, "--tensor-parallel", "2")
    for job in (one_stage, again, hybrid):
        assert job.returncode == 0, job.stderr
    assert one_stage.stdout.strip() and one_stage.stdout == again.stdout == hybrid.stdout
    assert "group sums" in one_stage.stderr
    prompts = ["The capital of France", "hello", "def hello(world):\n"]
    rows = [{"id": i, "prompt": p, "max_tokens": 24} for i, p in enumerate(prompts)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = {0: one_stage.stdout[:-1]}
    for r in rows[1:]:
        job = generate(2, folder, "--tensor-parallel", "2", prompt=r["prompt"])
        assert job.returncode == 0, job.stderr
        expected[r["id"]] = job.stdout[:-1]
    job = mpiexec(2, "batch", "--model", str(folder), "--input", str(inp), "--output", str(out),
                  "--no-chat-template", "--quiet", "--tensor-parallel", "2")
    assert job.returncode == 0, job.stderr
    got = {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}
    # generate's stdout, read as text, has its "\r" turned into "\n" (universal newlines); the JSON keeps it
    assert {i: text.replace("\r\n", "\n").replace("\r", "\n") for i, text in got.items()} == expected


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v32"])
def test_preflight_counts_what_each_rank_holds(models, kind):
    """preflight --tensor-parallel 2: each rank's weights as the job's stats line measures them, the
    latent projections, norms, router (and indexer) counted whole on both ranks."""
    folder = models[kind]
    pre = mpiexec(2, "preflight", "--model", str(folder), "--tensor-parallel", "2", "--weights-in-memory", "fp32")
    assert pre.returncode == 0, pre.stderr
    rows = [line.split() for line in pre.stdout.splitlines()[1:] if line.strip()]
    planned = [float(row[rows[0].index("MiB", 12) - 1]) for row in rows]  # the weights column
    job = generate(2, folder, "--tensor-parallel", "2", "--weights-in-memory", "fp32")
    assert job.returncode == 0, job.stderr
    measured = [float(m) for m in re.findall(r"\(weights ([0-9.]+) MiB", job.stderr)]
    assert len(planned) == len(measured) == 2 and planned == measured, (planned, measured)


def test_shares():
    """Heads split as evenly as 5 go; per layer, the members' shares add up to the layer with its
    replicated parts (latent projections, norms, router, indexer) once per member."""
    config = ModelConfig.from_dict(dict(model_type="deepseek_v3", **SHAPE))
    assert [heads_of(config, Shard(m, 2), MLA_TOOLS) for m in range(2)] == [(0, 3), (3, 5)]
    assert [heads_of(config, Shard(m, 3), MLA_TOOLS) for m in range(3)] == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(UserError, match="more than the model's 5 attention heads"):
        heads_of(config, Shard(5, 6), MLA_TOOLS)
    assert layer_fractions(config, Shard(0, 1), MLA_TOOLS) == [1.0] * 4
    whole = [layer_parameters(config, i, 5, (128, 48, 48)) for i in range(4)]
    nothing = [layer_parameters(config, i, 0, (0, 0, 0)) for i in range(4)]  # what every member holds whole
    for t in (2, 3):
        held = np.sum([np.array(layer_fractions(config, Shard(m, t), MLA_TOOLS)) * whole for m in range(t)], axis=0)
        assert np.allclose(held, np.array(whole) + (t - 1) * np.array(nothing))
    # the dense layer: 2 x 64 norms, q_a 64 x 32 + 32, kv_a 64 x 24 + 16, q_b 32 x 5 x 24, kv_b 16 x 5 x 32,
    # o 80 x 64, MLP 3 x 64 x 128
    assert whole[0] == 128 + 64 * 32 + 32 + 64 * 24 + 16 + 32 * 120 + 16 * 160 + 80 * 64 + 3 * 64 * 128
    for kind in ("deepseek_v3", "deepseek_v32"):  # the fractions are the sharded modules' own sizes
        config = ModelConfig.from_dict(dict(model_type=kind, **SHAPE, **(V32 if kind == "deepseek_v32" else {})))
        family = family_for(config).module()
        sizes = []
        for m in range(3):
            model = TransformerSlice(config, family.DecoderLayer, 0, 4, False)
            if m:
                shard_modules(model, config, Shard(m - 1, 2))
            sizes.append([sum(v.size for _, v in tree_flatten(layer.parameters())) for layer in model.layers])
        for m in range(2):
            assert np.allclose(np.array(sizes[m + 1]) / sizes[0], layer_fractions(config, Shard(m, 2), MLA_TOOLS))
    check_family(SimpleNamespace(model_type="kimi_k2"), "deepseek_v3", 2)
    check_family(SimpleNamespace(model_type="deepseek_v32"), "deepseek_v32", 2)
    with pytest.raises(UserError, match="not supported for deepseek_v4"):
        check_family(SimpleNamespace(model_type="deepseek_v4"), "deepseek_v4", 2)


@pytest.mark.parametrize("layout", ["split", "legacy"])
def test_gguf_deepseek2_with_two_ranks(layout, tmp_path):
    """A DeepSeek GGUF (llama.cpp's deepseek2: kv_b split into attn_k_b / attn_v_b, or the older attn_kv_b
    without a query latent), Q8_0 (o_proj's columns cut on its blocks of 32: v_head_dim 32), 5 heads: T = 2
    against transformers on the file's values."""
    import test_gguf_inplace as g  # its GGUF writer (llama.cpp's layout) and reference
    from gguf import GGMLQuantizationType as QT

    (tmp_path / "vocab").mkdir()
    write_tokenizer(tmp_path / "vocab")
    types = {"exps": QT.Q8_0, "attn": QT.Q8_0, "ffn_": QT.Q8_0, "token_embd": QT.Q8_0, "output.": QT.Q8_0}
    overrides = {"q_lora_rank": None} if layout == "legacy" else {}
    model = g._deepseek(tmp_path / "hf", num_attention_heads=5, num_key_value_heads=5, **overrides)
    written = g.write_model(tmp_path / "m.gguf", model, "deepseek2", g._by_kind(types), mla=layout,
                            vocab=g.gguf_vocab(tmp_path / "vocab"))
    expected = np.asarray(g.reference(model, written["state"]))
    whole, incremental = worker_logits(written["files"][0], 2, tmp_path)
    errors = np.abs(whole - expected).max(), np.abs(incremental - expected).max()
    print(layout, errors)
    # measured 6.50e-5 (split; T = 1 6.59e-5), 8.51e-5 (legacy, no query latent); tests/test_gguf_inplace.py's
    # T = 1 bounds for these layouts: 7e-5 and 1.1e-4
    assert max(errors) <= {"split": 7e-5, "legacy": 9e-5}[layout], errors


def test_mtp_drafts_with_two_ranks(tmp_path):
    """--draft mtp under --tensor-parallel 2: rank 0 holds DeepSeek's MTP module whole and drafts; the
    verified text equals the text without drafts (4 heads: 2 + 2)."""
    from test_moe import make_deepseek  # the MTP test's model and its module
    from test_mtp import add_mtp_layer

    main = make_deepseek(tmp_path / "model", num_nextn_predict_layers=1)
    add_mtp_layer(tmp_path / "model", main, tmp_path / "donor")
    args = ("generate", "--model", str(tmp_path / "model"), "--no-chat-template", "--prompt", "hello", "--max-tokens",
            "24", "--tensor-parallel", "2")
    plain = mpiexec(2, *args, "--draft", "none")
    drafted = mpiexec(2, *args, "--draft", "mtp", "--draft-tokens", "2")
    assert plain.returncode == 0 and drafted.returncode == 0, plain.stderr + drafted.stderr
    assert drafted.stdout == plain.stdout and plain.stdout.strip()
    stats = re.search(r"speculative: drafted (\d+), accepted (\d+)", drafted.stderr)
    assert stats and int(stats.group(1)) > 0, drafted.stderr
