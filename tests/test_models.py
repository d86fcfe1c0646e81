"""Our model code against transformers' own implementation of the same random weights."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

from conftest import (ROPE_WINDOW, assert_bfloat16_close, assert_far_from_uniform, forward, greedy_ours,
                      greedy_transformers, load_stages, long_prompt, make_tiny_model, mpiexec, shim_buildable)
from pipeline.models.config import ModelConfig
from pipeline.runtime.stage import Stage
from pipeline.checkpoints.tokenizer import Tokenizer
from pipeline.checkpoints.safetensors_checkpoint import Checkpoint

PROMPT = [1, 5, 77, 23, 299, 3, 4, 5, 6, 100, 42, 17]
LONG_PROMPT = long_prompt(64)  # past ROPE_WINDOW (32): llama3 scaling and YaRN at work
assert len(LONG_PROMPT) > 1.5 * ROPE_WINDOW

# Qwen3 with YaRN as Qwen publishes it for long contexts (factor 4, no mscale keys: the rotation
# itself is scaled by 0.1 ln(factor) + 1).
QWEN3_YARN = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": ROPE_WINDOW}}

# max |ours - transformers| of fp32 logits on LONG_PROMPT (whole prompt and token by token: the same
# here), measured with OpenBLAS and the BLAS shim: llama 1.81e-5, qwen3 0.99e-5, qwen3-yarn 1.51e-5,
# qwen2 2.14e-5, mistral 1.55e-5, on logits that reach |7|. Each tolerance sits just above.
TOLERANCE = {"llama": 2.5e-5, "qwen3": 1.5e-5, "qwen3-yarn": 2e-5, "qwen2": 3e-5, "mistral": 2e-5}
DENSE = list(TOLERANCE)


@pytest.fixture(scope="module")
def dense_models(tiny_models, tmp_path_factory) -> dict:
    yarn = make_tiny_model("qwen3", tmp_path_factory.mktemp("yarn") / "qwen3", **QWEN3_YARN)
    return {**tiny_models, "qwen3-yarn": yarn}


def reference_model(folder, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def reference_logits(folder, token_ids, dtype=torch.float32):
    with torch.no_grad():
        return reference_model(folder, dtype)(torch.tensor([token_ids])).logits[0].float().numpy()


@pytest.mark.parametrize("kind", DENSE)
def test_logits_match_transformers(dense_models, kind):
    folder = dense_models[kind]
    expected = reference_logits(folder, LONG_PROMPT)
    assert_far_from_uniform(expected)
    tolerance = TOLERANCE[kind]

    (stage,) = load_stages(folder, [(0, 4)])
    full = forward([stage], LONG_PROMPT)
    assert np.abs(full - expected).max() <= tolerance

    # Token by token through the KV cache gives the same logits as the whole prompt at once.
    stage.release([0])
    incremental = np.concatenate([forward([stage], [t]) for t in LONG_PROMPT])
    assert np.abs(incremental - expected).max() <= tolerance

    # Split into three stages, as three ranks would hold it: identical to one stage.
    stages = load_stages(folder, [(0, 1), (1, 3), (3, 4)])
    assert np.array_equal(forward(stages, LONG_PROMPT), full)


@pytest.mark.parametrize("kind", DENSE)
def test_greedy_continuation_matches_transformers(dense_models, kind):
    """Our generate loop (prefill, then decode through the KV cache) picks transformers' greedy
    tokens, 32 of them past a 48-token prompt, and no loop of a few tokens: at least 16 distinct
    (19-29 measured, here and in test_moe)."""
    folder = dense_models[kind]
    prompt = long_prompt(48, seed=3)
    expected = greedy_transformers(reference_model(folder), prompt, 32)
    assert len(set(expected)) >= 16, expected
    (stage,) = load_stages(folder, [(0, 4)])
    result = greedy_ours(stage, folder, prompt, 32)
    assert result.tokens == expected


@pytest.mark.parametrize("kind", DENSE)
def test_bfloat16_matches_transformers_bfloat16(dense_models, kind):
    folder = dense_models[kind]
    truth = reference_logits(folder, LONG_PROMPT)
    theirs = reference_logits(folder, LONG_PROMPT, torch.bfloat16)
    (stage,) = load_stages(folder, [(0, 4)], dtype=mx.bfloat16)
    ours = forward([stage], LONG_PROMPT)
    assert_bfloat16_close(ours, theirs, truth)


def test_generation_stops_at_the_end_of_the_context(tmp_path):
    """Asked for 100 tokens with only room for 14 in a 64-token context, generation gives
    transformers' 14 greedy tokens and stops with reason "length": in process (one rank, the
    overlapped decode loop) and in a 2-rank `generate` job."""
    folder = make_tiny_model("qwen3", tmp_path / "short", max_position_embeddings=64)
    reference = reference_model(folder)
    prompt = long_prompt(50, seed=2)
    (stage,) = load_stages(folder, [(0, 4)])
    result = greedy_ours(stage, folder, prompt, 100)
    assert result.finish_reason == "length" and result.tokens == greedy_transformers(reference, prompt, 64 - 50)
    assert stage.caches[0][0].offset == 63  # the last token is sampled, never fed back

    text = "Pipeline parallel inference splits layers across ranks; hidden states travel between them. " * 2
    ids = Tokenizer.from_folder(folder).prompt_ids(text, use_chat_template=False)
    room = 64 - len(ids)
    assert 4 <= room <= 40, len(ids)
    job = mpiexec(2, "generate", "--model", str(folder), "--prompt", text, "--max-tokens", "100", "--no-chat-template")
    assert job.returncode == 0, job.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert job.stdout == tokenizer.decode(greedy_transformers(reference, ids, room)) + "\n"
    assert f"({room} tokens, length)" in job.stderr


def test_config_dialects_agree():
    """rope_theta/rope_scaling (published checkpoints) and rope_parameters (transformers 5)."""
    base = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=10)
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = ModelConfig.from_dict({**base, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **scaling}})
    new = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                             **scaling}})
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "llama3", **scaling}
    plain = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None
    assert plain.head_dim == 16 and plain.num_key_value_heads == 4


def test_mlx_quantized_folder_loads(tiny_models, tmp_path):
    """An MLX-quantized folder (packed uint32 weights + scales/biases, `quantization` in
    config.json, as mlx-community publishes) computes with exactly the dequantized weights."""
    import json

    import mlx.nn as nn

    source = tiny_models["llama"]
    checkpoint = Checkpoint(source)
    quantized, dequantized = {}, {}
    for name in checkpoint.tensors:
        w = checkpoint.read(name)
        if name.endswith("proj.weight") or name == "lm_head.weight":
            q, s, b = mx.quantize(w, group_size=32, bits=4)
            quantized[name], quantized[name[:-6] + "scales"], quantized[name[:-6] + "biases"] = q, s, b
            dequantized[name] = mx.dequantize(q, s, b, group_size=32, bits=4)
        else:
            quantized[name] = dequantized[name] = w
    for folder, tensors in (("q", quantized), ("dq", dequantized)):
        (tmp_path / folder).mkdir()
        mx.save_safetensors(str(tmp_path / folder / "model.safetensors"), tensors)
        cfg = json.loads((source / "config.json").read_text())
        if folder == "q":
            cfg["quantization"] = {"group_size": 32, "bits": 4}
        (tmp_path / folder / "config.json").write_text(json.dumps(cfg))
    (q_stage,) = load_stages(tmp_path / "q", [(0, 4)])
    (dq_stage,) = load_stages(tmp_path / "dq", [(0, 4)])
    assert isinstance(q_stage.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert np.abs(forward([q_stage], PROMPT) - forward([dq_stage], PROMPT)).max() <= 1e-4


def test_sharded_bf16_folder(tiny_models, tmp_path):
    """Sharded safetensors with an index, in bfloat16, as most published checkpoints are."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    (stage,) = load_stages(tmp_path, [(0, 4)])
    expected = model.float().eval()(torch.tensor([PROMPT])).logits[0].detach().numpy()
    assert np.abs(forward([stage], PROMPT) - expected).max() <= 1e-4


def test_each_rank_reads_exactly_its_own_tensors(tiny_models, monkeypatch):
    folder = tiny_models["llama"]
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        all_names = set(f.keys())
    reads = []
    original = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, name: reads.append(name) or original(self, name))

    ranges = [(0, 1), (1, 3), (3, 4)]
    seen = set()
    for rank, (start, end) in enumerate(ranges):
        reads.clear()
        (stage,) = [Stage.load(ModelConfig.from_folder(folder), Checkpoint(folder), (start, end),
                               has_ends=rank == 0, dtype=mx.float32)]
        expected = {n for n in all_names
                    if any(n.startswith(f"model.layers.{i}.") for i in range(start, end))}
        if rank == 0:
            expected |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        assert set(reads) == expected == set(stage.loaded_tensors)
        assert len(reads) == len(set(reads))  # each read once
        seen |= set(reads)
    assert seen == all_names


def expect_batch_invariant_products() -> bool:
    """Whether this process's fp32 products round each row as alone (the BLAS shim is in use);
    where OpenBLAS and a C compiler are installed (as in CI) it must be."""
    from pipeline.kernels import blas

    if blas.invariant_rows():
        return True
    assert not shim_buildable(), blas.describe()
    return False


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "deepseek_v3"])
def test_packed_sequences_equal_separate_runs(tiny_models, tmp_path, family):
    """Several sequences packed into one forward pass, each at its own position, give what
    each gives alone: batching must not change results. Bit for bit where the BLAS shim makes
    products batch-invariant (then a greedy batch job equals generate however it is grouped)."""
    if family in ("qwen3_moe", "deepseek_v3"):
        from test_moe import make_deepseek, make_qwen3_moe

        folder = tmp_path / family
        (make_deepseek if family == "deepseek_v3" else make_qwen3_moe)(folder)
    else:
        folder = tiny_models[family]
    (stage,) = load_stages(folder, [(0, 4)])
    model = stage.model
    a, b, c = PROMPT, PROMPT[3:8], [7, 8, 9]
    next_id = iter(range(1000))

    def run(seq_tokens: dict[int, list[int]], last_only: bool) -> dict[int, np.ndarray]:
        ids = list(seq_tokens)
        lengths = [len(t) for t in seq_tokens.values()]
        hidden = model.embed(mx.array([[t for toks in seq_tokens.values() for t in toks]]))
        hidden = stage.run_layers(hidden, ids, lengths, last_only=last_only)
        ends = range(len(ids)) if last_only else np.cumsum(lengths) - 1  # last_only: one row per sequence
        return {s: np.array(model.logits(hidden[:, e]))[0] for s, e in zip(ids, ends)}

    def alone(prompt: list[int], steps: list[int], last_only: bool) -> list[np.ndarray]:
        seq = next(next_id) + 100
        out = [run({seq: prompt}, last_only)[seq]]
        return out + [run({seq: [t]}, last_only)[seq] for t in steps]

    tolerance = 0.0 if expect_batch_invariant_products() else 1e-5
    results = {}
    for last_only in (False, True):  # True: the final layer computes each sequence's last position only
        expected = {0: alone(a, [5, 9], last_only), 1: alone(b, [5, 9], last_only), 2: alone(c, [5, 9], last_only)}
        x, y, z = (10 * last_only + i for i in range(3))  # packed sequences' ids, fresh for each pass
        packed = [run({x: a, y: b, z: c}, last_only), run({z: [5], x: [5], y: [5]}, last_only),
                  run({y: [9], z: [9], x: [9]}, last_only)]
        for step, got in enumerate(packed):
            for seq, sid in enumerate((x, y, z)):
                assert np.abs(got[sid] - expected[seq][step]).max() <= tolerance, (family, last_only, step, seq)
        results[last_only] = expected
    for seq in range(3):  # the last position's logits, computed alone or with the whole prompt's: float rounding
        for full, last in zip(results[False][seq], results[True][seq]):
            assert np.abs(full - last).max() <= 1e-4 * max(1.0, np.abs(full).max()), (family, seq)
