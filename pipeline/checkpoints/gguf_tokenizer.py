"""The tokenizer a GGUF describes, rebuilt from its `tokenizer.ggml.*` metadata as transformers builds it
for `AutoTokenizer.from_pretrained(..., gguf_file=...)`: a `tokenizers.Tokenizer` (vocabulary, merges,
pre-tokenizer), and the tokenizer_config.json and generation_config.json settings (special tokens,
chat template, the ids that end a turn). The converter (gguf_convert.py) writes them as files; a GGUF read in
place gets them from `tokenizer_settings`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..util.errors import UserError
from .gguf_file import open_gguf
from .split_patterns import GPT2_REGEX_NAMES, PRE_TOKENIZER_SPLITS

# Tokens that end a chat turn. A GGUF names one eos id, often the pretraining one (or, in some
# files, a wrong one), so generation has to stop on these too.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


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
    # Here, not at the top: slow to import, and every rank imports this module (through tokenizer.py).
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
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # as in build_tokenizer

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
        splits = (split,) if isinstance(split, str) else split
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict[str, Any]):
    """SentencePiece BPE (tokenizer.ggml.model == "llama"), as transformers' LlamaTokenizer builds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # as in build_tokenizer

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


def tokenizer_settings(gguf_path: Path) -> tuple[Any, dict[str, Any]]:
    """(`tokenizers.Tokenizer`, keyword arguments of tokenizer.Tokenizer) for a GGUF file read in place
    (no tokenizer files on disk): what the tokenizer.json, tokenizer_config.json, config.json and
    generation_config.json of its conversion would give."""
    meta = open_gguf(gguf_path).metadata
    tokenizer = build_tokenizer(meta, gguf_path)
    tokenizer_config = build_tokenizer_config(meta)
    special = {key: tokenizer_config[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token")
               if tokenizer_config.get(key) is not None}
    eos = build_generation_config(meta)["eos_token_id"]
    return tokenizer, {"name": str(gguf_path), "chat_template": meta.get("tokenizer.chat_template"),
                     "special_tokens": special, "add_bos_token": tokenizer_config["add_bos_token"],
                     "extra_eos_ids": tuple(eos)}
