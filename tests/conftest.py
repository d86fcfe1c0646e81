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

# Weights drawn with std 0.2, not transformers' 0.02: logits then spread over several units (top-1
# probability ~0.1 where uniform is 0.0026), so a wrong scale, rotation or routing moves them far
# more than float rounding does; near-uniform logits would hide such bugs under any tolerance.
INIT_STD = 0.2
# original_max_position_embeddings of the tiny models with scaled RoPE (llama3, YaRN): small, so
# that LONG_PROMPT reaches past it, where the scaling matters most.
ROPE_WINDOW = 32


def openblas_installed() -> bool:
    from pipeline.kernels import blas

    return any(os.path.exists(path) for path in blas.candidates())


def shim_buildable() -> bool:
    """OpenBLAS and a C compiler are there (as in CI), so pipeline's BLAS shim must be in use."""
    from pipeline.kernels import build

    return openblas_installed() and build.c_compiler() is not None


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


def save_reference(model, folder: Path):
    """A transformers reference model saved to `folder` (safetensors, in eval mode) with
    write_tokenizer's tokenizer; returns the model."""
    folder.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(folder)
    write_tokenizer(folder)
    return model


def reference_logits(make, folder: Path, prompt: list[int]) -> tuple:
    """A model fixture's value: `folder`, the reference `make(folder)` saves there, and its logits
    on `prompt` ([tokens, vocab])."""
    import torch  # heavy: loaded by the tests that build references only

    reference = make(folder)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].numpy()
    return folder, reference, expected


def make_tiny_model(kind: str, folder: Path, **overrides) -> Path:
    """Build a tiny random model with transformers, save it (safetensors) with a tokenizer."""
    import torch
    import transformers

    torch.manual_seed({"llama": 0, "qwen3": 1, "qwen2": 2, "mistral": 3}.get(kind, 4))
    common = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=VOCAB_SIZE, max_position_embeddings=512,
                  bos_token_id=None, eos_token_id=2, pad_token_id=None, initializer_range=INIT_STD)
    common.update(overrides)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": ROPE_WINDOW}, tie_word_embeddings=False)
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
    save_reference(model, folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_tiny_model(kind, root / kind) for kind in ("llama", "qwen3", "qwen2", "mistral")}


@pytest.fixture(scope="module")
def kernels():
    """pipeline's kernels' extension (build.py: quantized products, attention, RMSNorm, RoPE), built once
    per machine into the cache as a real run builds it. It must build where a compiler is present and
    nobody turned it off; else the tests that need it skip."""
    from pipeline.kernels import build

    state = build.load()
    if state.module is None:
        if not build.missing_tools() and os.environ.get(build.KERNELS_ENV) is None:
            pytest.fail(f"pipeline's kernels should build here: {state.why_not}")
        pytest.skip(f"no kernels: {state.why_not}")
    return state.module


def load_stages(folder: Path, ranges, requantize=None, dtype=None) -> list:
    """One Stage per [start, end) range, as ranks would hold the model (stage 0 has the ends);
    floats in `dtype` (float32 unless given, as `--dtype`)."""
    import mlx.core as mx

    from pipeline.models.config import ModelConfig
    from pipeline.runtime.stage import Stage
    from pipeline.checkpoints.safetensors_checkpoint import Checkpoint

    config = ModelConfig.from_folder(folder)
    checkpoint = Checkpoint(folder)
    return [Stage.load(config, checkpoint, r, has_ends=(i == 0), dtype=dtype or mx.float32, requantize=requantize)
            for i, r in enumerate(ranges)]


def int8_loaded_both_ways(checkpoint, in_place: bool, requantize=None):
    """One stage of layers 0-3 loaded twice, its quantized matrices repacked for the int8 products after
    the load (use_int8 alone), and while loading (int8_repack.Int8WhileLoading, `in_place` as the loader asks)
    then use_int8 for the rest: (after, during, the module paths repacked while loading).
    `checkpoint`: a callable giving a fresh checkpoint."""
    import mlx.core as mx

    from pipeline.checkpoints.int8_repack import use_int8
    from pipeline.kernels import build
    from pipeline.runtime.stage import Stage

    if build.load().module is None:
        pytest.skip("int8 products need pipeline's kernels")
    stages, early = [], set()
    for int8_in_place in (None, in_place):
        source = checkpoint()
        stage = Stage.load(source.model_config(), source, (0, 4), has_ends=True, dtype=mx.float32,
                           requantize=requantize, int8_in_place=int8_in_place)
        early = {path for path, m in stage.model.named_modules() if getattr(m, "int8", False)}
        assert int8_in_place is not None or not early
        use_int8(stage.model, in_place=in_place)
        stages.append(stage)
    return stages[0], stages[1], early


def assert_same_parameters(expected, got) -> None:
    """The same parameters, bit for bit, and the same modules on the int8 path."""
    import numpy as np
    from mlx.utils import tree_flatten

    def int8(model):
        return {path for path, m in model.named_modules() if getattr(m, "int8", False)}

    assert int8(expected) == int8(got)
    theirs, ours = dict(tree_flatten(expected.parameters())), dict(tree_flatten(got.parameters()))
    assert theirs.keys() == ours.keys()
    for name, array in theirs.items():
        assert array.dtype == ours[name].dtype and array.shape == ours[name].shape, name
        assert np.array_equal(np.array(array), np.array(ours[name])), name


def forward(stages: list, token_ids: list[int]):
    """Logits of every position (as float32): token ids through a chain of stages, in process."""
    import mlx.core as mx
    import numpy as np

    hidden = stages[0].model.embed(mx.array([token_ids]))
    for stage in stages:
        hidden = stage.run_layers(hidden)
    return np.array(stages[0].model.logits(hidden).astype(mx.float32))[0]


def long_prompt(length: int = 64, seed: int = 0) -> list[int]:
    """`length` token ids drawn at random from 3 up (0-2 are the special tokens): a prompt that
    reaches past ROPE_WINDOW without a tokenizer."""
    import numpy as np

    return np.random.default_rng(seed).integers(3, VOCAB_SIZE, length).tolist()


def assert_far_from_uniform(logits) -> None:
    """The reference logits a test compares against are peaked enough for bugs to show (guards
    INIT_STD): with transformers' default init (std 0.02) these tiny models' logits stay within
    |0.7|, spread 0.16, top-1 probability 0.004 at every position, and any bug's effect shrinks
    with them; with std 0.2, logits reach |7|, spread 1.6, top-1 probability ~0.1 on average."""
    import numpy as np

    logits = np.asarray(logits, dtype=np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert p.max(-1).mean() > 0.05, f"top-1 probability {p.max(-1).mean():.4f}: logits nearly uniform"
    assert logits.std(-1).mean() > 1.0, f"logits' spread {logits.std(-1).mean():.3f}: nearly uniform"


# bfloat16 (`--dtype bfloat16`) against transformers in bfloat16 (loaded with dtype=bfloat16: a
# model `.to(bfloat16)` also rounds its RoPE frequencies, and errs twice as much), both against the
# fp32 truth, on a 64-token prompt (logits up to |7|; bf16 keeps 8 bits). Per position, the
# largest logit error; its median, and the positions off by more than 1 (where bf16 rounding flips
# a MoE router's choice between near-tied experts). Measured, ours / transformers':
#   median  llama 0.160/0.154, qwen3 0.092/0.097, qwen3-yarn 0.112/0.104, qwen2 0.178/0.157,
#           mistral 0.169/0.157, deepseek-yarn 0.152/0.140, qwen3-moe-dense-layer 0.101/0.096,
#           DeepSeek FP8 (hidden 192, logits up to |12|) 0.228/0.229: ratio <= 1.13
#   positions off by more than 1: 0/0 for the dense models, deepseek-yarn 2/1, FP8 2/2
#   ours vs transformers directly, median: 0.69-0.96x transformers' own median error
#   top-1 agreeing with fp32's: 0.91-0.97
# Which tokens flip is chance, and a flipped token spreads its error to later positions through
# attention: other MoE cases measured deepseek 4/1 flips (median 1.24x), qwen3-moe 7/2 (1.8x),
# deepseek-no-q-lora 1/2 (0.97x); the bf16 tests use the cases above, not those.
BF16_MEDIAN_RATIO = 1.25
BF16_EXTRA_FLIPS = 2
BF16_DIRECT_RATIO = 1.25
BF16_TOP1_AGREEMENT = 0.875


def assert_bfloat16_close(ours, theirs, truth) -> None:
    """bf16 logits: about as far from the fp32 truth as transformers' bf16 run, and close to it
    (bounds just above the measurements above)."""
    import numpy as np

    ours_error, their_error = np.abs(ours - truth).max(-1), np.abs(theirs - truth).max(-1)
    assert np.median(ours_error) <= BF16_MEDIAN_RATIO * np.median(their_error), \
        (np.median(ours_error), np.median(their_error))
    assert (ours_error > 1).sum() <= (their_error > 1).sum() + BF16_EXTRA_FLIPS, \
        ((ours_error > 1).sum(), (their_error > 1).sum())
    assert np.median(np.abs(ours - theirs).max(-1)) <= BF16_DIRECT_RATIO * np.median(their_error)
    assert (ours.argmax(-1) == truth.argmax(-1)).mean() >= BF16_TOP1_AGREEMENT


def greedy_transformers(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy continuation (no end-of-sequence stop)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def transformers_text(reference, folder: Path, prompt: str, max_tokens: int) -> str:
    """transformers' greedy continuation of a text prompt (no chat template), as text, stopping at
    id 2 (the tiny models' end of sequence): what `generate` and `batch` should print for it."""
    import torch  # heavy: loaded by the tests that build references only

    from pipeline.checkpoints.tokenizer import Tokenizer  # as greedy_ours imports the engine: where used

    tokenizer = Tokenizer.from_folder(folder)
    ids = tokenizer.prompt_ids(prompt, use_chat_template=False)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=2,
                                 pad_token_id=0)[0, len(ids):].tolist()
    return tokenizer.decode(out[:out.index(2)] if 2 in out else out, skip_special_tokens=True)


def greedy_ours(stage, folder: Path, prompt_ids: list[int], max_tokens: int):
    """Our generate path (engine.generate: prefill, then the overlapped one-rank decode loop)
    on one in-process rank; returns the Generation."""
    from mpi4py import MPI

    from pipeline.runtime.engine import generate
    from pipeline.runtime.requests import SamplingParams
    from pipeline.checkpoints.tokenizer import Tokenizer
    from pipeline.cluster.transport import MpiTransport

    return generate(stage, MpiTransport(MPI.COMM_SELF), Tokenizer.from_folder(folder), prompt_ids,
                    SamplingParams(), max_tokens)


def mapped_bytes(path: Path) -> int:
    """Bytes of `path` this process has mapped in memory (/proc/self/smaps: Rss of its mappings)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line: address range, ..., path
                inside = len(fields) >= 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def cache_with_builds(folder: Path) -> Path:
    """A fresh $PIPELINE_CACHE `folder` (made here) holding this machine's builds of pipeline's compiled
    parts (the kernels' extension, the BLAS shim) and of MLX's compiled CPU kernels (tmp/mlx), copied from
    the session's cache: jobs given it find them built instead of compiling them again (the extension
    alone takes about a minute of g++, many on a loaded machine); models and all else start empty.
    The extension and the shim are built here first where missing."""
    import shutil
    import time

    from pipeline.kernels import build
    from pipeline.util.paths import cache_root

    folder.mkdir(parents=True, exist_ok=True)
    build.load()
    for built in (build.extension_path(), build.shim_path()):
        if built.is_file():
            (folder / built.parent.name).mkdir(mode=0o700, exist_ok=True)
            shutil.copy2(built, folder / built.parent.name / built.name)
    if (cache_root() / "tmp" / "mlx").is_dir():
        def being_written(where, names):  # a kernel another job on this machine may be compiling now
            return [n for n in names if os.path.isfile(os.path.join(where, n))
                    and time.time() - os.path.getmtime(os.path.join(where, n)) < 60]

        (folder / "tmp").mkdir(mode=0o700, exist_ok=True)
        shutil.copytree(cache_root() / "tmp" / "mlx", folder / "tmp" / "mlx", ignore=being_written, dirs_exist_ok=True)
    return folder


def mpiexec(n: int, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `mpiexec -n N python -m pipeline ARGS` from the repository root."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(["mpiexec", "-n", str(n), sys.executable, "-m", "pipeline", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env)


def fp8_blocks(w):
    """A torch float matrix as DeepSeek publishes FP8 weights: e4m3 values with one float32 scale
    (`weight_scale_inv`) per 128x128 block. Returns (e4m3 weight, scale_inv)."""
    import torch

    rows, cols = w.shape
    scale_inv = torch.zeros((rows + 127) // 128, (cols + 127) // 128)
    q = torch.zeros_like(w)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale_inv[i, j] = block.abs().max() / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = block / scale_inv[i, j]
    return q.to(torch.float8_e4m3fn), scale_inv
