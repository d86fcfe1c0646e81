"""GGUF token embeddings, LM heads and expert stacks held in their own blocks (IQ4_NL, IQ4_XS, Q6_K: quants.NATIVE_ROWS),
against truths from elsewhere:
- the gguf package's dequantizers (llama.cpp's) define the blocks: an embedding's looked-up rows equal gguf's
  dequantization of those rows bit for bit (kernels/gguf_rows.py), an expert stack's gathered products equal
  a float64 product of gguf's dequantization of each chosen expert (and the bits of gguf_matmul on each row alone);
- transformers runs each tiny model on gguf's dequantization of the file's weights: embedding, head and experts
  in these types, our logits with float products within float32 rounding of it, on 1 and 2 stages;
- the planner counts, per rank, the bytes a loaded stage holds for a file mixing held, exact and re-quantized types.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import test_gguf_inplace
from conftest import assert_far_from_uniform, forward, write_tokenizer
from test_gguf_inplace import (LONG_PROMPT, _by_kind, _mistral, _qwen3, _qwen3_moe, _transformers, gguf_vocab,
                               random_blocks, reference, write_model)
from test_gguf_iquants import pack_iq4
from pipeline.checkpoints import quants
from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
from pipeline.checkpoints.int8_repack import use_int8
from pipeline.checkpoints.model_files import find
from pipeline.kernels import gguf_rows, qmm
from pipeline.models.experts import GGUFSwitchLinear
from pipeline.models.stage_slice import head_columns
from pipeline.planner.shapes import architecture
from pipeline.planner.stored_formats import checkpoint_format
from pipeline.planner.weights_bytes import Precision, model_bytes
from pipeline.runtime.stage import Stage

TYPES = (QT.IQ4_NL, QT.IQ4_XS, QT.Q6_K)


def held(raw: np.ndarray, qtype: QT, lead: tuple[int, ...] = ()) -> list[mx.array]:
    """The arrays a rank holds (codes, scales, Q6_K's d), rows regrouped under `lead` (an expert stack)."""
    return [mx.array(a).reshape(*lead, -1, a.shape[-1]) if lead else mx.array(a)
            for a in quants.native_arrays(raw, qtype.name)]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_looked_up_rows_are_gguf_dequantization(qtype):
    """Random block bytes (every code, fp16 scales of every size): the rows of any token ids, in any shape,
    are gguf's float32 dequantization of those rows, bit for bit."""
    rng = np.random.default_rng(5)
    raw = random_blocks(qtype, 40, 512, rng)
    truth = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    codes, scales, *d = held(raw, qtype)
    ids = mx.array(rng.integers(0, 40, (3, 7)))
    got = gguf_rows.dequantize(codes[ids], scales[ids], d[0][ids] if d else None, qmm.GGUF_NATIVE[scales.dtype])
    np.testing.assert_array_equal(np.array(got), truth[np.array(ids)])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gathered_expert_products_match_gguf_dequantization(kernels, qtype):
    """An expert stack's products for tokens x chosen experts, as models/experts.py calls them (unsorted, and
    sorted pairs as prefill's): within float32 rounding of float64 x @ gguf's dequantization of each chosen
    expert, and each row the bits of gguf_matmul on that row and expert alone, float and int8 alike."""
    rng = np.random.default_rng(6)
    experts, n, k = 5, 32, 512
    raw = random_blocks(qtype, experts * n, k, rng)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(experts, n, k)
    codes, scales, *d = held(raw, qtype, (experts,))
    d = d[0] if d else None
    x = rng.normal(0, 1, (9, k)).astype(np.float32)
    chosen = rng.integers(0, experts, (9, 2))
    for int8 in (False, True):
        got = np.array(qmm.gguf_gather(mx.array(x)[:, None, None, :], codes, scales, d, mx.array(chosen), int8=int8))
        got = got.reshape(9, 2, n)
        alone = np.stack([np.stack([np.array(qmm.gguf_matmul(mx.array(x[t:t + 1]), codes[e], scales[e], int8=int8,
                                                             d=None if d is None else d[e]))[0]
                                    for e in chosen[t]]) for t in range(9)])
        np.testing.assert_array_equal(got, alone)
        if not int8:
            floats = got
            truth = np.einsum("tk,tenk->ten", x.astype(np.float64), w[chosen])
            scale = np.einsum("tk,tenk->ten", np.abs(x).astype(np.float64), np.abs(w[chosen]))
            assert (np.abs(got - truth) / scale).max() < 2e-7  # measured ~6e-8, as the 2-D products
    order = np.argsort(chosen.reshape(-1), kind="stable")  # prefill's sorted pairs: [pairs, 1, 1, k] x [pairs, 1]
    pairs = np.array(qmm.gguf_gather(mx.array(x[order // 2])[:, None, None, :], codes, scales, d,
                                     mx.array(chosen.reshape(-1)[order])[:, None], int8=False))
    np.testing.assert_array_equal(pairs.reshape(-1, n), floats.reshape(-1, n)[order])


# ---- whole models ---------------------------------------------------------------------------------------------

def _write(tmp_path, kind: str, types: dict, vocab) -> tuple:
    """A tiny transformers model of `kind` written as a GGUF with tensor types by name (IQ4 packed by
    test_gguf_iquants' packer, gguf's own quantizers having none)."""
    make, arch = {"mistral": (_mistral, "llama"), "qwen3": (_qwen3, "qwen3"), "qwen3moe": (_qwen3_moe, "qwen3moe")}[kind]
    model = make(tmp_path / "hf") if kind == "qwen3moe" else _transformers(kind, make(tmp_path / "hf"))
    encode = test_gguf_inplace.encode
    test_gguf_inplace.encode = lambda w, q: pack_iq4(w.reshape(-1, w.shape[-1]), q).reshape(*w.shape[:-1], -1) \
        if q in (QT.IQ4_NL, QT.IQ4_XS) else random_nvfp4(w) if q == QT.NVFP4 else encode(w, q)
    try:
        written = write_model(tmp_path / "m.gguf", model, arch, _by_kind(types), vocab=vocab)
    finally:
        test_gguf_inplace.encode = encode
    return model, written


def random_nvfp4(w: np.ndarray) -> np.ndarray:
    """NVFP4 blocks (4 ue4m3 scales, then 32 code bytes, per 64 values) of random codes spread about as w's values
    (std 0.2: scales 0.027-0.047), which gguf dequantizes but does not quantize: a type pipeline re-quantizes."""
    rng = np.random.default_rng(w.size)
    raw = rng.integers(0, 256, (*w.shape[:-1], w.shape[-1] // 64, 36), dtype=np.uint8)
    raw[..., :4] = rng.integers(22, 29, raw[..., :4].shape)
    return raw.reshape(*w.shape[:-1], -1)


# kind -> the tensors in the type under test (the rest Q8_0, norms and routers F32)
ENDS = {
    "embedding-and-head": ("mistral", ("token_embd", "output.")),  # a separate LM head
    "tied-embedding": ("qwen3", ("token_embd",)),  # the embedding is also the head
    "expert-stacks": ("qwen3moe", ("exps", "token_embd")),  # gate, up and down stacks
}


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab")
    write_tokenizer(folder)
    return gguf_vocab(folder)


# the types held as the file's row bytes (quants.BLOCKS: the K-quant kernels' Q2_K, Q5_K) have their embeddings and
# heads held so too (their kernels dequantize rows); their expert stacks: test_gguf_block_experts.py
CASES = [(case, qtype) for case in ENDS for qtype in TYPES] + [("embedding-and-head", QT.Q2_K),
                                                                 ("tied-embedding", QT.Q5_K)]


@pytest.mark.parametrize("case, qtype", CASES, ids=lambda v: getattr(v, "name", v))
def test_models_with_ends_and_experts_in_blocks_match_transformers(case, qtype, tmp_path, vocab, kernels, capsys):
    """Embedding, LM head (or the tied embedding as the head) and expert stacks of `qtype` are held as the file's
    bytes (nothing re-quantized, no note) and, with float products, give transformers' logits on gguf's
    dequantization of the same file within float32 rounding, on 1 and 2 stages; the head's last rows as the last
    rank's head share give the same logits of those rows."""
    kind, ours = ENDS[case]
    types = {"attn": QT.Q8_0, "ffn_gate.": QT.Q8_0, "ffn_up.": QT.Q8_0, "ffn_down.": QT.Q8_0, "token_embd": QT.Q8_0,
             "output.": QT.Q8_0} | {key: qtype for key in ours}
    model, written = _write(tmp_path, kind, types, vocab)
    truth = reference(model, written["state"])
    assert_far_from_uniform(truth)
    capsys.readouterr()
    checkpoint = GGUFCheckpoint(written["files"][0])
    held_names = {n for n, e in checkpoint.tensors.items() if e.how == "native" and n.endswith(".weight")}
    expected = {"model.embed_tokens.weight"} | ({"lm_head.weight"} if "output." in ours else set())
    if case == "expert-stacks":
        expected |= {f"model.layers.{i}.mlp.switch_mlp.{p}_proj.weight" for i in range(4) for p in ("gate", "up", "down")}
    assert held_names == expected
    config = checkpoint.model_config()
    state = qmm.load()
    saved, state.gguf_int8 = state.gguf_int8, False
    try:
        logits = []
        for ranges in (((0, 4),), ((0, 2), (2, 4))):
            stages = [Stage.load(config, checkpoint, r, has_ends=(i == 0), dtype=mx.float32,
                                 head_rows=64 if i == len(ranges) - 1 and i else 0) for i, r in enumerate(ranges)]
            logits.append(np.array(forward(stages, LONG_PROMPT)))
        assert type(stages[0].model.embed_tokens) is (qmm.GGUFEmbedding if qtype in TYPES else qmm.GGUFBlocksEmbedding)
        if case == "expert-stacks":
            assert type(stages[1].model.layers[0].mlp.switch_mlp.down_proj) is GGUFSwitchLinear
        # the last rank's head share (its rows cut from the head's blocks) gives rank 0's logits of those rows
        x = mx.array(np.random.default_rng(7).normal(0, 1, (3, config.hidden_size)).astype(np.float32))
        whole = stages[0].model.embed_tokens if config.tie_word_embeddings else stages[0].model.lm_head
        share = np.array(head_columns(stages[-1].model.head_share, x, 0, 64))
        np.testing.assert_array_equal(share, np.array(head_columns(whole, x, config.vocab_size - 64, config.vocab_size)))
    finally:
        state.gguf_int8 = saved
    assert "re-quantized" not in capsys.readouterr().err
    np.testing.assert_array_equal(logits[0], logits[1])
    error = np.abs(logits[0] - truth).max()
    # float32 rounding: measured 1.5e-4 (Mistral), 1.9e-5 (Qwen3), 2.3e-4 (Qwen3-MoE), logits up to |14|
    assert error < 4e-4 and (logits[0].argmax(-1) == truth.argmax(-1)).all(), error


# ---- what the planner counts ----------------------------------------------------------------------------------

# held in their blocks: the embedding (Q2_K: row bytes), the head and IQ4 / Q6_K / Q4_K layer matrices; exact: Q8_0
MIX = {"token_embd": QT.Q2_K, "attn_q.": QT.IQ4_XS, "attn_k.": QT.Q4_K, "attn_v": QT.IQ4_NL, "attn_output": QT.Q8_0,
       "ffn_gate": QT.Q6_K, "ffn_up": QT.Q4_K, "ffn_down": QT.IQ4_NL, "output.": QT.Q6_K}
TIED_MIX = MIX | {"token_embd": QT.IQ4_NL}  # Qwen3's tied embedding, in its blocks, is the head
# the Q2_K gate and up expert stacks and the Q3_K embedding in their blocks, the NVFP4 down stacks re-quantized (no
# kernel of ours computes NVFP4)
MOE_MIX = {"down_exps": QT.NVFP4, "exps": QT.Q2_K, "token_embd": QT.Q3_K, "attn_q.": QT.IQ4_XS, "attn": QT.Q4_1,
           "output.": QT.Q6_K}
MIXES = {"mistral": MIX, "qwen3": TIED_MIX, "qwen3moe": MOE_MIX}


@pytest.mark.parametrize("kind, dtype, int8", (("mistral", "float32", False), ("qwen3", "float32", True),
                                               ("qwen3moe", "float32", False), ("qwen3moe", "bfloat16", True)))
def test_plan_counts_what_each_rank_holds(tmp_path, vocab, kind, dtype, int8, capsys):
    """A file mixing types held in their blocks (embedding or head, layer matrices), exact ones and re-quantized
    ones, loaded on 2 ranks as a job loads them (--int8-activations: repacked while loading, then the head): the
    planner's bytes for each rank (its layers, and rank 0's ends) are what the loaded stage holds."""
    _, written = _write(tmp_path, kind, MIXES[kind], vocab)
    path = written["files"][0]
    checkpoint = GGUFCheckpoint(path)
    hows = {e.how for n, e in checkpoint.tensors.items() if n.endswith(".weight") and e.layout}
    assert hows == ({"native", "exact", "requantized"} if kind == "qwen3moe" else {"native", "exact"}), hows
    config = checkpoint.model_config()
    mb = model_bytes(architecture(config), Precision(checkpoint_format(config, find(path)), dtype, int8=int8))
    for rank, (start, end) in enumerate(((0, 2), (2, 4))):
        stage = Stage.load(config, GGUFCheckpoint(path), (start, end), has_ends=rank == 0, dtype=getattr(mx, dtype),
                           int8_in_place=False if int8 else None)
        if int8:
            use_int8(stage.model, tied_head=bool(config.tie_word_embeddings))
        planned = sum(mb.layers[start:end]) + (mb.ends if rank == 0 else 0)
        assert planned == stage.weight_nbytes, (rank, planned, stage.weight_nbytes)
        if rank == 0:  # the embedding's rows (float32 from its blocks) in --dtype, as every float the layers take
            assert stage.model.embed(mx.array([[1, 2]])).dtype == getattr(mx, dtype)
        if rank == 0 and kind == "qwen3moe" and dtype == "float32":  # the loader's note: the re-quantized stacks,
            # held vs in the file (as read: float32 scales, which --dtype bfloat16 then halves); the Q2_K stacks are
            # the file's bytes
            mlps = [stage.model.layers[i].mlp.switch_mlp for i in range(start, end)]
            assert (sum(m[f"{p}_proj"]["weight"].nbytes for m in mlps for p in ("gate", "up"))
                    == sum(checkpoint.gguf.tensors[f"blk.{i}.ffn_{p}_exps.weight"].nbytes
                           for i in range(start, end) for p in ("gate", "up")))
            stacks = [(f"blk.{i}.ffn_down_exps.weight", stage.model.layers[i].mlp.switch_mlp.down_proj)
                      for i in range(start, end)]
            held = sum(module[p].nbytes for _, module in stacks for p in ("weight", "scales", "biases"))
            in_file = sum(checkpoint.gguf.tensors[name].nbytes for name, _ in stacks)
            note, = [line for line in capsys.readouterr().err.splitlines() if "re-quantized" in line]
            assert "2 GGUF tensors " in note and "(2 NVFP4 -> 8-bit group 64: blk.0-1.ffn_down_exps" in note, note
            assert f"{held / 2**20:.1f} MiB in memory for " in note and f"in the file ({held / in_file:.2f}x)" in note, note
