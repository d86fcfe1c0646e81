"""Qwen3.5-MoE, MiniMax-M2 and GLM-5 (issue 36) read from their checkpoints as published: FP8 and MLX 4-bit.

FP8 (Qwen/Qwen3.5-*-FP8, MiniMaxAI/MiniMax-M2, zai-org/GLM-5-FP8): e4m3 weights with a float32
`weight_scale_inv` per 128x128 block (`quantization_config` quant_method fp8, fmt e4m3, weight_block_size
[128, 128]); the embedding, LM head, norms, routers (mlp.gate, and Qwen's shared_expert_gate), MiniMax's
and GLM's correction biases, and Qwen's small linear-attention parts (in_proj_a/b, conv1d, A_log, dt_bias)
left in bf16; experts one tensor per expert.

MLX 4-bit (mlx-community's conversions, mlx_lm.convert): the names mlx-lm's models hold after their
sanitize(), MLX affine 4-bit (here group 32: every tiny width divides it) wherever a Linear, Embedding,
SwitchLinear or MultiLinear's input width divides the group size, the routers 8-bit with groups of 64
(mlx-lm's quant_predicate for MiniMax and Qwen3.5; GLM's router is no Linear and stays float):
- experts stacked, `mlp.switch_mlp.{gate,up,down}_proj` (MiniMax: under `block_sparse_moe.`);
- Qwen3.5: under `language_model.model.` / `language_model.lm_head.`, no vision tower or MTP, the
  convolution's kernel stored [channels, kernel, 1] and the (1 + w) RMSNorms stored as 1 + w;
- GLM-5 (mlx-lm's deepseek_v32): kv_b_proj split per head into `self_attn.embed_q` [heads, latent, nope]
  and `self_attn.unembed_out` [heads, v, latent], each quantized on its own; no MTP layer.

Each folder is made from a tiny transformers model; transformers then runs on the weights the format
holds (dequantized in float32), and our logits must match it."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import INIT_STD, VOCAB_SIZE, assert_far_from_uniform, forward, fp8_blocks, load_stages, long_prompt
from test_minimax_glm import _perturb, make_minimax_m2
from test_qwen3_5_moe import make_qwen3_5_moe
from pipeline.util.errors import UserError

PROMPT = long_prompt(24, seed=3)
BITS, GROUP = 4, 32
ROUTER_BITS, ROUTER_GROUP = 8, 64


# ---------------------------------------------------------------------------------------------- helpers

def fp8_pair(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale_inv, the weight it stands for in float32)."""
    q, scale_inv = fp8_blocks(t.float())
    blocks = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[: t.shape[0], : t.shape[1]]
    return q, scale_inv, q.float() * blocks


def mlx_quantized(t: torch.Tensor, bits: int, group: int) -> tuple[dict, torch.Tensor]:
    """MLX affine quantization of a float tensor (last axis): ({weight, scales, biases}, dequantized)."""
    w = mx.array(t.float().numpy())
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    back = mx.dequantize(q, s, b, group_size=group, bits=bits)
    return {"weight": q, "scales": s, "biases": b}, torch.from_numpy(np.array(back))


def write_folder(folder, tensors: dict, source, config: dict) -> None:
    folder.mkdir()
    if tensors and isinstance(next(iter(tensors.values())), mx.array):
        mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "mlx"})
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / f, folder / f)


def transformers_logits(cls, folder) -> np.ndarray:
    reference = cls.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return reference(torch.tensor([PROMPT])).logits[0].numpy()


def ours(folder, layers: int) -> np.ndarray:
    return forward(load_stages(folder, [(0, layers)]), PROMPT)


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def check(source, cls, layers, published: dict, dequantized: dict, extra: dict, tolerance: float) -> float:
    """Write the published folder and transformers' dequantized one; our logits on the first against
    transformers' on the second. Returns the largest difference."""
    root = source.parent
    config = json.loads((source / "config.json").read_text())
    tag = "mlx" if "quantization" in extra else "fp8"
    write_folder(root / tag, published, source, {**config, **extra})
    write_folder(root / (tag + "_reference"), dequantized, source, config)
    expected = transformers_logits(cls, root / (tag + "_reference"))
    assert_far_from_uniform(expected)
    got = ours(root / tag, layers)
    error = float(np.abs(got - expected).max())
    assert error <= tolerance, error
    return error


def stacked(experts: dict[int, mx.array]) -> mx.array:
    return mx.stack([experts[e] for e in sorted(experts)])


def to_mlx(hf: dict, rename, quantizable, router, special=None) -> tuple[dict, dict]:
    """mlx_lm.convert's output from transformers-saved tensors: `rename` (saved name -> mlx-lm's name, or
    None to drop; experts named `...switch_mlp.P.weight#E` are stacked), MLX-quantized where
    `quantizable(mlx name, tensor)` (routers `router(name)` at 8 bits, groups of 64). Returns the MLX
    tensors and the saved tensors as they dequantize (for transformers)."""
    out, back, experts = {}, {}, {}
    for name, t in hf.items():
        new = rename(name, t)
        if new is None:
            continue
        new, value = new if isinstance(new, tuple) else (new, t)
        if special and special(name, t, out, back):
            continue
        base, _, expert = new.partition("#")
        if quantizable(base, value):
            bits, group = (ROUTER_BITS, ROUTER_GROUP) if router(base) else (BITS, GROUP)
            parts, deq = mlx_quantized(value, bits, group)
            back[name] = deq.reshape(t.shape) if value.shape == t.shape else t  # transposed ones: see `special`
            for suffix, array in parts.items():
                key = base[: -len("weight")] + suffix
                if expert:
                    experts.setdefault(key, {})[int(expert)] = array
                else:
                    out[key] = array
        else:
            back[name] = t
            array = mx.array(value.float().numpy())
            if expert:
                experts.setdefault(base, {})[int(expert)] = array
            else:
                out[base] = array
    for key, parts in experts.items():
        out[key] = stacked(parts)
    return out, back


def linear_weight(name: str, t) -> bool:
    return name.endswith(".weight") and t.ndim >= 2 and "conv1d" not in name and t.shape[-1] % GROUP == 0


# ------------------------------------------------------------------------------------------- MiniMax-M2

@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    root = tmp_path_factory.mktemp("minimax_formats")
    make_minimax_m2(root / "source")
    return root / "source", load_file(str(root / "source" / "model.safetensors"))


MINIMAX_FP8_TOLERANCE = 1.5e-5  # measured 6.0e-6; logits up to |6.9|


def test_minimax_m2_fp8(minimax):
    source, hf = minimax
    published, dequantized = {}, {}
    for name, t in hf.items():
        if name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
            published[name], published[name + "_scale_inv"], dequantized[name] = fp8_pair(t)
        else:  # the router, correction bias, norms, embedding and head: as they are
            published[name] = dequantized[name] = t
    fp8 = {**FP8_CONFIG, "fmt": "float8_e4m3fn", "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    check(source, transformers.MiniMaxM2ForCausalLM, 4, published, dequantized, {"quantization_config": fp8},
          MINIMAX_FP8_TOLERANCE)


MINIMAX_MLX_TOLERANCE = 1.5e-5  # measured 4.8e-6; logits up to |7.2|


def test_minimax_m2_mlx_4bit(minimax):
    source, hf = minimax

    def rename(name, t):
        import re

        m = re.match(r"^(.*\.block_sparse_moe)\.experts\.(\d+)\.w([123])\.weight$", name)
        if m:
            proj = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}[m.group(3)]
            return f"{m.group(1)}.switch_mlp.{proj}.weight#{m.group(2)}"
        return name

    published, dequantized = to_mlx(hf, rename, linear_weight, lambda n: n.endswith("block_sparse_moe.gate.weight"))
    assert "model.layers.3.block_sparse_moe.switch_mlp.down_proj.scales" in published
    assert published["model.layers.0.block_sparse_moe.gate.scales"].shape == (8, 64 // ROUTER_GROUP)
    check(source, transformers.MiniMaxM2ForCausalLM, 4, published, dequantized,
          {"quantization": {"group_size": GROUP, "bits": BITS}}, MINIMAX_MLX_TOLERANCE)


# ------------------------------------------------------------------------------------------- Qwen3.5-MoE

@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5_formats")
    make_qwen3_5_moe(root / "source")
    return root / "source", load_file(str(root / "source" / "model.safetensors"))


def qwen_cls():
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

    return Qwen3_5MoeForConditionalGeneration


QWEN_FP8_TOLERANCE = 1e-4  # measured 3.6e-5 (transformers' chunked delta rule against our recurrence)
# Left in bf16 by Qwen's FP8 release: the linear attention's per-head in_proj_a / in_proj_b (tiny outputs),
# besides the routers, norms, convolution, embedding and head.
QWEN_NOT_FP8 = (".in_proj_a.weight", ".in_proj_b.weight")


def test_qwen3_5_moe_fp8(qwen):
    source, hf = qwen
    published, dequantized = {}, {}
    for name, t in hf.items():
        if (name.startswith("model.language_model.layers.") and t.ndim == 2 and not name.endswith(QWEN_NOT_FP8)
                and not any(part in name for part in ("norm", "conv1d", "mlp.gate.", "shared_expert_gate."))):
            published[name], published[name + "_scale_inv"], dequantized[name] = fp8_pair(t)
        else:
            published[name] = dequantized[name] = t
    assert sum(n.endswith("_scale_inv") for n in published) == 3 * (4 + 3 * 8 + 3) + 3 * (3 + 3 * 8 + 3)  # attention + experts + shared expert
    fp8 = {**FP8_CONFIG, "modules_to_not_convert": ["lm_head", "model.visual", "mlp.gate", "mlp.shared_expert_gate",
                                                    "linear_attn.in_proj_a", "linear_attn.in_proj_b"]}
    check(source, qwen_cls(), 6, published, dequantized, {"quantization_config": fp8}, QWEN_FP8_TOLERANCE)


QWEN_ONE_PLUS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight",
                 "model.language_model.norm.weight")


def qwen_mlx_name(name: str, t):
    """mlx-lm's qwen3_5_moe names and layouts (its sanitize()): see the module docstring."""
    import re

    if name.startswith(("model.visual.", "mtp.")):
        return None
    value = t
    if name.endswith("conv1d.weight"):
        value = t.moveaxis(2, 1)  # [channels, kernel, 1]
    elif name.endswith(QWEN_ONE_PLUS):
        value = t + 1.0
    if name == "lm_head.weight":
        return "language_model.lm_head.weight", value
    new = name.replace("model.language_model.", "language_model.model.", 1)
    m = re.match(r"^(.*\.mlp)\.experts\.(\d+)\.(\w+_proj)\.weight$", new)
    if m:
        new = f"{m.group(1)}.switch_mlp.{m.group(3)}.weight#{m.group(2)}"
    return new, value


QWEN_MLX_TOLERANCE = 1e-4  # measured 4.3e-5


def test_qwen3_5_moe_mlx_4bit(qwen):
    source, hf = qwen
    published, dequantized = to_mlx(hf, qwen_mlx_name, linear_weight,
                                    lambda n: n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")))
    assert published["language_model.model.layers.0.linear_attn.conv1d.weight"].shape[-1] == 1
    assert "language_model.model.layers.5.mlp.switch_mlp.up_proj.biases" in published
    assert not any(n.startswith(("mtp.", "model.visual")) for n in published)
    check(source, qwen_cls(), 6, published, dequantized, {"quantization": {"group_size": GROUP, "bits": BITS}},
          QWEN_MLX_TOLERANCE)


# ----------------------------------------------------------------------------------------------- GLM-5

def make_glm(folder, seed=0):
    """test_minimax_glm.py's tiny GLM-5 with its MLA widths at 32, so that MLX groups of 32 divide them
    (mlx-lm quantizes embed_q and unembed_out only then)."""
    from test_minimax_glm import GLM_INDEXERS

    torch.manual_seed(seed)
    config = transformers.GlmMoeDsaConfig(
        hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, vocab_size=VOCAB_SIZE, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=8, v_head_dim=32,
        mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"], indexer_types=GLM_INDEXERS,
        index_topk=8, index_n_heads=32, index_head_dim=32, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=2, initializer_range=INIT_STD)
    model = transformers.GlmMoeDsaForCausalLM(config)
    _perturb(model)
    from conftest import save_reference

    return save_reference(model, folder)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm_formats")
    make_glm(root / "source")
    return root / "source", load_file(str(root / "source" / "model.safetensors"))


GLM_FP8_TOLERANCE = 3e-5  # measured 1.1e-5
# Left in bf16 (as DeepSeek V3.2's FP8 release, whose layout GLM-5-FP8 follows): the indexer's per-head
# weights_proj, besides the router, correction bias, norms, embedding and head.
GLM_NOT_FP8 = (".mlp.gate.weight", ".indexer.weights_proj.weight")


def test_glm_moe_dsa_fp8(glm):
    source, hf = glm
    published, dequantized = {}, {}
    for name, t in hf.items():
        if name.startswith("model.layers.") and t.ndim == 2 and not name.endswith(GLM_NOT_FP8):
            published[name], published[name + "_scale_inv"], dequantized[name] = fp8_pair(t)
        else:
            published[name] = dequantized[name] = t
    assert "model.layers.0.self_attn.indexer.wq_b.weight_scale_inv" in published
    check(source, transformers.GlmMoeDsaForCausalLM, 5, published, dequantized,
          {"quantization_config": FP8_CONFIG}, GLM_FP8_TOLERANCE)


def glm_mlx_name(name: str, t):
    import re

    m = re.match(r"^(.*\.mlp)\.experts\.(\d+)\.(\w+_proj)\.weight$", name)
    if m:
        return f"{m.group(1)}.switch_mlp.{m.group(3)}.weight#{m.group(2)}"
    return name


def glm_split_kv_b(heads: int, nope: int):
    """mlx-lm's deepseek_v32 sanitize(): kv_b_proj [heads * (nope + v), latent] -> embed_q [heads, latent, nope]
    and unembed_out [heads, v, latent], each quantized on its own; the reference gets kv_b_proj back from
    the two dequantized."""

    def special(name, t, out, back):
        if not name.endswith(".self_attn.kv_b_proj.weight"):
            return False
        prefix = name[: -len("kv_b_proj.weight")]
        w = t.reshape(heads, -1, t.shape[-1])
        halves = {"embed_q": w[:, :nope].transpose(1, 2).contiguous(), "unembed_out": w[:, nope:].contiguous()}
        restored = {}
        for module, half in halves.items():
            parts, restored[module] = mlx_quantized(half, BITS, GROUP)
            for suffix, array in parts.items():
                out[f"{prefix}{module}.{suffix}"] = array
        back[name] = torch.cat([restored["embed_q"].transpose(1, 2), restored["unembed_out"]], 1).reshape(t.shape)
        return True

    return special


GLM_MLX_TOLERANCE = 3e-5  # measured 1.1e-5


def test_glm_moe_dsa_mlx_4bit(glm):
    source, hf = glm
    published, dequantized = to_mlx(hf, glm_mlx_name, lambda n, t: linear_weight(n, t) and not n.endswith("mlp.gate.weight"),
                                    lambda n: False, special=glm_split_kv_b(heads=4, nope=32))
    assert published["model.layers.2.self_attn.embed_q.weight"].shape == (4, 32, 32 * BITS // 32)
    assert "model.layers.2.self_attn.kv_b_proj.weight" not in published
    assert published["model.layers.1.mlp.gate.weight"].dtype == mx.float32  # MoEGate: no Linear, not quantized
    check(source, transformers.GlmMoeDsaForCausalLM, 5, published, dequantized,
          {"quantization": {"group_size": GROUP, "bits": BITS}}, GLM_MLX_TOLERANCE)

    # embed_q quantized beside a float unembed_out: its width cannot be told from its packed words alone
    half = {k: v for k, v in published.items() if ".unembed_out." not in k}
    for layer in range(5):
        prefix = f"model.layers.{layer}.self_attn.unembed_out."
        half[prefix + "weight"] = mx.dequantize(published[prefix + "weight"], published[prefix + "scales"],
                                                published[prefix + "biases"], group_size=GROUP, bits=BITS)
    config = json.loads((source / "config.json").read_text())
    write_folder(source.parent / "mlx_half", half, source, {**config, "quantization": {"group_size": GROUP, "bits": BITS}})
    with pytest.raises(UserError, match=r"self_attn\.embed_q: packed .* no MLX quantization") as error:
        load_stages(source.parent / "mlx_half", [(0, 5)])
    assert "\n" not in str(error.value)
