"""`plan --tensor-parallel` and the layouts table (issue 34, item 4): what each rank of a group holds
(split vs replicated parts, by hand), the layout timing by hand, the fitted terms recomputed from their
measurements, every published figure within its tolerance, and the command's output and errors."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from conftest import REPO
from pipeline.models.config import ModelConfig
from pipeline.planner import calibration, cluster_costs, layouts
from pipeline.planner.calibration import fit, predict
from pipeline.planner.cluster_costs import APPLE_MLX, MEASUREMENTS, HostTerms, LinkTerms
from pipeline.planner.config_files import load_config
from pipeline.planner.layouts import kv_share, param_share, plan_layout, shared_model_bytes
from pipeline.planner.shapes import architecture
from pipeline.planner.stored_formats import checkpoint_format
from pipeline.planner.weights_bytes import Precision

SMALL = {"model_type": "llama", "vocab_size": 384, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def shares(raw: dict, t: int) -> dict[str, float]:
    arch = architecture(ModelConfig.from_dict(raw))
    return {p.name.removeprefix("model.layers.0."): param_share(arch, p, t) for p in arch.layers[0] + arch.ends}


def test_gqa_shares_by_hand():
    two = shares(SMALL, 2)
    assert two["self_attn.q_proj.weight"] == two["self_attn.o_proj.weight"] == 0.5  # 2 of 4 heads each
    assert two["self_attn.k_proj.weight"] == 0.5  # 2 KV heads over 2 ranks: one each
    assert two["mlp.gate_proj.weight"] == two["mlp.down_proj.weight"] == 0.5
    assert two["input_layernorm.weight"] == two["model.norm.weight"] == two["model.embed_tokens.weight"] == 1.0
    assert two["lm_head.weight"] == 0.5  # split by vocabulary
    three = shares(SMALL, 3)
    assert three["self_attn.q_proj.weight"] == 0.5  # 4 heads over 3 ranks: the busiest holds 2
    assert three["self_attn.k_proj.weight"] == 1.0  # 2 KV heads do not divide over 3: held whole
    assert three["mlp.up_proj.weight"] == math.ceil(128 / 3) / 128
    # SmolLM2's 9 query and 3 KV heads on 2 ranks: 5 of 9 query heads, every KV head
    smol = shares({**SMALL, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}, 2)
    assert smol["self_attn.q_proj.weight"] == 5 / 9 and smol["self_attn.v_proj.weight"] == 1.0


def test_mla_and_moe_shares_by_hand():
    """DeepSeek V3.1: the latent projections, the routers and the latent cache on every rank."""
    arch = architecture(load_config("DeepSeek-V3.1"))
    moe = {p.name.removeprefix("model.layers.5."): param_share(arch, p, 4) for p in arch.layers[5]}
    for whole in ("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.kv_a_proj_with_mqa.weight",
                  "self_attn.kv_a_layernorm.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias"):
        assert moe[whole] == 1.0, whole
    for split in ("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
                  "mlp.experts.0.gate_proj.weight", "mlp.experts.0.down_proj.weight", "mlp.shared_experts.up_proj.weight"):
        assert moe[split] == 0.25, split  # 128 heads, 2048 expert features, 2048 shared: a quarter each
    assert kv_share(arch, 5, 4) == 1.0  # the latent cache does not shrink with T
    qwen = architecture(load_config("Qwen3-235B-A22B"))
    assert kv_share(qwen, 0, 4) == 0.25 and kv_share(qwen, 0, 8) == 1.0  # 4 KV heads


def test_rank_bytes_and_timing_by_hand():
    """1 stage x 2 ranks of SMALL in bf16. Per layer and rank: q 4,096 + k 2,048 + v 2,048 + o 4,096 + MLP
    24,576 + norms 256 = 37,120 B; the first stage's extras: embedding 49,152 whole + norm 128 + half the
    head 24,576. A token reads its layers, one embedding row (128 B), the norm and its half of the head,
    and the KV cache of its context (1 token: 2 KV heads x 16 x 2 x 2 B / 2 ranks = 64 B per layer)."""
    config = ModelConfig.from_dict(SMALL)
    arch = architecture(config)
    precision = Precision(checkpoint_format(config), "bfloat16")
    mb = shared_model_bytes(arch, precision, 2)
    assert mb.layers == [37_120, 37_120] and mb.ends == 49_152 + 128 + 24_576
    host, link = HostTerms("test", 0.5, 0.25), LinkTerms("test", 10.0, 1.0)
    lay = plan_layout(arch, precision, 2, [1.0, 1.0], [1.0, 1.0], host, link, context=1, batch=1)
    assert lay.counts == [2] and lay.ranks[0].weights == 2 * 37_120 + 73_856 and lay.fits
    read = 2 * (37_120 + 64) + 128 + 128 + 24_576
    layer_sum = 10e-6 + 1 * 64 * 4 / (1e9 * 0.25)  # one other rank's float32 partial of 64 values
    head_sum = 10e-6 + 1 * 2 * 4 / (1e9 * 0.25)
    seconds = read / (1e9 * 0.5) + 2 * 2 * layer_sum + head_sum
    assert lay.single_tps == pytest.approx(1 / seconds)
    assert lay.sums_ms == pytest.approx(1e3 * (4 * layer_sum + head_sum))
    pipeline = plan_layout(arch, precision, 1, [1.0, 1.0], [1.0, 1.0], host, link, context=1, batch=1)
    assert pipeline.sums_ms == 0 and pipeline.counts == [1, 1]


def calibration_errors(host: HostTerms = APPLE_MLX) -> dict[tuple[str, int, int], float]:
    """Predicted / measured - 1 for every published figure, keyed (model, hosts, T)."""
    return {(m.model, len(m.host_memory), m.tensor_parallel): predict(m, host) / m.tps - 1 for m in MEASUREMENTS}


def test_the_terms_are_their_fit():
    fitted = fit()
    assert fitted.bandwidth_fraction == pytest.approx(APPLE_MLX.bandwidth_fraction, rel=2e-3)
    assert fitted.link_fraction == pytest.approx(APPLE_MLX.link_fraction, rel=2e-3)


def check_calibration(errors: dict) -> None:
    for key, error in errors.items():
        model, hosts, t = key
        # one node (the bandwidth fraction) and exo's pure tensor-parallel four-node figures: within 15% (issue 34)
        if hosts == 1 or hosts == t == 4:
            assert abs(error) <= 0.15, (key, f"{100 * error:+.1f}%")
        else:  # the two-node figures, checked looser: +18-19% for DeepSeek and Qwen (docs/plan.md)
            assert abs(error) <= 0.20, (key, f"{100 * error:+.1f}%")


def test_calibration_against_the_published_figures():
    errors = calibration_errors()
    check_calibration(errors)
    assert abs(errors["DeepSeek-V3.1", 4, 4]) < 0.005  # the figure link_fraction is fitted on


@pytest.mark.parametrize("planted", ["one sum per layer", "no link fraction", "roofline"])
def test_calibration_catches_a_wrong_term(planted, monkeypatch):
    host = APPLE_MLX
    if planted == "one sum per layer":
        monkeypatch.setattr(layouts, "SUMS_PER_LAYER", 1)
    elif planted == "no link fraction":  # the link's published bandwidth alone
        host = host._replace(link_fraction=1.0)
    else:  # today's roofline: no bandwidth fraction
        host = host._replace(bandwidth_fraction=1.0)
    with pytest.raises(AssertionError):
        check_calibration(calibration_errors(host))


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "plan", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_plan_tensor_parallel_beside_exos_figure():
    result = run_plan("--model", "DeepSeek-V3.1", "--host-memory", "512,512,256,256", "--quantize", "4",
                      "--tensor-parallel", "4", "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.strip().startswith("tensor 1 x 4")]
    assert len(rows) == 1 and "yes" in rows[0]
    measured = [line for line in result.stdout.splitlines() if "measured by exo: 32.5 tok/s" in line]
    assert len(measured) == 1, result.stdout
    predicted = float(measured[0].split("predicted ")[1].split()[0])
    assert abs(predicted / 32.5 - 1) < 0.15


def test_plan_prints_every_layout_of_a_cluster():
    result = run_plan("--model", "Qwen3-235B-A22B", "--host-memory", "512,512,256,256", "--quantize", "8",
                      "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for name in ("pipeline 4 x 1", "hybrid 2 x 2", "tensor 1 x 4"):
        assert sum(line.strip().startswith(name) for line in text.splitlines()) == 1, name
    assert "best single stream: tensor 1 x 4" in text and "measured by exo: 31.9 tok/s" in text
    result = run_plan("--model", "Qwen3-235B-A22B", "--hosts", "4", "--quantize", "4", "--cluster-terms", "linux-tcp",
                      "--bandwidth-gbs", "100")
    assert result.returncode == 0 and "TCP, 10 Gigabit Ethernet" in result.stdout and "measured by" not in result.stdout


def test_plan_tensor_parallel_bad_inputs():
    for args, fragment in [(("--tensor-parallel", "3"), "--tensor-parallel 3 must divide the 4 hosts"),
                           (("--tensor-parallel", "0"), "--tensor-parallel 0 must divide the 4 hosts")]:
        result = run_plan("--model", "DeepSeek-V3.1", "--host-memory", "512,512,256,256", "--quantize", "4", *args)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert result.returncode == 2 and len(errors) == 1 and fragment in errors[0], result.stderr
    # 8-bit DeepSeek (664 GiB + each rank's whole latent projections) does not fit four ranks of 256 GiB
    result = run_plan("--model", "DeepSeek-V3.1", "--host-memory", "512,512,256,256", "--tensor-parallel", "4")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 2 and len(errors) == 1 and "does not fit as tensor 1 x 4" in errors[0]
