"""Qwen3.5-MoE against transformers (our oracle): a tiny random model as transformers 5.25 writes it
(`Qwen3_5MoeForConditionalGeneration`: the language model under model.language_model.*, its vision
tower saved beside it and never read), its Gated DeltaNet layers and gated full-attention layers
mixed so that on 3 ranks each rank holds both kinds and both kinds meet at a rank boundary."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from conftest import (INIT_STD, VOCAB_SIZE, assert_far_from_uniform, forward, greedy_ours, greedy_transformers,
                      load_stages, long_prompt, mpiexec, reference_logits, transformers_text, write_tokenizer)

# Ranks of 2 layers each: (linear, full), (full, linear), (linear, full); boundaries full|full, linear|linear.
LAYER_TYPES = ["linear_attention", "full_attention", "full_attention", "linear_attention", "linear_attention",
               "full_attention"]
THREE_RANKS = [(0, 2), (2, 4), (4, 6)]
# 80 tokens: past transformers' chunk of 64 in its chunked prefill.
LONG_PROMPT = long_prompt(80, seed=5)
# Measured: 4.4e-5 against transformers' forward (logits up to |7|), which prefills with the chunked
# form of the delta rule; against transformers fed one token at a time (the sequential recurrence,
# as ours) 3e-5.
TOLERANCE = 1.5e-4


def make_qwen3_5_moe(folder, seed=0):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=VOCAB_SIZE, max_position_embeddings=512, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2, linear_conv_kernel_dim=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=LAYER_TYPES, eos_token_id=2, bos_token_id=None, initializer_range=INIT_STD)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision))
    # Norms start at zero (scaled by 1 + weight), the gated norm at one, dt_bias at one: perturb them,
    # and spread the decays' rates so that some heads forget fast and some slowly.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.05, 2.0)))
    folder.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(folder)
    # Published checkpoints carry an MTP module (transformers drops it): two of its tensors, never read.
    from safetensors.torch import load_file, save_file  # here: only this fixture rewrites a checkpoint

    tensors = load_file(folder / "model.safetensors")
    tensors.update({"mtp.fc.weight": torch.randn(64, 128), "mtp.layers.0.input_layernorm.weight": torch.randn(64)})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    write_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    return reference_logits(make_qwen3_5_moe, tmp_path_factory.mktemp("qwen3_5_moe"), LONG_PROMPT)


def test_logits_match_transformers_on_1_and_3_ranks(qwen3_5_moe):
    folder, _, expected = qwen3_5_moe
    assert_far_from_uniform(expected)
    stored = json.loads((folder / "config.json").read_text())
    assert stored["model_type"] == "qwen3_5_moe" and "text_config" in stored
    (stage,) = load_stages(folder, [(0, 6)])
    from pipeline.checkpoints.safetensors_checkpoint import Checkpoint  # here: only this test opens one itself

    held = Checkpoint(folder).tensors
    assert any(n.startswith("mtp.") for n in held) and any(n.startswith("model.visual.") for n in held)
    assert stage.loaded_tensors and not any("visual" in n or "mtp" in n for n in stage.loaded_tensors)
    one_rank = forward([stage], LONG_PROMPT)
    print(f"max logit error vs transformers: {np.abs(one_rank - expected).max():.3g}")
    assert np.abs(one_rank - expected).max() <= TOLERANCE
    three_ranks = forward(load_stages(folder, THREE_RANKS), LONG_PROMPT)
    assert np.array_equal(three_ranks, one_rank)


def _states(stages, seq=0):
    """Every layer's cache of one sequence, as numpy: a linear layer's convolution window and memory,
    an attention layer's keys and values."""
    out = []
    for stage in stages:
        for cache in stage.caches[seq]:
            if hasattr(cache, "recurrent"):
                out += [np.array(cache.conv), np.array(cache.recurrent)]
            else:
                out += [np.array(cache.keys[..., :cache.offset, :]), np.array(cache.values[..., :cache.offset, :])]
    return out


def test_prefill_in_chunks_gives_the_state_of_one_pass(qwen3_5_moe):
    """The prompt in pieces of 7 (a piece shorter than the convolution's window too) on 3 ranks: each
    layer's state and the logits are those of one pass, within float rounding (the products and the
    experts' gathers of 7 rows round differently from those of 80: measured 2e-5 on the states, 1e-5 on
    the logits); the convolution and the recurrence alone, fed the same inputs, to the bit."""
    folder, _, _ = qwen3_5_moe
    whole, pieces = load_stages(folder, THREE_RANKS), load_stages(folder, THREE_RANKS)
    expected = forward(whole, LONG_PROMPT)[-1]
    cuts = [0, 2, 9, 16, 23, 30, 37, 44, 51, 58, 65, 72, 79, 80]
    for begin, end in zip(cuts, cuts[1:]):
        got = forward(pieces, LONG_PROMPT[begin:end])[-1]
    print(f"chunked prefill vs one pass: logits {np.abs(got - expected).max():.3g}, states "
          f"{max(np.abs(a - b).max() for a, b in zip(_states(pieces), _states(whole))):.3g}")
    assert np.abs(got - expected).max() <= 1e-4
    for ours, theirs in zip(_states(pieces), _states(whole)):
        assert ours.shape == theirs.shape and np.abs(ours - theirs).max() <= 1e-4
    # The fixed-size state: a linear layer's bytes do not grow with the context.
    linear = pieces[0].caches[0][0]
    assert linear.offset == 80 and linear.bytes_per_token == 0
    assert linear.nbytes == (3 * 128 + 4 * 16 * 16) * 4  # conv window 3 x (2 x 2 x 16 + 4 x 16), memory 4 x 16 x 16
    # The convolution and the recurrence of one linear layer, the same inputs in pieces and at once.
    from pipeline.models.cache import LinearAttentionState

    layer = whole[0].model.layers[0].linear_attn
    rng = np.random.default_rng(0)
    mixed = mx.array(rng.standard_normal((80, 128)).astype(np.float32))
    decay, beta = mx.array(rng.uniform(0.3, 1, (80, 4)).astype(np.float32)), mx.array(rng.uniform(0, 1, (80, 4)).astype(np.float32))
    at_once, in_pieces = LinearAttentionState(), LinearAttentionState()
    out = layer.sequence(mixed, decay, beta, at_once)
    parts = [layer.sequence(mixed[b:e], decay[b:e], beta[b:e], in_pieces) for b, e in zip(cuts, cuts[1:])]
    assert np.array_equal(np.array(mx.concatenate(parts)), np.array(out))
    assert np.array_equal(np.array(in_pieces.conv), np.array(at_once.conv))
    assert np.array_equal(np.array(in_pieces.recurrent), np.array(at_once.recurrent))


def test_greedy_matches_transformers_in_prefill_chunks(qwen3_5_moe, monkeypatch):
    """generate's path, the prompt fed in prefill chunks of 16, then decoding: transformers' greedy tokens."""
    from pipeline.runtime import engine

    folder, reference, _ = qwen3_5_moe
    prompt = long_prompt(48, seed=3)
    expected = greedy_transformers(reference, prompt, 24)
    assert len(set(expected)) >= 12, expected
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 16)
    (stage,) = load_stages(folder, [(0, 6)])
    assert greedy_ours(stage, folder, prompt, 24).tokens == expected


def _update_before_decay(memory, q, k, v, decay, beta):
    """The planted bug: the delta rule's correction measured against the memory before its decay,
    the decay applied after the write."""
    recalled = (memory * k[:, :, None]).sum(axis=1)
    memory = memory + k[:, :, None] * (beta[:, None] * (v - recalled))[:, None, :]
    memory = memory * decay[:, None, None]
    return memory, (memory * q[:, :, None]).sum(axis=1)


def _window_shifted(right):
    """The planted bug: the convolution's state keeps the window one step early (drops the newest input)."""
    def call(self, x, state):
        before = state.conv if state.conv is not None else mx.zeros((self.weight.shape[-1] - 1, x.shape[1]), x.dtype)
        out = right(self, x, state)
        state.conv = mx.concatenate([before, x], axis=0)[-self.weight.shape[-1]:-1]
        return out
    return call


@pytest.mark.parametrize("bug", ["gate after the update", "convolution state one step early"])
def test_planted_bugs_are_caught(bug, qwen3_5_moe, monkeypatch):
    """The comparisons above can fail: the decay applied after the delta rule's write moves the logits of
    one pass far past the tolerance; a convolution state kept one step early leaves one pass alone (it
    never reads the state back) but moves the logits of a prompt prefilled in two pieces."""
    from pipeline.models import gated_deltanet

    folder, _, expected = qwen3_5_moe
    if bug == "gate after the update":
        monkeypatch.setattr(gated_deltanet, "delta_rule_step", _update_before_decay)
        (stage,) = load_stages(folder, [(0, 6)])
        assert np.abs(forward([stage], LONG_PROMPT) - expected).max() > 100 * TOLERANCE
    else:
        monkeypatch.setattr(gated_deltanet.DepthwiseConv, "__call__",
                            _window_shifted(gated_deltanet.DepthwiseConv.__call__))
        (stage,) = load_stages(folder, [(0, 6)])
        forward([stage], LONG_PROMPT[:40])
        assert np.abs(forward([stage], LONG_PROMPT[40:]) - expected[40:]).max() > 100 * TOLERANCE


PROMPTS = ["The capital of France is Paris.", "def hello(world):\n    return 42\n" * 4,
           "Pipeline parallel inference splits layers across ranks; hidden states travel between them."]


def test_three_ranks_generate_transformers_text(qwen3_5_moe):
    """`mpiexec -n 3 ... generate`: two layers a rank, both kinds on each, the hidden states crossing a
    full|full and a linear|linear boundary; transformers' greedy text."""
    folder, reference, _ = qwen3_5_moe
    expected = transformers_text(reference, folder, PROMPTS[2], 16)
    assert len(expected) >= 10, expected
    result = mpiexec(3, "generate", "--model", str(folder), "--no-chat-template", "--prompt", PROMPTS[2],
                     "--max-tokens", "16", "--split", "2,2,2", env={"OPENBLAS_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout[:-1] == expected


def test_batch_on_two_ranks_is_generate(qwen3_5_moe, tmp_path):
    """`mpiexec -n 2 ... batch`: prompts of several lengths packed in micro-batches, each sequence's linear
    states its own; each text is transformers' greedy one."""
    folder, reference, _ = qwen3_5_moe
    expected = {i: transformers_text(reference, folder, p, 10) for i, p in enumerate(PROMPTS)}
    assert all(len(text) >= 10 for text in expected.values()), expected
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": 10}) + "\n" for i, p in enumerate(PROMPTS)))
    result = mpiexec(2, "batch", "--model", str(folder), "--input", str(inp), "--output", str(out),
                     "--no-chat-template", "--quiet", env={"OPENBLAS_NUM_THREADS": "1"}, timeout=180)
    assert result.returncode == 0, result.stderr
    assert {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())} == expected


def test_bfloat16_is_as_close_as_transformers_bfloat16(qwen3_5_moe):
    """--dtype bfloat16 (the linear layers' memory and decay parameters still float32) against the fp32
    truth, beside transformers loaded in bfloat16 (whose recurrence also runs in float32). Measured on
    64 tokens, ours / transformers': median of the per-position largest error 0.34 / 0.61, positions off
    by more than 1: 9 / 19, top-1 agreeing with fp32's 0.92."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration  # here: this test alone reloads it

    folder, _, expected = qwen3_5_moe
    prompt = LONG_PROMPT[:64]
    with torch.no_grad():
        bf16 = Qwen3_5MoeForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
        theirs = bf16(input_ids=torch.tensor([prompt])).logits[0].float().numpy()
    truth = expected[:64]  # a causal model: the first 64 positions of the 80-token prompt's logits
    ours = forward(load_stages(folder, [(0, 6)], dtype=mx.bfloat16), prompt)
    ours_error, their_error = np.abs(ours - truth).max(-1), np.abs(theirs - truth).max(-1)
    assert np.median(ours_error) <= 1.25 * np.median(their_error), (np.median(ours_error), np.median(their_error))
    assert (ours_error > 1).sum() <= (their_error > 1).sum() + 2
    assert (ours.argmax(-1) == truth.argmax(-1)).mean() >= 0.875
