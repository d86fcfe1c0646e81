"""GGUF types held in their own blocks (IQ4_NL, IQ4_XS, Q6_K: checkpoints/quants.py NATIVE) and computed there
(kernels/gguf_kernels.cpp through kernels/qmm.py), against truths from elsewhere:
- the gguf package's dequantizers (llama.cpp's) define what the blocks mean: the float products equal a
  float64 product of gguf's dequantization, and the int8 products one of gguf's dequantization times the
  activations rounded as ggml's q8_0 / q8_K round them (llama.cpp's vec_dot pairs);
- blocks are packed here from ggml-common.h's published layouts (gguf's Python quantizers have no
  IQ4_NL, IQ4_XS or Q6_K; Q6_K's packer is test_gguf_inplace's pack_k): random bytes for the kernels, codes
  fitted to floats for the models;
- transformers runs the tiny model on gguf's dequantization of the file's weights.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from conftest import assert_far_from_uniform, forward, make_tiny_model, mpiexec
from test_gguf_inplace import LONG_PROMPT, gguf_vocab, random_blocks, reference, write_model, write_single
from pipeline.checkpoints import quants
from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
from pipeline.kernels import qmm
from pipeline.runtime.stage import Stage

TYPES = (QT.IQ4_NL, QT.IQ4_XS, QT.Q6_K)
ROW_COUNTS = (1, 2, 3, 8, 17, 64, 65)  # decode, drafts, batches, a prompt's chunk, past a tile
KVALUES = np.array(gguf.quants.IQ4_NL.kvalues, np.float32)


# ---- blocks from ggml-common.h's layouts --------------------------------------------------------------------

def pack_iq4(w: np.ndarray, qtype: QT) -> np.ndarray:
    """float [rows, cols] -> IQ4_NL blocks (d fp16, 16 code bytes per 32) or IQ4_XS super-blocks (d fp16,
    scales_h uint16, scales_l[4], 128 code bytes per 256), codes the nearest codebook entries."""
    rows, cols = w.shape
    sub = w.reshape(rows, -1, 32).astype(np.float32)
    biggest = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    scale = biggest / -127.0  # as quantize_row_iq4_nl starts: the largest value maps to -127
    if qtype == QT.IQ4_NL:
        d = scale.astype(np.float16)
        step = d.astype(np.float32)
        header = d.view(np.uint8).reshape(rows, -1, 2)
    else:
        blocks = scale.reshape(rows, -1, 8)
        d = (np.abs(blocks).max(-1) / 31).astype(np.float16)  # ls - 32 in [-32, 31]
        df = d.astype(np.float32)[..., None]
        ls = np.clip(np.round(blocks / np.where(df > 0, df, 1)), -32, 31).astype(np.int32)
        step = (df * ls).reshape(rows, -1)
        u = (ls + 32).astype(np.uint16)
        scales_h = np.zeros(u.shape[:-1], np.uint16)
        for j in range(8):
            scales_h |= (u[..., j] >> 4) << np.uint16(2 * j)
        low = (u & 15).astype(np.uint8)
        scales_l = low[..., 0::2] | (low[..., 1::2] << 4)
        header = np.concatenate([d.view(np.uint8).reshape(*d.shape, 2), scales_h.view(np.uint8).reshape(*d.shape, 2),
                                 scales_l], axis=-1)
    target = sub / np.where(step == 0, 1, step)[..., None]
    codes = np.abs(target[..., None] - KVALUES).argmin(-1).astype(np.uint8)  # [rows, subs, 32]
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # byte i: value i low, value i + 16 high
    if qtype == QT.IQ4_NL:
        return np.concatenate([header, qs], axis=-1).reshape(rows, -1)
    return np.concatenate([header, qs.reshape(rows, -1, 128)], axis=-1).reshape(rows, -1)


def held(raw: np.ndarray, qtype: QT) -> tuple[mx.array, ...]:
    """The arrays a rank holds: codes, scales (and Q6_K's d)."""
    return tuple(mx.array(a) for a in quants.native_arrays(raw, qtype.name))


def product(x: np.ndarray, arrays: tuple[mx.array, ...], int8: bool) -> np.ndarray:
    codes, scales, *d = arrays
    return np.array(qmm.gguf_matmul(mx.array(x), codes, scales, int8=int8, d=d[0] if d else None))


def rounded(x: np.ndarray, block: int) -> np.ndarray:
    """x rounded as ggml's q8_0 (block 32) / q8_K (block 256) round it, back in float64: d = max|x| / 127,
    rint(x / d) (the kernels' arithmetic, in float32 as they do it)."""
    b = x.reshape(x.shape[0], -1, block).astype(np.float32)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(b * inverse), -127, 127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


# ---- the kernels against gguf's dequantization ---------------------------------------------------------------

def test_packer_fits_the_floats():
    """The test's own packers give blocks gguf decodes close to the floats they were fitted to."""
    w = np.random.default_rng(0).normal(0, 0.2, (8, 512)).astype(np.float32)
    for qtype, bound in ((QT.IQ4_NL, 0.06), (QT.IQ4_XS, 0.06)):  # measured 0.053 both (weights up to |0.9|)
        error = np.abs(gguf.quants.dequantize(pack_iq4(w, qtype), qtype) - w)
        assert error.max() < bound, (qtype.name, error.max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_gguf_dequantization_at_every_row_count(kernels, qtype):
    """Random block bytes (every code, fp16 scales of every size, IQ4_XS's 6-bit scales): the float products
    equal float64 x @ dequantized.T within float32 accumulation, the int8 products the same with x rounded
    per block as llama.cpp's q8 types; each row's result has the same bits at every row count."""
    rng = np.random.default_rng(1)
    n, k = 48, 1024
    raw = random_blocks(qtype, n, k, rng)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    arrays = held(raw, qtype)
    x_all = rng.normal(0, 1, (max(ROW_COUNTS), k)).astype(np.float32)
    x_all[3, :32] = 0  # an all-zero activation block
    block = 32 if qtype == QT.IQ4_NL else 256
    outputs = {}
    for rows in ROW_COUNTS:
        x = x_all[:rows]
        scale = np.abs(x).astype(np.float64) @ np.abs(w).T  # what float32 rounding is relative to
        for int8 in (False, True):
            got = product(x, arrays, int8)
            truth = (rounded(x, block) if int8 else x.astype(np.float64)) @ w.T
            error = (np.abs(got - truth) / scale).max()
            # measured 6.3e-8 / 7.5e-8 / 6.6e-8 (float), 5.8e-8 / 4.4e-8 / 4.1e-8 (int8) for IQ4_NL / IQ4_XS / Q6_K
            assert error < 2e-7, (rows, int8, error)
            outputs[rows, int8] = got
    for (rows, int8), got in outputs.items():  # row-count invariance: every row's bits as in the largest call
        np.testing.assert_array_equal(got, outputs[max(ROW_COUNTS), int8][:rows], err_msg=f"{rows} rows, int8 {int8}")
    if qtype == QT.IQ4_NL:  # an odd number of blocks: AVX-512 takes them in pairs, the last one alone
        raw = random_blocks(qtype, 16, 96, rng)
        w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
        x = rng.normal(0, 1, (5, 96)).astype(np.float32)
        for int8 in (False, True):
            got = product(x, held(raw, qtype), int8)
            truth = (rounded(x, block) if int8 else x.astype(np.float64)) @ w.T
            assert (np.abs(got - truth) / (np.abs(x).astype(np.float64) @ np.abs(w).T)).max() < 2e-7


def test_a_wrong_codebook_entry_fails(kernels):
    """The kernels read ggml's kvalues_iq4nl: the same blocks with one entry of the codebook planted wrong
    in the truth are off by far more than the tolerance above (so that test would catch a kernel with it)."""
    rng = np.random.default_rng(2)
    raw = random_blocks(QT.IQ4_NL, 16, 256, rng)
    x = rng.normal(0, 1, (2, 256)).astype(np.float32)
    got = product(x, held(raw, QT.IQ4_NL), False)
    planted = gguf.quants.IQ4_NL.kvalues
    try:
        gguf.quants.IQ4_NL.kvalues = (*planted[:5], planted[5] + 1, *planted[6:])
        wrong = gguf.quants.dequantize(raw, QT.IQ4_NL).astype(np.float64)
    finally:
        gguf.quants.IQ4_NL.kvalues = planted
    scale = np.abs(x).astype(np.float64) @ np.abs(wrong).T
    assert (np.abs(got - x.astype(np.float64) @ wrong.T) / scale).max() > 1e-4


def test_q6_k_sub_block_scales_are_each_their_own(kernels):
    """Each of a Q6_K block's 16 values x 16 sub-blocks takes its own int8 scale: with two neighbouring scales
    swapped in the truth (sub-blocks 2c and 2c + 1 share a 32-value step of the kernels), both products are
    off by far more than the tolerance above."""
    rng = np.random.default_rng(4)
    raw = random_blocks(QT.Q6_K, 16, 512, rng)
    x = rng.normal(0, 1, (3, 512)).astype(np.float32)
    swapped = raw.reshape(16, 2, 210).copy()
    swapped[:, :, [196, 197]] = swapped[:, :, [197, 196]]  # sub-blocks 4 and 5 (scales at bytes 192-207)
    wrong = gguf.quants.dequantize(swapped.reshape(16, -1), QT.Q6_K).astype(np.float64)
    for int8 in (False, True):
        got = product(x, held(raw, QT.Q6_K), int8)
        truth = (rounded(x, 256) if int8 else x.astype(np.float64)) @ wrong.T
        assert (np.abs(got - truth) / (np.abs(x).astype(np.float64) @ np.abs(wrong).T)).max() > 1e-4


# ---- loading: the file's bytes, read in place -----------------------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_layer_matrices_are_held_as_the_files_bytes(tmp_path, kernels, qtype):
    """A layer's matrix loads as two arrays whose bytes are the file's bytes of that tensor (codes apart from
    their scales), the planner counts those bytes, and the module's products are the kernels'."""
    rng = np.random.default_rng(3)
    raw = random_blocks(qtype, 64, 512, rng)
    path = write_single(tmp_path / "one.gguf", "blk.0.ffn_down.weight", raw, qtype, 512)
    checkpoint = GGUFCheckpoint(path)
    module = "model.layers.0.mlp.down_proj"
    entry = checkpoint.tensors[f"{module}.weight"]
    assert entry.how == "native"
    parts = ("weight", "scales", "biases") if qtype == QT.Q6_K else ("weight", "scales")  # Q6_K's d as biases
    assert {n for n in checkpoint.tensors if n.startswith(module)} == {f"{module}.{p}" for p in parts}
    arrays = [checkpoint.read(f"{module}.{p}") for p in parts]
    assert sum(a.nbytes for a in arrays) == raw.nbytes == entry.source[0].nbytes
    held_bytes = np.concatenate([np.array(a).view(np.uint8).reshape(64, -1) for a in arrays], axis=1)
    per_block = {QT.IQ4_NL: (16, 2), QT.IQ4_XS: (128, 8), QT.Q6_K: (192, 16, 2)}[qtype]  # bytes of each part
    pieces = [p.reshape(64, -1, n) for p, n in zip(np.split(held_bytes, np.cumsum(
        [a.nbytes // 64 for a in arrays])[:-1], axis=1), per_block)]
    in_file = np.concatenate(pieces[1:] + pieces[:1], axis=-1) if qtype != QT.Q6_K else np.concatenate(pieces, axis=-1)
    assert np.array_equal(in_file.reshape(64, -1), raw)  # the file's bytes, block by block
    assert sum(checkpoint.tensors[f"{module}.{p}"].nbytes for p in parts) == raw.nbytes
    # --quantize asks for MLX's layout: re-quantized as before
    assert GGUFCheckpoint(path, 8).tensors[f"{module}.weight"].how == "requantized"


# ---- a whole model -------------------------------------------------------------------------------------------

def _model(tmp_path, qtype):
    """A tiny Mistral written as a llama GGUF (q/k rows permuted, as llama.cpp's converter writes them) with
    every layer matrix `qtype`, the rest F32 (as test_gguf_inplace's dense cases)."""
    import transformers

    folder = make_tiny_model("mistral", tmp_path / "hf", hidden_size=256, intermediate_size=512)
    model = transformers.MistralForCausalLM.from_pretrained(folder).eval()
    choose = lambda name, w: qtype if name.startswith("blk.") and w.ndim == 2 else QT.F32  # noqa: E731
    return model, write_model(tmp_path / "m.gguf", model, "llama", choose, vocab=gguf_vocab(folder))


@pytest.fixture(scope="module", params=TYPES, ids=lambda t: t.name)
def iq_model(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param.name)
    import test_gguf_inplace

    encode = test_gguf_inplace.encode
    test_gguf_inplace.encode = lambda w, q: pack_iq4(w.reshape(-1, w.shape[-1]), q).reshape(*w.shape[:-1], -1) \
        if q in (QT.IQ4_NL, QT.IQ4_XS) else encode(w, q)
    try:
        model, written = _model(tmp, request.param)
    finally:
        test_gguf_inplace.encode = encode
    return request.param, model, written


def test_model_matches_transformers_on_the_files_weights(iq_model, kernels):
    """The tiny model with every layer matrix IQ4: our logits with float products equal transformers' on
    gguf's dequantization of the same file within float32 rounding, on 1 and 2 stages; with int8 products
    (llama.cpp's arithmetic) the same bits on 1 and 2 stages, within the activations' rounding of them."""
    qtype, model, written = iq_model
    truth = reference(model, written["state"])
    checkpoint = GGUFCheckpoint(written["files"][0])
    assert {e.how for n, e in checkpoint.tensors.items() if n.startswith("model.layers.") and n.endswith("proj.weight")} \
        == {"native"}
    config = checkpoint.model_config()
    state = qmm.load()
    saved = state.gguf_int8
    try:
        for int8 in (False, True):
            state.gguf_int8 = int8
            logits = []
            for ranges in (((0, 4),), ((0, 2), (2, 4))):
                stages = [Stage.load(config, checkpoint, r, has_ends=(i == 0), dtype=mx.float32)
                          for i, r in enumerate(ranges)]
                logits.append(np.array(forward(stages, LONG_PROMPT)))
            np.testing.assert_array_equal(logits[0], logits[1])
            ours = logits[0]
            assert_far_from_uniform(ours)
            error = np.abs(ours - truth).max()
            if not int8:  # float32 rounding: measured 1.5e-4 all three types (logits up to |14|), as the K-quants' 3.1e-4
                assert error < 4e-4 and (ours.argmax(-1) == truth.argmax(-1)).all(), error
            else:  # measured 2.4 / 92% (IQ4_NL), 3.7 / 77% (IQ4_XS: blocks of 256), 5.1 / 81% (Q6_K: blocks of 256);
                # a Q8_0 file's int8 products: 4.3 / 70%
                bound = 6.0 if qtype == QT.Q6_K else 4.5
                assert error < bound and (ours.argmax(-1) == truth.argmax(-1)).mean() > 0.75, error
    finally:
        state.gguf_int8 = saved


def test_dense_weights_keep_the_blocks(iq_model, kernels):
    """--weights-in-memory fp32 dequantizes MLX-quantized modules; IQ4 layer matrices stay in their blocks
    (qmm.GGUFLinear), with the same products."""
    _, _, written = iq_model
    checkpoint = GGUFCheckpoint(written["files"][0])
    config = checkpoint.model_config()
    held, dense = (Stage.load(config, checkpoint, (0, 4), has_ends=True, dtype=mx.float32, dense=d) for d in (False, True))
    assert type(dense.model.layers[0].mlp.down_proj) is qmm.GGUFLinear
    np.testing.assert_array_equal(forward([dense], LONG_PROMPT), forward([held], LONG_PROMPT))


def test_plan_counts_the_files_bytes(iq_model):
    """What `plan` and preflight count a rank holding each layer is the layer's bytes in the file (its IQ4
    matrices as stored, its F32 norms as float32), with or without the int8 products."""
    from pipeline.models.config import ModelConfig
    from pipeline.planner.weights_bytes import held_and_dense

    _, _, written = iq_model
    path = written["files"][0]
    checkpoint = GGUFCheckpoint(path)
    in_file = [sum(t.nbytes for t in checkpoint.gguf.tensors.values() if t.name.startswith(f"blk.{i}.")) for i in range(4)]
    config = checkpoint.model_config()
    for int8 in (False, True):
        assert held_and_dense(config, path, int8=int8)[0].layers == in_file

