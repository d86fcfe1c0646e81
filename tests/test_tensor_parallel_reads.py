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


def assert_same_both_ways(path, t: int, member: int, monkeypatch):
    """The member loaded reading whole tensors and cutting them, and reading its shares: the same arrays, bit for
    bit. Returns the (share reads', whole reads') checkpoints."""
    monkeypatch.setenv(SHARE_READS, "0")
    whole, whole_checkpoint, _ = load_member(path, t, member)
    monkeypatch.setenv(SHARE_READS, "1")
    share, checkpoint, _ = load_member(path, t, member)
    assert set(whole) == set(share)
    for name in whole:
        assert whole[name].shape == share[name].shape and mx.array_equal(whole[name], share[name]).item(), name
    return checkpoint, whole_checkpoint


@pytest.mark.parametrize("form, t, member", [("gguf", 2, 0), ("gguf", 2, 1), ("gguf", 3, 1), ("gguf", 3, 2),
                                             ("folder", 2, 0), ("folder", 2, 1)])
def test_share_reads_hold_what_whole_reads_cut(form, t, member, monkeypatch):
    path = find_default_gguf() if form == "gguf" else default_model_dir(progress=False)
    checkpoint, _ = assert_same_both_ways(path, t, member, monkeypatch)
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


@pytest.mark.parametrize("t, member", [(2, 0), (2, 1), (3, 2)])
def test_deepseek_gguf_reads_its_heads_of_k_b_and_v_b(t, member, tmp_path, monkeypatch):
    """llama.cpp's deepseek2 GGUF stores MLA's kv_b_proj as attn_k_b [heads, latent, nope] and attn_v_b [heads, v,
    latent] (the loader joins them): a member reads its heads of both (each one run of bytes), as it reads its share
    of every other tensor (Q8_0 expert stacks, attention), and holds what reading them whole and cutting holds."""
    import test_gguf_inplace as g  # its GGUF writer (llama.cpp's layout)
    from conftest import write_tokenizer
    from gguf import GGMLQuantizationType as QT

    (tmp_path / "vocab").mkdir()
    write_tokenizer(tmp_path / "vocab")
    types = {"exps": QT.Q8_0, "attn": QT.Q8_0, "ffn_": QT.Q8_0, "token_embd": QT.Q8_0, "output.": QT.Q8_0}
    model = g._deepseek(tmp_path / "hf", num_attention_heads=6, num_key_value_heads=6)
    path = g.write_model(tmp_path / "m.gguf", model, "deepseek2", g._by_kind(types), mla="split",
                         vocab=g.gguf_vocab(tmp_path / "vocab"))["files"][0]
    checkpoint, whole_checkpoint = assert_same_both_ways(path, t, member, monkeypatch)
    kv_b = checkpoint.tensors["model.layers.0.self_attn.kv_b_proj.weight"]
    k_b, v_b = (t.name for t in kv_b.source)
    with narrowed_for(checkpoint, t, member) as _:
        read = checkpoint.tensors["model.layers.0.self_attn.kv_b_proj.weight"].source
        assert [s.shape[0] for s in read] == [2 if t == 3 else 3] * 2, (k_b, v_b, [s.shape for s in read])
    assert checkpoint.bytes_read < (0.75 if t == 2 else 0.6) * whole_checkpoint.bytes_read


def narrowed_for(checkpoint, t: int, member: int):
    from pipeline.checkpoints.share_reads import narrowed

    config = checkpoint.model_config()
    return narrowed(checkpoint, read_shares(checkpoint.tensors, config, Shard(member, t),
                                            vocab_share(config.vocab_size, t, member), member == 0))
