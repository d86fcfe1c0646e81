"""GGUF Q5_0 (22 bytes per 32 values: fp16 d, 4 bytes of fifth bits, 16 nibble bytes; w = d (q - 16)) is held at the
file's size: MLX 5-bit affine codes (20 bytes per 32) and float16 scales, no biases (kernels/qmm.py hold_symmetric;
the products compute each bias, -16 d, exactly). Against float64 products of the gguf package's own Q5_0
dequantization; the products are the bits they were with the biases held. Q5_1 (d q + m: a bias of its own) keeps
its biases, held float16 (qmm.hold_half; the loader cast them to float32): 5-bit codes + fp16 d + fp16 m are its 24
bytes per 32, the file's size."""

from __future__ import annotations

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from test_gguf_inplace import LONG_PROMPT, _by_kind, _mistral, _transformers, reference, vocab, write_model  # noqa: F401
from conftest import forward
from pipeline.checkpoints import quants
from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
from pipeline.checkpoints.weights import dequantize_slice
from pipeline.kernels import qmm
from pipeline.models.experts import QuantizedSwitchLinear
from pipeline.planner.memory import measured
from pipeline.planner.weights_bytes import held_and_dense
from pipeline.runtime.stage import Stage


@pytest.fixture(autouse=True)
def float_products():
    """These are the float products' tests (--no-int8-activations: qmm_kernels.cpp); the int8 ones, llama.cpp's
    arithmetic and the default on x86 with AVX2, are test_gguf_q5_int8.py's."""
    state = qmm.load()
    saved, state.gguf_int8 = state.gguf_int8, False
    yield
    state.gguf_int8 = saved


def _q5_rows(rng, rows: int, cols: int, qtype=QT.Q5_0) -> np.ndarray:
    """GGUF rows of `qtype` from the gguf package's own quantizer (random floats with some large rows)."""
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 3, (rows, 1)).astype(np.float32)
    return gguf.quants.quantize(w, qtype)


def _module(raw: np.ndarray, cls=nn.QuantizedLinear) -> nn.Module:
    """A Linear holding these Q5_0 rows as the loader gives them before after_load (scales, biases cast to float32)."""
    w, s, b = quants.decode_exact(raw, "Q5_0")
    rows, cols = w.shape[0], w.shape[1] * 32 // 5
    module = qmm.QuantizedLinear(cols, rows, bias=False, group_size=32, bits=5)
    module.weight, module.scales, module.biases = mx.array(w), mx.array(s).astype(mx.float32), mx.array(b).astype(mx.float32)
    return module


@pytest.mark.parametrize("kernels", [True, False], ids=["pipeline-kernels", "mlx"])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_products_match_float64_of_ggufs_dequantization(rows, kernels, monkeypatch):
    rng = np.random.default_rng(rows)
    raw = _q5_rows(rng, 96, 256)
    truth = gguf.quants.dequantize(raw, QT.Q5_0).astype(np.float64)  # [96, 256]
    module = _module(raw)
    x = mx.array(rng.standard_normal((rows, 256)).astype(np.float32))
    before = module(x)  # the biases held, as before
    module.after_load()
    assert module["biases"].shape == (96, 0) and module["scales"].dtype == mx.float16  # the file's 22 bytes per 32
    assert sum(a.nbytes for a in (module["weight"], module["scales"], module["biases"])) == raw.nbytes
    if not kernels:
        monkeypatch.setattr(qmm, "extension_for", lambda x: None)
    out = module(x)
    expected = np.asarray(x).astype(np.float64) @ truth.T
    # float32 accumulation of 256 products (measured 8.8e-8 with pipeline's kernels, 3.7e-7 MLX's, relative to the
    # largest |output|)
    assert np.abs(np.asarray(out) - expected).max() <= 1e-6 * np.abs(expected).max()
    if kernels:
        assert mx.array_equal(out, before).item()  # the same bits as with the biases held


def test_q5_1_keeps_its_biases_in_float16():
    """Q5_1's d and m, cast to float32 by the loader, are held as float16 again (qmm.hold_half): its 24 bytes per 32."""
    raw = _q5_rows(np.random.default_rng(0), 32, 64, QT.Q5_1)
    truth = gguf.quants.dequantize(raw, QT.Q5_1).astype(np.float64)
    w, s, b = quants.decode_exact(raw, "Q5_1")
    module = qmm.QuantizedLinear(64, 32, bias=False, group_size=32, bits=5)
    module.weight, module.scales, module.biases = mx.array(w), mx.array(s).astype(mx.float32), mx.array(b).astype(mx.float32)
    x = mx.array(np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32))
    before = module(x)
    module.after_load()
    assert module["biases"].shape == (32, 2) and module["biases"].dtype == mx.float16
    # 5-bit codes + fp16 d + fp16 m: 24 bytes per 32 values, the file's own size
    assert sum(a.nbytes for a in (module["weight"], module["scales"], module["biases"])) == raw.nbytes
    out = module(x)
    assert mx.array_equal(out, before).item()
    expected = np.asarray(x).astype(np.float64) @ truth.T
    assert np.abs(np.asarray(out) - expected).max() <= 1e-6 * np.abs(expected).max()


def test_expert_stack_and_dense_copy_match_ggufs_dequantization():
    rng = np.random.default_rng(7)
    raws = [_q5_rows(rng, 64, 128) for _ in range(3)]
    truth = np.stack([gguf.quants.dequantize(r, QT.Q5_0) for r in raws]).astype(np.float64)  # [3, 64, 128]
    decoded = [quants.decode_exact(r, "Q5_0") for r in raws]
    stack = QuantizedSwitchLinear(128, 64, 3, group_size=32, bits=5)
    for i, name in enumerate(("weight", "scales", "biases")):
        stack[name] = mx.array(np.stack([d[i] for d in decoded])).astype(mx.uint32 if i == 0 else mx.float32)
    stack.after_load()
    assert stack["biases"].shape == (3, 64, 0) and stack["scales"].dtype == mx.float16
    x = rng.standard_normal((5, 128)).astype(np.float32)
    indices = np.array([[0, 2], [1, 0], [2, 2], [1, 1], [0, 1]], np.uint32)
    out = np.asarray(stack(mx.array(x)[:, None, None, :], mx.array(indices))).reshape(5, 2, 64)  # as models/experts.py calls it
    expected = np.einsum("tk,tenk->ten", x.astype(np.float64), truth[indices])
    assert np.abs(out - expected).max() <= 1e-6 * np.abs(expected).max()  # measured 9.1e-8
    # --weights-in-memory fp32: the dense copy is the gguf package's values exactly
    holder = nn.Module()
    holder.proj = _module(raws[0])
    holder.proj.after_load()
    assert dequantize_slice(holder, mx.float32) == 1
    assert np.array_equal(np.asarray(holder.proj.weight), truth[0].astype(np.float32))


def test_q5_0_model_is_held_at_the_files_size_and_counted_so(tmp_path, vocab):  # noqa: F811
    """A model of Q5_0 layer matrices (a K-quant mix's fallback type): logits as transformers' on the file's values;
    every Q5_0 matrix held in the file's bytes; plan's count (held_and_dense) is the stage's."""
    folder = _mistral(tmp_path / "hf")
    model = _transformers("mistral", folder)
    types = {"attn": QT.Q5_0, "ffn_gate": QT.Q5_0, "ffn_up": QT.Q5_1, "ffn_down": QT.Q5_0, "token_embd": QT.Q8_0,
             "output.": QT.Q5_0}
    written = write_model(tmp_path / "m.gguf", model, "llama", _by_kind(types), vocab=vocab)
    expected = reference(model, written["state"])
    path = written["files"][0]
    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.model_config()
    stage = Stage.load(config, checkpoint, (0, config.num_hidden_layers), has_ends=True, dtype=mx.float32)
    logits = forward([stage], LONG_PROMPT)
    assert np.abs(logits - expected).max() <= 2e-4  # float32 rounding (measured 1.5e-4; logits up to |14|)
    q5 = {t.name: t.n_bytes for t in gguf.GGUFReader(path).tensors if t.tensor_type == QT.Q5_0}
    assert len(q5) == 6 * config.num_hidden_layers + 1
    held = dict(stage.model.named_modules())
    q_proj = held["layers.0.self_attn.q_proj"]
    assert q_proj["biases"].shape[-1] == 0 and q_proj["scales"].dtype == mx.float16
    assert sum(a.nbytes for a in (q_proj["weight"], q_proj["scales"])) == q5["blk.0.attn_q.weight"]
    assert held["lm_head"]["biases"].shape[-1] == 0  # the untied head too
    up = held["layers.0.mlp.up_proj"]  # Q5_1 keeps its own biases, float16 as its scales: the file's bytes
    assert up["biases"].shape == (512, 256 // 32) and up["biases"].dtype == mx.float16
    q5_1 = {t.name: t.n_bytes for t in gguf.GGUFReader(path).tensors if t.tensor_type == QT.Q5_1}
    assert sum(a.nbytes for a in (up["weight"], up["scales"], up["biases"])) == q5_1["blk.0.ffn_up.weight"]
    planned = held_and_dense(config, path, "float32")[0]
    assert sum(planned.layers) + planned.ends == measured(stage).weights


def test_only_exactly_symmetric_matrices_drop_their_biases():
    """Scales that are no float16 values stay float32 (biases still dropped where -16 x them); an MLX 5-bit
    quantization (its own biases) keeps them."""
    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((32, 64)).astype(np.float32))
    q, s, b = mx.quantize(w, group_size=32, bits=5)
    module = qmm.QuantizedLinear(64, 32, bias=False, group_size=32, bits=5)
    module.weight, module.scales, module.biases = q, s, b
    module.after_load()
    assert module["biases"].shape == (32, 2)
    thirds = mx.array(rng.integers(1, 1000, (32, 2)).astype(np.float32) / 3)  # no float16 values
    module.scales, module.biases = thirds, thirds * -16
    x = mx.array(rng.standard_normal((4, 64)).astype(np.float32))
    before = module(x)
    module.after_load()
    assert module["biases"].shape == (32, 0) and module["scales"].dtype == mx.float32
    assert mx.array_equal(module(x), before).item()
