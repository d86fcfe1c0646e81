"""`convert`: a llama.cpp GGUF file (or split set) into a Hugging Face-layout model folder.

Running a GGUF needs no conversion (gguf_checkpoint.py reads it in place); `convert` writes what that
reading gives (the same tensors, MLX-quantized where the GGUF's types map exactly or re-quantized where
they do not, config.json from the metadata: gguf_config.py) as safetensors, for those who want an MLX
folder, with the tokenizer the GGUF describes (gguf_tokenizer.py) as `tokenizer.json` (vocabulary,
merges, pre-tokenizer) and `tokenizer_config.json` (special tokens, chat template).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from . import quants, safetensors_file
from ..util.errors import UserError
from .gguf_checkpoint import GGUFCheckpoint
from .gguf_tokenizer import build_generation_config, build_tokenizer, build_tokenizer_config

MAX_SHARD_BYTES = 2_000_000_000

# our model_type -> the Hugging Face `architectures` entry of config.json
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
                    "minimax_m2": "MiniMaxM2ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
                    # a text-only folder (no vision tower): transformers' text model, config flat (no text_config)
                    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}


class OutputExistsError(UserError):
    """The output folder already exists (possibly created by a concurrent conversion)."""


# ----------------------------------------------------------------------------------------------
# Entry point


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True,
                 requantize_bits: int | None = None, group_size: int = 64) -> Path:
    """Convert `gguf_path` (a GGUF file, or any part of a split set) into an HF-layout model folder at
    `out_dir` and return `out_dir`. `requantize_bits`/`group_size`: the MLX layout of GGUF types MLX
    cannot hold exactly (as --quantize/--group-size when running the file).

    Everything is written into a temporary folder next to `out_dir` and renamed at the end, so a
    crash never leaves a half-written model. Raises OutputExistsError if `out_dir` exists and is not
    empty (also when another process finished first), UserError for any unusable input.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    # every check on the input is here; MLX layouts only (no blocks held as the file's: other tools read the folder)
    checkpoint = GGUFCheckpoint(gguf_path, requantize_bits, group_size, native=False)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise OutputExistsError(f"output folder {out_dir} already exists and is not empty: remove it or pick another")
    meta = checkpoint.gguf.metadata
    config = folder_config(checkpoint)
    tokenizer = build_tokenizer(meta, gguf_path)
    tokenizer_config = build_tokenizer_config(meta)
    generation_config = build_generation_config(meta)

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as err:
        raise UserError(f"cannot create the output folder {out_dir}: {err.strerror}") from err
    try:
        _write_weights(checkpoint, tmp_dir, progress, desc=f"converting {gguf_path.name}")
        _write_json(tmp_dir / "config.json", config)
        tokenizer.save(str(tmp_dir / "tokenizer.json"))
        _write_json(tmp_dir / "tokenizer_config.json", tokenizer_config)
        _write_json(tmp_dir / "generation_config.json", generation_config)
        os.chmod(tmp_dir, 0o755)  # mkdtemp makes it owner-only
        try:
            os.rename(tmp_dir, out_dir)  # atomic; replaces out_dir only if it is an empty folder
        except OSError as err:
            if out_dir.exists():
                raise OutputExistsError(f"output folder {out_dir} already exists and is not empty") from err
            raise
    except OSError as err:  # disk full, permissions, ...
        raise UserError(f"cannot write the converted model to {out_dir}: {_one_line(err)}") from err
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def folder_config(checkpoint) -> dict[str, Any]:
    """config.json of the converted folder: the checkpoint's config, its `architectures` entry, and an
    mlx-lm style `quantization`: the most common (bits, group) by default, modules held otherwise
    with their own entry, float matrices `false`."""
    config = dict(checkpoint.config_dict)
    if config["model_type"] not in HF_ARCHITECTURES:
        raise UserError(f"{checkpoint.folder}: convert does not write {config['model_type']} folders yet "
                        f"(it writes {', '.join(sorted(HF_ARCHITECTURES))}); run the GGUF in place instead")
    config["architectures"] = [HF_ARCHITECTURES[config["model_type"]]]
    modules: dict[str, dict | bool] = {}
    scale_dtypes, float_dtypes, symmetric = set(), [], []
    for name, entry in checkpoint.tensors.items():
        module, _, part = name.rpartition(".")
        if part == "scales":
            lay = entry.layout
            modules[module] = {"group_size": lay.group_size, "bits": lay.bits,
                               **({"mode": lay.mode} if lay.mode != "affine" else {})}
            scale_dtypes.add(entry.dtype)
            if entry.how == "exact" and all(t.ggml_type in quants.SYMMETRIC_TYPES for t in entry.source):
                symmetric.append(module)
        elif part == "weight" and entry.layout is None and len(entry.shape) >= 2:
            modules[module] = False
            float_dtypes.append(entry.dtype)
    settings = [m for m in modules.values() if m]
    if settings:
        default = max(settings, key=lambda m: (settings.count(m), m["bits"]))
        quantization: dict[str, Any] = dict(default)
        quantization.update({module: m for module, m in sorted(modules.items()) if m != default})
        config["quantization"] = config["quantization_config"] = quantization
        config["torch_dtype"] = "float16" if scale_dtypes == {"F16"} else "float32"
        if symmetric:  # for the planner (stored_formats.CheckpointFormat.symmetric); other readers ignore the key
            config[quants.SYMMETRIC_KEY] = sorted(symmetric)
    elif float_dtypes:
        main = max(sorted(set(float_dtypes)), key=float_dtypes.count)
        config["torch_dtype"] = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(main, "float32")
    return config


def _write_weights(checkpoint, out_dir: Path, progress: bool, desc: str) -> None:
    """Every tensor, read as a rank would read it, into `model.safetensors` (or shards plus an index)."""
    names = sorted(checkpoint.tensors)
    shards: list[list[str]] = [[]]  # planned first (sizes are known up front) so files get their final names
    shard_bytes = 0
    for name in names:
        size = checkpoint.tensors[name].nbytes
        if shards[-1] and shard_bytes + size > MAX_SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total_size = 0
    with tqdm(total=len(names), desc=desc, unit="tensor", file=sys.stderr, disable=not progress) as bar:
        for file_name, shard in zip(files, shards):
            arrays = {}
            for name in shard:
                arrays[name] = checkpoint.read(name)
                weight_map[name] = file_name
                total_size += arrays[name].nbytes
                bar.update(1)
            safetensors_file.save(out_dir / file_name, arrays, metadata={"format": "mlx"})  # mappable (mapped_files.py)
            del arrays
    checkpoint.loaded(names)
    if len(shards) > 1:
        _write_json(out_dir / "model.safetensors.index.json",
                    {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))})


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
