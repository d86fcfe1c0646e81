"""--int8-activations: pipeline/kernels/int8_kernels.cpp through pipeline/kernels/qmm.py. Against independent truths:
  - numpy's float64 product of the dequantized weights (test_quant_kernels.dequantized_float64) and x,
    within the bound that rounding x to int8 per 32 inputs allows (at most d / 2 per input);
  - numpy's float64 model of the int8 arithmetic itself (x rounded as the kernel documents), to float
    rounding: a wrong nibble, column, chunk, scale or sum is off by far more.
Then the properties batch jobs rely on: a row's bits do not depend on the other rows (count, place,
experts), at any row count, and every ISA path (VNNI, AVX-512 without it, AVX2) gives the same bits;
and end to end, `generate` and `batch` print the same text with the flag, on 1 and 2 ranks."""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import REPO, make_tiny_model, mpiexec
from pipeline.checkpoints.int8_repack import use_int8
from pipeline.kernels import build, qmm
from test_quant_kernels import SCALE_DTYPES, assert_same_bits, dequantized_float64, quantized, variant_and_native


def int8_rows(x: np.ndarray):
    """x [rows, k] float32 as the kernel rounds it, by numpy alone: per chunk of 32, d = max|x| / 127,
    xq = clip(rint(x * (1 / d)), -127, 127), and the chunk's sum of the rounded inputs, d * sum(xq).
    Float32 operations throughout, as the kernel's."""
    rows, k = x.shape
    chunks = x.reshape(rows, k // 32, 32)
    amax = np.abs(chunks).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    xq = np.clip(np.rint(chunks * inverse[..., None]), -127, 127).astype(np.int64)
    sums = (xq.sum(axis=-1).astype(np.float32) * d).astype(np.float32)
    return xq, d, sums


def int8_reference(x: np.ndarray, w, scales, biases, bits: int, group_size: int):
    """(float64 value of the kernel's arithmetic, the sum of its terms' magnitudes) for x @ w.T."""
    unit = dequantized_float64(w, mx.ones_like(scales).astype(mx.float32), mx.zeros_like(biases).astype(mx.float32),
                               bits, group_size).astype(np.int64)  # the q values
    s = np.repeat(np.array(scales.astype(mx.float32)), group_size // 32, axis=-1)  # per chunk
    b = np.repeat(np.array(biases.astype(mx.float32)), group_size // 32, axis=-1)
    xq, d, sums = int8_rows(x)
    n, k = unit.shape
    isum = np.einsum("nck,rck->rnc", unit.reshape(n, k // 32, 32), xq)  # exact integers
    sd = (s[None] * d[:, None, :]).astype(np.float32).astype(np.float64)  # s * d rounds once in float32
    terms = isum * sd, b[None].astype(np.float64) * sums[:, None, :].astype(np.float64)
    return (terms[0] + terms[1]).sum(-1), (np.abs(terms[0]) + np.abs(terms[1])).sum(-1)


def rounding_bound(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """|x @ w.T - xq * d @ w.T| <= sum over chunks of d / 2 * sum |w| (float64 truth, no kernel model)."""
    rows, k = x.shape
    d = np.abs(x.reshape(rows, k // 32, 32)).max(-1) / 127
    per_chunk = np.abs(weights).reshape(weights.shape[0], k // 32, 32).sum(-1)
    return (d / 2) @ per_chunk.T


def int8(kernels, w, scales, biases, group_size, bits):
    return kernels.int8_repack(w, scales, biases, group_size, bits)


# Float32 error of the kernel's own steps over their float64 value, relative to the sum of the terms'
# magnitudes: two fused multiply-adds per chunk (one rounding each), s * d (one). Measured at most
# 5.5e-8 over the shapes below; a wrong nibble, column, chunk or scale is off by order 1.
RELATIVE_TOLERANCE = 1e-7


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("group_size", (32, 64, 128))
@pytest.mark.parametrize("bits", (4, 8))
def test_int8_product_matches_float64_truth_and_model(kernels, bits, group_size, scale_dtype):
    rng = np.random.default_rng(bits * 100 + group_size)
    n, k = 48, 384  # three blocks of 16 columns, 12 chunks
    w, scales, biases = quantized(rng, n, k, bits, group_size, scale_dtype)
    x = (rng.standard_normal((7, k)) * rng.uniform(0.1, 10, (7, 1))).astype(np.float32)
    x[3, :32] = 0  # a chunk of zeros: d = 0
    got = np.array(kernels.int8_matmul(mx.array(x), *int8(kernels, w, scales, biases, group_size, bits), group_size,
                                       bits)).astype(np.float64)
    model, magnitude = int8_reference(x, w, scales, biases, bits, group_size)
    assert np.max(np.abs(got - model) / magnitude) < RELATIVE_TOLERANCE
    weights = dequantized_float64(w, scales, biases, bits, group_size)
    truth = x.astype(np.float64) @ weights.T
    assert np.all(np.abs(got - truth) <= rounding_bound(x, weights) * 1.001 + 1e-6 * magnitude)
    assert np.max(np.abs(got - truth)) > 0  # activations were rounded: this is not the float32 path


@pytest.mark.parametrize("symmetric", (False, True))
@pytest.mark.parametrize("bits", (4, 8))
def test_int8_product_is_the_weights_times_the_rounded_activations(kernels, bits, symmetric):
    """The product is w . (d * xq), the weights' own times the rounded inputs (float64, numpy alone), so its
    error is weighted by the weights, as llama.cpp's Q8_0/Q8_1 products: the bias term takes the rounded
    inputs' sum. (With x's own sum, the error is weighted by the codes, w - b, from 0 to 2^bits - 1 times
    the scale: for GGUF's Q4_0 (b = -8 s) ~3x the RMS error, +4.4% instead of +0.3% SmolLM2 Q4_0 perplexity.)"""
    rng = np.random.default_rng(23 + bits)
    n, k, group_size = 32, 256, 32
    w, scales, biases = quantized(rng, n, k, bits, group_size, "float32")
    if symmetric:  # GGUF's Q4_0 / Q8_0: w = s (q - 2^(bits - 1))
        biases = scales * -(2 ** (bits - 1))
    x = (rng.standard_normal((5, k)) * 3).astype(np.float32)
    got = np.array(kernels.int8_matmul(mx.array(x), *int8(kernels, w, scales, biases, group_size, bits), group_size,
                                       bits)).astype(np.float64)
    weights = dequantized_float64(w, scales, biases, bits, group_size)
    xq, d, _ = int8_rows(x)
    rounded = (xq * d[..., None].astype(np.float64)).reshape(x.shape)
    truth = rounded @ weights.T
    # measured at most 4.8e-8 (float32 steps); with x's own sum in the bias term 2.9e-3 to 4.6e-3
    assert np.max(np.abs(got - truth) / (np.abs(rounded) @ np.abs(weights).T)) < RELATIVE_TOLERANCE
    # and so its error against x itself is that of the rounded inputs times the weights (ratio measured 1 +- 4e-6)
    exact = x.astype(np.float64) @ weights.T
    assert np.sqrt(np.mean((got - exact) ** 2)) < 1.01 * np.sqrt(np.mean((truth - exact) ** 2))


@pytest.mark.parametrize("gguf_like", (False, True))
@pytest.mark.parametrize("experts", (0, 3))
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (8, 64)])
def test_repack_in_place_equals_a_copy_and_spares_shared_buffers(kernels, bits, group_size, experts, gguf_like):
    """in_place (what loading asks for a layer's weights): the same arrays as a copy, written into the
    arrays' own buffers; a buffer another array shares (here the whole of which w is a slice) is copied."""
    rng = np.random.default_rng(11)
    n, k = 64, 512
    w, scales, biases = quantized(rng, n, k, bits, group_size, "float16", experts=experts)
    if gguf_like:  # float32 scales holding float16 values and symmetric biases: held as float16, biases dropped
        scales = scales.astype(mx.float32)
        biases = scales * -(2 ** (bits - 1))
    copied = int8(kernels, w, scales, biases, group_size, bits)
    assert (copied[1].dtype == mx.float16 and copied[2].size == 0) == gguf_like
    private = [mx.contiguous(a * 1) for a in (w, scales, biases)]  # buffers of their own
    mx.eval(private)
    rewritten = kernels.int8_repack(*private, group_size, bits, True)
    for got, want, own in zip(rewritten, copied, private):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(np.array(got), np.array(want))
        if own.dtype == want.dtype and own.shape == want.shape:
            assert np.array_equal(np.array(own), np.array(want))  # in its own buffer
    assert not np.array_equal(np.array(w), np.array(copied[0]))
    whole = mx.concatenate([w, w], axis=-2)
    mx.eval(whole)
    before = np.array(whole)
    part = whole[..., :n, :]  # row-contiguous, the buffer shared with `whole`
    shared = kernels.int8_repack(part, mx.contiguous(scales * 1), mx.contiguous(biases * 1), group_size, bits, True)
    assert np.array_equal(np.array(shared[0]), np.array(copied[0])) and np.array_equal(np.array(whole), before)


def test_scales_made_anew_in_place_are_in_huge_pages(kernels):
    """In place rewrites the weight in its buffer; scales that change dtype (a GGUF's float32 scales
    holding float16 values) are new arrays, which start on a 2 MiB boundary (huge_page_array) as a copy's
    do: in place does not say the rank's malloc gives huge pages (a GGUF's weights decoded into huge pages
    of their own are repacked in place whatever malloc does)."""
    rng = np.random.default_rng(2)
    n, k, group_size = 4096, 8192, 32  # float16 scales of 2 MiB
    w, scales, _ = quantized(rng, n, k, 4, group_size, "float16")
    scales = mx.contiguous(scales.astype(mx.float32))
    biases = mx.contiguous(scales * -8)
    mx.eval(scales, biases)
    w2, s2, b2 = kernels.int8_repack(w, scales, biases, group_size, 4, True)
    assert s2.dtype == mx.float16 and s2.nbytes >= 2 << 20 and b2.size == 0
    assert np.asarray(s2.view(mx.uint8)).ctypes.data % (2 << 20) == 0


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (8, 64)])
def test_each_row_rounds_the_same_whatever_shares_the_call(kernels, bits, group_size):
    """Rows 1..80 (past the float32 path's BLAS limit: prefill chunks stay exact too), in various places:
    a row's bits equal those it gets alone."""
    rng = np.random.default_rng(5)
    n, k, rows = 64, 256, 80
    packed = int8(kernels, *quantized(rng, n, k, bits, group_size, "bfloat16"), group_size, bits)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
    full = np.array(kernels.int8_matmul(x, *packed, group_size, bits))
    for r in range(rows):
        assert np.array_equal(np.array(kernels.int8_matmul(x[r:r + 1], *packed, group_size, bits))[0], full[r]), r
    for count in range(1, rows + 1):
        start = (count * 7) % (rows - count + 1)
        part = np.array(kernels.int8_matmul(x[start:start + count], *packed, group_size, bits))
        assert np.array_equal(part, full[start:start + count]), f"rows {start}..{start + count}"


def test_gathered_rows_equal_their_expert_alone(kernels):
    rng = np.random.default_rng(3)
    experts, n, k, rows, bits, group_size = 5, 32, 256, 23, 4, 64
    w, scales, biases = quantized(rng, n, k, bits, group_size, "float16", experts=experts)
    packed = int8(kernels, w, scales, biases, group_size, bits)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    chosen = rng.integers(0, experts, rows).astype(np.uint32)
    got = np.array(kernels.int8_gather_qmm(mx.array(x), *packed, mx.array(chosen), group_size, bits))
    for r, e in enumerate(chosen):
        alone = np.array(kernels.int8_matmul(mx.array(x[r:r + 1]), *(a[int(e)] for a in packed), group_size, bits))
        assert np.array_equal(alone[0], got[r])
        model, magnitude = int8_reference(x[r:r + 1], w[int(e)], scales[int(e)], biases[int(e)], bits, group_size)
        assert np.max(np.abs(got[r] - model[0]) / magnitude[0]) < RELATIVE_TOLERANCE


def test_use_int8_repacks_modules_in_place(kernels):
    """Linear layers and a tied embedding: same shapes, products through the int8 path, lookups
    unchanged; a layer whose rows are not whole blocks of 16 stays on the float32 path."""
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(64, 40), nn.Embedding(32, 64))
    nn.quantize(model, group_size=32, bits=4)
    qmm.use_in(model)
    x = mx.random.normal((3, 64))
    before = [model.layers[0](x), model.layers[1](x), model.layers[2].as_linear(x), model.layers[2](mx.array([1, 5]))]
    shapes = [model.layers[0].weight.shape, model.layers[0].scales.shape]
    untied = nn.Sequential(nn.Embedding(32, 64))
    nn.quantize(untied, group_size=32, bits=4)
    assert use_int8(untied, tied_head=False) == 0 and "int8_weight" not in untied.layers[0]  # lookups only
    assert use_int8(model, tied_head=True) == 2
    assert [model.layers[0].weight.shape, model.layers[0].scales.shape] == shapes
    assert getattr(model.layers[0], "int8", False) and not getattr(model.layers[1], "int8", False)
    after = [model.layers[0](x), model.layers[1](x), model.layers[2].as_linear(x), model.layers[2](mx.array([1, 5]))]
    for i in (0, 2):  # int8: close, not equal
        assert not np.array_equal(np.array(after[i]), np.array(before[i]))
        assert np.allclose(np.array(after[i]), np.array(before[i]), atol=0.05 * float(mx.abs(before[i]).max()))
    for i in (1, 3):  # untouched
        assert np.array_equal(np.array(after[i]), np.array(before[i]))
    # the LM head's share (head_share.py): rows [16, 32) of the tied embedding, whole blocks only
    assert np.array_equal(np.array(qmm.rows_product(model.layers[2], x, 16, 32)), np.array(after[2])[:, 16:32])
    with pytest.raises(AssertionError):
        qmm.rows_product(model.layers[2], x, 8, 24)


@pytest.mark.skipif(build.missing_tools() != "" or os.environ.get(build.KERNELS_ENV) is not None,
                    reason="no kernels here")
def test_a_cpu_without_vnni_gives_the_same_bits(kernels, tmp_path):
    """AVX-512 without VNNI (vpmaddubsw + vpmaddwd): the integer sums are exact and the float steps the
    same, so the bits equal VNNI's. (The AVX2 build is compared in test_quant_kernels.py, int8 included.)
    Builds the variant (~25 s)."""
    if kernels.int8_isa() != "AVX-512 VNNI":
        pytest.skip(f"this CPU's int8 path is {kernels.int8_isa()}: no VNNI path to compare the variant with")
    variant, native = variant_and_native(tmp_path, ("-mno-avx512vnni",))
    assert str(variant["int8 isa"]) == "AVX-512BW" and str(native["int8 isa"]) == "AVX-512 VNNI"
    assert_same_bits(variant, native, "int8 ")


def test_int8_flag_needs_float32_activations(tmp_path):
    result = mpiexec(1, "generate", "--model", str(tmp_path), "--prompt", "hi", "--int8-activations",
                     "--dtype", "bfloat16")
    assert result.returncode != 0
    assert "--int8-activations needs --dtype float32" in result.stderr


def test_int8_products_are_the_default_on_x86_and_can_be_turned_off(kernels, tmp_path):
    """Without the flag, quantized weights take the int8 products where the CPU has AVX2 (and float32
    products where --dtype is not float32, without an error); --no-int8-activations keeps float32 products."""
    if not build.int8_by_default(None, "float32"):
        pytest.skip("int8 products are not the default here (no AVX2, or no kernels)")
    make_tiny_model("llama", tmp_path)
    base = ("generate", "--model", str(tmp_path), "--prompt", "hi", "--max-tokens", "4", "--quantize", "4",
            "--group-size", "32", "--no-chat-template")
    stats = {}
    for name, extra in (("default", ()), ("off", ("--no-int8-activations",)), ("bf16", ("--dtype", "bfloat16"))):
        result = mpiexec(1, *base, *extra)
        assert result.returncode == 0, result.stderr
        stats[name] = result.stderr
    assert "int8 activations" in stats["default"]
    assert "int8 activations" not in stats["off"] and "pipeline's" in stats["off"]
    assert "int8 activations" not in stats["bf16"]


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_generate_and_batch_agree_with_int8_on_1_and_2_ranks(kernels, tmp_path, kind):
    """Quantized at load (--quantize 4 --group-size 32), the int8 path end to end: dense layers, the LM
    head, and for DeepSeek V3 the gathered experts. Texts equal across rank counts and batch composition."""
    from test_batch import ENV, PROMPTS, read_records, write_jsonl
    from test_moe import make_deepseek

    folder = tmp_path / kind
    make_tiny_model("llama", folder) if kind == "llama" else make_deepseek(folder)
    flags = ("--quantize", "4", "--group-size", "32", "--int8-activations", "--no-chat-template")
    expected = {}
    for i, prompt in enumerate(PROMPTS[:4]):
        texts = []
        for n in (1, 2):
            result = mpiexec(n, "generate", "--model", str(folder), "--prompt", prompt, "--max-tokens", "12", *flags,
                             env=ENV)
            assert result.returncode == 0, result.stderr
            assert "int8 activations" in result.stderr
            texts.append(result.stdout)
        assert texts[0] == texts[1], prompt
        if i == 0:  # speculative decoding verifies its drafts through the same products
            result = mpiexec(2, "generate", "--model", str(folder), "--prompt", prompt, "--max-tokens", "12", *flags,
                             "--draft", "ngram", "--ngram-min", "1", env=ENV)
            assert result.returncode == 0 and result.stdout == texts[0], result.stderr
        expected[i] = texts[0][:-1]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p, "max_tokens": 12} for i, p in enumerate(PROMPTS[:4])])
    for n in (1, 2):
        out = tmp_path / f"out{n}.jsonl"
        result = mpiexec(n, "batch", "--model", str(folder), "--input", str(inp), "--output", str(out), "--quiet",
                         *flags, env=ENV)
        assert result.returncode == 0, result.stderr
        assert {r["id"]: r["text"] for r in read_records(out)} == expected, f"{n} ranks"


def test_float16_valued_scales_are_held_as_float16_with_the_same_products(kernels):
    """GGUF's Q4_0/Q4_1/Q8_0 scales reach the repack as float32 holding float16 values: repacked, they are
    float16 (half the bytes a token reads) and every product has the same bits; other float32 scales stay.
    4096 x 1024 4-bit codes are 2 MiB: the repack puts them on a 2 MiB boundary (huge pages), which the
    product must read from that offset."""
    rng = np.random.default_rng(11)
    n, k, bits, group_size = 4096, 1024, 4, 32
    w, scales, biases = quantized(rng, n, k, bits, group_size, "float16")
    as_float32 = int8(kernels, w, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)
    as_float16 = int8(kernels, w, scales, biases, group_size, bits)
    assert as_float32[1].dtype == as_float32[2].dtype == mx.float16
    x = rng.standard_normal((3, k)).astype(np.float32)
    got = np.array(kernels.int8_matmul(mx.array(x), *as_float32, group_size, bits))
    assert np.array_equal(got, np.array(kernels.int8_matmul(mx.array(x), *as_float16, group_size, bits)))
    model, magnitude = int8_reference(x, w, scales, biases, bits, group_size)
    assert np.max(np.abs(got - model) / magnitude) < RELATIVE_TOLERANCE
    nudged = scales.astype(mx.float32) * (1 + 2.0 ** -20)  # not float16 values
    assert int8(kernels, w, nudged, biases.astype(mx.float32), group_size, bits)[1].dtype == mx.float32


@pytest.mark.parametrize("bits", (4, 8))
def test_symmetric_matrices_drop_their_biases_with_the_same_products(kernels, bits):
    """Biases that are all -2^(bits - 1) times their scales (GGUF's Q4_0 and Q8_0) are not held after the
    repack: the kernel makes each from its scale, and the products keep their bits. Against the same
    matrix with one column's bias changed (so all are held): every other column is bit for bit the same;
    and against the float64 model of the arithmetic."""
    rng = np.random.default_rng(17 + bits)
    n, k, group_size = 48, 256, 32
    w, scales, _ = quantized(rng, n, k, bits, group_size, "float16")
    biases = scales * -(2 ** (bits - 1))
    symmetric = int8(kernels, w, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)
    assert symmetric[2].shape == (n, 0)  # no biases held
    one_off = np.array(biases)
    one_off[0, 0] *= 0.5
    held = int8(kernels, w, scales, mx.array(one_off), group_size, bits)
    assert held[2].shape == biases.shape
    x = (rng.standard_normal((9, k)) * 3).astype(np.float32)
    got = np.array(kernels.int8_matmul(mx.array(x), *symmetric, group_size, bits))
    other = np.array(kernels.int8_matmul(mx.array(x), *held, group_size, bits))
    assert np.array_equal(got[:, 1:], other[:, 1:]) and not np.array_equal(got[:, 0], other[:, 0])
    model, magnitude = int8_reference(x, w, scales, biases, bits, group_size)
    assert np.max(np.abs(got - model) / magnitude) < RELATIVE_TOLERANCE
    fused = kernels.int8_products(mx.array(x), [symmetric[0]] * 2, [symmetric[1]] * 2, [symmetric[2]] * 2, group_size,
                                  bits)
    assert all(np.array_equal(np.array(f), got) for f in fused)


@pytest.mark.parametrize("rows", (1, 5, 70))
def test_fused_products_and_swiglu_have_the_bits_of_the_products_alone(kernels, rows):
    """A layer's q/k/v products as one operation, and gate/up with SwiGLU as one: each output element the
    same bits as the separate products (and models/layers.py's swiglu of them), gates from -100 to 100
    (the sigmoid's saturated ends)."""
    from pipeline.models.layers import swiglu

    rng = np.random.default_rng(rows)
    k, bits, group_size = 256, 4, 64
    mats = [int8(kernels, *quantized(rng, n, k, bits, group_size, "bfloat16"), group_size, bits) for n in (96, 32, 96)]
    x = mx.array((rng.standard_normal((rows, k)) * rng.uniform(0.1, 30, (rows, 1))).astype(np.float32))
    alone = [np.array(kernels.int8_matmul(x, *m, group_size, bits)) for m in mats]
    together = kernels.int8_products(x, *[[m[i] for m in mats] for i in range(3)], group_size, bits)
    for a, t in zip(alone, together):
        assert np.array_equal(a, np.array(t))
    gate, up = mats[0], mats[2]
    assert np.abs(alone[0]).max() > 30  # past where the sigmoid rounds to 0 or 1
    expected = np.array(swiglu(mx.array(alone[0]), mx.array(alone[2])))
    got = np.array(kernels.int8_swiglu(x, [gate[0], up[0]], [gate[1], up[1]], [gate[2], up[2]], group_size, bits))
    assert np.array_equal(expected, got)


def test_layer_products_take_the_fused_operation_only_where_it_is_exact():
    """qmm.products and qmm.swiglu_product on Linears: with int8 products, one operation with the bits of
    each Linear called alone (Linear biases added after); dense or float32-kernel Linears, called alone."""
    from pipeline.models.layers import swiglu

    mx.random.seed(4)
    k = 128

    def linears(widths: tuple[int, ...], bias: bool, form: str) -> list[nn.Module]:
        model = nn.Sequential(*[nn.Linear(k, n, bias=bias) for n in widths])
        for linear in model.layers:
            linear.weight = mx.random.normal(linear.weight.shape)
            if bias:
                linear.bias = mx.random.normal(linear.bias.shape)
        if form != "dense":
            nn.quantize(model, group_size=32, bits=4)
            qmm.use_in(model)
        if form == "int8":
            assert use_int8(model) == len(widths)
        return list(model.layers)

    x = mx.random.normal((3, k))
    for bias in (False, True):
        for form in ("dense", "quantized", "int8"):
            modules = linears((64, 32, 32), bias, form)
            for alone, together in zip([m(x) for m in modules], qmm.products(modules, x)):
                assert np.array_equal(np.array(alone), np.array(together)), (bias, form)
            gate, up = linears((64, 64), bias, form)
            assert np.array_equal(np.array(swiglu(gate(x), up(x))), np.array(qmm.swiglu_product(gate, up, x, swiglu)))
