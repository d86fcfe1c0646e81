"""A tied 8-bit embedding held once, the LM head too (issue 37): its int8 products read the embedding's own bytes
(int8_kernels.cpp: gguf_q8_0_matmul on a GGUF's Q8_0 blocks held as the file's row bytes, int8_rows_matmul on
MLX's 8-bit layout, the converted default model's), where the int8 path used to hold a second, int8 copy.

Truths: the gguf package's Q8_0 quantizer and dequantizer (llama.cpp's); a float64 product of gguf's dequantization
times the activations rounded per 32 as int8_kernels.cpp rounds them (d = max|x| / 127, xq = rint(x / d)); and, bit
for bit, int8_matmul on int8_repack's copy of the same matrix, the head product these replace.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from test_gguf_native_ends import _write, vocab  # noqa: F401 (vocab: the fixture)
from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
from pipeline.checkpoints.int8_repack import use_int8
from pipeline.checkpoints.model_files import find
from pipeline.kernels import gguf_rows, qmm
from pipeline.models.stage_slice import head_columns
from pipeline.planner.shapes import architecture
from pipeline.planner.stored_formats import checkpoint_format
from pipeline.planner.weights_bytes import Precision, model_bytes
from pipeline.runtime.stage import Stage

Q8_0 = 8  # ggml's type id


def q8_0_blocks(rng, n: int, k: int) -> np.ndarray:
    """gguf's Q8_0 quantization of random rows of varied magnitude: uint8 [n, k / 32 * 34]."""
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 2.0, (n, 1)).astype(np.float32)
    return gguf.quants.quantize(w, QT.Q8_0)


def rounded(x: np.ndarray) -> np.ndarray:
    """x rounded per 32 as int8_kernels.cpp's quantize_row (float32 steps), as float64 d * xq."""
    chunks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d = np.abs(chunks).max(-1, keepdims=True) / np.float32(127)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    xq = np.clip(np.rint(chunks * inverse), -127, 127)
    return (d.astype(np.float64) * xq).reshape(x.shape)


def mlx_8bit(blocks: np.ndarray) -> tuple[mx.array, mx.array, mx.array]:
    """The same matrix in MLX's 8-bit affine layout (group 32), as a converted GGUF holds it: codes q + 128,
    scales d and biases -128 d in float16."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 34)
    d = b[..., :2].copy().view(np.float16)[..., 0]
    u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(n, -1)
    return mx.array(u.view(np.uint32)), mx.array(d), mx.array((d.astype(np.float32) * -128).astype(np.float16))


def bits(a) -> np.ndarray:
    return np.array(a).view(np.uint32)


@pytest.mark.parametrize("n, k, rows", [(80, 576, 1), (37, 256, 3), (64, 576, 4), (53, 96, 9), (48, 1024, 17)])
def test_q8_0_head_is_gguf_dequantization_times_rounded_activations(kernels, n, k, rows):
    """n not a multiple of 16 (a last, partial column block), rows below and above where a column block is first
    rearranged (4): within float32 rounding of the float64 product of gguf's dequantization and the rounded x."""
    rng = np.random.default_rng(n * k + rows)
    blocks = q8_0_blocks(rng, n, k)
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    got = np.array(qmm.gguf_blocks_matmul(mx.array(x), mx.array(blocks), Q8_0, int8=True))
    w = gguf.quants.dequantize(blocks, QT.Q8_0).astype(np.float64)
    expected = rounded(x) @ w.T
    magnitude = np.abs(rounded(x)) @ np.abs(w).T
    assert np.max(np.abs(got - expected) / magnitude) < 1e-7  # measured 2.0e-8 to 7.3e-8


@pytest.mark.parametrize("rows", [1, 2, 4, 9])
def test_q8_0_head_has_the_bits_of_the_int8_copy(kernels, rows):
    """The product from the file's blocks equals, bit for bit, int8_matmul on int8_repack of the same matrix in MLX's
    layout (what the int8 path held as the head before), on the direct path (1-3 rows) and the rearranged one."""
    rng = np.random.default_rng(rows)
    n, k = 96, 576
    blocks = q8_0_blocks(rng, n, k)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
    copy = kernels.int8_repack(*mlx_8bit(blocks), 32, 8)
    expected = kernels.int8_matmul(x, *copy, 32, 8)
    np.testing.assert_array_equal(bits(qmm.gguf_blocks_matmul(x, mx.array(blocks), Q8_0, int8=True)), bits(expected))


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_mlx_8bit_rows_product_has_the_bits_of_the_int8_copy(kernels, dtype, group_size):
    """MLX's 8-bit affine layout read in place (int8_rows_matmul): any scale dtype and group size, biases not tied to
    the scales (an MLX checkpoint's 8 bits), 1 to 9 rows: the bits of int8_matmul on its int8_repack."""
    rng = np.random.default_rng(group_size)
    n, k = 64, 512
    w = mx.array(rng.integers(0, 256, (n, k), dtype=np.uint8).view(np.uint32))
    s = mx.array(rng.uniform(1e-3, 2e-2, (n, k // group_size)).astype(np.float32)).astype(getattr(mx, dtype))
    b = mx.array(rng.normal(0, 0.5, (n, k // group_size)).astype(np.float32)).astype(getattr(mx, dtype))
    copy = kernels.int8_repack(w, s, b, group_size, 8)
    for rows in (1, 3, 4, 9):
        x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
        np.testing.assert_array_equal(bits(kernels.int8_rows_matmul(x, w, s, b, group_size)),
                                      bits(kernels.int8_matmul(x, *copy, group_size, 8)))


def test_each_row_has_its_own_bits_whatever_shares_the_call(kernels):
    rng = np.random.default_rng(7)
    n, k, rows = 40, 320, 12
    blocks = mx.array(q8_0_blocks(rng, n, k))
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
    full = bits(kernels.gguf_q8_0_matmul(x, blocks, Q8_0, True))
    for count in range(1, rows + 1):
        start = (count * 5) % (rows - count + 1)
        part = bits(kernels.gguf_q8_0_matmul(x[start:start + count], blocks, Q8_0, True))
        np.testing.assert_array_equal(part, full[start:start + count], err_msg=f"rows {start}..{start + count}")


def test_q8_0_float_products(kernels):
    """Where int8 products are not asked for: within float32 rounding of the float64 product with gguf's dequantization."""
    rng = np.random.default_rng(11)
    blocks = q8_0_blocks(rng, 50, 384)
    x = rng.standard_normal((5, 384)).astype(np.float32)
    got = np.array(qmm.gguf_blocks_matmul(mx.array(x), mx.array(blocks), Q8_0, int8=False))
    w = gguf.quants.dequantize(blocks, QT.Q8_0).astype(np.float64)
    assert np.max(np.abs(got - x @ w.T) / (np.abs(x) @ np.abs(w).T)) < 4e-8  # measured 2.7e-8


def test_looked_up_rows_are_gguf_dequantization():
    rng = np.random.default_rng(3)
    blocks = q8_0_blocks(rng, 30, 256)
    ids = rng.integers(0, 30, (2, 5))
    got = gguf_rows.q8_0(mx.array(blocks)[mx.array(ids)])
    np.testing.assert_array_equal(np.array(got), gguf.quants.dequantize(blocks, QT.Q8_0).astype(np.float32)[ids])


def test_tied_q8_0_embedding_is_held_once_as_the_files_bytes(tmp_path, vocab, kernels):
    """A Qwen3 GGUF (tied embedding) all Q8_0, loaded as a job loads it with int8 products: the embedding is the
    file's bytes of token_embd (weight bytes == file bytes, no int8 copy beside it), its lookups gguf's dequantization,
    its head the bits of an int8 copy's; the planner counts what the stage holds."""
    _, written = _write(tmp_path, "qwen3", {"token_embd": QT.Q8_0}, vocab)
    path = written["files"][0]
    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.model_config()
    assert config.tie_word_embeddings
    stage = Stage.load(config, GGUFCheckpoint(path), (0, config.num_hidden_layers), has_ends=True, dtype=mx.float32,
                       int8_in_place=False)
    use_int8(stage.model, tied_head=True)
    embedding = stage.model.embed_tokens
    assert isinstance(embedding, qmm.GGUFBlocksEmbedding) and embedding.type_id == Q8_0
    assert not any(name.startswith("int8_") for name in embedding)
    raw = checkpoint.gguf.tensors["token_embd.weight"]
    assert embedding["weight"].nbytes == raw.nbytes  # the file's bytes, once
    blocks = np.array(embedding["weight"])
    ids = mx.array([[3, 1, 4, 1, 5]])
    np.testing.assert_array_equal(np.array(embedding(ids))[0], gguf.quants.dequantize(blocks, QT.Q8_0)[[3, 1, 4, 1, 5]])
    x = mx.array(np.random.default_rng(0).standard_normal((3, config.hidden_size)).astype(np.float32))
    copy = kernels.int8_repack(*mlx_8bit(blocks), 32, 8)
    qmm.set_gguf_int8(True)
    try:
        np.testing.assert_array_equal(bits(embedding.as_linear(x)), bits(kernels.int8_matmul(x, *copy, 32, 8)))
        np.testing.assert_array_equal(bits(head_columns(embedding, x, 16, 48)), bits(embedding.as_linear(x))[:, 16:48])
    finally:
        qmm.set_gguf_int8(None)
    mb = model_bytes(architecture(config), Precision(checkpoint_format(config, find(path)), "float32", int8=True))
    assert sum(mb.layers) + mb.ends == stage.weight_nbytes


def test_tied_8bit_mlx_embedding_gains_no_copy(kernels):
    """MLX's 8-bit tied embedding (the converted default model's): use_int8 makes no int8 copy; the head reads the
    embedding in place with the bits the copy gave, whole and in row slices (head_share, vocabulary splits);
    a 4-bit one still gains its copy."""
    mx.random.seed(1)
    model = nn.Sequential(nn.Embedding(96, 64), nn.Embedding(64, 64))
    nn.quantize(model, class_predicate=lambda path, _: {"group_size": 32, "bits": 8 if path == "layers.0" else 4})
    qmm.use_in(model)
    eight, four = model.layers
    before = sum(a.nbytes for _, a in nn.utils.tree_flatten(eight.parameters()))
    copy = kernels.int8_repack(eight["weight"], eight["scales"], eight["biases"], 32, 8)
    assert use_int8(model, tied_head=True) == 2
    assert "int8_weight" not in eight and eight.int8_rows
    assert sum(a.nbytes for _, a in nn.utils.tree_flatten(eight.parameters())) == before
    assert "int8_weight" in four
    x = mx.array(np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32))
    expected = bits(kernels.int8_matmul(x, *copy, 32, 8))
    np.testing.assert_array_equal(bits(eight.as_linear(x)), expected)
    np.testing.assert_array_equal(bits(qmm.rows_product(eight, x, 16, 80)), expected[:, 16:80])
