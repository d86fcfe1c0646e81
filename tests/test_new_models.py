"""Kimi K2.5 and DeepSeek V3.2 against transformers (our oracle), from tiny random models that
transformers builds and saves: Kimi K2.5's language model inside its multimodal wrapper (the vision
tower saved beside it and never read), and V3.2's sparse attention (the lightning indexer choosing
the top-k cached positions of each query, on top of MLA)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from conftest import (INIT_STD, VOCAB_SIZE, assert_far_from_uniform, forward, greedy_ours, greedy_transformers,
                      load_stages, long_prompt, mpiexec, reference_logits, save_reference, transformers_text,
                      write_tokenizer)

LONG_PROMPT = long_prompt(64)


def _perturb(model) -> None:
    """Random init leaves norms at one and biases at zero: perturb them (router correction biases
    by more, negative ones too, so they change which experts win)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.5)


# ---------------------------------------------------------------------------------------- Kimi K2.5

def make_kimi_k25(folder, seed=0, vocab_size=VOCAB_SIZE, tokenizer=True):
    """Kimi K2.5 as transformers builds it: a K2 (DeepSeek V3) language model in a wrapper with a
    MoonViT vision tower and projector."""
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                num_experts_per_tok=3, n_group=1, topk_group=1, vocab_size=vocab_size, q_lora_rank=32,
                kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
                n_shared_experts=1, routed_scaling_factor=2.827, max_position_embeddings=512, eos_token_id=2,
                bos_token_id=None, initializer_range=INIT_STD)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                            tie_word_embeddings=False)
    model = Kimi_K25ForConditionalGeneration(config)
    _perturb(model)
    folder.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(folder)
    if tokenizer:
        write_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kimi_k25")
    return folder, make_kimi_k25(folder)


def test_kimi_k25_logits_match_transformers(kimi_k25):
    folder, reference = kimi_k25
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([LONG_PROMPT])).logits[0].numpy()
    assert_far_from_uniform(expected)
    (stage,) = load_stages(folder, [(0, 4)])
    # The published layout's names (language_model.*), the vision tower's never read.
    stored = json.loads((folder / "config.json").read_text())
    assert stored["model_type"] == "kimi_k25" and "text_config" in stored
    assert stage.loaded_tensors and not any("vision" in n or "mm_projector" in n for n in stage.loaded_tensors)
    # Tolerance just above the measured 1.59e-5 (logits up to |6|), as for DeepSeek V3.
    assert np.abs(forward([stage], LONG_PROMPT) - expected).max() <= 2e-5
    split = load_stages(folder, [(0, 1), (1, 3), (3, 4)])
    assert np.abs(forward(split, LONG_PROMPT) - expected).max() <= 2e-5


def test_kimi_k25_greedy_matches_transformers(kimi_k25):
    folder, reference = kimi_k25
    prompt = long_prompt(48, seed=3)
    expected = greedy_transformers(reference, prompt, 24)
    assert len(set(expected)) >= 12, expected
    (stage,) = load_stages(folder, [(0, 4)])
    assert greedy_ours(stage, folder, prompt, 24).tokens == expected


def test_kimi_k25_chat_with_kimis_tokenizer(tmp_path):
    """A Kimi K2.5 folder as Moonshot ships it: the wrapper's config.json, Kimi's tiktoken.model and
    chat template (its tokenization_kimi.py never run). The chat prompt is rendered and encoded the
    Kimi way, and our greedy answer to it is transformers' own."""
    from test_tokenizer_kimi import make_kimi_folder

    from pipeline.checkpoints.tokenizer import Tokenizer

    probe = make_kimi_folder(tmp_path / "probe")
    vocab = len((probe / "tiktoken.model").read_text().splitlines()) + 256
    reference = make_kimi_k25(tmp_path / "k25", vocab_size=vocab, tokenizer=False)
    config = json.loads((tmp_path / "k25" / "config.json").read_text())
    folder = make_kimi_folder(tmp_path / "k25", config=config, generation_config={"eos_token_id": vocab - 256 + 2})
    tokenizer = Tokenizer.from_folder(folder)
    assert not (folder / "EXECUTED").exists()
    prompt = tokenizer.prompt_ids("The quick brown fox? 你好")
    assert tokenizer.decode(prompt).startswith("<|im_system|>system<|im_middle|>You are Kimi")
    expected = greedy_transformers(reference, prompt, 16)
    (stage,) = load_stages(folder, [(0, 4)])
    assert greedy_ours(stage, folder, prompt, 16).tokens == expected


def test_kimi_k25_published_names_and_counts():
    """Kimi K2.5's config.json as published (pipeline/planner/configs/Kimi-K2.5.json): K2's language model
    (about 1.03T parameters, 32B activated, the model card's 1T/32B) with K2 Thinking's INT4
    experts, under a wrapper; its tensors are named language_model.* beside vision_tower.* and
    mm_projector.*, which no rank reads."""
    from pipeline.planner.config_files import load_config
    from pipeline.planner.shapes import architecture, count_params
    from pipeline.planner.stored_formats import checkpoint_format
    from pipeline.checkpoints.tensor_names import canonical_tensors

    config = load_config("Kimi-K2.5")
    counts = count_params(architecture(config))
    assert abs(counts.total - 1.03e12) <= 0.005 * 1.03e12  # 1026.4B
    assert abs(counts.active - 32e9) <= 0.02 * 32e9  # 31.69B
    assert (config.model_type, config.num_hidden_layers, config.vocab_size, config.tie_word_embeddings) == \
        ("deepseek_v3", 61, 163840, False)
    assert checkpoint_format(config).kind == "int4"  # the wrapper's quantization_config
    published = ["language_model.lm_head.weight", "language_model.model.embed_tokens.weight",
                 "language_model.model.norm.weight", "language_model.model.layers.7.self_attn.q_a_proj.weight",
                 "language_model.model.layers.7.mlp.experts.5.down_proj.weight_packed",
                 "mm_projector.proj.0.weight", "vision_tower.encoder.blocks.3.wqkv.weight",
                 "vision_tower.patch_embed.pos_emb.weight"]
    assert sorted(canonical_tensors(dict.fromkeys(published))) == [
        "lm_head.weight", "model.embed_tokens.weight", "model.layers.7.mlp.experts.5.down_proj.weight_packed",
        "model.layers.7.self_attn.q_a_proj.weight", "model.norm.weight"]
    # transformers' in-memory names, and its saved ones ("layers" written "blocks")
    assert sorted(canonical_tensors(dict.fromkeys(["model.language_model.layers.0.mlp.gate.weight",
                                                   "language_model.model.blocks.1.mlp.gate.weight",
                                                   "model.vision_tower.layers.0.attn.proj.weight"]))) == [
        "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]


# ------------------------------------------------------------------------------------- DeepSeek V3.2

INDEX_TOPK = 16  # LONG_PROMPT's later queries see up to 64 positions: the indexer keeps 16 of them
# 32 indexer heads, not a handful: a position whose ReLU(q . k) is 0 in every head scores exactly 0, and
# with 8 heads a few such ties reached the top-k boundary, where the choice between equal scores is
# arbitrary (torch's and ours differ); with 32 heads that never happens here.


def make_deepseek_v32(folder, seed=0):
    torch.manual_seed(seed)
    config = transformers.DeepseekV32Config(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        vocab_size=VOCAB_SIZE, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=512, eos_token_id=2,
        bos_token_id=None, initializer_range=INIT_STD, index_topk=INDEX_TOPK, index_n_heads=32, index_head_dim=16)
    model = transformers.DeepseekV32ForCausalLM(config)
    _perturb(model)
    return save_reference(model, folder)


@pytest.fixture(scope="module")
def deepseek_v32(tmp_path_factory):
    return reference_logits(make_deepseek_v32, tmp_path_factory.mktemp("deepseek_v32"), LONG_PROMPT)


V32_TOLERANCE = 2e-5  # measured 1.66e-5 (whole prompt, split in three), 1.73e-5 token by token; logits up to |7|


def test_deepseek_v32_logits_match_transformers(deepseek_v32):
    folder, _, expected = deepseek_v32
    assert_far_from_uniform(expected)
    (stage,) = load_stages(folder, [(0, 4)])
    assert np.abs(forward([stage], LONG_PROMPT) - expected).max() <= V32_TOLERANCE
    # The cache of each layer: MLA's latent (16) and rotary key (8), and the indexer's key (16).
    assert stage.kv_bytes_per_token == 4 * (16 + 8 + 16) * 4
    stage.release([0])
    incremental = np.concatenate([forward([stage], [t]) for t in LONG_PROMPT])  # decoding: one query at a time
    assert np.abs(incremental - expected).max() <= V32_TOLERANCE
    split = load_stages(folder, [(0, 1), (1, 3), (3, 4)])
    assert np.abs(forward(split, LONG_PROMPT) - expected).max() <= V32_TOLERANCE


def test_deepseek_v32_greedy_matches_transformers(deepseek_v32):
    folder, reference, _ = deepseek_v32
    prompt = long_prompt(48, seed=3)
    expected = greedy_transformers(reference, prompt, 24)
    assert len(set(expected)) >= 12, expected
    (stage,) = load_stages(folder, [(0, 4)])
    assert greedy_ours(stage, folder, prompt, 24).tokens == expected


@pytest.mark.parametrize("bug", ["every position", "the worst top-k", "one position late"])
def test_a_wrong_top_k_is_caught(bug, deepseek_v32, monkeypatch):
    """The comparison above can fail: each planted bug in the indexer's choice moves the logits by
    far more than the tolerance (measured 7.5-8.7)."""
    from pipeline.models.deepseek_v32 import LightningIndexer

    folder, _, expected = deepseek_v32
    right = LightningIndexer.selected
    wrong = {"every position": lambda self, q, w, keys, at: None,
             "the worst top-k": lambda self, q, w, keys, at: right(self, -q, w, keys, at),
             "one position late": lambda self, q, w, keys, at: right(self, q, w, keys, at - 1)
             if keys.shape[0] > self.top_k else None}[bug]
    monkeypatch.setattr(LightningIndexer, "selected", wrong)
    (stage,) = load_stages(folder, [(0, 4)])
    assert np.abs(forward([stage], LONG_PROMPT) - expected).max() > 100 * V32_TOLERANCE


def test_deepseek_v32_published_config():
    """DeepSeek-V3.2 as published: V3's 671B plus 0.85B of indexers (62 x 14M, the MTP layer's
    too) -- 685.4B in the download with the MTP module's copies of embedding and head (the model
    card's 685B), 37.5B activated; FP8 with 128x128 ue8m0 scales; the indexer key makes each
    layer's cache 512 + 64 + 128 values per token."""
    from pipeline.planner.config_files import load_config
    from pipeline.planner.shapes import architecture, count_params
    from pipeline.planner.stored_formats import checkpoint_format

    config = load_config("DeepSeek-V3.2")
    arch = architecture(config)
    counts = count_params(arch)
    assert abs(counts.total + counts.unused_with_copies - 685e9) <= 0.002 * 685e9
    assert abs(counts.total - 671.9e9) <= 0.001 * 671.9e9
    assert abs(counts.active - 37.5e9) <= 0.01 * 37.5e9
    assert arch.kv_values == 512 + 64 + 128
    assert (checkpoint_format(config).kind, checkpoint_format(config).block) == ("fp8", (128, 128))
    indexer = [p.name for p in arch.layers[5] if ".indexer." in p.name]
    assert indexer == [f"model.layers.5.self_attn.indexer.{n}" for n in
                       ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")]


# ------------------------------------------------------------------------------ across ranks, in batch

@pytest.mark.parametrize("family", ["kimi_k25", "deepseek_v32"])
def test_batch_on_two_ranks_gives_transformers_text(family, kimi_k25, deepseek_v32, tmp_path):
    """`mpiexec -n 2 ... batch`: prompts of several lengths (the longest past V3.2's top-k) packed in
    micro-batches over two ranks; each text is transformers' greedy one."""
    folder, reference = kimi_k25 if family == "kimi_k25" else deepseek_v32[:2]
    prompts = ["The capital of France is Paris.", "def hello(world):\n    return 42\n" * 4,
               "Pipeline parallel inference splits layers across ranks; hidden states travel between them."]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": 10}) + "\n" for i, p in enumerate(prompts)))
    result = mpiexec(2, "batch", "--model", str(folder), "--input", str(inp), "--output", str(out),
                     "--no-chat-template", "--quiet", env={"OPENBLAS_NUM_THREADS": "1"}, timeout=180)
    assert result.returncode == 0, result.stderr
    texts = {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}
    assert texts == {i: transformers_text(reference, folder, p, 10) for i, p in enumerate(prompts)}
