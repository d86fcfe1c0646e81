"""The regexes that cut text into pieces before byte-level BPE merges them (pre-tokenizer splits):
llama.cpp's table by a GGUF's `tokenizer.ggml.pre` (gguf_tokenizer.py), and Kimi K2's tiktoken
pattern, which both its tiktoken.model folders (tokenizer.py) and its GGUFs use.
"""

from __future__ import annotations

# Kimi K2's pre-tokenizer split, the `pat_str` of TikTokenTokenizer in Moonshot's tokenization_kimi.py (the same in
# Kimi-K2-Instruct, -Thinking, K2.5 and Kimi-Linear): runs of Han characters are pieces of their own, then
# o200k-style letter runs (excluding Han), 1-3 digit groups, punctuation runs, newlines and other whitespace.
# Its character-class intersections (&&) need tiktoken's Rust regex; Python's `re` cannot run it.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

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
         "jina-v5-nano", "dbrx", "smaug-bpe", "glm4", "glm5"],  # GLM's: llama.cpp's CHATGLM4, the same regex
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
    # Kimi K2: Moonshot's tiktoken pattern (Han runs apart, o200k-style words: KIMI_PAT_STR above),
    # which llama.cpp's custom K2 splitter implements too; its class intersections (&&) run in the
    # tokenizers library's regex engine.
    "kimi-k2": KIMI_PAT_STR,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}


GPT2_REGEX_NAMES = (None, "default", "gpt2", "gpt-2", "smollm", "mpt", "olmo", "jais", "trillion", "granite-docling",
                    "phi-2")
