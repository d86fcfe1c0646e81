"""Tool-call arguments streamed as the model writes them (pipeline.chat.tool_calls with
scan.JsonObjectScanner), for every tool-call format the parsers know.

The truth for each output is its whole-text parse done without the streaming machinery: each
call's text between its markers given to the format's own `parse` (what the parser passed on
before arguments streamed). Each output is fed in random splits (seeded), one character at a time
and cut at every place inside every marker: the events joined must be that parse, the arguments
must go out in pieces before the call's end marker arrives, and the Chat Completions chunks,
put together by the official `openai` client's own stream accumulator, must equal the
non-streamed response. The outputs are written as the published templates and model cards
write calls: nested JSON, strings with braces, quotes, escapes and non-ASCII text, several
calls, text before and after.
"""

from __future__ import annotations

import json
import random

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from pipeline.chat.events import ToolCallArguments, ToolCallEnd, ToolCallStart
from pipeline.chat.output import ChatOutputParser
from pipeline.chat.scan import JsonObjectScanner, dump_json, read_json
from pipeline.chat.tool_calls import (ALL_FORMATS, DEEPSEEK_SEP, DEEPSEEK_V3, DEEPSEEK_V31, FORMATS, HEAD_LIMIT,
                                      KIMI_ARGUMENT_BEGIN, KIMI_K2, MARKUP_FORMATS, QWEN)
from pipeline.runtime.requests import Finished, Tokens
from pipeline.serve.adapters import ChatAdapter
from test_chat_parsers import TOOL_CASES, call, ids, message_of, stream_tokens
from test_chat_parsers import deepseek_folder, deepseek_v3, kimi  # noqa: F401 (fixtures: the real tokenizers)
from test_tool_call_formats import CASES as MARKUP_CASES, check_events, cuts_of

# A long call's arguments, as a model writes them: a file with code in it (braces, quotes,
# backslashes, newlines as escapes), escaped and literal non-ASCII text, nested objects and lists
# (and the first characters of each format's end marker: text, once the next character shows it)
SOURCE = 'def main():\n    print("{}: {}".format(\'a}\', "b{"))  # \\ </tool_call <|tool_call_end <｜tool▁call▁end\n' * 3
LONG = {"path": "src/app/\"quoted\" {name}.py", "content": SOURCE, "encoding": "utf-8",
        "note": "café ☕ 北京 😀", "options": {"overwrite": True, "mode": None, "ratio": 0.25, "limit": -12,
                                           "tags": ["a", ["b", {}], {"c": []}]}}
LONG_RAW = json.dumps(LONG, ensure_ascii=False)
LONG_ASCII = json.dumps(LONG)                              # \u00e9, \ud83d\ude00 ... as escapes
LONG_COMPACT = json.dumps(LONG, separators=(",", ":"))     # Qwen re-serializes this one
SMALL = '{"query": {"text": "a } b \\" c", "k": [1, 2.5e3, true]}, "n": 3}'

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def ds_v3(name, args):
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def ds_v31(name, args):
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


def kimi_call(name, args, i):
    return f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def qwen(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


# (output, its content); the calls are the reference parse's
CASES = {
    DEEPSEEK_V3: [
        ("I'll write the file." + DS_BEGIN + ds_v3("write_file", LONG_RAW) + "\n" + ds_v3("search", SMALL) + DS_END,
         "I'll write the file."),
        (DS_BEGIN + ds_v3("write_file", LONG_ASCII) + DS_END, None),
    ],
    DEEPSEEK_V31: [
        (DS_BEGIN + ds_v31("write_file", LONG_RAW) + ds_v31("search", SMALL) + DS_END, None),
        ("Checking.\n\n" + DS_BEGIN + ds_v31("write_file", " " + LONG_ASCII + "\n") + DS_END + "Done.",
         "Checking.\n\nDone."),
    ],
    KIMI_K2: [
        ("Let me look.<|tool_calls_section_begin|>" + kimi_call("write_file", LONG_RAW, 0) + kimi_call("search", SMALL, 1)
         + "<|tool_calls_section_end|>", "Let me look."),
        ("<|tool_calls_section_begin|> " + kimi_call("write_file", LONG_ASCII, 0) + " <|tool_calls_section_end|>", None),
    ],
    QWEN: [
        ("Sure.\n" + qwen("write_file", LONG_RAW) + "\n" + qwen("search", SMALL), "Sure.\n"),
        (qwen("write_file", LONG_COMPACT) + "\n" + qwen("search", '{"x":1E2,"y":-0,"z":1.50,"w":"\\u00e9\\ud83d\\ude00"}'),
         None),
        ('<tool_call>\n{"name":"write_file","arguments":' + LONG_ASCII + '}\n</tool_call>\nWriting it now.',
         "Writing it now."),  # blank space after calls is dropped
    ],
}
LONG_CASES = {fmt: cases[0][0] for fmt, cases in CASES.items()}  # each has a long call to stream


def test_every_format_has_cases():
    assert set(CASES) == set(FORMATS) == set(TOOL_CASES)


def reference(fmt, text: str) -> list[dict]:
    """The calls in `text` as the format's whole-call parse reads each one (every call in these
    outputs is well-formed)."""
    calls, at = [], 0
    while (begin := text.find(fmt.call_begin, at)) >= 0:
        end = text.index(fmt.call_end, begin)
        parsed = fmt.parse(text[begin + len(fmt.call_begin):end])
        assert parsed is not None, text[begin:end]
        calls.append(call(parsed.name, parsed.arguments, parsed.id or f"call_{len(calls)}"))
        at = end + len(fmt.call_end)
    return calls


def parse_events(pieces, fmt) -> list:
    parser = ChatOutputParser(in_reasoning=None, tool_format=fmt, new_id=ids())
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def splits(text: str, fmt, seed: int, count: int = 60):
    """The format's output cut as cuts_of does, at its markers."""
    return cuts_of(text, [m for m in (fmt.call_begin, fmt.call_end, fmt.section_begin, fmt.section_end, DEEPSEEK_SEP,
                                      KIMI_ARGUMENT_BEGIN) if m], seed, count)


@pytest.mark.parametrize("fmt,text,content", [(f, *case) for f, cases in CASES.items() for case in cases]
                         + [(f, case[0], case[1]) for f, cases in TOOL_CASES.items() for case in cases],
                         ids=lambda v: v.name if hasattr(v, "parse") else None)
def test_streamed_calls_join_to_the_whole_parse(fmt, text, content):
    want = reference(fmt, text)
    assert want
    for pieces in splits(text, fmt, seed=len(text)):
        events = parse_events(pieces, fmt)
        check_events(events)
        message = message_of(events)
        assert (message.content, message.tool_calls) == (content, want), pieces


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_arguments_stream_before_the_end_marker(fmt):
    """Fed one character at a time, a long call's arguments go out in many pieces, all of them
    before its end marker has arrived; nothing is sent that is not part of them."""
    text = LONG_CASES[fmt]
    parser = ChatOutputParser(in_reasoning=None, tool_format=fmt, new_id=ids())
    end_at = text.index(fmt.call_end)
    sent, pieces, started_at = "", 0, None
    for i, char in enumerate(text[:end_at]):
        for event in parser.feed(char):
            if isinstance(event, ToolCallStart):
                started_at = i
            elif isinstance(event, ToolCallArguments) and event.index == 0:
                sent += event.text
                pieces += 1
            assert not isinstance(event, ToolCallEnd)
    whole = reference(fmt, text)[0]["function"]["arguments"]
    assert started_at == text.index("{", text.index("write_file"))  # started at its arguments' first character
    assert pieces > 50 and sent == whole
    assert len(json.loads(whole)["content"]) == len(SOURCE)


def test_only_what_is_certain_goes_out():
    """A possible end marker's first characters wait; an unfinished number waits where Qwen's
    arguments are re-serialized (1E2 is written 100.0 once whole); a string's characters do not."""
    parser = ChatOutputParser(in_reasoning=None, tool_format=KIMI_K2, new_id=ids())
    head = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
    assert parser.feed(head + '{"a": "x<|tool_c') == [ToolCallStart(0, "functions.f:0", "f"),
                                                     ToolCallArguments(0, '{"a": "x')]
    assert parser.feed('ount|> y"}') == [ToolCallArguments(0, '<|tool_count|> y"}')]  # it was text
    assert parser.feed("<|tool_call_end|>") == [ToolCallEnd(0)]

    parser = ChatOutputParser(in_reasoning=None, tool_format=QWEN, new_id=ids())
    assert parser.feed('<tool_call>{"name": "f", "arguments": {"n":1E') == [
        ToolCallStart(0, "call_0", "f"), ToolCallArguments(0, '{"n": ')]
    assert parser.feed('2,"s":"a\\u00') == [ToolCallArguments(0, '100.0, "s": "a')]
    assert parser.feed('e9\\ud83d') == [ToolCallArguments(0, "é")]  # a surrogate waits for its other half
    assert parser.feed('\\ude00"}}</tool_call>') == [ToolCallArguments(0, '😀"}'), ToolCallEnd(0)]


def test_a_call_cut_off_by_max_tokens():
    """The output ends inside a call whose pieces went out: it ends there, incomplete, with the
    pieces sent; the chunk stream's finish_reason is `length`, the same in the plain response."""
    text = LONG_CASES[KIMI_K2]
    cut = text.index("<|tool_call_end|>") - 40
    chunks, adapter = stream_chunks(KIMI_K2, [text[:cut][i:i + 3] for i in range(0, cut, 3)], "length")
    events = parse_events([text[:cut]], KIMI_K2)
    assert events[-1] == ToolCallEnd(0, complete=False)
    sent = "".join(e.text for e in events if isinstance(e, ToolCallArguments))
    assert LONG_RAW.startswith(sent) and len(sent) > len(LONG_RAW) - 45
    with pytest.raises(openai.LengthFinishReasonError) as cut_off:  # the client's stream helper says so
        accumulate(chunks)
    final = cut_off.value.completion
    assert final.choices[0].finish_reason == "length"
    assert final.choices[0].message.tool_calls[0].function.arguments == sent
    assert adapter.response()["choices"][0]["finish_reason"] == "length"
    assert adapter.response()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == sent


def stream_chunks(fmt, pieces, reason="stop"):
    adapter = ChatAdapter("chatcmpl-1", 1, "m", str, False, False,
                          output=ChatOutputParser(in_reasoning=None, tool_format=fmt, new_id=ids()))
    chunks = adapter.opening()
    for i, piece in enumerate(pieces):
        chunks += adapter.tokens(Tokens(i, piece))
    chunks += adapter.finished(Finished(reason, "".join(pieces), "", prompt_tokens=5, completion_tokens=len(pieces),
                                        cached_tokens=0, queued_s=0.0, ttft_s=0.1, total_s=1.0))
    return chunks, adapter


def accumulate(chunks):
    """The chunks as the official `openai` client's stream helper (client.chat.completions.stream)
    puts them together."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion()


@pytest.mark.parametrize("fmt,text,content", [(f, *case) for f, cases in CASES.items() for case in cases],
                         ids=lambda v: v.name if hasattr(v, "parse") else None)
def test_openai_client_accumulates_the_chunks(fmt, text, content):
    want = reference(fmt, text)
    rng = random.Random(7)
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(text)), len(text) // 4))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        chunks, adapter = stream_chunks(fmt, pieces)
        assert sum(1 for c in chunks for d in [c["choices"][0]["delta"]] if c["choices"]
                   and (d.get("tool_calls") or [{}])[0].get("function", {}).get("arguments")) > 20
        message = accumulate(chunks).choices[0].message
        streamed = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}}
                    for c in message.tool_calls]
        plain = adapter.response()["choices"][0]
        assert plain["finish_reason"] == "tool_calls" and accumulate(chunks).choices[0].finish_reason == "tool_calls"
        assert streamed == plain["message"]["tool_calls"] == want
        assert (message.content or None) == plain["message"]["content"] == content


# -- the scanner against Python's json module ----------------------------------------------------------------------

def random_value(rng, depth=0):
    roll = rng.random()
    if depth < 3 and roll < 0.25:
        return {random_text(rng): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if depth < 3 and roll < 0.4:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return rng.choice([random_text(rng), rng.randint(-10**6, 10**6), rng.uniform(-1e9, 1e9), 1e300, -0.0, 0,
                       True, False, None, float("nan"), float("-inf")])


def random_text(rng):
    return "".join(rng.choice('ab "\\/{}[]:,\n\t\x01é\u2028😀<｜>') for _ in range(rng.randint(0, 8)))


def test_scanner_agrees_with_json():
    """Random objects written every way json can write them, some with one character changed:
    the scanner reads a whole object exactly where json.loads does, raw it gives the text as
    written, normalized what json.dumps writes (dump_json: repeated keys kept), and on any text
    only a prefix of what the whole would give."""
    rng = random.Random(0)
    checked = 0
    for _ in range(1500):
        value = {"k": random_value(rng)} if rng.random() < 0.5 else random_value(rng)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]),
                          separators=rng.choice([(",", ":"), (", ", ": "), (" ,\n", " :\t")]))
        if rng.random() < 0.3:
            at = rng.randrange(len(text))
            text = text[:at] + rng.choice('{}[]",:\\ x0-eE.') + text[at + 1:]
        try:
            whole = read_json(text)
            is_object = isinstance(json.loads(text), dict)
        except ValueError:
            is_object = False
        for normalize in (False, True):
            scanner = JsonObjectScanner(normalize)
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
            out = "".join(scanner.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)]))
            if is_object:
                checked += 1
                assert scanner.closed and not scanner.broken, text
                assert out == (dump_json(whole) if normalize else text.strip()), text
                if normalize and '"k"' not in out:  # no repeated keys: exactly json.dumps
                    assert out == json.dumps(json.loads(text), ensure_ascii=False)
            elif not normalize:
                assert text.lstrip().startswith(out), text
    assert checked > 1000
    # a repeated key: kept where it was, as the whole parse of a Qwen call keeps it
    assert dump_json(read_json('{"a":1,"a":{"a":2}}')) == '{"a": 1, "a": {"a": 2}}'
    assert QWEN.parse('{"name": "f", "arguments": {"a":1,"a":2}}').arguments == '{"a": 1, "a": 2}'


@pytest.mark.parametrize("text", ['{"a": "\x01"}', '{"a": 01}', '{"a": tru}', '{"a": "\\x"}', '{"a" 1}', '[1]',
                                  '{"a": 1,}', '{"a": "\\u12G4"}', '{"a": [}'])
def test_scanner_stops_where_json_breaks(text):
    for normalize in (False, True):
        scanner = JsonObjectScanner(normalize)
        out = "".join(scanner.feed(c) for c in text + " ")
        assert scanner.broken and not scanner.closed
        with pytest.raises((ValueError, AssertionError)):
            assert isinstance(json.loads(text), dict)
        assert normalize or text.startswith(out)


def test_formats_other_than_these_four_need_cases():
    """Every format the parsers know (ALL_FORMATS, what format_for_template can pick) must come with
    outputs: a JSON format (FORMATS, issue 23's) above, its head streaming and its parse deciding; a
    markup format (issue 36's) in test_tool_call_formats.py, which runs the same checks on them."""
    assert set(ALL_FORMATS) == set(FORMATS) | set(MARKUP_FORMATS)
    for fmt in ALL_FORMATS:
        assert fmt.head is not None
        assert fmt in CASES and fmt in LONG_CASES if fmt in FORMATS else fmt in MARKUP_CASES
    assert {DEEPSEEK_V3, DEEPSEEK_V31, KIMI_K2, QWEN} <= set(FORMATS)


def test_a_qwen_call_written_another_way_comes_whole_at_its_end():
    """Only `{"name": ..., "arguments": {...}}` streams; keys the other way round, or arguments as a
    JSON string, are read whole at the end marker, as before."""
    for text, arguments in [('{"arguments": {"a":1}, "name": "f"}', '{"a": 1}'),
                            ('{"name": "f", "arguments": "{\\"a\\":1}"}', '{"a":1}')]:
        parser = ChatOutputParser(in_reasoning=None, tool_format=QWEN, new_id=ids())
        assert parser.feed("<tool_call>\n" + text + "\n") == []
        assert parser.feed("</tool_call>") == [ToolCallStart(0, "call_0", "f"), ToolCallArguments(0, arguments),
                                              ToolCallEnd(0)]


def test_a_head_past_the_limit_does_not_stream_however_it_is_split():
    """Whether a call streams is decided by its first HEAD_LIMIT characters, wherever the pieces
    end: a name longer than that comes whole at the call's end, in every split."""
    name = "n" * (HEAD_LIMIT - 8)
    text = DS_BEGIN + ds_v31(name, SMALL) + DS_END
    before_end = text[:text.index(DEEPSEEK_V31.call_end)]
    for pieces in ([before_end], [before_end[:-30], before_end[-30:]], list(before_end)):
        parser = ChatOutputParser(in_reasoning=None, tool_format=DEEPSEEK_V31, new_id=ids())
        assert [e for piece in pieces for e in parser.feed(piece)] == []
        assert parser.feed(text[len(before_end):]) + parser.finish() == [
            ToolCallStart(0, "call_0", name), ToolCallArguments(0, SMALL), ToolCallEnd(0)]
    short = DS_BEGIN + ds_v31("n" * (HEAD_LIMIT - 20), SMALL) + DS_END  # its head fits: it streams
    assert any(isinstance(e, ToolCallArguments) for e in parse_events([short[:short.index(SMALL) + 5]], DEEPSEEK_V31))


@pytest.mark.parametrize("tokenizer,fmt", [("deepseek_v3", DEEPSEEK_V3), ("deepseek_v3", DEEPSEEK_V31), ("kimi", KIMI_K2)])
def test_real_tokens_stream_the_arguments(tokenizer, fmt, request):
    """A long call as the model's own tokenizer's tokens, decoded one at a time as the scheduler
    passes them on (markers are single tokens there): many pieces, all before the end marker's
    token, joined equal to the whole parse."""
    text = LONG_CASES[fmt]
    pieces = stream_tokens(request.getfixturevalue(tokenizer), text)
    end = pieces.index(fmt.call_end)
    events = parse_events(pieces[:end], fmt)
    sent = "".join(e.text for e in events if isinstance(e, ToolCallArguments) and e.index == 0)
    assert sent == reference(fmt, text)[0]["function"]["arguments"]
    assert sum(isinstance(e, ToolCallArguments) for e in events) > 50
    assert message_of(parse_events(pieces, fmt)).tool_calls == reference(fmt, text)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_arguments_too_deep_for_python_are_a_broken_call_not_an_error(fmt):
    """JSON nested deeper than Python's json module reads (its recursion limit): the whole parse
    says malformed, so the started call ends incomplete; the request does not fail."""
    deep = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
    text = {DEEPSEEK_V3: DS_BEGIN + ds_v3("f", deep) + DS_END, DEEPSEEK_V31: DS_BEGIN + ds_v31("f", deep) + DS_END,
            KIMI_K2: "<|tool_calls_section_begin|>" + kimi_call("f", deep, 0) + "<|tool_calls_section_end|>",
            QWEN: qwen("f", deep)}[fmt]
    events = parse_events([text], fmt)
    assert events[-1] == ToolCallEnd(0, complete=False)
    assert "".join(e.text for e in events if isinstance(e, ToolCallArguments)) == deep
