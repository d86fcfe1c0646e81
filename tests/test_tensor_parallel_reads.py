"""--tensor-parallel ranks read only their share of each tensor (checkpoints/share_reads.py): the same
weights as reading whole tensors and cutting them, for the default model as a GGUF file (rows read
alone, column shares row by row) and as its converted safetensors folder, T = 2 and 3; and the GGUF
reader's count of bytes read equals the share's bytes, counted from the file's header by the gguf package."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
from mlx.utils import tree_flatten

from pipeline.checkpoints.default_model import default_model_dir, find_default_gguf
from pipeline.checkpoints.model_files import locate
from pipeline.checkpoints.share_reads import read_shares
from pipeline.models.tensor_parallel import Shard
from pipeline.models.vocab_split import vocab_share
from pipeline.runtime.stage import SHARE_READS, Stage


def load_member(path, t: int, member: int):
    checkpoint = locate(path).open(None)
    config = checkpoint.model_config()
    stage = Stage.load(config, checkpoint, (0, config.num_hidden_layers), has_ends=member == 0, dtype=mx.float32,
                       shard=Shard(member, t), vocab_slice=vocab_share(config.vocab_size, t, member))
    return dict(tree_flatten(stage.model.parameters())), checkpoint, stage


@pytest.mark.parametrize("form, t, member", [("gguf", 2, 0), ("gguf", 2, 1), ("gguf", 3, 1), ("gguf", 3, 2),
                                             ("folder", 2, 0), ("folder", 2, 1)])
def test_share_reads_hold_what_whole_reads_cut(form, t, member, monkeypatch):
    path = find_default_gguf() if form == "gguf" else default_model_dir(progress=False)
    monkeypatch.setenv(SHARE_READS, "0")
    whole, _, _ = load_member(path, t, member)
    monkeypatch.setenv(SHARE_READS, "1")
    share, checkpoint, _ = load_member(path, t, member)
    assert set(whole) == set(share)
    for name in whole:
        assert whole[name].shape == share[name].shape and mx.array_equal(whole[name], share[name]).item(), name
    if form == "gguf":
        assert checkpoint.bytes_read < 0.75 * sum(e.source[0].nbytes for n, e in checkpoint.tensors.items()
                                                  if n.endswith(".weight"))


def test_gguf_reader_reads_exactly_the_share():
    """Bytes read per member == each tensor's share of its bytes, from the gguf package's reading of the header:
    rows [b, e) of a tensor of R rows are (e - b) / R of its bytes, columns likewise (whole blocks)."""
    import gguf

    path = find_default_gguf()
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    for member in range(2):
        _, checkpoint, stage = load_member(path, 2, member)
        config = checkpoint.model_config()
        shares = read_shares(stage.loaded_tensors, config, Shard(member, 2), vocab_share(config.vocab_size, 2, member),
                             member == 0)
        expected = 0
        for name in stage.loaded_tensors:
            if name.rsplit(".", 1)[-1] in ("scales", "biases", "ggml_type"):
                continue  # one GGUF tensor each, counted with its weight
            nbytes = sizes[checkpoint.tensors[name].source[0].name]
            if name in shares:
                _, begin, end, of = shares[name]
                nbytes = nbytes * (end - begin) // of
            expected += nbytes
        assert checkpoint.bytes_read == expected, (member, checkpoint.bytes_read, expected)
        assert expected < 0.7 * sum(sizes.values())
