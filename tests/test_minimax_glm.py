"""MiniMax-M2 and GLM-5 (issue 36) against transformers (our oracle), from tiny random models that
transformers 5 builds and saves. MiniMax-M2 under its published names (`block_sparse_moe`, experts'
w1/w2/w3): its q/k RMSNorm over all heads together, RoPE over the first rotary_dim features of each head,
and sigmoid routing whose correction bias only chooses the experts. GLM-5: V3.2's sparse attention with
an interleaved-RoPE indexer, and layers that reuse the last full layer's top-k (both kinds on the first
and last of three stages). Per family: logits on one stage, split in three and token by token, greedy
text with the prompt in several prefill chunks, a batch job on three ranks, and a planted bug per
mechanism."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import (INIT_STD, VOCAB_SIZE, assert_bfloat16_close, assert_far_from_uniform, forward, fp8_blocks,
                      greedy_ours, greedy_transformers, load_stages, long_prompt, mpiexec, reference_logits,
                      save_reference, transformers_text)
from pipeline.checkpoints.tokenizer import Tokenizer
from pipeline.models import glm_moe_dsa as glm_family, minimax_m2 as minimax_family
from pipeline.runtime import engine
from pipeline.runtime.prefix_cache import PrefixCache
from pipeline.runtime.requests import ListSource, Request, SamplingParams, Tokens

LONG_PROMPT = long_prompt(64)


def _perturb(model) -> None:
    """Random init leaves norms at one and the correction bias at zero: perturb them (the bias by
    more, negative too, so it changes which experts win)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.5)


def _batch_texts(folder, ranks: int, prompts: list[str], tmp_path, max_tokens: int = 10,
                 extra: tuple[str, ...] = ()) -> dict[int, str]:
    """`mpiexec -n RANKS ... batch` over the prompts: each id's text."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": max_tokens}) + "\n"
                           for i, p in enumerate(prompts)))
    result = mpiexec(ranks, "batch", "--model", str(folder), "--input", str(inp), "--output", str(out),
                     "--no-chat-template", "--quiet", *extra, env={"OPENBLAS_NUM_THREADS": "1"}, timeout=180)
    assert result.returncode == 0, result.stderr
    return {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}


BATCH_PROMPTS = ["The capital of France is Paris.", "def hello(world):\n    return 42\n" * 4,
                 "Pipeline parallel inference splits layers across ranks; hidden states travel between them."]


# ------------------------------------------------------------------------------------------ MiniMax-M2

def make_minimax_m2(folder, seed=0):
    torch.manual_seed(seed)
    config = transformers.MiniMaxM2Config(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=3, vocab_size=VOCAB_SIZE,
        rotary_dim=8,  # the published config's legacy field: RoPE on half of each head
        max_position_embeddings=512, bos_token_id=None, eos_token_id=2, initializer_range=INIT_STD)
    model = transformers.MiniMaxM2ForCausalLM(config)
    _perturb(model)
    return save_reference(model, folder)


@pytest.fixture(scope="module")
def minimax_m2(tmp_path_factory):
    return reference_logits(make_minimax_m2, tmp_path_factory.mktemp("minimax_m2"), LONG_PROMPT)


MINIMAX_TOLERANCE = 2e-5  # measured 5.0e-6 (whole prompt, split in three, token by token); logits up to |6.6|


def test_minimax_m2_logits_match_transformers(minimax_m2):
    folder, _, expected = minimax_m2
    assert_far_from_uniform(expected)
    with safe_open(folder / "model.safetensors", "np") as stored:
        assert "model.layers.2.block_sparse_moe.experts.7.w3.weight" in stored.keys()  # as published
    (stage,) = load_stages(folder, [(0, 4)])
    # read as transformers' in-memory names
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in stage.loaded_tensors
    assert "model.layers.2.mlp.e_score_correction_bias" in stage.loaded_tensors
    assert np.abs(forward([stage], LONG_PROMPT) - expected).max() <= MINIMAX_TOLERANCE
    assert stage.kv_bytes_per_token == 4 * 2 * (2 * 16) * 4  # 4 layers, keys and values of 2 KV heads x 16
    stage.release([0])
    incremental = np.concatenate([forward([stage], [t]) for t in LONG_PROMPT])  # decoding: one query at a time
    assert np.abs(incremental - expected).max() <= MINIMAX_TOLERANCE
    split = load_stages(folder, [(0, 1), (1, 3), (3, 4)])
    assert np.abs(forward(split, LONG_PROMPT) - expected).max() <= MINIMAX_TOLERANCE


def test_minimax_m2_greedy_matches_transformers_in_prefill_chunks(minimax_m2, monkeypatch):
    """generate's path, the 48-token prompt fed in three prefill chunks of 16."""
    folder, reference, _ = minimax_m2
    prompt = long_prompt(48, seed=6)
    expected = greedy_transformers(reference, prompt, 24)
    assert len(set(expected)) >= 12, expected
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 16)
    (stage,) = load_stages(folder, [(0, 4)])
    assert greedy_ours(stage, folder, prompt, 24).tokens == expected


def _per_head_norm(self, x):
    """The planted bug: each head normed alone (Qwen3's way), with its slice of the weight."""
    heads, d = x.shape[-2], x.shape[-1]
    variance = (x * x).mean(axis=-1, keepdims=True)
    return x * mx.rsqrt(variance + self.eps) * self["weight"].reshape(heads, d)


@pytest.mark.parametrize("bug", ["q/k norm per head", "routing without the correction bias",
                                 "RoPE over the whole head"])
def test_minimax_m2_planted_bugs_are_caught(bug, minimax_m2, monkeypatch):
    """The comparison above can fail: each mechanism done the wrong way moves the logits far past the
    tolerance."""
    family = minimax_family
    folder, _, expected = minimax_m2
    if bug == "q/k norm per head":
        monkeypatch.setattr(family.RMSNormOverHeads, "__call__", _per_head_norm)
    elif bug == "RoPE over the whole head":
        monkeypatch.setattr(family, "rotary_dims", lambda config: config.head_dim)
    (stage,) = load_stages(folder, [(0, 4)])
    if bug == "routing without the correction bias":
        for layer in stage.model.layers:
            del layer.mlp["e_score_correction_bias"]
    assert np.abs(forward([stage], LONG_PROMPT) - expected).max() > 100 * MINIMAX_TOLERANCE


def test_minimax_m2_batch_on_three_ranks_gives_transformers_text(minimax_m2, tmp_path):
    """`mpiexec -n 3 ... batch`: prompts of several lengths in micro-batches over three ranks (a layer
    boundary after layers 1 and 2 or so); each text is transformers' greedy one, as generate's is."""
    folder, reference, _ = minimax_m2
    texts = _batch_texts(folder, 3, BATCH_PROMPTS, tmp_path)
    assert texts == {i: transformers_text(reference, folder, p, 10) for i, p in enumerate(BATCH_PROMPTS)}


# --------------------------------------------------------------------------------------------- GLM-5

GLM_INDEXERS = ["full", "shared", "full", "full", "shared"]  # layer 1 reuses layer 0's top-k, layer 4 layer 3's
GLM_SPLIT = [(0, 1), (1, 4), (4, 5)]  # ranks 1 and 2 begin at shared layers: the top-k crosses both boundaries
GLM_INDEX_TOPK = 16  # LONG_PROMPT's later queries see up to 64 positions: the indexer keeps 16 (32 indexer
# heads, so that no two positions tie at the top-k boundary: see test_new_models.py's INDEX_TOPK)


def make_glm_moe_dsa(folder, seed=0):
    torch.manual_seed(seed)
    config = transformers.GlmMoeDsaConfig(
        hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, vocab_size=VOCAB_SIZE, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"], indexer_types=GLM_INDEXERS,
        index_topk=GLM_INDEX_TOPK, index_n_heads=32, index_head_dim=16, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=2, initializer_range=INIT_STD)
    model = transformers.GlmMoeDsaForCausalLM(config)
    _perturb(model)
    with torch.no_grad():  # the indexer's LayerNorm bias too
        for name, p in model.named_parameters():
            if name.endswith("bias") and "norm" not in name:
                p.add_(torch.randn_like(p) * 0.1)
    return save_reference(model, folder)


@pytest.fixture(scope="module")
def glm_moe_dsa(tmp_path_factory):
    return reference_logits(make_glm_moe_dsa, tmp_path_factory.mktemp("glm_moe_dsa"), LONG_PROMPT)


GLM_TOLERANCE = 3e-5  # measured 1.23-1.57e-5 (whole prompt, split in three, token by token); logits up to |6.2|


def test_glm_moe_dsa_logits_match_transformers(glm_moe_dsa):
    folder, _, expected = glm_moe_dsa
    assert_far_from_uniform(expected)
    (stage,) = load_stages(folder, [(0, 5)])
    assert np.abs(forward([stage], LONG_PROMPT) - expected).max() <= GLM_TOLERANCE
    # The caches: MLA's latent (16) and rotary key (8) in every layer, the indexer's key (16) in the full ones.
    assert stage.kv_bytes_per_token == (5 * (16 + 8) + 3 * 16) * 4
    stage.release([0])
    incremental = np.concatenate([forward([stage], [t]) for t in LONG_PROMPT])  # decoding: one query at a time
    assert np.abs(incremental - expected).max() <= GLM_TOLERANCE
    split = load_stages(folder, GLM_SPLIT)
    assert np.abs(forward(split, LONG_PROMPT) - expected).max() <= GLM_TOLERANCE


def test_glm_moe_dsa_greedy_matches_transformers_in_prefill_chunks(glm_moe_dsa, monkeypatch):
    folder, reference, _ = glm_moe_dsa
    prompt = long_prompt(48, seed=6)
    expected = greedy_transformers(reference, prompt, 24)
    assert len(set(expected)) >= 12, expected
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 16)
    (stage,) = load_stages(folder, [(0, 5)])
    assert greedy_ours(stage, folder, prompt, 24).tokens == expected


def test_glm_moe_dsa_top_k_crosses_rank_boundaries(glm_moe_dsa):
    """Ranks beginning at a shared layer get the top-k with the hidden states (index_topk more columns),
    in float32 and in bfloat16 (int32 bits in pairs of bf16 columns): the logits of each split equal the
    logits of one stage, to the bit; a decode step's too."""
    folder, _, _ = glm_moe_dsa
    for dtype in (mx.float32, mx.bfloat16):
        whole = load_stages(folder, [(0, 5)], dtype=dtype)
        split = load_stages(folder, GLM_SPLIT, dtype=dtype)
        hidden = split[0].run_layers(split[0].model.embed(mx.array([LONG_PROMPT])))
        assert hidden.shape[-1] == 64 + GLM_INDEX_TOPK * (4 // hidden.dtype.size)  # the top-k rides along
        split[0].release([0])
        assert np.array_equal(forward(whole, LONG_PROMPT), forward(split, LONG_PROMPT))
        assert np.array_equal(forward(whole, LONG_PROMPT[:5]), forward(split, LONG_PROMPT[:5]))


@pytest.mark.parametrize("bug", ["top-k off by one", "reused top-k from the wrong layer", "indexer RoPE in halves",
                                 "sent top-k one position early"])
def test_glm_moe_dsa_planted_bugs_are_caught(bug, glm_moe_dsa, monkeypatch):
    """The comparison above can fail: each mechanism done the wrong way moves the logits far past the
    tolerance."""
    family = glm_family
    folder, _, expected = glm_moe_dsa
    if bug == "sent top-k one position early":  # as received by ranks 1 and 2
        right = family.as_mask
        monkeypatch.setattr(family, "as_mask", lambda chosen, positions, top_k: right(
            chosen - 1 if chosen is not None and chosen.dtype == mx.int32 else chosen, positions, top_k))
        stages = load_stages(folder, GLM_SPLIT)
        assert np.abs(forward(stages, LONG_PROMPT) - expected).max() > 100 * GLM_TOLERANCE
        return
    (stage,) = load_stages(folder, [(0, 5)])
    attention = [layer.self_attn for layer in stage.model.layers]
    if bug == "top-k off by one":
        for a in attention:
            if not a.shared:
                a.indexer.top_k = GLM_INDEX_TOPK - 1
    elif bug == "reused top-k from the wrong layer":  # layer 4 gets layer 2's choice, not layer 3's
        attention[3].relay = family.TopKRelay()
    else:  # V3.2's rotate-half pairs
        for a in attention:
            if not a.shared:
                a.indexer.rope.traditional = False
    assert np.abs(forward([stage], LONG_PROMPT) - expected).max() > 100 * GLM_TOLERANCE


def test_glm_moe_dsa_batch_on_three_ranks_gives_transformers_text(glm_moe_dsa, tmp_path):
    """`mpiexec -n 3 ... batch --split 1,3,1`: ranks 1 and 2 begin at shared layers, the top-k they
    reuse sent with the hidden states; the longest prompt past the top-k; each text is transformers'
    greedy one."""
    folder, reference, _ = glm_moe_dsa
    texts = _batch_texts(folder, 3, BATCH_PROMPTS, tmp_path, extra=("--split", "1,3,1"))
    assert texts == {i: transformers_text(reference, folder, p, 10) for i, p in enumerate(BATCH_PROMPTS)}


# ------------------------------------------------------------- drafts and the prefix cache, per family

@pytest.fixture(params=["minimax_m2", "glm_moe_dsa"])
def family(request):
    """(folder, transformers model) of each family's tiny model (its module fixture)."""
    return request.getfixturevalue(request.param)[:2]


@pytest.mark.parametrize("right", [2, 0])
def test_drafts_right_or_wrong_give_the_same_tokens_and_caches(family, right):
    """Drafts half right, all wrong, verified past GLM's top-k (a 40-token prompt, 24 more): the tokens
    are plain greedy decoding's, and the caches hold what plain decoding's do, bit for bit."""
    from test_speculative import Oracle, run  # here: another test module's helpers, for these tests alone

    folder, _ = family
    (stage,) = load_stages(folder, [(0, json.loads((folder / "config.json").read_text())["num_hidden_layers"])])
    prompt = long_prompt(40, seed=6)
    plain, plain_caches = run(stage, folder, prompt, 24)
    assert len(set(plain.tokens)) >= 8, plain.tokens
    drafted, caches = run(stage, folder, prompt, 24, Oracle(plain.tokens, len(prompt), 4, right))
    assert drafted.tokens == plain.tokens and drafted.draft.drafted > 0
    assert (drafted.draft.accepted > 0) == (right > 0)
    for (k, v), (pk, pv) in zip(caches, plain_caches, strict=True):
        assert k.shape == pk.shape and np.array_equal(k, pk) and np.array_equal(v, pv)


def test_prefix_cache_hit_equals_a_cold_run(family):
    """A second turn that re-sends the first turn's prompt and answer resumes from the kept caches: the
    same greedy text as a cold run, each chosen token's logprob within float rounding."""
    from test_scheduler import REUSE_TOLERANCE, Collect, scheduler  # here: another test module's helpers

    folder, _ = family
    (stage,) = load_stages(folder, [(0, json.loads((folder / "config.json").read_text())["num_hidden_layers"])])
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.eos_token_ids = set()  # a random model says end-of-text early; decode the full length
    first, greedy = long_prompt(40, seed=6), SamplingParams()
    answer = greedy_ours(stage, folder, first, 12).tokens
    stage.release([0])
    second = first + answer + long_prompt(8, seed=7)
    cold = Collect()
    scheduler(stage, tokenizer, ListSource([Request(second, greedy, 12, cold, logprobs=0)])).run()
    turns = [Collect(), Collect()]
    cache = PrefixCache(capacity_tokens=4096)
    warm = scheduler(stage, tokenizer, ListSource([Request(first, greedy, 12, turns[0]),
                                                   Request(second, greedy, 12, turns[1], logprobs=0)]), max_batch=1)
    warm.prefix_cache = cache
    warm.run()
    hit = turns[1].last
    assert hit.cached_tokens >= len(first) + len(answer) - 1 and cold.last.cached_tokens == 0
    assert hit.text == cold.last.text and hit.completion_tokens == cold.last.completion_tokens == 12
    ours = [e.logprob.logprob for e in turns[1].events if isinstance(e, Tokens)]
    theirs = [e.logprob.logprob for e in cold.events if isinstance(e, Tokens)]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= REUSE_TOLERANCE


def test_minimax_m2_fp8_as_published(minimax_m2, tmp_path):
    """MiniMax-M2's files as published: FP8 e4m3 projections (the experts' w1/w2/w3 included) with a
    weight_scale_inv per 128x128 block, the router and correction bias left unconverted. Our logits are
    transformers' on the same weights dequantized."""
    folder, _, _ = minimax_m2
    stored = load_file(str(folder / "model.safetensors"))
    fp8, dequantized = {}, {}
    for name, t in stored.items():
        if name.endswith("proj.weight") or name.endswith((".w1.weight", ".w2.weight", ".w3.weight")):
            q, scale_inv = fp8_blocks(t.float())
            fp8[name], fp8[name + "_scale_inv"] = q, scale_inv
            blocks = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[: t.shape[0], : t.shape[1]]
            dequantized[name] = q.float() * blocks
        else:
            fp8[name] = dequantized[name] = t
    assert sum(n.endswith("_scale_inv") for n in fp8) == 4 * (4 + 3 * 8)  # attention's 4, experts' 24, per layer
    config = json.loads((folder / "config.json").read_text())
    published = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                 "weight_block_size": [128, 128],
                 "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    for name, tensors, extra in (("fp8", fp8, {"quantization_config": published}), ("dequantized", dequantized, {})):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **extra}))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(folder / f, tmp_path / name / f)
    reference = transformers.MiniMaxM2ForCausalLM.from_pretrained(tmp_path / "dequantized").eval()
    with torch.no_grad():
        expected = reference(torch.tensor([LONG_PROMPT])).logits[0].numpy()
    (stage,) = load_stages(tmp_path / "fp8", [(0, 4)])
    assert np.abs(forward([stage], LONG_PROMPT) - expected).max() <= MINIMAX_TOLERANCE


def test_bfloat16_is_as_close_as_transformers_own(family):
    """--dtype bfloat16 against transformers loaded in bfloat16, both against the float32 truth (conftest's
    bounds; measured medians ours / theirs: MiniMax-M2 0.070 / 0.069, GLM-5 0.359 / 0.363, GLM's 6 / 6
    positions off by more than 1 where bf16 flips a near-tied expert or top-k position)."""
    folder, reference = family
    with torch.no_grad():
        truth = reference(torch.tensor([LONG_PROMPT])).logits[0].numpy()
        theirs = type(reference).from_pretrained(folder, dtype=torch.bfloat16).eval()(
            torch.tensor([LONG_PROMPT])).logits[0].float().numpy()
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    ours = forward(load_stages(folder, [(0, layers)], dtype=mx.bfloat16), LONG_PROMPT)
    assert_bfloat16_close(ours, theirs, truth)
