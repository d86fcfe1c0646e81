"""Shared fixtures: tiny random models saved by `transformers` (our reference oracle), a small
byte-level BPE tokenizer, and a helper that runs real `mpiexec` jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline  # noqa: F401 -- first, so MLX binds the BLAS (and shim) a real run uses

REPO = Path(__file__).resolve().parents[1]

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

VOCAB_SIZE = 384


def openblas_installed() -> bool:
    from pipeline import blas

    return any(os.path.exists(path) for path in blas.candidates())


def shim_buildable() -> bool:
    """OpenBLAS and a C compiler are there (as in CI), so pipeline's BLAS shim must be in use."""
    from pipeline import blas

    return openblas_installed() and blas.c_compiler() is not None


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer trained on a few sentences, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
            "Pipeline parallel inference splits layers across ranks; hidden states travel between them.",
            "def hello(world):\n    return 42\n"] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def make_tiny_model(kind: str, folder: Path, **overrides) -> Path:
    """Build a tiny random model with transformers, save it (safetensors) with a tokenizer."""
    import torch
    import transformers

    torch.manual_seed({"llama": 0, "qwen3": 1, "qwen2": 2, "mistral": 3}.get(kind, 4))
    common = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=VOCAB_SIZE, max_position_embeddings=512,
                  bos_token_id=None, eos_token_id=2, pad_token_id=None)
    common.update(overrides)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**{**common, "head_dim": 32}, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
        model = transformers.MistralForCausalLM(config)
    else:
        raise ValueError(kind)
    # Random init leaves biases at zero and norms at one; perturb them so they are tested too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_tiny_model(kind, root / kind) for kind in ("llama", "qwen3", "qwen2", "mistral")}


def load_stages(folder: Path, ranges, requantize=None) -> list:
    """One Stage per [start, end) range, as ranks would hold the model (stage 0 has the ends)."""
    import mlx.core as mx

    from pipeline.config import ModelConfig
    from pipeline.stage import Stage
    from pipeline.weights import Checkpoint

    config = ModelConfig.from_folder(folder)
    checkpoint = Checkpoint(folder)
    return [Stage.load(config, checkpoint, r, has_ends=(i == 0), dtype=mx.float32, requantize=requantize)
            for i, r in enumerate(ranges)]


def forward(stages: list, token_ids: list[int]):
    """Logits of every position: token ids through a chain of stages, in process."""
    import mlx.core as mx
    import numpy as np

    hidden = stages[0].model.embed(mx.array([token_ids]))
    for stage in stages:
        hidden = stage.run_layers(hidden)
    return np.array(stages[0].model.logits(hidden))[0]


def mpiexec(n: int, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `mpiexec -n N python -m pipeline ARGS` from the repository root."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(["mpiexec", "-n", str(n), sys.executable, "-m", "pipeline", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env)
