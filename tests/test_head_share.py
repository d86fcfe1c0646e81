"""The LM head shared between rank 0 and the last rank (head_share.py): the last rank holds
exactly the head's last rows, the combined greedy choice equals one argmax over the whole
vocabulary, bit for bit, and the split moves towards the rank that waits. The end-to-end check
(batch texts equal `generate`'s with a share) is in test_batch.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from pipeline.models.config import ModelConfig
from pipeline.checkpoints.format_adapters import Requantize
from pipeline.runtime.head_share import HeadSplit, combined_argmax, head_share_fraction, head_share_rows, returned_rows, split_returned
from pipeline.runtime.stage import Stage
from pipeline.planner.weights_bytes import model_bytes_of
from pipeline.checkpoints.safetensors_checkpoint import Checkpoint


def test_combined_argmax_is_the_first_index_of_the_largest_logit():
    own = mx.array([[1.0, 5.0, 2.0], [1.0, 3.0, 3.0], [0.5, 0.0, 0.0], [7.0, 7.0, 1.0]])
    # the last rank's (max, argmax) over entries 3..: a larger max wins, a tie keeps rank 0's index
    share = mx.array([[4.0, 1.0], [3.0, 0.0], [2.5, 2.0], [8.0, 0.0]])
    assert combined_argmax(own, share, own_columns=3).tolist() == [1, 1, 5, 3]


def test_the_head_is_shared_only_where_both_ends_have_exact_products():
    assert head_share_fraction("auto", [64, 64]) == 0.5
    assert head_share_fraction(0.25, [64, 0, 64]) == 0.25  # a middle rank's BLAS does not matter
    assert head_share_fraction("off", [64, 64]) == 0
    assert head_share_fraction("auto", [64]) == 0  # one rank: nothing to share with
    assert head_share_fraction("auto", [64, 0]) == 0  # the last rank's products are not exact
    assert head_share_fraction("auto", [0, 64]) == 0
    assert head_share_rows(0.5, 1000) == 496 and head_share_rows(0.25, 1000) == 256  # in steps of 16
    assert head_share_rows(0.0, 1000) == 0 and head_share_rows(0.001, 1000) == 16


@pytest.mark.parametrize("kind,requantize", [("llama", None), ("qwen3", None), ("llama", Requantize(8, 32))])
def test_shared_head_picks_the_same_tokens_as_the_whole_head(tiny_models, kind, requantize):
    """Rank 0's slice and a last-rank slice holding half the head (untied lm_head for Llama, the
    tied embedding for Qwen3; 8-bit quantized too): for many rows, the combined choice equals
    the argmax of the whole head's logits; the last rank's rows are the head's last rows."""
    folder = tiny_models[kind]
    config, checkpoint = ModelConfig.from_folder(folder), Checkpoint(folder)
    vocab, rows_held = config.vocab_size, head_share_rows(0.5, config.vocab_size)
    first = Stage.load(config, checkpoint, (0, 2), has_ends=True, dtype=mx.float32, requantize=requantize)
    last = Stage.load(config, checkpoint, (2, 4), has_ends=False, dtype=mx.float32, requantize=requantize,
                      head_rows=rows_held)
    head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    assert head_name in last.loaded_tensors and "model.norm.weight" in last.loaded_tensors
    whole = first.model.embed_tokens if config.tie_word_embeddings else first.model.lm_head
    for name in ("weight", "scales", "biases"):
        if name in whole:
            assert mx.array_equal(last.model.head_share[name], whole[name][-rows_held:]).item(), name
    assert not hasattr(last.model, "embed_tokens") and not hasattr(last.model, "lm_head")
    if requantize is None:  # what the memory planner counts for it (layer_split.plan_weights_in_memory, memory.py)
        held = sum(a.nbytes for a in last.model.head_share.parameters().values())
        assert held == rows_held / vocab * model_bytes_of(config, folder, dense=True).head

    mx.random.seed(0)
    hidden = mx.random.normal((1, 24, config.hidden_size)) * 3  # the last positions of 24 sequences
    for columns in (rows_held, rows_held // 3, 16):
        returned = returned_rows(last.model, hidden, columns, [(0, 10), (10, 24)])  # two products
        rows, share = split_returned(returned, config.hidden_size)
        assert mx.array_equal(rows, hidden[0]).item() and share.shape == (24, 2)
        expected = mx.argmax(first.model.logits(rows), axis=-1)
        got = combined_argmax(first.model.logits(rows, vocab_end=vocab - columns), share, vocab - columns)
        assert got.tolist() == expected.tolist()
        from_share = np.array(got) >= vocab - columns
        if columns == rows_held:
            assert 0 < from_share.sum() < 24  # both ranks' parts won for some rows
    rows, share = split_returned(returned_rows(last.model, hidden, 0, [(0, 24)]), config.hidden_size)
    assert share is None and rows.shape == (24, config.hidden_size)  # no share: the hidden states alone


def test_the_split_moves_towards_the_rank_that_waits():
    split = HeadSplit(max_columns=1024)
    split.update(0.0, 0.004, rows=16)  # no cost measured yet: no move
    assert split.columns == 0
    split.observe_cost(0.0016, rows=16, columns=1000)  # 100 ns per logit
    split.update(0.0, 0.004, rows=16)  # the last rank idled 4 ms: give it columns
    assert 0 < split.columns <= 1024 and split.columns % 16 == 0
    before = split.columns
    split.update(0.004, 0.0, rows=16)  # now rank 0 waited: take some back
    assert split.columns < before
    for _ in range(100):
        split.update(0.0, 0.05, rows=16)
    assert split.columns == 1024  # never more than the last rank holds
    for _ in range(100):
        split.update(0.05, 0.0, rows=16)
    assert split.columns == 0
    fixed = HeadSplit(max_columns=512, fixed=512)
    fixed.observe_cost(0.001, rows=16, columns=1000)
    fixed.update(0.05, 0.0, rows=16)
    assert fixed.columns == 512
