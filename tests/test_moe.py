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

from conftest import VOCAB_SIZE, forward, load_stages, mpiexec, write_tokenizer
from pipeline.config import ModelConfig
from pipeline.formats import Requantize
from pipeline.models.deepseek_v3 import MoEGate

PROMPT = [1, 5, 77, 23, 299, 3, 4, 5, 6, 100, 42, 17]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def make_deepseek(folder, seed=0, hidden=64, **overrides):
    torch.manual_seed(seed)
    settings = dict(hidden_size=hidden, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                    intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
                    n_group=4, topk_group=2, vocab_size=VOCAB_SIZE, q_lora_rank=32, kv_lora_rank=16,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
                    n_shared_experts=1, max_position_embeddings=512, eos_token_id=2, bos_token_id=None)
    settings.update(overrides)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**settings))
    return _perturb_and_save(model, folder)


def make_qwen3_moe(folder, seed=0, **overrides):
    torch.manual_seed(seed)
    settings = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                    vocab_size=VOCAB_SIZE, head_dim=16, eos_token_id=2, bos_token_id=None)
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


def load(folder, ranges=((0, 4),), requantize=None):
    return load_stages(folder, ranges, requantize=requantize)


CASES = {
    "deepseek-q-lora": (make_deepseek, {}),
    "deepseek-no-q-lora": (make_deepseek, {"q_lora_rank": None}),
    "deepseek-yarn": (make_deepseek, {"rope_scaling": YARN}),
    "qwen3-moe-norm-topk": (make_qwen3_moe, {"norm_topk_prob": True}),
    "qwen3-moe-dense-layer": (make_qwen3_moe, {"norm_topk_prob": False, "mlp_only_layers": [1]}),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, tmp_path):
    make, overrides = CASES[case]
    reference = make(tmp_path, **overrides)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
    (stage,) = load(tmp_path)
    assert np.abs(forward([stage], PROMPT) - expected).max() <= 1e-4
    stage.release([0])
    incremental = np.concatenate([forward([stage], [t]) for t in PROMPT])
    assert np.abs(incremental - expected).max() <= 1e-4
    split = load(tmp_path, ((0, 1), (1, 3), (3, 4)))
    assert np.abs(forward(split, PROMPT) - expected).max() <= 1e-4


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


def _fp8_blocks(w: torch.Tensor):
    """Quantize like DeepSeek's published weights: e4m3 with one fp32 scale per 128x128 block."""
    rows, cols = w.shape
    scale_inv = torch.zeros((rows + 127) // 128, (cols + 127) // 128)
    q = torch.zeros_like(w)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale_inv[i, j] = block.abs().max() / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = block / scale_inv[i, j]
    return q.to(torch.float8_e4m3fn), scale_inv


def test_fp8_checkpoint_loads_to_the_dequantized_values(tmp_path):
    # hidden 192 / intermediate 320: weights span whole and partial 128x128 blocks.
    make_deepseek(tmp_path / "bf", hidden=192, intermediate_size=320)
    fp8, dequantized = {}, {}
    for name, w in load_file(str(tmp_path / "bf" / "model.safetensors")).items():
        if name.endswith("proj.weight") and "gate." not in name:
            q, scale_inv = _fp8_blocks(w.float())
            fp8[name], fp8[name + "_scale_inv"] = q, scale_inv
            expanded = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
            dequantized[name] = q.float() * expanded
        else:
            fp8[name] = dequantized[name] = w.float().contiguous()
    folder = tmp_path / "fp8"
    folder.mkdir()
    save_file(fp8, str(folder / "model.safetensors"))
    config = json.loads((tmp_path / "bf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(config))

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
            continue  # absorbed into w_uk / w_uv (checked through the logits below)
        else:
            ours = np.array(params[local])
        assert np.array_equal(ours, expected.numpy()), name
        checked += name.startswith(layer1)
    assert checked > 10
    # And the model computes with them: same logits as transformers running the dequantized weights.
    (tmp_path / "dq").mkdir()
    save_file(dequantized, str(tmp_path / "dq" / "model.safetensors"))
    (tmp_path / "dq" / "config.json").write_text((tmp_path / "bf" / "config.json").read_text())
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dq", dtype=torch.float32).eval()
    with torch.no_grad():
        expected_logits = reference(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(forward([stage], PROMPT) - expected_logits).max() <= 1e-4

    # --quantize 4: each tensor re-quantized right after it is dequantized, exactly as
    # quantizing the dequantized checkpoint offline would.
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
    # 8 bits stay close to the full-precision logits.
    (q8,) = load(folder, requantize=Requantize(bits=8, group_size=64))
    assert np.corrcoef(forward([q8], PROMPT).ravel(), expected_logits.ravel())[0, 1] > 0.999


def test_compressed_tensors_int4_maps_exactly_onto_mlx_affine(tmp_path):
    """Kimi K2 Thinking's experts: pack-quantized symmetric INT4, group 32, packed with the
    compressed-tensors library itself."""
    pack = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers").pack_to_int32
    make_deepseek(tmp_path / "bf")
    tensors, expected = {}, {}
    generator = torch.Generator().manual_seed(0)
    for name, w in load_file(str(tmp_path / "bf" / "model.safetensors")).items():
        if ".experts." in name:
            rows, cols = w.shape
            q = torch.randint(-8, 8, (rows, cols), generator=generator, dtype=torch.int8)
            scale = (torch.rand(rows, cols // 32, generator=generator) * 0.02).to(torch.bfloat16)
            base = name[: -len(".weight")]
            tensors[base + ".weight_packed"] = pack(q, 4)
            tensors[base + ".weight_scale"] = scale
            tensors[base + ".weight_shape"] = torch.tensor([rows, cols], dtype=torch.int32)
            expected[name] = q.float() * scale.float().repeat_interleave(32, 1)
        else:
            tensors[name] = w.contiguous()
    folder = tmp_path / "int4"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text((tmp_path / "bf" / "config.json").read_text())

    (stage,) = load(folder)
    experts = stage.model.layers[1].mlp.switch_mlp.gate_proj
    assert experts.bits == 4 and experts.group_size == 32
    dequantized = np.array(mx.dequantize(experts.weight, experts.scales, experts.biases, group_size=32, bits=4))
    for e in range(8):
        assert np.array_equal(dequantized[e], expected[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].numpy())


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
