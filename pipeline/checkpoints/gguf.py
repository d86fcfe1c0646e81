"""A llama.cpp GGUF file's metadata as Hugging Face files, and `convert`: a GGUF (or split set) into a
model folder.

Running a GGUF needs no conversion (gguf_checkpoint.py reads it in place); `convert` writes what that
reading gives (the same tensors, MLX-quantized where the GGUF's types map exactly or re-quantized where
they do not, config.json from the metadata) as safetensors, for those who want an MLX folder. This
module also builds the tokenizer a GGUF describes, for both: `tokenizer.json` (vocabulary, merges,
pre-tokenizer) and `tokenizer_config.json` (special tokens, chat template).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import quants
from ..util.errors import UserError

MAX_SHARD_BYTES = 2_000_000_000

# our model_type -> the Hugging Face `architectures` entry of config.json
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM"}

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


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True,
                 requantize_bits: int | None = None, group_size: int = 64) -> Path:
    """Convert `gguf_path` (a GGUF file, or any part of a split set) into an HF-layout model folder at
    `out_dir` and return `out_dir`. `requantize_bits`/`group_size`: the MLX layout of GGUF types MLX
    cannot hold exactly (as --quantize/--group-size when running the file).

    Everything is written into a temporary folder next to `out_dir` and renamed at the end, so a
    crash never leaves a half-written model. Raises OutputExistsError if `out_dir` exists and is not
    empty (also when another process finished first), UserError for any unusable input.
    """
    from .gguf_checkpoint import GGUFCheckpoint

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    checkpoint = GGUFCheckpoint(gguf_path, requantize_bits, group_size)  # every check on the input is here
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


# A converted folder lists under this key the modules held exactly from quants.SYMMETRIC_TYPES (their
# biases -2^(bits - 1) times their scales, which the int8 repack does not keep), for the planner.
SYMMETRIC_KEY = "pipeline_symmetric_modules"


def folder_config(checkpoint) -> dict[str, Any]:
    """config.json of the converted folder: the checkpoint's config, its `architectures` entry, and an
    mlx-lm style `quantization`: the most common (bits, group) by default, modules held otherwise
    with their own entry, float matrices `false`."""
    config = dict(checkpoint.config_dict)
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
        if symmetric:  # for the planner (plan.CheckpointFormat.symmetric); other readers ignore the key
            config[SYMMETRIC_KEY] = sorted(symmetric)
    elif float_dtypes:
        main = max(sorted(set(float_dtypes)), key=float_dtypes.count)
        config["torch_dtype"] = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(main, "float32")
    return config


def _write_weights(checkpoint, out_dir: Path, progress: bool, desc: str) -> None:
    """Every tensor, read as a rank would read it, into `model.safetensors` (or shards plus an index)."""
    from tqdm import tqdm

    from . import safetensors_file

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


def tokenizer_settings(gguf_path: Path) -> tuple[Any, dict[str, Any]]:
    """(backend, keyword arguments of tokenizer.Tokenizer) for a GGUF file: what the tokenizer.json,
    tokenizer_config.json, config.json and generation_config.json of its conversion would give."""
    from .gguf_file import open_gguf

    meta = open_gguf(gguf_path).metadata
    from .tokenizer import HFTokenizersBackend

    backend = HFTokenizersBackend(build_tokenizer(meta, gguf_path))
    tokenizer_config = build_tokenizer_config(meta)
    special = {key: tokenizer_config[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token")
               if tokenizer_config.get(key) is not None}
    eos = build_generation_config(meta)["eos_token_id"]
    return backend, {"name": str(gguf_path), "chat_template": meta.get("tokenizer.chat_template"),
                     "special_tokens": special, "add_bos_token": tokenizer_config["add_bos_token"],
                     "extra_eos_ids": tuple(eos)}
