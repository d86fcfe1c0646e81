"""`pipeline convert` of a Qwen3.5-MoE GGUF (llama.cpp's `qwen35moe`): the folder it writes (config.json of
model_type qwen3_5_moe_text, transformers' `Qwen3_5MoeForCausalLM`; the tensors as the GGUF is read in place:
norms back to their stored weight, A_log, the convolution [channels, 1, kernel], value heads left tiled and
said so in config.json) loads back and gives the GGUF's logits, and transformers' within test_qwen3_5_moe's
bound; a Q8_0 file converts to MLX 8-bit (its blocks exactly) with the logits of the file read in place."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from conftest import REPO, forward, load_stages, reference_logits
from test_gguf_inplace import gguf_vocab
from test_qwen3_5_features import _gguf_logits, write_qwen35moe_gguf
from test_qwen3_5_moe import LONG_PROMPT, THREE_RANKS, TOLERANCE, make_qwen3_5_moe


@pytest.fixture(scope="module")
def qwen35_gguf(tmp_path_factory):
    folder, model, expected = reference_logits(make_qwen3_5_moe, tmp_path_factory.mktemp("qwen35_convert"), LONG_PROMPT)
    for kind in ("", "q8_0"):
        write_qwen35moe_gguf(folder / f"tiny-qwen35moe{kind}.gguf", model, gguf_vocab(folder), kind)
    return folder, expected


@pytest.mark.parametrize("kind", ["", "q8_0"])
def test_convert_of_a_qwen35moe_gguf_loads_back_with_its_logits(qwen35_gguf, kind, tmp_path):
    from pipeline.checkpoints.gguf_convert import convert_gguf

    folder, expected = qwen35_gguf
    path = folder / f"tiny-qwen35moe{kind}.gguf"
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    in_place, _ = _gguf_logits(path, [(0, 6)], LONG_PROMPT)
    (stage,) = load_stages(out, [(0, 6)])
    converted = forward([stage], LONG_PROMPT)
    to_gguf, to_transformers = np.abs(converted - in_place).max(), np.abs(converted - expected).max()
    print(f"qwen35moe {kind or 'F32'} converted: max logit difference to the GGUF read in place {to_gguf:.3g}, "
          f"to transformers {to_transformers:.3g}")
    assert to_gguf <= 1e-5
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text" and config["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert config["linear_value_heads_tiled"] is True
    if kind:
        assert config["quantization"]["bits"] == 8
    if not kind:
        assert to_transformers <= TOLERANCE
        three = forward(load_stages(out, THREE_RANKS), LONG_PROMPT)
        assert np.array_equal(three, converted)


def test_convert_command_line(qwen35_gguf, tmp_path):
    folder, _ = qwen35_gguf
    result = subprocess.run([sys.executable, "-m", "pipeline", "convert", "--gguf", str(folder / "tiny-qwen35moe.gguf"),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "out" / "tokenizer.json").exists()
