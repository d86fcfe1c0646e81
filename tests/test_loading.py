"""A rank's loaded weights against the same tensors read independently (safetensors' own reader,
torch for the FP8 arithmetic), for every way a folder stores them: bf16 shards cast to float32 or
kept in bfloat16, FP8 blocks dequantized or re-quantized at load (--quantize), MLX-quantized
triples, an F64 tensor MLX cannot read itself; and a rank reads only its own tensors' bytes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten
from safetensors.torch import load_file, save_file

from conftest import fp8_blocks, mapped_bytes

from pipeline.models.config import ModelConfig
from pipeline.checkpoints.format_adapters import Requantize
from pipeline.runtime.stage import Stage
from pipeline.checkpoints.safetensors_checkpoint import Checkpoint

HIDDEN, INTER, LAYERS, VOCAB = 256, 320, 4, 384  # 256: whole 128x128 FP8 blocks; 320: partial ones
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=HIDDEN, intermediate_size=INTER,
              num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
              vocab_size=VOCAB, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
PROJ = {"self_attn.q_proj": (256, HIDDEN), "self_attn.k_proj": (128, HIDDEN), "self_attn.v_proj": (128, HIDDEN),
        "self_attn.o_proj": (HIDDEN, 256), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTER)}


def random_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A Llama's tensors in bf16, values spread enough that casts and scales are exercised."""
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
           "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g), "model.norm.weight": 1 + torch.randn(HIDDEN, generator=g)}
    for i in range(LAYERS):
        for proj, shape in PROJ.items():
            out[f"model.layers.{i}.{proj}.weight"] = torch.randn(*shape, generator=g) * 0.05
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    return {name: t.to(torch.bfloat16) for name, t in out.items()}


def save_shards(folder: Path, tensors: dict[str, torch.Tensor], shards: int, config: dict | None = None) -> Path:
    """`tensors` in `shards` files with an index, layers spread over them as publishers do."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors, key=lambda n: (int(n.split(".")[2]) if n.startswith("model.layers.") else -1, n))
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[min(shards - 1, i * shards // len(names))] for i, name in enumerate(names)}
    for file in files:
        save_file({n: tensors[n].contiguous() for n in names if weight_map[n] == file}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    return folder


def loaded(folder: Path, layers=(0, LAYERS), has_ends=True, dtype=mx.float32, requantize=None) -> dict[str, mx.array]:
    """The parameters one rank holds for `layers`, under checkpoint names."""
    stage = Stage.load(ModelConfig.from_folder(folder), Checkpoint(folder), layers, has_ends=has_ends, dtype=dtype,
                       requantize=requantize)
    params = {}
    for name, array in tree_flatten(stage.model.parameters()):
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            name = f"model.layers.{int(index) + layers[0]}.{rest}"
        elif not name.startswith("lm_head."):
            name = "model." + name
        params[name] = array
    return params


def as_numpy(array: mx.array) -> np.ndarray:
    """Exact bits: bfloat16 through float32 (exact), everything else as it is."""
    return np.array(array.astype(mx.float32) if array.dtype == mx.bfloat16 else array)


def test_bf16_shards_load_exactly_as_stored(tmp_path):
    folder = save_shards(tmp_path / "bf16", random_tensors(), shards=3)
    truth = {}
    for file in folder.glob("*.safetensors"):
        truth.update(load_file(str(file)))  # safetensors' own reader
    for dtype in (mx.float32, mx.bfloat16):
        params = loaded(folder, dtype=dtype)
        assert set(params) == set(truth)
        for name, array in params.items():
            assert array.dtype == dtype, name
            np.testing.assert_array_equal(as_numpy(array), truth[name].float().numpy(), err_msg=name)


@pytest.mark.parametrize("mapped", [False, True])
def test_a_rank_reads_only_its_own_tensors(tmp_path, monkeypatch, mapped):
    """Read into new memory: the bytes read() returns. Mapped (mapped_files.py): the shard's pages this
    process maps, held as stored (bf16) so that they stay mapped."""
    from pipeline.kernels import mapped_files

    if not Path("/proc/self/io").exists():
        pytest.skip("needs /proc/self/io and /proc/self/smaps (Linux) to count the bytes read")
    monkeypatch.setenv(mapped_files.ENV, "1" if mapped else "0")
    if mapped and not mapped_files.available():
        pytest.skip("no mapping without pipeline's kernels")
    folder = save_shards(tmp_path / "bf16", random_tensors(), shards=2)
    checkpoint = Checkpoint(folder)
    owned = sum(info.nbytes for name, info in checkpoint.tensors.items() if name.startswith("model.layers.3."))
    shard_path = checkpoint.tensors["model.layers.3.mlp.up_proj.weight"].file
    shard = max(path.stat().st_size for path in checkpoint.files)
    before = _bytes_read()
    params = loaded(folder, layers=(3, 4), has_ends=False, dtype=mx.bfloat16 if mapped else mx.float32)
    read = mapped_bytes(shard_path) if mapped else _bytes_read() - before
    truth = load_file(str(shard_path))
    np.testing.assert_array_equal(as_numpy(params["model.layers.3.mlp.up_proj.weight"]),
                                  truth["model.layers.3.mlp.up_proj.weight"].float().numpy())
    # its tensors' bytes, plus the headers and the config: far from the shard. Mapped: plus the pages its
    # tensors' ends share, and the kernel's fault-around (cached pages near a fault, 64 KiB by default)
    count = sum(name.startswith("model.layers.3.") for name in checkpoint.tensors)
    slack = count * 2 * os.sysconf("SC_PAGE_SIZE") + 2 * 64 * 1024 if mapped else 64 * 1024
    assert owned <= read < owned + slack < shard, (owned, read, slack, shard)


def test_each_file_header_is_parsed_once_per_stream(tmp_path):
    """Every read of a file shares its one mx.load header (per stream): a header per read would
    keep a file open per tensor and parse it again each time."""
    folder = save_shards(tmp_path / "bf16", random_tensors(), shards=3)
    checkpoint = Checkpoint(folder)
    arrays = [checkpoint.read(name) for name in checkpoint.tensors]
    with mx.stream(mx.new_stream(mx.cpu)):
        arrays += [checkpoint.read(name) for name in list(checkpoint.tensors)[:5]]
    mx.eval(arrays)
    assert len(checkpoint._lazy) <= len(checkpoint.files) + 5


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    """Projections in FP8 blocks (whole blocks: 256 wide; partial: 320), the rest bf16. Returns the
    folder and each projection's dequantized float32 value, computed by torch."""
    tensors, dequantized = {}, {}
    for name, t in random_tensors(1).items():
        if name.endswith("proj.weight"):
            q, scale_inv = fp8_blocks(t.float())
            tensors[name], tensors[name + "_scale_inv"] = q, scale_inv
            expanded = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[: t.shape[0], : t.shape[1]]
            dequantized[name] = q.float() * expanded
        else:
            tensors[name] = t
    config = {**CONFIG, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    return save_shards(tmp_path_factory.mktemp("fp8") / "fp8", tensors, shards=2, config=config), dequantized


def test_fp8_blocks_dequantize_exactly(fp8_folder):
    folder, dequantized = fp8_folder
    params = loaded(folder)
    assert HIDDEN % 128 == 0 and INTER % 128  # both the whole-block and the partial-block paths
    for name, expected in dequantized.items():
        np.testing.assert_array_equal(np.array(params[name]), expected.numpy(), err_msg=name)


def test_fp8_requantized_at_load_equals_quantizing_the_dequantized_weights(fp8_folder):
    folder, dequantized = fp8_folder
    params = loaded(folder, requantize=Requantize(4, 64))
    for name, expected in dequantized.items():
        module = name.removesuffix(".weight")
        q, s, b = mx.quantize(mx.array(expected.numpy()), group_size=64, bits=4)
        for part, want in (("weight", q), ("scales", s), ("biases", b)):
            np.testing.assert_array_equal(np.array(params[f"{module}.{part}"]), np.array(want), err_msg=f"{module}.{part}")
    truth = load_file(str(Checkpoint(folder).tensors["model.embed_tokens.weight"].file))["model.embed_tokens.weight"]
    q, s, b = mx.quantize(mx.array(truth.float().numpy()), group_size=64, bits=4)  # the embedding is re-quantized too
    np.testing.assert_array_equal(np.array(params["model.embed_tokens.scales"]), np.array(s))


def test_mlx_quantized_triples_load_as_stored(tmp_path):
    folder = tmp_path / "q4"
    folder.mkdir()
    arrays = {}
    for name, t in random_tensors(2).items():
        w = mx.array(t.float().numpy()).astype(mx.bfloat16)
        if name.endswith("proj.weight") or name.endswith("embed_tokens.weight") or name.startswith("lm_head"):
            q, s, b = mx.quantize(w, group_size=32, bits=4)
            base = name.removesuffix(".weight")
            arrays.update({name: q, base + ".scales": s, base + ".biases": b})
        else:
            arrays[name] = w
    mx.save_safetensors(str(folder / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps({**CONFIG, "quantization": {"group_size": 32, "bits": 4}}))
    truth = load_file(str(folder / "model.safetensors"))
    params = loaded(folder)
    assert set(params) == set(truth)
    for name, array in params.items():
        expected = truth[name]
        assert array.dtype == (mx.uint32 if expected.dtype == torch.uint32 else mx.float32), name
        want = expected.numpy() if expected.dtype == torch.uint32 else expected.float().numpy()
        np.testing.assert_array_equal(np.array(array), want, err_msg=name)


def test_a_file_with_a_dtype_mlx_cannot_read(tmp_path):
    """F64 (which mx.load refuses): that file's tensors are read another way, to the same values."""
    tensors = {name: t.to(torch.float64) if name.startswith("model.layers.1.") else t
               for name, t in random_tensors(3).items()}
    folder = save_shards(tmp_path / "f64", tensors, shards=2)
    params = loaded(folder)
    for name, t in tensors.items():
        np.testing.assert_array_equal(np.array(params[name]), t.float().numpy(), err_msg=name)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("qtype_name", ["Q4_0", "Q8_0", "Q4_K", "MXFP4"])
def test_gguf_pieces_decoded_on_threads_equal_gguf_own_dequantization(tmp_path, monkeypatch, qtype_name):
    """A GGUF tensor split into many pieces, decoded at once on four threads and joined: bit for bit
    what gguf's own dequantizer makes of the file (the one-piece path is test_gguf_inplace's)."""
    from gguf import GGMLQuantizationType as QT
    from test_gguf_inplace import decode, load_tensor, random_blocks, write_single

    import pipeline.util.cores
    from pipeline.checkpoints import gguf_checkpoint, quants

    qtype = QT[qtype_name]
    raw = random_blocks(qtype, 96, 512, np.random.default_rng(5))
    path = write_single(tmp_path / "t.gguf", "blk.0.ffn_up.weight", raw, qtype, 512)
    monkeypatch.setattr(pipeline.util.cores, "cpus_allowed", lambda: frozenset(range(4)))
    monkeypatch.setattr(gguf_checkpoint, "MIN_PIECE_VALUES", 1)
    monkeypatch.setattr(quants, "CHUNK_VALUES", 7 * 512)  # 7 rows a piece: the last one short
    ours, checkpoint = load_tensor(path, "model.layers.0.mlp.up_proj")
    tensor = checkpoint.tensors["model.layers.0.mlp.up_proj.weight"].source[0]
    assert checkpoint._workers == 4 and len(checkpoint._pieces(tensor, 4)) == 14
    assert np.array_equal(ours, decode(raw, qtype))
    assert checkpoint.bytes_read == tensor.nbytes
    checkpoint.loaded([])
