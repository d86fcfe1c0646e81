"""--tensor-parallel ranks read only their share of each tensor from safetensors folders too
(checkpoints/share_reads.py): Hugging Face's tensors of one expert each (Qwen3-MoE, DeepSeek V3), MLX folders'
expert stacks (each expert's rows: a run of bytes an expert), DeepSeek's FP8 weights with their 128 x 128 block
scales (shares widened to whole blocks), Kimi K2's compressed-tensors INT4 experts, and --expert-parallel's
whole experts (another member's not read at all). The truth: the same member loaded by reading whole tensors and
cutting them (PIPELINE_SHARE_READS=0), bit for bit; and the reader's count of bytes read equals the shares'
bytes, counted from the files' headers, well under the whole read's."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mlx.core as mx
from mlx.utils import tree_flatten
from safetensors.torch import load_file, save_file

from conftest import REPO, fp8_blocks, write_tokenizer
from pipeline.checkpoints.format_adapters import Requantize
from pipeline.checkpoints.model_files import locate
from pipeline.checkpoints.share_reads import read_shares
from pipeline.models.tensor_parallel import Shard
from pipeline.models.vocab_split import vocab_share
from pipeline.runtime.stage import SHARE_READS, Stage
from test_moe import make_deepseek, make_qwen3_moe, pack_int4_experts

LAYERS_READ = "model.layers."


def load_member(folder, t: int, member: int, experts: bool = False, requantize: Requantize | None = None):
    checkpoint = locate(folder).open(None)
    config = checkpoint.model_config()
    stage = Stage.load(config, checkpoint, (0, config.num_hidden_layers), has_ends=member == 0, dtype=mx.float32,
                       requantize=requantize, shard=Shard(member, t, experts),
                       vocab_slice=vocab_share(config.vocab_size, t, member))
    return dict(tree_flatten(stage.model.parameters())), checkpoint, stage


def share_bytes(checkpoint, stage, t: int, member: int, experts: bool = False) -> int:
    """The bytes of each loaded tensor's share, from its header: (end - begin) / of of a tensor cut along one axis
    (its rows, columns or experts: whole rows or columns of every expert alike), none of another member's expert
    (--expert-parallel), all of a tensor held whole."""
    config = checkpoint.model_config()
    shares = read_shares(checkpoint.tensors, config, Shard(member, t, experts), vocab_share(config.vocab_size, t, member),
                         member == 0)
    total = 0
    for name in stage.loaded_tensors:
        nbytes = checkpoint.tensors[name].nbytes
        if name in shares:
            axis, begin, end, of = shares[name]
            if axis == -3 and len(checkpoint.tensors[name].shape) == 2:  # one expert's tensor
                expert = int(name.split(".experts.")[1].split(".")[0])
                nbytes = nbytes if begin <= expert < end else 0
            else:
                nbytes = nbytes * (end - begin) // of
        total += nbytes
    return total


def assert_share_reads_hold_what_whole_reads_cut(folder, t, member, monkeypatch, experts=False, requantize=None,
                                                 at_most=0.8):
    monkeypatch.setenv(SHARE_READS, "0")
    whole, whole_checkpoint, _ = load_member(folder, t, member, experts, requantize)
    monkeypatch.setenv(SHARE_READS, "1")
    share, checkpoint, stage = load_member(folder, t, member, experts, requantize)
    assert set(whole) == set(share)
    for name in whole:
        assert whole[name].shape == share[name].shape, name
        assert whole[name].dtype == share[name].dtype and mx.array_equal(whole[name], share[name]).item(), name
    assert checkpoint.bytes_read == share_bytes(checkpoint, stage, t, member, experts)
    assert checkpoint.bytes_read <= at_most * whole_checkpoint.bytes_read, (checkpoint.bytes_read,
                                                                           whole_checkpoint.bytes_read)
    return checkpoint, whole_checkpoint


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """qwen3_moe: Hugging Face's layout (a tensor an expert, float32); mlx: the same as an MLX folder (stacked
    experts, 4-bit, group 32); fp8: DeepSeek V3 as DeepSeek publishes it (e4m3, a scale per 128 x 128 block):
    hidden 256, experts of 256 features (two blocks a side: T = 2 reads one of each), a dense MLP of 384."""
    root = tmp_path_factory.mktemp("share_reads")
    make_qwen3_moe(root / "qwen3_moe", moe_intermediate_size=64, intermediate_size=128)
    mlx_tensors, config = {}, json.loads((root / "qwen3_moe" / "config.json").read_text())
    stacks: dict[str, list] = {}
    for name, w in sorted(load_file(str(root / "qwen3_moe" / "model.safetensors")).items()):
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            expert, proj = rest.split(".", 1)
            stacks.setdefault(f"{prefix}.mlp.switch_mlp.{proj}", []).append((int(expert), w))
        else:
            mlx_tensors[name] = mx.array(w.float().numpy())
    for name, parts in stacks.items():
        mlx_tensors[name] = mx.stack([mx.array(w.float().numpy()) for _, w in sorted(parts, key=lambda p: p[0])])
    for name in [n for n in mlx_tensors if n.endswith("proj.weight") and ".mlp.gate." not in n]:
        q, s, b = mx.quantize(mlx_tensors[name], group_size=32, bits=4)
        stem = name[: -len(".weight")]
        mlx_tensors.update({name: q, stem + ".scales": s, stem + ".biases": b})
    (root / "mlx").mkdir()
    mx.save_safetensors(str(root / "mlx" / "model.safetensors"), mlx_tensors)
    (root / "mlx" / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 32, "bits": 4}}))
    write_tokenizer(root / "mlx")

    make_deepseek(root / "bf", hidden=256, intermediate_size=384, moe_intermediate_size=256)
    fp8 = {}
    for name, w in load_file(str(root / "bf" / "model.safetensors")).items():
        if name.endswith("proj.weight") and "gate." not in name:
            fp8[name], fp8[name + "_scale_inv"] = fp8_blocks(w.float())
        else:
            fp8[name] = w.float().contiguous()
    (root / "fp8").mkdir()
    save_file(fp8, str(root / "fp8" / "model.safetensors"))
    write_tokenizer(root / "fp8")
    config = json.loads((root / "bf" / "config.json").read_text())
    (root / "fp8" / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}}))

    # Kimi K2's routed experts as Moonshot publishes them: compressed-tensors INT4 (group 32, symmetric, bf16
    # scales), packed by the compressed-tensors library; the rest as stored (bf16 in K2, float32 here)
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    int4, _ = pack_int4_experts(load_file(str(root / "bf" / "model.safetensors")), helpers)
    (root / "int4").mkdir()
    save_file(int4, str(root / "int4" / "model.safetensors"))
    write_tokenizer(root / "int4")
    k2 = json.loads((REPO / "pipeline" / "planner" / "configs" / "Kimi-K2-Thinking.json").read_text())
    (root / "int4" / "config.json").write_text(json.dumps({**config, "quantization_config": k2["quantization_config"]}))

    # Qwen3-MoE in FP8 as Qwen publishes its -FP8 models (a weight_scale_inv per 128 x 128 block; here one partial)
    qwen_fp8 = {}
    for name, w in load_file(str(root / "qwen3_moe" / "model.safetensors")).items():
        if name.endswith("proj.weight") and ".mlp.gate." not in name:
            qwen_fp8[name], qwen_fp8[name + "_scale_inv"] = fp8_blocks(w.float())
        else:
            qwen_fp8[name] = w.float().contiguous()
    (root / "qwen3_fp8").mkdir()
    save_file(qwen_fp8, str(root / "qwen3_fp8" / "model.safetensors"))
    write_tokenizer(root / "qwen3_fp8")
    config = json.loads((root / "qwen3_moe" / "config.json").read_text())
    (root / "qwen3_fp8" / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}}))
    return {kind: root / kind for kind in ("qwen3_moe", "mlx", "fp8", "int4", "qwen3_fp8")}


@pytest.mark.parametrize("t, member, experts, bits", [(2, 0, False, None), (2, 1, False, None), (3, 2, False, None),
                                                      (2, 1, False, 4), (2, 0, True, None), (2, 1, True, 4)])
def test_one_tensor_an_expert(folders, t, member, experts, bits, monkeypatch):
    """Qwen3-MoE as Hugging Face stores it: each expert's rows or columns (float32, or re-quantized at load), or under
    --expert-parallel the member's experts only (another's not read at all)."""
    requantize = Requantize(bits, 32) if bits else None
    assert_share_reads_hold_what_whole_reads_cut(folders["qwen3_moe"], t, member, monkeypatch, experts, requantize,
                                                 at_most=0.7)


@pytest.mark.parametrize("member, experts", [(0, False), (1, False), (1, True)])
def test_mlx_expert_stacks(folders, member, experts, monkeypatch):
    """An MLX folder's stacks [experts, rows, columns]: each expert's rows (a run an expert), columns (a run a row),
    or whole experts (one run), of the packed words, scales and biases alike."""
    assert_share_reads_hold_what_whole_reads_cut(folders["mlx"], 2, member, monkeypatch, experts, at_most=0.7)


@pytest.mark.parametrize("t, member, bits", [(2, 0, None), (2, 1, None), (3, 1, None), (3, 2, None), (2, 1, 4)])
def test_fp8_blocks(folders, t, member, bits, monkeypatch):
    """DeepSeek V3's FP8: a share widened to whole 128 x 128 blocks and its weight_scale_inv's blocks read, dequantized
    (or re-quantized at load) and cut: what dequantizing the whole weight and cutting it holds. T = 3's shares of 256
    expert features (86 / 85 / 85) fall inside blocks: each member reads the blocks its share touches."""
    requantize = Requantize(bits, 32) if bits else None
    checkpoint, _ = assert_share_reads_hold_what_whole_reads_cut(folders["fp8"], t, member, monkeypatch,
                                                                 requantize=requantize, at_most=0.75 if t == 2 else 0.9)
    expert = "model.layers.1.mlp.experts.0.gate_proj.weight"
    shares = read_shares(checkpoint.tensors, checkpoint.model_config(), Shard(member, t))
    axis, begin, end, of = shares[expert]
    assert axis == -2 and begin % 128 == 0 and (end % 128 == 0 or end == of)
    assert shares[expert + "_scale_inv"] == (-2, begin // 128, -(-end // 128), 2)


@pytest.mark.parametrize("member, experts", [(0, False), (1, True)])
def test_qwen3_fp8_experts(folders, member, experts, monkeypatch):
    """Qwen3-MoE's FP8 experts: a share inside one (partial) block reads the block, and under --expert-parallel
    another member's experts and their scales are not read at all."""
    checkpoint, _ = assert_share_reads_hold_what_whole_reads_cut(folders["qwen3_fp8"], 2, member, monkeypatch, experts,
                                                                 at_most=0.8 if experts else 1.0)
    shares = read_shares(checkpoint.tensors, checkpoint.model_config(), Shard(member, 2, experts))
    scales = "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"  # member 0's expert
    assert shares[scales] == ((-3, 4, 8, 8) if experts else (-1, 0, 1, 1))


@pytest.mark.parametrize("member", [0, 1])
def test_kimi_k2_int4_experts(folders, member, monkeypatch):
    """Kimi K2's compressed-tensors INT4 experts: packed words and group scales of each expert's rows or columns (its
    weight_shape read as the share's)."""
    assert_share_reads_hold_what_whole_reads_cut(folders["int4"], 2, member, monkeypatch, at_most=0.7)


def test_a_wrong_share_is_caught(folders, monkeypatch):
    """Reading the other member's rows of each expert (the runs one run late) makes the share reads differ from the cut."""
    import pipeline.checkpoints.share_reads as share_reads

    real = share_reads.share_runs

    def off_by_one_expert(info, axis, lo, hi):
        held, runs = real(info, axis, lo, hi)
        if len(info.shape) == 3 and axis % 3 == 1:
            runs = share_reads.Runs(runs.file, runs.begin + runs.nbytes // runs.rows, runs.nbytes, runs.rows, runs.stride)
        return held, runs

    monkeypatch.setattr(share_reads, "share_runs", off_by_one_expert)
    with pytest.raises(AssertionError):
        assert_share_reads_hold_what_whole_reads_cut(folders["mlx"], 2, 0, monkeypatch)


def test_a_share_inside_a_group_is_refused_as_whole_reads_refuse_it(folders, monkeypatch):
    """Re-quantized at load in groups of 64, 64 expert features over 2 members cut the groups: reading the share
    narrowed (32 columns, which alone would stay float) must not slip past the refusal the whole read gives."""
    from pipeline.util.errors import UserError

    for setting in ("0", "1"):
        monkeypatch.setenv(SHARE_READS, setting)
        with pytest.raises(UserError, match="cut its quantization groups of 64"):
            load_member(folders["qwen3_moe"], 2, 1, requantize=Requantize(4, 64))
