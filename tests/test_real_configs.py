"""The real configurations in pipeline/planner/configs against what their publishers state, from
config.json alone: parameter shapes are written out per layer (no weights allocated) and their
totals and per-token active counts compared with the published figures.

Published figures and how they are counted:
- DeepSeek-V3 (README_WEIGHTS.md): 671B main model (embedding, 61 layers, head) plus the
  multi-token-prediction module, "11.5B unique parameters" (with its own copies of the embedding
  and head, the 685B total of the download); "36.6B activated, including 0.9B for the output head"
  -- so the embedding table, a lookup, is not counted as active. R1 and V3.1 share the architecture.
- Kimi K2 (tech report / model card): about 1.04T total (1T on the card, 1.03T from the
  checkpoint's own metadata), 32B activated.
- Qwen3-235B-A22B (model card): 235B total, 22B activated.
- Qwen3.5-397B-A17B and Qwen3.5-35B-A3B (model cards): 397B / 35B total with the vision tower
  (image-text-to-text models), the MTP module not counted; 17B / 3B activated (rounded).
- GLM-5 (transformers' model doc): 744B total, 40B active per token; its MTP layer not in the 744B.
- MiniMax-M2 (transformers' model doc): 230 billion total parameters with 10 billion active.
The last three families run since issue 36 (models/qwen3_5_moe.py, glm_moe_dsa.py, minimax_m2.py).
"""

from __future__ import annotations

import pytest

from pipeline.models.config import ModelConfig
from pipeline.models.registry import family_for
from pipeline.planner.config_files import bundled_configs, load_config
from pipeline.planner.memory import kv_layer_bytes
from pipeline.planner.shapes import architecture, count_params, qwen3_5_vision_params
from pipeline.util.errors import UserError
from pipeline.planner.stored_formats import checkpoint_format
from pipeline.planner.weights_bytes import Precision, model_bytes

NAMES = ["DeepSeek-V3", "DeepSeek-R1", "DeepSeek-V3.1", "Kimi-K2-Instruct", "Kimi-K2-Thinking", "Qwen3-235B-A22B",
         # counted in test_new_models.py and test_deepseek_v4.py:
         "Kimi-K2.5", "DeepSeek-V3.2", "DeepSeek-V4-Pro", "DeepSeek-V4-Flash",
         "MiniMax-M2",  # run since issue 36 (tests/test_minimax_glm.py), counted below
         "Qwen3.5-397B-A17B", "Qwen3.5-35B-A3B",  # run since issue 36 (tests/test_qwen3_5_moe.py), counted below
         "GLM-5", "GLM-5.1"]  # run since issue 36 (tests/test_minimax_glm.py), counted below
PLANNED: list[str] = []  # plan only


def close(value: float, published: float, tolerance: float) -> bool:
    return abs(value - published) <= tolerance * published


def test_all_configs_are_bundled_and_run_by_the_runtime():
    assert sorted(bundled_configs()) == sorted(n.lower() for n in NAMES + PLANNED)
    for name in NAMES:
        config = load_config(name)
        family_for(config)  # the runtime has a family for each model_type
        architecture(config)


@pytest.mark.parametrize("name, family", [("GLM-5", "GLM-5")])
def test_planned_families_are_refused_by_the_runtime_in_one_line(name, family, monkeypatch):
    """A family the planner sizes before the runtime runs it (as GLM-5 was) is refused in one line."""
    from pipeline.models import registry  # local: only this test rewires the registry

    monkeypatch.delitem(registry.FAMILIES, "glm_moe_dsa")
    monkeypatch.setitem(registry.PLANNED, "glm_moe_dsa", "GLM-5")
    config = load_config(name)
    architecture(config)  # the planner sizes it
    with pytest.raises(UserError) as refused:
        family_for(config)
    message = str(refused.value)
    assert message.startswith(f"{family} (") and "is not yet supported by the runtime (issue 36)" in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["DeepSeek-V3", "DeepSeek-R1", "DeepSeek-V3.1"])
def test_deepseek_v3_counts(name):
    config = load_config(name)
    arch = architecture(config)
    counts = count_params(arch)
    assert close(counts.total, 671e9, 0.001)  # 671.03B: the MTP module is not in the 671B
    assert close(counts.active, 36.6e9, 0.002)  # 36.63B, the published 36.6B with the head
    assert close(counts.active, 37e9, 0.02)
    assert close(counts.unused, 11.5e9, 0.02)  # MTP: 11.61B of its own
    assert close(counts.total + counts.unused_with_copies, 685e9, 0.005)  # the download: 684.5B
    r = config.raw
    assert (len(arch.layers), r["first_k_dense_replace"], r["n_routed_experts"], r["num_experts_per_tok"],
            r["n_shared_experts"], r["num_attention_heads"], r["q_lora_rank"], r["kv_lora_rank"]) == \
        (61, 3, 256, 8, 1, 128, 1536, 512)
    moe_layers = [i for i, layer in enumerate(arch.layers) if any(p.experts for p in layer)]
    assert moe_layers == list(range(3, 61))
    assert arch.kv_values == 512 + 64  # the MLA latent, per token per layer
    fmt = checkpoint_format(config)
    assert (fmt.kind, fmt.block) == ("fp8", (128, 128))


def test_deepseek_v3_1_scales_are_ue8m0():
    assert load_config("DeepSeek-V3.1").raw["quantization_config"]["scale_fmt"] == "ue8m0"
    assert "scale_fmt" not in load_config("DeepSeek-V3").raw["quantization_config"]


@pytest.mark.parametrize("name", ["Kimi-K2-Instruct", "Kimi-K2-Thinking"])
def test_kimi_k2_counts(name):
    config = load_config(name)
    arch = architecture(config)
    counts = count_params(arch)
    assert close(counts.total, 1.04e12, 0.015)  # 1026.4B
    assert close(counts.total, 1.03e12, 0.005)
    assert close(counts.active, 32e9, 0.02)  # 31.69B
    assert counts.unused == 0  # no MTP module published
    r = config.raw
    assert (config.model_type, len(arch.layers), r["first_k_dense_replace"], r["n_routed_experts"],
            r["num_experts_per_tok"], r["num_attention_heads"], r["vocab_size"]) == \
        ("kimi_k2", 61, 1, 384, 8, 64, 163840)


def test_kimi_k2_thinking_is_int4_experts_only():
    config = load_config("Kimi-K2-Thinking")
    q = config.raw["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    weights = q["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"], weights["type"]) == (4, 32, True, "int")
    fmt = checkpoint_format(config)
    arch = architecture(config)
    quantized = {p.name.split(".", 3)[3] for layer in arch.layers for p in layer if fmt.native(p)}
    assert quantized == {"mlp.experts.0.gate_proj.weight", "mlp.experts.0.up_proj.weight",
                         "mlp.experts.0.down_proj.weight"}  # attention, shared experts, dense MLP, head: bf16
    assert checkpoint_format(load_config("Kimi-K2-Instruct")).kind == "fp8"
    # Routed experts are 98.9% of the parameters: about 0.5625 B/param on disk overall.
    disk = sum(fmt.disk_bytes(p) for layer in arch.layers for p in layer) + sum(fmt.disk_bytes(p) for p in arch.ends)
    assert 585e9 < disk < 600e9  # 594.2 GB
    resident = model_bytes(arch, Precision(fmt, "bfloat16"))
    assert 650e9 < sum(resident.layers) + resident.ends < 665e9  # 0.625 B/param once scales and biases are bf16


def test_qwen3_235b_counts():
    config = load_config("Qwen3-235B-A22B")
    arch = architecture(config)
    counts = count_params(arch)
    assert close(counts.total, 235e9, 0.002)  # 235.09B
    assert close(counts.active, 22e9, 0.03)  # 21.57B (22.19B if the embedding table were counted)
    assert len(arch.layers) == 94 and all(any(p.experts == 128 for p in layer) for layer in arch.layers)
    assert arch.kv_values == 2 * 4 * 128
    assert checkpoint_format(config).kind == "float"


# ------------------------------------------------------------- planned families (issue 36)

def test_qwen3_5_397b_counts_and_linear_state():
    config = load_config("Qwen3.5-397B-A17B")  # published as an image-text-to-text wrapper around text_config
    arch = architecture(config)
    counts = count_params(arch)
    assert close(counts.total + counts.not_loaded, 397e9, 0.002)  # 396.35B language model + 0.46B vision tower
    embedding = config.vocab_size * config.hidden_size
    assert close(counts.active + embedding, 17e9, 0.03)  # 17.35B as Qwen counts (embedding in, as for Qwen3's 22B)
    assert close(counts.unused, 6.6e9, 0.01)  # mtp.*: one full-attention MoE layer + fc + norms
    assert [what for what, _ in arch.not_loaded] == ["vision tower (model.visual.*)"]
    kinds = [cache.kind for cache in arch.kv_layers]
    assert len(kinds) == 60 and kinds.count("full_attention") == 15 and kinds[3::4] == ["full_attention"] * 15
    state = 64 * 128 * 128 + (4 - 1) * (2 * 16 * 128 + 64 * 128)  # recurrent + convolution, per sequence
    for i, cache in enumerate(arch.kv_layers):
        assert (cache.per_token, cache.per_sequence) == ((2 * 2 * 256, 0) if i % 4 == 3 else (0, state))
    # In the memory plan a linear layer's state is per sequence and the same at any context.
    short, long = kv_layer_bytes(arch, 2, 16, sequences=3), kv_layer_bytes(arch, 2, 65536, sequences=3)
    state_bytes = 64 * 128 * 128 * 4 + (4 - 1) * (2 * 16 * 128 + 64 * 128) * 2  # the recurrent state in float32
    assert short[0] == long[0] == 3 * state_bytes and long[3] == 4096 * short[3] == 3 * 65536 * 1024 * 2
    assert all(sum(1 for p in layer if p.experts == 512) == 3 for layer in arch.layers)
    assert checkpoint_format(config).kind == "float"


def test_qwen3_5_35b_counts():
    arch = architecture(load_config("Qwen3.5-35B-A3B"))
    counts = count_params(arch)
    assert close(counts.total + counts.not_loaded, 35e9, 0.01)  # 35.11B
    assert close(counts.active, 3e9, 0.03)  # 2.95B (3.46B with the embedding table): "A3B"
    assert len(arch.layers) == 40 and arch.top_k == 8


@pytest.mark.parametrize("name", ["GLM-5", "GLM-5.1"])
def test_glm_5_counts(name):
    config = load_config(name)
    arch = architecture(config)
    counts = count_params(arch)
    assert close(counts.total, 744e9, 0.001)  # 743.91B
    assert close(counts.active, 40e9, 0.03)  # 40.83B
    assert close(counts.unused, 9.95e9, 0.01)  # the MTP layer (model.layers.78), without its embedding/head copies
    moe = [i for i, layer in enumerate(arch.layers) if any(p.experts == 256 for p in layer)]
    assert moe == list(range(3, 78))
    assert all(any(".indexer.wk." in p.name for p in layer) for layer in arch.layers)  # GLM-5: every layer indexes
    assert [(c.per_token, c.kind) for c in arch.kv_layers] == [(512 + 64 + 128, "indexed_attention")] * 78
    # A decode step reads every indexer key but only the top-k latents.
    assert arch.kv_read(5, 100_000) == 100_000 * 128 + 2048 * (512 + 64)
    assert arch.kv_read(5, 1000) == 1000 * (128 + 512 + 64)
    assert checkpoint_format(config).kind == "float"


def test_minimax_m2_counts():
    config = load_config("MiniMax-M2")
    arch = architecture(config)
    counts = count_params(arch)
    assert close(counts.total, 230e9, 0.01)  # 228.69B
    assert close(counts.active, 10e9, 0.05)  # 10.42B
    norms = {p.name.rsplit(".", 2)[1]: p.shape for p in arch.layers[0] if "self_attn" in p.name and "norm" in p.name}
    assert norms == {"q_norm": (48 * 128,), "k_norm": (8 * 128,)}  # QK norm over all heads together, not per head
    assert config.raw["rotary_dim"] == 64 and arch.kv_values == 2 * 8 * 128
    fmt = checkpoint_format(config)
    assert (fmt.kind, fmt.block) == ("fp8", (128, 128))
    disk = sum(fmt.disk_bytes(p) for layer in arch.layers for p in layer) + sum(fmt.disk_bytes(p) for p in arch.ends)
    assert 225e9 < disk < 235e9  # 230.0 GB: FP8 linears, bf16 embedding, head and norms


def _tiny_configs():
    """Tiny instances of transformers' config classes, layer kinds mixed so each kind occurs."""
    import transformers  # here: the other tests of this file count from config.json alone, without torch

    qwen = transformers.Qwen3_5MoeConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=12, linear_conv_kernel_dim=3, moe_intermediate_size=24,
                         shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2, vocab_size=100,
                         layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                                      "full_attention"]),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=16, patch_size=4))
    glm = transformers.GlmMoeDsaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=20, index_head_dim=16, index_n_heads=2,
        index_topk=4, first_k_dense_replace=2, index_topk_freq=2, index_skip_topk_offset=1)
    minimax = transformers.MiniMaxM2Config(
        vocab_size=100, hidden_size=64, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, rotary_dim=8,
        bos_token_id=1, eos_token_id=2)
    return {"qwen3_5_moe": qwen, "glm_moe_dsa": glm, "minimax_m2": minimax}


@pytest.mark.parametrize("family", ["qwen3_5_moe", "glm_moe_dsa", "minimax_m2"])
def test_tiny_instances_count_what_transformers_builds(family):
    """Our shapes against transformers' own model of each family: the parameter counts agree (routers'
    correction biases, buffers in transformers, left out; Qwen3.5's vision tower separately; MTP
    modules, which transformers does not build, not compared)."""
    import torch  # here, as in _tiny_configs: only these tests build models
    import transformers

    config = _tiny_configs()[family]
    ours = ModelConfig.from_dict(config.to_dict())
    arch = architecture(ours)
    counted = sum(p.numel for layer in arch.layers for p in layer if not p.name.endswith("e_score_correction_bias"))
    counted += sum(p.numel for p in arch.ends)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert counted == sum(p.numel() for p in model.parameters())
    # tensor by tensor too, transformers' stacked experts (gate_up_proj, down_proj) against ours per projection
    by_name: dict[str, int] = {}
    for p in [p for layer in arch.layers for p in layer] + arch.ends:
        if not p.name.endswith("e_score_correction_bias"):
            name = p.name.replace(".experts.0.gate_proj.weight", ".experts.gate_up_proj")
            name = name.replace(".experts.0.up_proj.weight", ".experts.gate_up_proj")
            name = name.replace(".experts.0.down_proj.weight", ".experts.down_proj")
            by_name[name] = by_name.get(name, 0) + p.numel
    assert by_name == {name: p.numel() for name, p in model.named_parameters()}
    assert len(arch.layers) == config.get_text_config().num_hidden_layers
    if family == "qwen3_5_moe":
        assert [c.kind for c in arch.kv_layers] == config.text_config.layer_types
        tower = transformers.Qwen3_5MoeForConditionalGeneration(config).model.visual
        assert qwen3_5_vision_params(config.vision_config.to_dict()) == sum(p.numel() for p in tower.parameters())
    if family == "glm_moe_dsa":  # indexers and dense/MoE layers as transformers derives them
        assert [c.kind == "indexed_attention" for c in arch.kv_layers] == [t == "full" for t in config.indexer_types]
        assert [any(p.experts for p in layer) for layer in arch.layers] == [t == "sparse" for t in config.mlp_layer_types]
