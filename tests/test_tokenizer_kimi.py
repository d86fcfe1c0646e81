"""Kimi K2 tokenizer folders (tiktoken.model + tokenizer_config.json + a Python tokenizer we must never run).

The reference for every id is computed independently: tiktoken.Encoding built directly from the rank file with
Kimi's published split pattern and special tokens, and the chat template rendered with plain jinja2. No internet:
the folder, its rank file and its template are made here.
"""

import base64
import json
import re
import sys
from collections import Counter
from pathlib import Path

import jinja2
import pytest
import tiktoken  # an install requirement: a missing tiktoken must fail these tests, not skip them
from tiktoken.load import load_tiktoken_bpe

import pipeline.checkpoints.tokenizer as tokenizer_module
from pipeline.checkpoints import split_patterns
from pipeline.util.errors import UserError
from pipeline.checkpoints.tokenizer import StreamingDetokenizer, Tokenizer

# pat_str of TikTokenTokenizer in moonshotai/Kimi-K2-Instruct's tokenization_kimi.py (also K2-Thinking, K2.5)
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Offsets from the base vocabulary size, as in Kimi-K2-Instruct's tokenizer_config.json (163584 + offset)
# and Kimi-K2-Thinking's <think> tokens. "special": false marks the tool-call markers, as there.
KIMI_SPECIALS = {
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|im_end|>", True), 3: ("<|im_user|>", True),
    4: ("<|im_assistant|>", True), 6: ("<|start_header_id|>", True), 7: ("<|end_header_id|>", True),
    9: ("[EOT]", True), 10: ("<|im_system|>", True),
    11: ("<|tool_calls_section_begin|>", False), 12: ("<|tool_calls_section_end|>", False),
    13: ("<|tool_call_begin|>", False), 14: ("<|tool_call_argument_begin|>", False), 15: ("<|tool_call_end|>", False),
    17: ("<|im_middle|>", True), 22: ("<think>", True), 23: ("</think>", True),
    254: ("[UNK]", True), 255: ("[PAD]", True),
}

# Written for these tests in the shape of Kimi K2's chat_template.jinja: a default system turn, role names (or a
# message's `name`) after <|im_user|>/<|im_assistant|>/<|im_system|>, tool calls and tool results, and the same
# kind of indentation the real one has (which leaves "\n    " inside a tool result).
KIMI_TEMPLATE = """\
{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
  {%- endif -%}
  {%- set role_name = message.get('name') or message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{ role_name }}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{ role_name }}<|im_middle|>
  {%- else -%}
    <|im_system|>{{ role_name }}<|im_middle|>
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
    {%- if message['content'] -%}{{ message['content'] }}{%- endif -%}
    <|tool_calls_section_begin|>
    {%- for call in message['tool_calls'] -%}
      <|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>{{ call['function']['arguments'] }}<|tool_call_end|>
    {%- endfor -%}
    <|tool_calls_section_end|>
  {%- elif message['role'] == 'tool' -%}
    ## Return of {{ message.tool_call_id }}
    {{ message['content'] }}
  {%- else -%}
    {{ message['content'] }}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""

TRAINING_TEXT = [
    "You are Kimi, an AI assistant created by Moonshot AI.",
    "The quick brown fox jumps over the lazy dog. Hello world! What's the weather like?",
    "你好，世界！今天天气很好。我们一起去公园散步吧。你好你好世界世界",
    "こんにちは世界 Здравствуй, мир! مرحبا بالعالم",
    "emoji: 😀👍🏽🇯🇵 😀😀 and ZWJ 👨‍👩‍👧",
    "def add(a, b):\n    return a + b\n\n",
    "user assistant system tool_call functions.get_weather:0 {\"city\": \"Beijing\"}",
    "1234567890 3.14159 2025",
] * 8

RAINBOW = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "你好，世界！今天天气很好。",
    "emoji: 😀👍🏽🇯🇵 and ZWJ 👨‍👩‍👧",
    "def f(x):\n\treturn x ** 2  # square\n",
    "mixed: naïve café — “quotes” 1234567 ½",
    "Здравствуй, мир! مرحبا بالعالم",
    "x你 12345 I'M HERE, they'll go",
]


def train_ranks(texts, n_merges=300):
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pairs (ties broken by the bytes)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter()
    for text in texts:
        for word in re.findall(r" ?\w+| ?[^\w\s]+|\s+", text):
            words[tuple(bytes([b]) for b in word.encode("utf-8"))] += 1
    for _ in range(n_merges):
        pairs = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    # Merges only a different split pattern could use: Latin letter + first byte of 你, and 1234 across
    # Kimi's three-digit groups. Kimi's pattern must never produce them.
    for token in (b"x\xe4", b"12", b"34", b"1234"):
        ranks.setdefault(token, len(ranks))
    return ranks


def make_kimi_folder(folder: Path, *, config=None, generation_config=None, **tokenizer_config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    ranks = train_ranks(TRAINING_TEXT)
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in by_rank]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    tcfg = {
        "added_tokens_decoder": {
            str(base + offset): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False, "special": special}
            for offset, (name, special) in KIMI_SPECIALS.items()},
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "clean_up_tokenization_spaces": False, "model_max_length": 1e30,
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    tcfg.update(tokenizer_config)
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg, ensure_ascii=False))
    (folder / "chat_template.jinja").write_text(KIMI_TEMPLATE)
    # Kimi-K2-Instruct: config.json says [EOS], generation_config.json says <|im_end|>
    config = {"model_type": "kimi_k2", "bos_token_id": base, "eos_token_id": base + 1} if config is None else config
    generation_config = {"eos_token_id": base + 2} if generation_config is None else generation_config
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps(generation_config))
    # The checkpoint's own tokenizer code: loading the folder must never run it
    (folder / "tokenization_kimi.py").write_text(
        "import pathlib\n"
        "pathlib.Path(__file__).with_name('EXECUTED').write_text('tokenization_kimi.py ran')\n"
        "raise RuntimeError('tokenization_kimi.py must never be imported')\n")
    return folder


@pytest.fixture(scope="module")
def kimi_folder(tmp_path_factory):
    return make_kimi_folder(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def kimi(kimi_folder):
    return Tokenizer.from_folder(kimi_folder)


@pytest.fixture(scope="module")
def reference(kimi_folder):
    """tiktoken.Encoding built directly, the way Kimi's TikTokenTokenizer builds it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")  # load_tiktoken_bpe would otherwise cache the file under /tmp
        ranks = load_tiktoken_bpe(str(kimi_folder / "tiktoken.model"))
    base = len(ranks)
    names = {base + offset: name for offset, (name, _) in KIMI_SPECIALS.items()}
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + 256)}
    return tiktoken.Encoding(name="reference", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def ref_ids(reference, text):
    return reference.encode(text, allowed_special="all")


def render_reference(messages, add_generation_prompt=True):
    """The template rendered with plain jinja2, set up as transformers sets up its renderer."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, separators=None: json.dumps(x, ensure_ascii=False, separators=separators)
    return env.from_string(KIMI_TEMPLATE).render(messages=messages, tools=None,
                                                add_generation_prompt=add_generation_prompt)


def base_size(reference):
    return reference.n_vocab - 256


# -- loading --------------------------------------------------------------------------------------------------

def test_folder_code_is_never_run(kimi_folder, kimi):
    assert not (kimi_folder / "EXECUTED").exists()
    assert "tokenization_kimi" not in sys.modules


def test_split_pattern_is_kimis():
    assert split_patterns.KIMI_PAT_STR == KIMI_PAT_STR


def test_special_tokens_and_vocab(kimi, reference):
    base = base_size(reference)
    assert kimi.vocab_size == reference.n_vocab == base + 256
    for offset, (name, _) in KIMI_SPECIALS.items():
        assert kimi.token_to_id(name) == base + offset
        assert kimi.encode(name) == [base + offset]  # special-token text encodes to the id (allowed_special="all")
        assert kimi.decode([base + offset]) == name
    # Ids the config leaves unnamed are reserved placeholders, as in Kimi's tokenizer
    assert kimi.token_to_id(f"<|reserved_token_{base + 5}|>") == base + 5
    assert kimi.decode([base + 200]) == f"<|reserved_token_{base + 200}|>"
    assert kimi.token_to_id("<|not_a_token|>") is None
    assert kimi.token_to_id("a") == ord("a") and kimi.token_to_id(" ") == 32
    assert kimi.bos_token == "[BOS]"


def test_eos_ids_include_im_end_and_eos(kimi, reference):
    base = base_size(reference)
    assert kimi.eos_token_ids == {base + 1, base + 2}  # [EOS] and <|im_end|>


def test_no_bos_is_added(kimi, reference):
    text = "Hello world"
    assert kimi.encode(text) == kimi.encode(text, add_special_tokens=False) == ref_ids(reference, text)
    assert kimi.prompt_ids(text, use_chat_template=False) == ref_ids(reference, text)


# -- encoding and decoding ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", RAINBOW + [" ".join(RAINBOW), "", "<|im_user|>user<|im_middle|>hi[EOS]<|im_end|>"])
def test_encode_matches_tiktoken_and_round_trips(kimi, reference, text):
    ids = kimi.encode(text)
    assert ids == ref_ids(reference, text)
    assert kimi.decode(ids) == text


def test_han_and_digit_rules_of_the_pattern(kimi, reference):
    # The rank file has "x\xe4" (x + the first byte of 你) and "1234": a pattern that kept Latin and Han, or four
    # digits, in one piece would use them. Kimi's pattern splits Han runs off and digits into groups of three.
    x_han, four_digits = reference.encode_single_token(b"x\xe4"), reference.encode_single_token(b"1234")
    for text in ("x你", "ax你好b", "1234", "12345678"):
        ids = kimi.encode(text)
        assert x_han not in ids and four_digits not in ids
        assert ids == ref_ids(reference, text)
    assert [kimi.decode([i]) for i in kimi.encode("1234")] == ["12", "3", "4"]


def test_byte_pieces_of_cjk_and_emoji(kimi):
    # Precondition for the streaming tests: characters the rank file has no whole token for (🙂 and 鸟 are not
    # in the training text) are spelled with tokens that are incomplete UTF-8 on their own
    ids = kimi.encode("你好🙂鸟", add_special_tokens=False)
    assert sum("\ufffd" in kimi.decode([i]) for i in ids) >= 4
    assert kimi.decode(ids) == "你好🙂鸟"


def test_decode_skip_special_tokens(kimi, reference):
    base = base_size(reference)
    ids = kimi.encode("<|im_assistant|>assistant<|im_middle|>ok<|tool_calls_section_begin|><|tool_call_begin|>"
                      "functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
                      "<|im_end|>")
    assert base + 2 in ids and base + 13 in ids
    # Tokens marked "special": false (the tool-call markers) stay, as transformers keeps them
    assert kimi.decode(ids, skip_special_tokens=True) == (
        "assistantok<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>")
    # Unnamed reserved ids are kept too: transformers never registers them as special tokens
    assert kimi.decode([base + 200, ord("a")], skip_special_tokens=True) == f"<|reserved_token_{base + 200}|>a"


def test_unknown_ids_are_dropped_by_decode(kimi):
    assert kimi.decode([ord("h"), kimi.vocab_size, 10**9, ord("i")]) == "hi"


def test_long_runs_are_cut_where_kimi_cuts(kimi, reference, monkeypatch):
    # Kimi encodes ordinary text in 400k-character chunks, and cuts runs longer than 25k all-space or
    # all-non-space characters; where it cuts changes the tokens. Shrink both limits to exercise the cuts.
    monkeypatch.setattr(tokenizer_module, "_KIMI_MAX_CHUNK", 120)
    monkeypatch.setattr(tokenizer_module, "_KIMI_MAX_RUN", 25)

    def kimi_pieces(text, chunk=120, run_limit=25):
        for start in range(0, len(text), chunk):
            part, run, piece_start = text[start:start + chunk], 0, 0
            is_space = part[0].isspace() if part else False
            for i, ch in enumerate(part):
                if ch.isspace() != is_space:
                    run, is_space = 1, ch.isspace()
                else:
                    run += 1
                    if run > run_limit:
                        yield part[piece_start:i]
                        piece_start, run = i, 1
            yield part[piece_start:]

    text = "x" + "the" * 20 + " " * 40 + "你好" * 20 + " end " + "ab" * 70
    expected = [i for piece in kimi_pieces(text) for i in reference.encode_ordinary(piece)]
    assert expected != reference.encode_ordinary(text)  # the cuts matter for this text
    assert kimi.encode(text) == expected
    assert kimi.decode(kimi.encode(text)) == text


# -- chat template --------------------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "你好！请介绍一下你自己。😀"}],
    [{"role": "user", "content": "Weather in Beijing?", "name": "alice"},
     {"role": "assistant", "content": "Let me check.", "tool_calls": [
         {"id": "functions.get_weather:0", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Beijing\"}"}}]},
     {"role": "tool", "name": "get_weather", "tool_call_id": "functions.get_weather:0", "content": "Sunny, 25°C"},
     {"role": "assistant", "content": "It is sunny.", "tool_calls": None},
     {"role": "user", "content": "Thanks <|im_end|> bye"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_prompt_matches_independent_render_and_encoding(kimi, reference, messages):
    text = kimi.apply_chat_template(messages)
    # transformers drops None-valued keys before rendering; so does the reference here
    expected_text = render_reference([{k: v for k, v in m.items() if v is not None} for m in messages])
    assert text == expected_text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>")
    assert ("You are Kimi, an AI assistant created by Moonshot AI." in text) == (messages[0]["role"] != "system")
    ids = kimi.encode(text, add_special_tokens=False)
    assert ids == ref_ids(reference, expected_text)
    base = base_size(reference)
    # One <|im_end|> per turn, plus any written in a message: Kimi's tokenizer turns special-token text anywhere
    # in the rendered prompt into the special id, user content included
    turns = len(messages) + (messages[0]["role"] != "system")
    assert ids.count(base + 2) == turns + sum(m["content"].count("<|im_end|>") for m in messages)
    assert ids[-1] == base + 17  # <|im_middle|> ends the generation prompt


def test_tool_turns_render_like_kimi(kimi):
    text = kimi.apply_chat_template(CONVERSATIONS[2])
    assert "<|im_user|>alice<|im_middle|>" in text  # a message's name replaces its role
    assert ("<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n    Sunny, 25°C<|im_end|>"
            in text)
    assert ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            "{\"city\": \"Beijing\"}<|tool_call_end|><|tool_calls_section_end|>") in text


@pytest.mark.parametrize("system", [None, "You answer in one word."])
def test_prompt_ids(kimi, reference, system):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hi 你好"}]
    ids = kimi.prompt_ids("Hi 你好", system=system)
    assert ids == ref_ids(reference, render_reference(messages))
    base = base_size(reference)
    assert ids[0] == base + 10 and base not in ids  # starts with <|im_system|>; no [BOS] anywhere


def test_template_in_tokenizer_config(tmp_path, reference):
    # Older Kimi-K2 revisions kept the template in tokenizer_config.json instead of chat_template.jinja
    folder = make_kimi_folder(tmp_path / "m", chat_template=KIMI_TEMPLATE)
    (folder / "chat_template.jinja").unlink()
    tok = Tokenizer.from_folder(folder)
    assert tok.prompt_ids("hello") == ref_ids(reference, render_reference([{"role": "user", "content": "hello"}]))


# -- streaming ------------------------------------------------------------------------------------------------

def stream(tok, ids, stop_strings=()):
    d = StreamingDetokenizer(tok, stop_strings)
    pieces = []
    for i in ids:
        pieces.append(d.add(i))
        if d.stopped:
            break
    else:
        pieces.append(d.finish())
    return d, pieces


def test_streaming_pieces_concatenate_to_decode(kimi):
    text = " ".join(RAINBOW) + "<|im_end|>" + "你好😀🙂鸟世界 the end"
    ids = kimi.encode(text, add_special_tokens=False)
    d, pieces = stream(kimi, ids)
    assert "".join(pieces) == kimi.decode(ids) == d.text == text
    assert not any("\ufffd" in p for p in pieces)


def test_streaming_holds_back_split_characters(kimi):
    ids = kimi.encode("a🙂b鸟c", add_special_tokens=False)
    assert sum("\ufffd" in kimi.decode([i]) for i in ids) >= 4
    _, pieces = stream(kimi, ids)
    assert "".join(pieces) == "a🙂b鸟c"
    assert "🙂" in pieces and "鸟" in pieces  # held back while incomplete, then emitted whole
    assert "" in pieces and not any("\ufffd" in p for p in pieces)


def test_streaming_stops_at_a_stop_string(kimi):
    ids = kimi.encode("Hello world! 你好世界 and more", add_special_tokens=False)
    d, pieces = stream(kimi, ids, stop_strings=["世界"])
    assert d.stopped and "".join(pieces) == d.text == "Hello world! 你好"


# -- choosing the backend, and errors -------------------------------------------------------------------------

def test_tokenizer_json_wins_when_both_are_there(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    folder = make_kimi_folder(tmp_path / "m")
    HFTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(folder / "tokenizer.json"))
    assert Tokenizer.from_folder(folder).vocab_size == 2


def test_missing_tokenizer_files(tmp_path):
    with pytest.raises(UserError, match=r"tokenizer\.json.*tiktoken\.model"):
        Tokenizer.from_folder(tmp_path)


@pytest.mark.parametrize("content, match", [
    ("YQ== 0\nYg==\n", "line 2"),                   # a line without a rank
    ("YQ== 0\nYg== x\n", "line 2"),                 # a rank that is not a number
    ("YQ== 0\nYg== 2\n", r"ranks should be 0\.\.1"),  # a gap: special ids would collide with ranks
    ("YQ== 0\nYg== 0\n", r"ranks should be 0\.\.1"),  # a rank used twice
    ("", "ranks should be"),                        # empty
])
def test_bad_rank_file(tmp_path, content, match):
    folder = make_kimi_folder(tmp_path / "m")
    (folder / "tiktoken.model").write_text(content)
    with pytest.raises(UserError, match=match):
        Tokenizer.from_folder(folder)


def test_bad_added_tokens_decoder(tmp_path):
    folder = make_kimi_folder(tmp_path / "m", added_tokens_decoder={"x": {"content": "[BOS]"}})
    with pytest.raises(UserError, match="added_tokens_decoder"):
        Tokenizer.from_folder(folder)


def test_kimi_k3_is_refused(tmp_path):
    folder = make_kimi_folder(tmp_path / "m", config={"model_type": "kimi_k3"})
    with pytest.raises(UserError, match="Kimi K3"):
        Tokenizer.from_folder(folder)
