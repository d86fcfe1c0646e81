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
"""

from __future__ import annotations

import pytest

from pipeline.models.registry import family_for
from pipeline.planner.config_files import bundled_configs, load_config
from pipeline.planner.shapes import architecture, count_params
from pipeline.planner.stored_formats import checkpoint_format
from pipeline.planner.weights_bytes import Precision, model_bytes

NAMES = ["DeepSeek-V3", "DeepSeek-R1", "DeepSeek-V3.1", "Kimi-K2-Instruct", "Kimi-K2-Thinking", "Qwen3-235B-A22B",
         # counted in test_new_models.py and test_deepseek_v4.py:
         "Kimi-K2.5", "DeepSeek-V3.2", "DeepSeek-V4-Pro", "DeepSeek-V4-Flash"]


def close(value: float, published: float, tolerance: float) -> bool:
    return abs(value - published) <= tolerance * published


def test_all_configs_are_bundled_and_run_by_the_runtime():
    assert sorted(bundled_configs()) == sorted(n.lower() for n in NAMES)
    for name in NAMES:
        config = load_config(name)
        family_for(config)  # the runtime has a family for each model_type
        architecture(config)


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
