"""Expert stacks held as a GGUF file's row bytes (quants.BLOCKS: Q5_K, Q3_K, Q2_K, TQ2_0, TQ1_0 and the grid i-quants
IQ2_XXS .. IQ1_M), gathered per token as models/experts.py runs them (kernels_common.h's gathered BlockProduct),
against truths from elsewhere:
- the gguf package's dequantizers (llama.cpp's) define the blocks: a stack's gathered products for tokens x chosen
  experts are within float32 rounding of a float64 product of gguf's dequantization of each chosen expert (float
  products; int8 products the same with x rounded per 256 as Q8_K), each (token, expert) the bits of the layer
  kernel's product of that token and expert alone, at every token count (batch invariance);
- transformers runs a tiny Qwen3-MoE and DeepSeek-V3 on gguf's dequantization of a file whose expert stacks are in
  these types: our logits within float32 rounding of it, on 1 and 2 stages, the stacks held at the file's bytes
  (nothing re-quantized), and the planner counting what each rank holds.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import test_gguf_inplace
import test_gguf_iquant_grids
import test_gguf_kquants
from conftest import assert_far_from_uniform, forward, write_tokenizer
from test_gguf_inplace import LONG_PROMPT, _by_kind, _deepseek, _qwen3_moe, gguf_vocab, reference, write_model
from pipeline.checkpoints import quants
from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
from pipeline.checkpoints.model_files import find
from pipeline.kernels import qmm
from pipeline.models.experts import GGUFBlocksSwitchLinear
from pipeline.planner.shapes import architecture
from pipeline.planner.stored_formats import checkpoint_format
from pipeline.planner.weights_bytes import Precision, held_and_dense, model_bytes
from pipeline.runtime.stage import Stage

TYPES = tuple(QT[name] for name in quants.BLOCKS)
GRID_TYPES = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M)
TOKEN_COUNTS = (1, 2, 3, 4, 5, 8, 9, 17, 33)  # decode, drafts, past each tile, a prompt's chunk (>= 64 pairs: sorted)
# relative to |x| @ |w|.T; measured at most (float / int8) 7.3e-8 (TQ2_0) / 3.8e-8 (Q5_K) over the types
TOLERANCE, INT8_TOLERANCE = 1e-7, 5e-8


def stack_blocks(qtype: QT, rows: int, k: int, rng, d: float | None = None) -> np.ndarray:
    """[rows, row bytes] of random blocks of `qtype` (every code, finite fp16 scales of many sizes; the grid types'
    d `d` where given)."""
    if qtype in GRID_TYPES:
        return test_gguf_iquant_grids.random_blocks(qtype, rows, k, rng, d)
    return test_gguf_kquants.blocks(qtype, rows, k, rng)


def gathered(x: np.ndarray, stack: mx.array, qtype: QT, chosen: np.ndarray, int8: bool) -> np.ndarray:
    """Tokens x [T, k] times their chosen experts [T, K] as SwitchGLU calls a projection: [T, K, n]."""
    out = qmm.gguf_blocks_gather(mx.array(x)[:, None, None, :], stack, quants.BLOCKS[qtype.name][0],
                                 mx.array(chosen), int8=int8)
    return np.array(out).reshape(*chosen.shape, -1)


def relative_error(got: np.ndarray, x: np.ndarray, w: np.ndarray, chosen: np.ndarray, int8: bool) -> float:
    xs = test_gguf_kquants.rounded(x) if int8 else x.astype(np.float64)
    truth = np.einsum("tk,tenk->ten", xs, w[chosen])
    scale = np.einsum("tk,tenk->ten", np.abs(x).astype(np.float64), np.abs(w[chosen]))
    return float((np.abs(got - truth) / scale).max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gathered_products_match_gguf_dequantization_at_every_token_count(kernels, qtype):
    """Random block bytes for a stack of 6 experts, 33 tokens choosing 2 each: within float32 rounding of float64 x
    @ gguf's dequantization of each chosen expert (int8: x rounded as Q8_K); each (token, expert) the bits of the
    layer kernel's product of that token alone with that expert's matrix; the first T tokens of the batch the same
    bits at every token count T, and prefill's sorted pairs ([pairs, 1, 1, k] x [pairs, 1]) the same bits too."""
    rng = np.random.default_rng(300 + int(qtype))
    experts, n, k = 6, 24, 512
    raw = stack_blocks(qtype, experts * n, k, rng)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(experts, n, k)
    stack = mx.array(raw.reshape(experts, n, -1))
    tokens = max(TOKEN_COUNTS)
    x = rng.normal(0, 1, (tokens, k)).astype(np.float32)
    x[3, :256] = 0  # an all-zero activation block
    x[5, 300] = 40.0  # a block whose Q8_K d is set by one value
    chosen = np.argsort(rng.random((tokens, experts)), axis=1)[:, :2]  # two distinct experts a token
    type_id = quants.BLOCKS[qtype.name][0]
    for int8 in (False, True):
        whole = gathered(x, stack, qtype, chosen, int8)
        error = relative_error(whole, x, w, chosen, int8)
        assert error < (INT8_TOLERANCE if int8 else TOLERANCE), (int8, error)
        for count in TOKEN_COUNTS:
            np.testing.assert_array_equal(gathered(x[:count], stack, qtype, chosen[:count], int8), whole[:count],
                                          err_msg=f"{count} tokens, int8 {int8}")
        for t in (0, 5, 17, tokens - 1):
            for j, e in enumerate(chosen[t]):
                alone = np.array(qmm.gguf_blocks_matmul(mx.array(x[t:t + 1]), stack[int(e)], type_id, int8))[0]
                np.testing.assert_array_equal(whole[t, j], alone, err_msg=f"token {t}, expert {e}, int8 {int8}")
        order = np.argsort(chosen.reshape(-1), kind="stable")  # SwitchGLU's sorted pairs past 64
        pairs = qmm.gguf_blocks_gather(mx.array(x[order // 2])[:, None, None, :], stack, type_id,
                                       mx.array(chosen.reshape(-1)[order])[:, None], int8=int8)
        np.testing.assert_array_equal(np.array(pairs).reshape(-1, n), whole.reshape(-1, n)[order])


def test_q2_k_stack_sub_block_scales_are_each_their_own(kernels):
    """Each expert's Q2_K sub-blocks take their own scale and min byte: with two neighbouring ones swapped in one
    expert's truth, the gathered products of the tokens that chose it are off by far more than the tolerance."""
    rng = np.random.default_rng(7)
    experts, n, k = 4, 16, 512
    raw = stack_blocks(QT.Q2_K, experts * n, k, rng)
    swapped = raw.reshape(experts, n, 2, 84).copy()
    swapped[2, :, :, [6, 7]] = swapped[2, :, :, [7, 6]]  # expert 2's scale/min bytes of sub-blocks 6 and 7
    right = gguf.quants.dequantize(raw, QT.Q2_K).astype(np.float64).reshape(experts, n, k)
    wrong = gguf.quants.dequantize(swapped.reshape(experts * n, -1), QT.Q2_K).astype(np.float64).reshape(experts, n, k)
    x = rng.normal(0, 1, (6, k)).astype(np.float32)
    chosen = np.array([[2, 0], [1, 2], [3, 2], [2, 1], [0, 2], [2, 3]])
    for int8 in (False, True):
        got = gathered(x, mx.array(raw.reshape(experts, n, -1)), QT.Q2_K, chosen, int8)
        assert relative_error(got, x, right, chosen, int8) < TOLERANCE
        assert relative_error(got, x, wrong, chosen, int8) > 1e-3  # measured 0.05-0.07


def test_each_token_gets_its_own_expert(kernels):
    """Experts whose matrices differ (IQ2_XXS, every expert its own bytes): each token's output is its chosen
    expert's, not a neighbour's (a gather off by one expert is off by the whole product); an expert index past the
    stack (a router's bug) gives NaN for that token alone."""
    rng = np.random.default_rng(8)
    experts, n, k = 5, 16, 256
    raw = stack_blocks(QT.IQ2_XXS, experts * n, k, rng)
    w = gguf.quants.dequantize(raw, QT.IQ2_XXS).astype(np.float64).reshape(experts, n, k)
    stack = mx.array(raw.reshape(experts, n, -1))
    x = rng.normal(0, 1, (5, k)).astype(np.float32)
    chosen = np.array([[4], [3], [2], [1], [0]])
    got = gathered(x, stack, QT.IQ2_XXS, chosen, False)
    assert relative_error(got, x, w, chosen, False) < TOLERANCE
    assert relative_error(got, x, w, (chosen + 1) % experts, False) > 0.1
    bad = gathered(x, stack, QT.IQ2_XXS, np.array([[4], [experts], [2], [1], [0]]), False)
    assert np.isnan(bad[1]).all() and not np.isnan(bad[[0, 2, 3, 4]]).any()
    np.testing.assert_array_equal(bad[[0, 2, 3, 4]], got[[0, 2, 3, 4]])


def test_wrong_inputs_are_refused_in_one_line(kernels):
    raw = mx.array(stack_blocks(QT.Q2_K, 8, 256, np.random.default_rng(0)).reshape(2, 4, -1))
    x = mx.zeros((3, 256))
    cases = [(lambda: kernels.gguf_kquant_gather_matmul(x, raw, 10, False, mx.zeros((3,), mx.int32)),
              "experts must be uint32 [rows]"),
             (lambda: kernels.gguf_kquant_gather_matmul(x, raw[0], 10, False, mx.zeros((3,), mx.uint32)),
              "stacks [experts, n, ...]"),
             (lambda: kernels.gguf_iquant_gather_matmul(x, raw, 10, False, mx.zeros((3,), mx.uint32)),
              "type must be IQ2_XXS"),
             (lambda: kernels.gguf_kquant_gather_matmul(mx.zeros((3, 512)), raw, 10, False, mx.zeros((3,), mx.uint32)),
              "blocks must be [n, ...]")]
    for call, words in cases:
        with pytest.raises(ValueError, match=None) as caught:
            call()
        assert words in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


# ---- whole models ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab")
    write_tokenizer(folder)
    return gguf_vocab(folder)


PACK = test_gguf_inplace.encode  # (write_model's encoder, which the model test replaces by _encode)


def _encode(w: np.ndarray, qtype: QT) -> np.ndarray:
    """What the test writes for `qtype`: the K-quants fitted by test_gguf_inplace's packers, the grid i-quants (which
    gguf does not quantize) random codes with d set so that the values spread as w's."""
    if qtype not in GRID_TYPES:
        return PACK(w, qtype)
    rows, k = int(np.prod(w.shape[:-1])), w.shape[-1]
    unit = stack_blocks(qtype, rows, k, np.random.default_rng(rows), d=1.0)
    d = float(w.std() / gguf.quants.dequantize(unit, qtype).std())
    return stack_blocks(qtype, rows, k, np.random.default_rng(rows), d=d).reshape(*w.shape[:-1], -1)


MODELS = {"qwen3moe": ("qwen3moe", _qwen3_moe, {"attn": QT.Q8_0, "token_embd": QT.Q8_0, "output.": QT.Q8_0}),
          "deepseek2": ("deepseek2", _deepseek, {"attn": QT.Q8_0, "shexp": QT.Q8_0, "ffn_": QT.Q8_0,
                                                 "token_embd": QT.Q8_0, "output.": QT.Q8_0})}
MODEL_CASES = [("qwen3moe", QT.Q2_K), ("qwen3moe", QT.IQ2_XXS), ("deepseek2", QT.IQ1_S), ("deepseek2", QT.Q3_K)]


@pytest.mark.parametrize("kind, qtype", MODEL_CASES, ids=lambda v: getattr(v, "name", v))
def test_moe_model_holds_experts_at_the_files_bytes(kind, qtype, tmp_path, vocab, kernels, capsys, monkeypatch):
    """A tiny MoE GGUF whose gate, up and down expert stacks are `qtype` (the rest Q8_0, norms and routers F32): the
    stacks are held as the file's bytes (nothing re-quantized, no note) and, with float products, give transformers'
    logits on gguf's dequantization of the same file within float32 rounding, on 1 and 2 stages; int8 products the
    same bits on 1 and 2 stages and near them; the planner counts each rank's bytes as the loaded stages hold them."""
    arch, make, types = MODELS[kind]
    model = make(tmp_path / "hf")
    monkeypatch.setattr(test_gguf_inplace, "encode", _encode)
    written = write_model(tmp_path / "m.gguf", model, arch, _by_kind({"exps": qtype} | types), vocab=vocab)
    truth = reference(model, written["state"])
    assert_far_from_uniform(truth)
    capsys.readouterr()
    path = written["files"][0]
    checkpoint = GGUFCheckpoint(path)
    held_names = {n for n, e in checkpoint.tensors.items() if e.how == "native" and n.endswith(".weight")}
    stacks = {n for n in checkpoint.tensors if ".switch_mlp." in n and n.endswith(".weight")}
    assert stacks and held_names == stacks, held_names ^ stacks
    assert not any(e.how == "requantized" for e in checkpoint.tensors.values())
    config = checkpoint.model_config()
    state = qmm.load()
    saved = state.gguf_int8
    logits = {}
    try:
        for int8 in (False, True):
            state.gguf_int8 = int8
            for ranges in (((0, 4),), ((0, 2), (2, 4))):
                stages = [Stage.load(config, GGUFCheckpoint(path), r, has_ends=(i == 0), dtype=mx.float32)
                          for i, r in enumerate(ranges)]
                logits[int8, len(ranges)] = np.array(forward(stages, LONG_PROMPT))
    finally:
        state.gguf_int8 = saved
    assert "re-quantized" not in capsys.readouterr().err
    # memory: each stack is the file's bytes (and its 4-byte type id), in a GGUFBlocksSwitchLinear
    mb = model_bytes(architecture(config), Precision(checkpoint_format(config, find(path)), "float32"))
    in_file = held = 0
    for stage, (start, end) in zip(stages, ((0, 2), (2, 4))):
        for i in range(end - start):
            layer = stage.model.layers[i]
            if "switch_mlp" not in layer.mlp:  # DeepSeek's first, dense layer
                continue
            for p in ("gate", "up", "down"):
                module = layer.mlp.switch_mlp[f"{p}_proj"]
                assert type(module) is GGUFBlocksSwitchLinear
                tensor = checkpoint.gguf.tensors[f"blk.{start + i}.ffn_{p}_exps.weight"]
                assert tensor.ggml_type == qtype.name and module["weight"].dtype == mx.uint8
                in_file, held = in_file + tensor.nbytes, held + module["weight"].nbytes
                assert module["ggml_type"].nbytes == 4
        planned = sum(mb.layers[start:end]) + (mb.ends if start == 0 else 0)
        assert planned == stage.weight_nbytes, (start, planned, stage.weight_nbytes)
    assert held == in_file, (held, in_file)
    # preflight counts as plan does, and plan's memory line names the type among those in their own blocks
    assert held_and_dense(config, path)[0].layers == mb.layers
    resident = checkpoint_format(config, find(path)).resident(False, "float32")
    assert qtype.name in resident.partition(" in their own blocks")[0], resident
    for int8 in (False, True):
        np.testing.assert_array_equal(logits[int8, 1], logits[int8, 2])
    error = np.abs(logits[False, 1] - truth).max()
    int8_error = np.median(np.abs(logits[True, 1] - truth).max(-1))  # per position: a routing flip moves a few far
    agree = (logits[True, 1].argmax(-1) == truth.argmax(-1)).mean()
    print(f"{kind} {qtype.name}: experts {held} bytes held, {in_file} in the file; |logits - transformers| float "
          f"{error:.2e}, int8 median over positions {int8_error:.2f}, top-1 agreeing {agree:.2f} "
          f"(logits up to {np.abs(truth).max():.1f})")
    # float32 rounding: measured up to 2.1e-4 (logits up to |14|)
    assert error < 4e-4 and (logits[False, 1].argmax(-1) == truth.argmax(-1)).all(), error
    # int8: activations rounded per 256 (Q8_K) in every expert product, through 4 layers of these random weights:
    # measured medians 0.22-0.48, top-1 agreement 0.92-0.97 (the kernels' own accuracy: the products tests above)
    assert int8_error < 1.0 and agree >= 0.85, (int8_error, agree)
