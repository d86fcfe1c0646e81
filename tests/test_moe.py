"""DeepSeek V3 (MLA + DeepSeekMoE) and Qwen3-MoE against transformers, and the checkpoint
formats these models are published in (FP8 blocks, compressed-tensors INT4, MLX-quantized)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from mlx.utils import tree_flatten
from safetensors.torch import load_file, save_file

from conftest import (INIT_STD, REPO, ROPE_WINDOW, VOCAB_SIZE, assert_bfloat16_close, assert_same_parameters, assert_far_from_uniform, forward,
                      fp8_blocks, greedy_ours, greedy_transformers, int8_loaded_both_ways, load_stages, long_prompt,
                      mpiexec, write_tokenizer)
from pipeline.models.config import ModelConfig
from pipeline.checkpoints.format_adapters import Requantize
from pipeline.models.deepseek_v3 import MoEGate

PROMPT = [1, 5, 77, 23, 299, 3, 4, 5, 6, 100, 42, 17]
LONG_PROMPT = long_prompt(64)  # past ROPE_WINDOW: YaRN's interpolated frequencies at work
# DeepSeek V3's YaRN (factor 40 there, 4 here) over a ROPE_WINDOW-token original context.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ROPE_WINDOW,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def make_deepseek(folder, seed=0, hidden=64, **overrides):
    torch.manual_seed(seed)
    settings = dict(hidden_size=hidden, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                    intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
                    n_group=4, topk_group=2, vocab_size=VOCAB_SIZE, q_lora_rank=32, kv_lora_rank=16,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
                    n_shared_experts=1, max_position_embeddings=512, eos_token_id=2, bos_token_id=None,
                    initializer_range=INIT_STD)
    settings.update(overrides)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**settings))
    return _perturb_and_save(model, folder)


def make_qwen3_moe(folder, seed=0, **overrides):
    torch.manual_seed(seed)
    settings = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                    vocab_size=VOCAB_SIZE, head_dim=16, eos_token_id=2, bos_token_id=None,
                    initializer_range=INIT_STD)
    settings.update(overrides)
    return _perturb_and_save(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**settings)), folder)


def _perturb_and_save(model, folder):
    """Random init leaves norms at one and router biases at zero: perturb them, with negative
    correction biases too, so every term of the routing is exercised."""
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
    return model


def load(folder, ranges=((0, 4),), requantize=None, dtype=None):
    return load_stages(folder, ranges, requantize=requantize, dtype=dtype)


# case -> (maker, settings, tolerance on max |ours - transformers| of fp32 logits on LONG_PROMPT,
# whole prompt, token by token and split in three: the same), just above the error measured with
# OpenBLAS and the BLAS shim on logits that reach |7|.
CASES = {
    "deepseek-q-lora": (make_deepseek, {}, 2e-5),  # measured 1.56e-5
    "deepseek-no-q-lora": (make_deepseek, {"q_lora_rank": None}, 2.2e-5),  # 1.69e-5
    "deepseek-yarn": (make_deepseek, {"rope_parameters": YARN, "max_position_embeddings": 4 * ROPE_WINDOW},
                      2e-5),  # 1.60e-5
    "qwen3-moe-norm-topk": (make_qwen3_moe, {"norm_topk_prob": True}, 1.3e-5),  # 0.98e-5
    "qwen3-moe-dense-layer": (make_qwen3_moe, {"norm_topk_prob": False, "mlp_only_layers": [1]}, 1.2e-5),  # 0.88e-5
}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict:
    """case -> (folder, transformers model)"""
    root = tmp_path_factory.mktemp("moe")
    return {case: (root / case, make(root / case, **settings)) for case, (make, settings, _) in CASES.items()}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, moe_models):
    folder, reference = moe_models[case]
    tolerance = CASES[case][2]
    with torch.no_grad():
        expected = reference(torch.tensor([LONG_PROMPT])).logits[0].numpy()
    assert_far_from_uniform(expected)
    (stage,) = load(folder)
    assert np.abs(forward([stage], LONG_PROMPT) - expected).max() <= tolerance
    stage.release([0])
    incremental = np.concatenate([forward([stage], [t]) for t in LONG_PROMPT])
    assert np.abs(incremental - expected).max() <= tolerance
    split = load(folder, ((0, 1), (1, 3), (3, 4)))
    assert np.abs(forward(split, LONG_PROMPT) - expected).max() <= tolerance


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuation_matches_transformers(case, moe_models):
    """Our generate loop picks transformers' 32 greedy tokens after a 48-token prompt, and they
    are no loop of a few tokens: at least 16 distinct (19-32 measured)."""
    folder, reference = moe_models[case]
    prompt = long_prompt(48, seed=3)
    expected = greedy_transformers(reference, prompt, 32)
    assert len(set(expected)) >= 16, expected
    (stage,) = load(folder)
    assert greedy_ours(stage, folder, prompt, 32).tokens == expected


@pytest.mark.parametrize("case", ["deepseek-yarn", "qwen3-moe-dense-layer"])  # see conftest on the choice
def test_bfloat16_matches_transformers_bfloat16(case, moe_models):
    """`--dtype bfloat16` on a MoE model (MLX's CPU gather_mm takes float32 only: the experts'
    product is widened, see SwitchLinear), against transformers in bfloat16."""
    folder, _ = moe_models[case]
    truth = reference_logits(folder, LONG_PROMPT)
    theirs = reference_logits(folder, LONG_PROMPT, torch.bfloat16)
    (stage,) = load(folder, dtype=mx.bfloat16)
    assert_bfloat16_close(forward([stage], LONG_PROMPT), theirs, truth)  # experts: whole stacks widened
    stage.release([0])
    incremental = np.concatenate([forward([stage], [t]) for t in LONG_PROMPT])
    assert_bfloat16_close(incremental, theirs, truth)  # one token: its chosen experts widened


def test_mla_cache_holds_the_compressed_latent(tmp_path):
    make_deepseek(tmp_path)
    (stage,) = load(tmp_path)
    forward([stage], PROMPT)
    cache = stage.caches[0][0]
    assert cache.offset == len(PROMPT)
    latent, rope_keys = cache.keys, cache.values
    assert latent.shape[1] == rope_keys.shape[1] == 1  # one shared "head", not 4 heads of keys/values
    assert latent.shape[-1] == 16 and rope_keys.shape[-1] == 8  # kv_lora_rank, qk_rope_head_dim
    assert stage.kv_bytes_per_token == 4 * (16 + 8) * 4  # 4 layers x 24 fp32 values


def test_unselected_groups_can_never_win():
    """Official DeepSeek routing: experts outside the topk_group best groups are excluded even
    when their biased scores beat the (negative) biased scores inside the chosen groups."""
    config = ModelConfig.from_dict(dict(model_type="deepseek_v3", hidden_size=2, num_attention_heads=1,
                                        num_hidden_layers=1, vocab_size=4, n_routed_experts=4,
                                        num_experts_per_tok=2, n_group=2, topk_group=1,
                                        routed_scaling_factor=1.0, norm_topk_prob=True))
    gate = MoEGate(config)
    gate.weight = mx.zeros((4, 2))  # every sigmoid score is 0.5
    # biased scores: group A = [0.9+0.5, -5+0.5] (top-2 sum -3.6), group B = [-0.6, -0.7] (sum -1.3)
    gate.e_score_correction_bias = mx.array([0.9, -5.0, -1.1, -1.2])
    indices, weights = gate(mx.zeros((1, 2)))
    assert sorted(np.array(indices)[0].tolist()) == [2, 3]
    assert np.allclose(np.array(weights), 0.5)  # unbiased scores 0.5, 0.5 renormalised


@pytest.mark.parametrize("kind", ["deepseek", "qwen3_moe"])
def test_greedy_identical_for_1_to_4_ranks(kind, tmp_path):
    (make_deepseek if kind == "deepseek" else make_qwen3_moe)(tmp_path)
    outputs = set()
    for n in (1, 2, 3, 4):
        result = mpiexec(n, "generate", "--model", str(tmp_path), "--prompt", "The capital", "--max-tokens", "12",
                         "--no-chat-template")
        assert result.returncode == 0, result.stderr
        outputs.add(result.stdout)
    assert len(outputs) == 1 and outputs.pop().strip()


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """A DeepSeek V3 checkpoint as DeepSeek publishes it (e4m3 weights with 128x128 block scales,
    `quantization_config` fp8), and its weights dequantized (fp32) in a plain folder for
    transformers. hidden 192 / intermediate 320: weights span whole and partial blocks.
    Returns (fp8 folder, dequantized folder, dequantized tensors)."""
    root = tmp_path_factory.mktemp("fp8")
    make_deepseek(root / "bf", hidden=192, intermediate_size=320)
    fp8, dequantized = {}, {}
    for name, w in load_file(str(root / "bf" / "model.safetensors")).items():
        if name.endswith("proj.weight") and "gate." not in name:
            q, scale_inv = fp8_blocks(w.float())
            fp8[name], fp8[name + "_scale_inv"] = q, scale_inv
            expanded = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
            dequantized[name] = q.float() * expanded
        else:
            fp8[name] = dequantized[name] = w.float().contiguous()
    config = json.loads((root / "bf" / "config.json").read_text())
    for folder, tensors in (("fp8", fp8), ("dq", dequantized)):
        (root / folder).mkdir()
        save_file(tensors, str(root / folder / "model.safetensors"))
        write_tokenizer(root / folder)
        quantization = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                                "activation_scheme": "dynamic"}} if folder == "fp8" else {}
        (root / folder / "config.json").write_text(json.dumps({**config, **quantization}))
    return root / "fp8", root / "dq", dequantized


def test_fp8_checkpoint_loads_to_the_dequantized_values(fp8_model):
    folder, _, dequantized = fp8_model
    (stage,) = load(folder)
    params = dict(tree_flatten(stage.model.parameters()))
    layer1 = "model.layers.1."
    checked = 0
    for name, expected in dequantized.items():
        local = name.replace("model.", "", 1)
        if ".experts." in name:  # stacked: layers.L.mlp.switch_mlp.P.weight[e]
            prefix, rest = local.split(".experts.")
            expert, proj = rest.split(".", 1)
            ours = np.array(params[f"{prefix}.switch_mlp.{proj}"])[int(expert)]
        elif name.endswith("kv_b_proj.weight"):
            continue  # absorbed into w_uk / w_uv (checked through the logits)
        else:
            ours = np.array(params[local])
        assert np.array_equal(ours, expected.numpy()), name
        checked += name.startswith(layer1)
    assert checked > 10


def test_fp8_logits_match_transformers_on_the_dequantized_weights(fp8_model):
    folder, dq, _ = fp8_model
    expected = reference_logits(dq, LONG_PROMPT)
    assert_far_from_uniform(expected)
    (stage,) = load(folder)
    # hidden 192, logits up to |12|: measured 4.74e-5
    assert np.abs(forward([stage], LONG_PROMPT) - expected).max() <= 6e-5


def test_fp8_with_dtype_bfloat16(fp8_model):
    """`--dtype bfloat16` on DeepSeek's FP8 checkpoint: the blocks dequantized straight to bf16,
    against transformers in bf16 on the dequantized weights (whole prompt and token by token),
    and end to end on two ranks, the same greedy text as in process."""
    folder, dq, _ = fp8_model
    truth = reference_logits(dq, LONG_PROMPT)
    theirs = reference_logits(dq, LONG_PROMPT, torch.bfloat16)
    (stage,) = load(folder, dtype=mx.bfloat16)
    assert stage.model.layers[1].mlp.switch_mlp.gate_proj.weight.dtype == mx.bfloat16
    assert_bfloat16_close(forward([stage], LONG_PROMPT), theirs, truth)
    stage.release([0])
    assert_bfloat16_close(np.concatenate([forward([stage], [t]) for t in LONG_PROMPT]), theirs, truth)

    from pipeline.checkpoints.tokenizer import Tokenizer

    prompt = "The quick brown fox jumps over the lazy dog."
    stage.release([0])
    expected = greedy_ours(stage, folder, Tokenizer.from_folder(folder).prompt_ids(prompt, use_chat_template=False), 16)
    assert len(expected.tokens) == 16 and len(set(expected.tokens)) >= 8
    result = mpiexec(2, "generate", "--model", str(folder), "--prompt", prompt, "--max-tokens", "16",
                     "--no-chat-template", "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text + "\n"


def test_fp8_requantized_as_offline(fp8_model):
    """--quantize 4: each tensor re-quantized right after it is dequantized, exactly as
    quantizing the dequantized checkpoint offline would."""
    folder, dq, dequantized = fp8_model
    (q4,) = load(folder, requantize=Requantize(bits=4, group_size=32))
    experts = q4.model.layers[1].mlp.switch_mlp.gate_proj
    assert type(experts).__name__ == "QuantizedSwitchLinear" and experts.bits == 4
    w = dequantized["model.layers.1.mlp.experts.5.gate_proj.weight"].numpy()
    q, s, b = mx.quantize(mx.array(w), group_size=32, bits=4)
    assert np.array_equal(np.array(experts.weight[5]), np.array(q))
    assert np.array_equal(np.array(experts.scales[5]), np.array(s))
    o_proj = q4.model.layers[2].self_attn.o_proj
    q, s, b = mx.quantize(mx.array(dequantized["model.layers.2.self_attn.o_proj.weight"].numpy()), group_size=32, bits=4)
    assert np.array_equal(np.array(o_proj.weight), np.array(q)) and np.array_equal(np.array(o_proj.biases), np.array(b))
    # 8 bits stay close to the full-precision logits (correlation measured 0.9964).
    (q8,) = load(folder, requantize=Requantize(bits=8, group_size=64))
    expected = reference_logits(dq, PROMPT)
    assert np.corrcoef(forward([q8], PROMPT).ravel(), expected.ravel())[0, 1] > 0.995


def reference_logits(folder, token_ids, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()


# ---- Kimi K2 (Thinking): model_type kimi_k2, INT4 experts, one expert group, YaRN -------------------------

K2_SIZES = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads", "num_key_value_heads",
            "num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size", "max_position_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id")


def pack_int4_experts(tensors: dict, helpers) -> tuple[dict, dict]:
    """Routed experts as Kimi K2 publishes them: compressed-tensors pack-quantized INT4 (group 32, symmetric, bf16
    scales, packed by the compressed-tensors library `helpers`), the rest as it is. Returns (packed tensors, the
    values compressed-tensors unpacks them to)."""
    packed, unpacked = {}, {}
    for name, w in tensors.items():
        if ".experts." not in name:
            packed[name] = unpacked[name] = w.contiguous()
            continue
        rows, cols = w.shape
        groups = w.float().reshape(rows, cols // 32, 32)
        scale = (groups.abs().amax(-1) / 7).to(torch.bfloat16)
        q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).to(torch.int8).reshape(rows, cols)
        base = name[: -len(".weight")]
        packed[base + ".weight_packed"] = helpers.pack_to_int32(q, 4)
        packed[base + ".weight_scale"] = scale
        packed[base + ".weight_shape"] = torch.tensor([rows, cols], dtype=torch.int32)
        values = helpers.unpack_from_int32(packed[base + ".weight_packed"], 4, torch.Size([rows, cols]))
        unpacked[name] = values.float() * scale.float().repeat_interleave(32, 1)
    return packed, unpacked


@pytest.fixture(scope="module")
def kimi_k2(tmp_path_factory):
    """A tiny Kimi K2 Thinking as Moonshot publishes it: config.json is the real one (bundled in
    pipeline/planner/configs: model_type kimi_k2, one expert group, routed_scaling_factor 2.827, YaRN
    factor 64 spelt `rope_scaling: {type: yarn}`, the compressed-tensors quantization_config) with
    the tiny sizes and a ROPE_WINDOW-token original context; the routed experts pack-quantized
    INT4 (group 32, symmetric, bf16 scales) by the compressed-tensors library. transformers has no
    kimi_k2, so the reference is DeepseekV3ForCausalLM with K2's settings on the weights that
    compressed-tensors unpacks. Returns (kimi folder, reference folder)."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    root = tmp_path_factory.mktemp("kimi")
    k2 = json.loads((REPO / "pipeline" / "planner" / "configs" / "Kimi-K2-Thinking.json").read_text())
    yarn = {**k2["rope_scaling"], "original_max_position_embeddings": ROPE_WINDOW}
    yarn["rope_type"] = yarn.pop("type")
    make_deepseek(root / "bf", n_group=k2["n_group"], topk_group=k2["topk_group"],
                  routed_scaling_factor=k2["routed_scaling_factor"], norm_topk_prob=k2["norm_topk_prob"],
                  first_k_dense_replace=k2["first_k_dense_replace"], n_shared_experts=k2["n_shared_experts"],
                  rms_norm_eps=k2["rms_norm_eps"], rope_parameters={**yarn, "rope_theta": k2["rope_theta"]},
                  max_position_embeddings=int(ROPE_WINDOW * yarn["factor"]))
    packed, unpacked = pack_int4_experts(load_file(str(root / "bf" / "model.safetensors")), helpers)
    tiny = json.loads((root / "bf" / "config.json").read_text())
    config = {**k2, **{key: tiny[key] for key in K2_SIZES}, "rope_scaling": {**k2["rope_scaling"],
              "original_max_position_embeddings": ROPE_WINDOW}}
    for folder, tensors, cfg in (("kimi", packed, config), ("reference", unpacked, tiny)):
        (root / folder).mkdir()
        save_file(tensors, str(root / folder / "model.safetensors"))
        (root / folder / "config.json").write_text(json.dumps(cfg))
        write_tokenizer(root / folder)
    return root / "kimi", root / "reference"


def test_kimi_k2_int4_maps_exactly_onto_mlx_affine(kimi_k2):
    """Each expert's packed INT4 words and bf16 scales become MLX affine 4-bit tensors that
    dequantize to exactly what compressed-tensors unpacks."""
    folder, reference = kimi_k2
    unpacked = load_file(str(reference / "model.safetensors"))
    (stage,) = load(folder)
    assert ModelConfig.from_folder(folder).model_type == "kimi_k2"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        experts = getattr(stage.model.layers[1].mlp.switch_mlp, proj)
        assert experts.bits == 4 and experts.group_size == 32
        ours = np.array(mx.dequantize(experts.weight, experts.scales, experts.biases, group_size=32, bits=4))
        for e in range(8):
            assert np.array_equal(ours[e], unpacked[f"model.layers.1.mlp.experts.{e}.{proj}.weight"].numpy())


def test_kimi_k2_logits_match_transformers(kimi_k2):
    folder, reference = kimi_k2
    expected = reference_logits(reference, LONG_PROMPT)
    assert_far_from_uniform(expected)
    tolerance = 2.5e-5  # measured 1.89e-5 (whole prompt, token by token, split in three), logits up to |7|
    (stage,) = load(folder)
    assert np.abs(forward([stage], LONG_PROMPT) - expected).max() <= tolerance
    stage.release([0])
    assert np.abs(np.concatenate([forward([stage], [t]) for t in LONG_PROMPT]) - expected).max() <= tolerance
    assert np.abs(forward(load(folder, ((0, 1), (1, 3), (3, 4))), LONG_PROMPT) - expected).max() <= tolerance


def test_kimi_k2_end_to_end_on_two_ranks(kimi_k2):
    """`mpiexec -n 2 ... generate` on the Kimi folder prints transformers' greedy text: a prompt
    of 102 tokens, past the YaRN window, then 24 tokens, at least 16 of them distinct (23 measured)."""
    folder, reference = kimi_k2
    prompt = ("Zebras quietly juggle seventeen violet umbrellas while the orchestra tunes, "
              "and a lighthouse keeper counts waves under amber skies")
    tokenizer = transformers.AutoTokenizer.from_pretrained(reference)
    ids = tokenizer(prompt).input_ids
    assert len(ids) > ROPE_WINDOW
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    expected = greedy_transformers(model, ids, 24)
    assert len(set(expected)) >= 16, expected
    # float32 products, as transformers computes: int8 activations (the default on x86) round differently
    result = mpiexec(2, "generate", "--model", str(folder), "--prompt", prompt, "--max-tokens", "24",
                     "--no-chat-template", "--no-int8-activations")
    assert result.returncode == 0, result.stderr
    assert result.stdout == tokenizer.decode(expected) + "\n"


@pytest.mark.parametrize("in_place", (False, True))
def test_int8_while_loading_holds_what_repacking_after_loading_does(fp8_model, in_place):
    """Layers repacked for the int8 products as they are read (int8_repack.Int8WhileLoading, in new buffers or
    in place) hold the same arrays as repacking after the whole load (use_int8), experts (stacked as
    they arrive) included; DeepSeek's kv_b_proj, read again after loading into w_uk / w_uv, is left
    to use_int8 with the rest of its attention module (its after_load would dequantize the int8 layout
    as MLX's)."""
    from pipeline.checkpoints.safetensors_checkpoint import Checkpoint

    folder = fp8_model[0]
    after, during, early = int8_loaded_both_ways(lambda: Checkpoint(folder), in_place,
                                                 requantize=Requantize(bits=4, group_size=32))
    assert "layers.1.mlp.switch_mlp.gate_proj" in early and "layers.0.mlp.up_proj" in early
    assert not any("self_attn" in path for path in early)  # the module with after_load: all left to use_int8
    assert getattr(during.model.layers[2].self_attn.o_proj, "int8", False)
    assert_same_parameters(after.model, during.model)


def test_mlx_quantized_moe_folder(tmp_path):
    """MLX-community layout: experts pre-stacked as switch_mlp, quantized, `quantization` in
    config.json. Computes exactly what the dequantized weights compute."""
    make_qwen3_moe(tmp_path / "src")
    (dense,) = load(tmp_path / "src")
    quantized, dequantized = {}, {}
    for name, w in tree_flatten(dense.model.parameters()):
        full = name if name.startswith("lm_head") else "model." + name
        if name.endswith("proj.weight") and w.shape[-1] % 32 == 0:
            q, s, b = mx.quantize(w, group_size=32, bits=4)
            stem = full[: -len(".weight")]
            quantized.update({full: q, stem + ".scales": s, stem + ".biases": b})
            dequantized[full] = mx.dequantize(q, s, b, group_size=32, bits=4)
        else:
            quantized[full] = dequantized[full] = w
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    for folder, tensors in (("mlx", quantized), ("dq", dequantized)):
        (tmp_path / folder).mkdir()
        mx.save_safetensors(str(tmp_path / folder / "model.safetensors"), tensors)
        if folder == "mlx":
            config["quantization"] = {"group_size": 32, "bits": 4}
        (tmp_path / folder / "config.json").write_text(json.dumps(config))
    (q_stage,) = load(tmp_path / "mlx")
    (dq_stage,) = load(tmp_path / "dq")
    assert type(q_stage.model.layers[0].mlp.switch_mlp.up_proj).__name__ == "QuantizedSwitchLinear"
    assert np.abs(forward([q_stage], PROMPT) - forward([dq_stage], PROMPT)).max() <= 1e-4
