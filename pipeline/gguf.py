"""Convert a llama.cpp GGUF file into a Hugging Face-layout model folder.

The folder holds what the loader reads: `config.json`, `model.safetensors` (or shards plus an
index), `tokenizer.json`, `tokenizer_config.json` and `generation_config.json`.

Quantized GGUF tensors are not dequantized. Q4_0, Q4_1 and Q8_0 are all "scale * q + offset" per
block of 32 values with fp16 scale and offset, which is exactly MLX's affine quantization with
group size 32, so each block is repacked into MLX's layout without losing a bit:

    Q4_1: w = d * q + m         (q in 0..15)  -> scales = d, biases = m,     bits 4
    Q4_0: w = d * (q - 8)       (q in 0..15)  -> scales = d, biases = -8 d,  bits 4
    Q8_0: w = d * q             (q in -128..127, stored as q + 128)
                                              -> scales = d, biases = -128 d, bits 8

(-8 d and -128 d are exact in fp16: multiplying by a power of two only changes the exponent.)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .errors import UserError

GROUP_SIZE = 32  # every supported GGML block holds 32 values
MAX_SHARD_BYTES = 2_000_000_000

# GGUF architecture -> (HF model_type, HF architectures entry)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# Names llama.cpp gives the per-layer tensors -> the HF module path inside `model.layers.{i}`.
LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Tokens that end a chat turn. A GGUF names one eos id, often the pretraining one (or, in some
# files, a wrong one), so generation has to stop on these too.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`, the same table transformers uses when it
# loads a GGUF tokenizer (transformers/integrations/gguf/gguf_tokenizer_mapping.py), so that our
# tokenizer.json encodes exactly as `AutoTokenizer.from_pretrained(..., gguf_file=...)` does.
# A tuple is a sequence of splits, applied in turn as llama.cpp's regex lists are (llama-vocab.cpp).
# GPT2_REGEX_NAMES use GPT-2's own ByteLevel regex; any other name is refused, since a wrong split
# silently changes how prompts tokenize.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    # DeepSeek V3/R1 (llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM, as in their tokenizer.json):
    # digit groups of up to three, runs of CJK ideographs and kana, then the rest.
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # Kimi K2: Moonshot's tiktoken pattern (Han runs apart, o200k-style words; tokenizer.py's
    # _KIMI_PAT_STR, looked up when used), which llama.cpp's custom K2 splitter implements too; its
    # class intersections (&&) run in the tokenizers library's regex engine.
    "kimi-k2": "kimi",
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}


GPT2_REGEX_NAMES = (None, "default", "gpt2", "gpt-2", "smollm", "mpt", "olmo", "jais", "trillion", "granite-docling",
                    "phi-2")


class OutputExistsError(UserError):
    """The output folder already exists (possibly created by a concurrent conversion)."""


# ----------------------------------------------------------------------------------------------
# Entry point


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True) -> Path:
    """Convert `gguf_path` into an HF-layout model folder at `out_dir` and return `out_dir`.

    Everything is written into a temporary folder next to `out_dir` and renamed at the end, so a
    crash never leaves a half-written model. Raises OutputExistsError if `out_dir` exists and is not
    empty (also when another process finished first), UserError for any unusable input.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    reader = _open_gguf(gguf_path)
    meta = _read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(
            f"{gguf_path}: unsupported model architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise OutputExistsError(f"output folder {out_dir} already exists and is not empty: remove it or pick another")

    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        # llama3-style rope scaling: GGUF keeps only the per-dimension factors, not the parameters
        # (factor, low/high_freq_factor, original context) that an HF config needs.
        raise UserError(
            f"{gguf_path}: unsupported llama3-style rope scaling (rope_freqs.weight tensor); "
            "use the original Hugging Face model folder instead"
        )
    for tensor in tensors.values():
        if tensor.tensor_type.name not in _SUPPORTED_TYPES:
            raise UserError(
                f"{gguf_path}: tensor {tensor.name} has GGML type {tensor.tensor_type.name}, which is not "
                f"supported (supported: {', '.join(_SUPPORTED_TYPES)}); use a Q4_0, Q4_1, Q8_0, F16, BF16 or F32 GGUF"
            )
        hf_module_path(tensor.name, gguf_path)  # fail on unknown names before any work is done

    # Everything that can fail on bad metadata runs before the (slow) weight conversion.
    config = build_config(meta, tensors, gguf_path)
    tokenizer = build_tokenizer(meta, gguf_path)
    tokenizer_config = build_tokenizer_config(meta)
    generation_config = build_generation_config(meta)
    # llama.cpp permutes q/k rows only for llama-family models (qwen uses NEOX-style rope).
    unpermute_heads = (config["num_attention_heads"], config["num_key_value_heads"]) if arch == "llama" else None

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as err:
        raise UserError(f"cannot create the output folder {out_dir}: {err.strerror}") from err
    try:
        _write_weights(tensors, tmp_dir, unpermute_heads, progress, desc=f"converting {gguf_path.name}")
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


# ----------------------------------------------------------------------------------------------
# Reading the file


def _open_gguf(path: Path):
    import gguf

    if not path.is_file():
        raise UserError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise UserError(f"cannot read GGUF file {path}: {err.strerror}") from err
    if magic != b"GGUF":
        raise UserError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # truncated or corrupt files raise all kinds of errors in the reader
        raise UserError(f"cannot read GGUF file {path}: {_one_line(err)}") from err


def _read_metadata(reader) -> dict[str, Any]:
    """All key/value metadata as plain Python values (str, int, float, bool, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _float32(value) -> float:
    """A GGUF float32 as the short decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# config.json


def build_config(meta: dict[str, Any], tensors: dict, gguf_path: Path) -> dict[str, Any]:
    """The HF `config.json` for this GGUF (`tensors`: name -> gguf ReaderTensor)."""
    arch = meta["general.architecture"]

    def need(key: str):
        full = f"{arch}.{key}"
        if full not in meta:
            raise UserError(f"{gguf_path}: GGUF metadata lacks {full}; the file is incomplete or not a {arch} model")
        return meta[full]

    model_type, architecture = ARCHITECTURES[arch]
    name = f"{meta.get('general.name', '')} {meta.get('general.basename', '')}".lower()
    if arch == "llama" and "mistral" in name:
        # Mistral GGUFs use the llama architecture; HF's MistralConfig defaults to a 4096-token
        # sliding window that only v0.1 had, so state "none" explicitly.
        model_type, architecture = "mistral", "MistralForCausalLM"

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    if "token_embd.weight" not in tensors:
        raise UserError(f"{gguf_path}: no token_embd.weight tensor; the file is incomplete")
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # GGUF shapes are [in, out]

    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [architecture],
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _float32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "qwen2",
    }
    if model_type == "mistral":
        config["sliding_window"] = None
    for key, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{meta_key}" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{meta_key}"])

    rope_scaling = _rope_scaling(meta, arch, gguf_path)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling

    quantization = build_quantization(tensors)
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
        config["torch_dtype"] = "float16"  # the scales and biases are fp16
    else:
        dtypes = [t.tensor_type.name for t in tensors.values() if len(t.shape) == 2]
        main = max(set(dtypes), key=dtypes.count)
        config["torch_dtype"] = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[main]
    return config


def _rope_scaling(meta: dict[str, Any], arch: str, gguf_path: Path) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"type": "linear", "rope_type": "linear", "factor": _float32(factor)}
    if kind == "yarn":
        scaling = {"type": "yarn", "rope_type": "yarn", "factor": _float32(factor)}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise UserError(f"{gguf_path}: unsupported rope scaling type {kind!r} in the GGUF metadata")


# ----------------------------------------------------------------------------------------------
# Tensors

_QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_FLOAT_TYPES = ("F32", "F16", "BF16")
_SUPPORTED_TYPES = (*_QUANT_BITS, *_FLOAT_TYPES)


def hf_module_path(gguf_name: str, gguf_path: Path | str = "GGUF") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (and so on)."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in GLOBAL_TENSOR_NAMES and parts[1] == "weight":
        return f"{GLOBAL_TENSOR_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSOR_NAMES \
            and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{LAYER_TENSOR_NAMES[parts[2]]}.{parts[3]}"
    raise UserError(f"{gguf_path}: tensor {gguf_name!r} has no known Hugging Face name; this model layout is not supported")


def build_quantization(tensors: dict) -> dict[str, Any] | None:
    """mlx-lm style quantization config, or None when nothing is quantized.

    The most common bit width is the default; modules quantized differently get their own entry
    and 2-D weights left in float get `false`, so nothing is quantized that is not stored so.
    """
    bits_by_module: dict[str, int | None] = {}
    for tensor in tensors.values():
        if not tensor.name.endswith(".weight") or len(tensor.shape) != 2:
            continue  # norms and biases are never quantized
        module = hf_module_path(tensor.name).removesuffix(".weight")
        bits_by_module[module] = _QUANT_BITS.get(tensor.tensor_type.name)
    counts = [b for b in bits_by_module.values() if b is not None]
    if not counts:
        return None
    default_bits = max(sorted(set(counts)), key=counts.count)
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default_bits}
    for module, bits in bits_by_module.items():
        if bits is None:
            quantization[module] = False
        elif bits != default_bits:
            quantization[module] = {"group_size": GROUP_SIZE, "bits": bits}
    return quantization


def ggml_to_mlx_affine(raw: np.ndarray, ggml_type: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Repack GGML Q4_0/Q4_1/Q8_0 rows into MLX affine quantization (group size 32).

    `raw` is the GGUF data as the reader gives it: uint8 [rows, bytes_per_row]. Returns
    (weight uint32 [rows, cols*bits/32], scales fp16 [rows, cols/32], biases fp16 [rows, cols/32]),
    the layout `mx.quantize(w, group_size=32, bits=bits)` produces.
    """
    rows = raw.shape[0]
    if ggml_type == "Q4_1":
        blocks = raw.reshape(rows, -1, 20)  # fp16 d, fp16 m, 16 bytes of nibbles
        scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        biases = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        weight = _pack_nibbles(blocks[..., 4:])
    elif ggml_type == "Q4_0":
        blocks = raw.reshape(rows, -1, 18)  # fp16 d, 16 bytes of nibbles
        scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        biases = scales * np.float16(-8)
        weight = _pack_nibbles(blocks[..., 2:])
    elif ggml_type == "Q8_0":
        blocks = raw.reshape(rows, -1, 34)  # fp16 d, 32 signed bytes
        scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        biases = scales * np.float16(-128)
        # int8 q -> unsigned q + 128, which is flipping the top bit. MLX 8-bit packs 4 values per
        # uint32 with element j at bits 8*(j%4): the plain little-endian byte order.
        q = blocks[..., 2:] ^ np.uint8(0x80)
        weight = np.ascontiguousarray(q).reshape(rows, -1).view("<u4")
    else:
        raise ValueError(f"not a supported quantized GGML type: {ggml_type}")
    return weight, np.ascontiguousarray(scales), np.ascontiguousarray(biases)


def _pack_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML 4-bit block bytes [rows, blocks, 16] -> MLX 4-bit packed uint32 [rows, blocks*4].

    GGML: byte i of a block holds element i (low nibble) and element i+16 (high nibble).
    MLX: element j of a row sits in word j//8 at bits 4*(j%8); in little-endian bytes that is
    byte j//2, low nibble for even j, high nibble for odd j.
    """
    rows = qs.shape[0]
    values = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)  # [rows, blocks, 32] in order
    packed = values[..., 0::2] | (values[..., 1::2] << np.uint8(4))
    return np.ascontiguousarray(packed).reshape(rows, -1).view("<u4")


def unpermute_rows(a: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q_proj/k_proj row permutation.

    convert_hf_to_gguf.py interleaves the two rotary halves of each head for llama.cpp's rope:
    `w.reshape(n_heads, 2, head_dim // 2, ...).swapaxes(1, 2)`. Only rows move, so this works the
    same on float weights, packed quantized rows, scales, biases and bias vectors.
    """
    rows = a.shape[0]
    return a.reshape(n_heads, rows // n_heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _converted_arrays(tensor, unpermute_heads: tuple[int, int] | None) -> dict[str, np.ndarray]:
    """One GGUF tensor -> its HF-named arrays (three for a quantized weight; BF16 as raw uint16).

    `unpermute_heads`: (query heads, key/value heads) when q/k rows must be unpermuted.
    """
    name = hf_module_path(tensor.name)
    ggml_type = tensor.tensor_type.name
    if ggml_type in _QUANT_BITS:
        weight, scales, biases = ggml_to_mlx_affine(tensor.data, ggml_type)
        module = name.removesuffix(".weight")
        arrays = {name: weight, f"{module}.scales": scales, f"{module}.biases": biases}
    elif ggml_type == "BF16":  # the reader gives raw bytes; numpy has no bfloat16
        arrays = {name: np.ascontiguousarray(tensor.data).view("<u2")}
    else:
        arrays = {name: np.asarray(tensor.data)}

    if unpermute_heads is not None:
        heads, kv_heads = unpermute_heads
        if ".self_attn.q_proj." in name:
            arrays = {k: unpermute_rows(v, heads) for k, v in arrays.items()}
        elif ".self_attn.k_proj." in name:
            arrays = {k: unpermute_rows(v, kv_heads) for k, v in arrays.items()}
    return arrays


def _output_nbytes(tensor) -> int:
    if tensor.tensor_type.name in _QUANT_BITS:
        rows = int(np.prod(tensor.shape[1:]))
        cols = int(tensor.shape[0])
        return rows * cols * _QUANT_BITS[tensor.tensor_type.name] // 8 + 2 * rows * (cols // GROUP_SIZE) * 2
    return int(tensor.n_bytes)


def _write_weights(tensors: dict, out_dir: Path, unpermute_heads: tuple[int, int] | None,
                   progress: bool, desc: str) -> None:
    """Convert every tensor and save `model.safetensors`, or shards plus an index if large."""
    import mlx.core as mx
    from tqdm import tqdm

    # Plan the shards first (output sizes are known up front) so files get their final names.
    shards: list[list] = [[]]
    shard_bytes = 0
    for tensor in tensors.values():
        size = _output_nbytes(tensor)
        if shards[-1] and shard_bytes + size > MAX_SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(tensor)
        shard_bytes += size

    if len(shards) == 1:
        file_names = ["model.safetensors"]
    else:
        file_names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total_size = 0
    with tqdm(total=len(tensors), desc=desc, unit="tensor", file=sys.stderr, disable=not progress) as bar:
        for file_name, shard in zip(file_names, shards):
            arrays = {}
            for tensor in shard:
                for key, value in _converted_arrays(tensor, unpermute_heads).items():
                    if tensor.tensor_type.name == "BF16":
                        arrays[key] = mx.array(value).view(mx.bfloat16)
                    else:
                        arrays[key] = mx.array(value)
                    weight_map[key] = file_name
                    total_size += value.nbytes
                bar.update(1)
            mx.save_safetensors(str(out_dir / file_name), arrays, metadata={"format": "mlx"})
            del arrays
    if len(shards) > 1:
        _write_json(out_dir / "model.safetensors.index.json",
                    {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))})


# ----------------------------------------------------------------------------------------------
# Tokenizer


def _token_id(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    return None if value is None else int(value)


def _token_text(meta: dict[str, Any], key: str) -> str | None:
    token_id = _token_id(meta, key)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _add_bos_token(meta: dict[str, Any]) -> bool:
    # Like transformers: use the file's flag; sentencepiece ("llama") vocabularies without one get
    # BOS, as llama.cpp does for them.
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def build_tokenizer(meta: dict[str, Any], gguf_path: Path | str = "GGUF"):
    """A `tokenizers.Tokenizer` equivalent to the one the GGUF describes.

    Mirrors what transformers builds for `AutoTokenizer.from_pretrained(dir, gguf_file=...)`.
    """
    from tokenizers import AddedToken, processors

    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise UserError(f"{gguf_path}: the GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if model == "gpt2":
        tokenizer = _byte_level_bpe(meta, gguf_path)
        spelled = _byte_level_alphabet()
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(meta)
        spelled = None
    else:
        raise UserError(
            f"{gguf_path}: unsupported tokenizer model {model!r} (tokenizer.ggml.model); supported: 'gpt2', 'llama'"
        )

    # Control tokens (<|im_start|> ...) become special tokens and user-defined ones plain added
    # tokens, so text containing them maps to the single id rather than being cut into pieces. In
    # a byte-level vocabulary a "control" token outside the byte alphabet is a llama.cpp mislabel.
    token_types = meta.get("tokenizer.ggml.token_type") or []
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_CONTROL and (spelled is None or set(token) <= spelled)
    ]
    tokenizer.add_special_tokens(control)
    vocab = tokenizer.get_vocab()
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    tokenizer.add_tokens(user_defined)
    # The named special tokens are always special, whatever type the file gives them.
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    named = [_token_text(meta, k) for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")]
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(named) if t and t not in added])

    bos, eos = _token_text(meta, "bos_token_id"), _token_text(meta, "eos_token_id")
    add_bos = _add_bos_token(meta) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = ([(bos, _token_id(meta, "bos_token_id"))] if add_bos else []) + \
              ([(eos, _token_id(meta, "eos_token_id"))] if add_eos else [])
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    return tokenizer


def _byte_level_alphabet() -> set[str]:
    return set(_bytes_to_unicode().values())


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _byte_level_bpe(meta: dict[str, Any], gguf_path: Path | str = "GGUF"):
    """GPT-2 style byte-level BPE (tokenizer.ggml.model == "gpt2")."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (rare: some special tokens) are respelled byte by byte.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(meta["tokenizer.ggml.tokens"])
    }
    merges = [tuple(merge.split(" ")) for merge in meta.get("tokenizer.ggml.merges") or []]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                     continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre")
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None and pre not in GPT2_REGEX_NAMES:
        known = sorted(set(PRE_TOKENIZER_SPLITS) | {n for n in GPT2_REGEX_NAMES if n})
        raise UserError(f"{gguf_path}: the GGUF's pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not implemented, so "
                        f"its prompts would tokenize wrongly; implemented: {', '.join(known)}")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        if pre == "kimi-k2":
            from .tokenizer import _KIMI_PAT_STR as split
        splits = (split,) if isinstance(split, str) else split
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict[str, Any]):
    """SentencePiece BPE (tokenizer.ggml.model == "llama"), as transformers' LlamaTokenizer builds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    else:
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best token score first (transformers' `generate_merges`, so ties break the same way)."""
    merges = []
    for token, score in scores.items():
        pairs = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    merges.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def build_tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _add_bos_token(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": _token_text(meta, "bos_token_id"),
        "eos_token": _token_text(meta, "eos_token_id"),
        "unk_token": _token_text(meta, "unknown_token_id"),
        "pad_token": _token_text(meta, "padding_token_id"),
        "clean_up_tokenization_spaces": False,
    }
    arch = meta.get("general.architecture")
    if f"{arch}.context_length" in meta:
        config["model_max_length"] = int(meta[f"{arch}.context_length"])
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def build_generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """`eos_token_id` is a list: the file's eos, its end-of-turn/message ids, and the usual
    end-of-turn tokens found in the vocabulary."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos_ids = [_token_id(meta, key) for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    index = {token: i for i, token in enumerate(tokens) if token in END_OF_TURN_TOKENS}
    eos_ids += [index[token] for token in END_OF_TURN_TOKENS if token in index]
    config: dict[str, Any] = {"eos_token_id": list(dict.fromkeys(i for i in eos_ids if i is not None))}
    if _token_id(meta, "bos_token_id") is not None:
        config["bos_token_id"] = _token_id(meta, "bos_token_id")
    if _token_id(meta, "padding_token_id") is not None:
        config["pad_token_id"] = _token_id(meta, "padding_token_id")
    return config


# ----------------------------------------------------------------------------------------------
# The tokenizer of a GGUF read in place (no tokenizer files on disk)


class InMemoryTokenizerBackend:
    """tokenizer.py's backend interface (encode, decode, token_to_id, vocab_size) over a
    `tokenizers.Tokenizer` built from GGUF metadata."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def tokenizer_settings(gguf_path: Path) -> tuple[InMemoryTokenizerBackend, dict[str, Any]]:
    """(backend, keyword arguments of tokenizer.Tokenizer) for a GGUF file: what the tokenizer.json,
    tokenizer_config.json, config.json and generation_config.json of its conversion would give."""
    from .gguf_file import open_gguf

    meta = open_gguf(gguf_path).metadata
    backend = InMemoryTokenizerBackend(build_tokenizer(meta, gguf_path))
    tokenizer_config = build_tokenizer_config(meta)
    special = {key: tokenizer_config[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token")
               if tokenizer_config.get(key) is not None}
    eos = build_generation_config(meta)["eos_token_id"]
    return backend, {"name": str(gguf_path), "chat_template": meta.get("tokenizer.chat_template"),
                     "special_tokens": special, "add_bos_token": tokenizer_config["add_bos_token"],
                     "extra_eos_ids": tuple(eos)}
