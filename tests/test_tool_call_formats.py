"""The tool-call formats whose arguments are markup with every value as text (pipeline.chat.tool_calls
MARKUP_FORMATS, read by chat/markup_arguments.py): Qwen3-Coder / Qwen3.5's `<function=...>` XML,
GLM-4.5 to GLM-5's `<arg_key>`/`<arg_value>`, MiniMax-M2's `<minimax:tool_call>`, DeepSeek V3.2's
and V4's DSML.

As in test_tool_call_streaming.py: each output, as the publishers' templates and encoding scripts
write calls, is fed whole, in random splits, one character at a time and cut at every place inside
every marker; the events joined must be the expected calls exactly (the JSON text the whole parse
gives, `dump_json`'s spelling), and a long string value must stream in many pieces before its
closing tag. Values are typed from the request's tool schemas. The templates' call-writing parts are
the published ones (excerpts below, each naming its source), rendered with jinja2 as transformers
does: what they write, the parser reads back as the arguments they were given.
"""

from __future__ import annotations

import json
import random

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from conftest import write_tokenizer
from pipeline.chat.events import ContentDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from pipeline.chat.markup_arguments import tool_schemas, typed_value
from pipeline.chat.output import ChatMessage, ChatOutputParser
from pipeline.chat.tool_calls import (DSML_V4, DSML_V32, GLM, MARKUP_FORMATS, MINIMAX_M2, QWEN, QWEN_XML,
                                      format_for_template)
from test_chat_parsers import ids, message_of

TOOLS = [{"type": "function", "function": {"name": "write_file", "description": "Write a file", "parameters": {
    "type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
        "ratio": {"type": "number"}, "overwrite": {"type": "boolean"}, "options": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}}, "note": {"type": ["string", "null"]}}}}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}}]
SCHEMAS = tool_schemas(TOOLS)

# a file with code in it: braces, quotes, backslashes, markup-looking text, non-ASCII, blank lines
SOURCE = ('def main():\n    print("{}: {}".format(\'a}\', "b{"))  # \\ <parameter </arg_value </invoke\n'
          '\n    return "café ☕ 北京 😀"\n') * 3
WRITE = {"path": "src/app/\"quoted\" {name}.py", "content": SOURCE, "mode": 420, "ratio": 0.25, "overwrite": True,
         "options": {"encoding": "utf-8", "limits": [1, 2.5, None]}, "tags": ["a", "b"]}
SEARCH = {"query": "a < b > c", "limit": 3}
WRITE_STRIPPED = {**WRITE, "content": SOURCE.strip()}  # MiniMax's published parser strips every value


def value_text(value, python_str=False) -> str:
    """A value as the templates write it: a string as is, anything else as JSON (Qwen3-Coder's
    template writes scalars with Jinja's `string`: Python's True)."""
    if isinstance(value, str):
        return value
    return str(value) if python_str and not isinstance(value, (dict, list)) else json.dumps(value, ensure_ascii=False)


def qwen_xml(name, args, python_str=False):
    params = "".join(f"<parameter={k}>\n{value_text(v, python_str)}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def glm45(name, args):
    return f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{value_text(v)}</arg_value>\n"
                                             for k, v in args.items()) + "</tool_call>"


def glm47(name, args):
    return f"<tool_call>{name}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{value_text(v)}</arg_value>"
                                          for k, v in args.items()) + "</tool_call>"


def minimax(*calls):
    invokes = "".join(f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{value_text(v)}</parameter>\n'
                                                          for k, v in args.items()) + "</invoke>\n"
                      for name, args in calls)
    return f"<minimax:tool_call>\n{invokes}</minimax:tool_call>"


def dsml(block, *calls):
    """As encoding_dsv32.py / encoding_dsv4.py write calls (encode_arguments_to_dsml, tool_call_template,
    tool_calls_template), after the answer's text."""
    invokes = "\n".join(f'<｜DSML｜invoke name="{name}">\n' + "\n".join(
        f'<｜DSML｜parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">{value_text(v)}'
        f"</｜DSML｜parameter>" for k, v in args.items()) + "\n</｜DSML｜invoke>" for name, args in calls)
    return f"\n\n<｜DSML｜{block}>\n{invokes}\n</｜DSML｜{block}>"


def dumped(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


# (output, its content, the calls it holds)
CASES = {
    QWEN_XML: [
        ("I'll write it.\n\n" + qwen_xml("write_file", WRITE) + "\n" + qwen_xml("search", SEARCH), "I'll write it.\n\n",
         [("write_file", WRITE), ("search", SEARCH)]),
        (qwen_xml("search", {"query": "\nleading and trailing newlines\n\n", "limit": 2}) + "\nDone.", "Done.",
         [("search", {"query": "\nleading and trailing newlines\n\n", "limit": 2})]),
        (qwen_xml("write_file", {"path": "a", "overwrite": False, "mode": 7}, python_str=True), None,
         [("write_file", {"path": "a", "overwrite": False, "mode": 7})]),
        ("<tool_call>\n<function=search>\n</function>\n</tool_call>", None, [("search", {})]),
    ],
    GLM: [
        ("Let me write it." + glm45("write_file", WRITE) + "\n" + glm45("search", SEARCH), "Let me write it.",
         [("write_file", WRITE), ("search", SEARCH)]),
        (glm47("write_file", WRITE) + glm47("search", SEARCH), None, [("write_file", WRITE), ("search", SEARCH)]),
        ("<tool_call>search</tool_call>", None, [("search", {})]),
    ],
    MINIMAX_M2: [
        ("Writing the file.\n" + minimax(("write_file", WRITE_STRIPPED), ("search", SEARCH)), "Writing the file.\n",
         [("write_file", WRITE_STRIPPED), ("search", SEARCH)]),
        (minimax(("search", {"query": "\n  spaced out \t\n", "limit": " 2\n"})), None,
         [("search", {"query": "spaced out", "limit": 2})]),
        (minimax(("search", {"query": "<parameter name=\"x\"> is text in a value", "limit": 1})) + "\nAfter.", "After.",
         [("search", {"query": "<parameter name=\"x\"> is text in a value", "limit": 1})]),
    ],
    DSML_V4: [
        ("I'll write it." + dsml("tool_calls", ("write_file", WRITE), ("search", SEARCH)), "I'll write it.\n\n",
         [("write_file", WRITE), ("search", SEARCH)]),
    ],
    DSML_V32: [
        (dsml("function_calls", ("write_file", WRITE)), None, [("write_file", WRITE)]),
    ],
}


def test_every_markup_format_has_cases():
    assert set(CASES) == set(MARKUP_FORMATS)


def parse_events(pieces, fmt, tools=TOOLS) -> list:
    parser = ChatOutputParser(in_reasoning=None, tool_format=fmt, new_id=ids(), schemas=tool_schemas(tools))
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def expected_calls(calls):
    return [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": dumped(args)}}
            for i, (name, args) in enumerate(calls)]


def splits(text: str, fmt, seed: int, count: int = 25):
    """The markup format's output cut as cuts_of does, at its markers."""
    return cuts_of(text, {m for m in (fmt.call_begin, fmt.call_end, fmt.section_begin, fmt.section_end,
                                      "<function=", "</function>", fmt.markup.open_start, fmt.markup.open_end,
                                      fmt.markup.value_end, "</arg_key>") if m}, seed, count)


def cuts_of(text: str, markers, seed: int, count: int):
    """`count` random cuts (few and many), one character a piece, and every cut inside every marker."""
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.choice([2, 5, 20, 100, len(text) // 3])
        cuts = sorted(rng.sample(range(1, len(text)), min(n, len(text) - 1)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    yield list(text)
    for marker in markers:
        at = text.find(marker)
        while at >= 0:
            for i in range(1, len(marker)):
                yield [text[:at + i], text[at + i:]]
            at = text.find(marker, at + 1)


def check_events(events) -> None:
    """Each call: a start, its pieces (none empty), a complete end, in index order."""
    open_call, started = None, 0
    for event in events:
        if isinstance(event, ToolCallStart):
            assert open_call is None and event.index == started
            open_call, started = event.index, started + 1
        elif isinstance(event, ToolCallArguments):
            assert event.index == open_call and event.text
        elif isinstance(event, ToolCallEnd):
            assert event.index == open_call and event.complete
            open_call = None
        else:
            assert isinstance(event, ContentDelta) and event.text
    assert open_call is None


@pytest.mark.parametrize("fmt,text,content,calls", [(f, *case) for f, cases in CASES.items() for case in cases],
                         ids=lambda v: v.name if hasattr(v, "markup") else None)
def test_streamed_calls_join_to_the_expected_calls(fmt, text, content, calls):
    want = expected_calls(calls)
    whole = message_of(parse_events([text], fmt))
    assert (whole.content, whole.tool_calls) == (content, want)
    for pieces in splits(text, fmt, seed=len(text)):
        events = parse_events(pieces, fmt)
        check_events(events)
        message = message_of(events)
        assert (message.content, message.tool_calls) == (content, want), pieces


@pytest.mark.parametrize("fmt", MARKUP_FORMATS, ids=lambda f: f.name)
def test_a_long_string_streams_before_its_closing_tag(fmt):
    """Fed one character at a time, the file's content goes out in many pieces, all of them before
    the value's closing tag; the call starts at its name."""
    text = CASES[fmt][0][0]
    parser = ChatOutputParser(in_reasoning=None, tool_format=fmt, new_id=ids(), schemas=SCHEMAS)
    end = text.index(fmt.markup.value_end, text.index(SOURCE[:20]))
    sent, pieces, started = "", 0, False
    for char in text[:end]:
        for event in parser.feed(char):
            started |= isinstance(event, ToolCallStart)
            if isinstance(event, ToolCallArguments) and event.index == 0:
                sent, pieces = sent + event.text, pieces + 1
            assert not isinstance(event, ToolCallEnd)
    assert started and pieces > 100
    assert sent.startswith('{"path": ') and json.dumps(SOURCE.strip(), ensure_ascii=False)[:-1] in sent


@pytest.mark.parametrize("schema,text,value", [
    ({"type": "integer"}, "42", 42), ({"type": "integer"}, " 42\n", 42), ({"type": "number"}, "2.5e3", 2500.0),
    ({"type": "boolean"}, "true", True), ({"type": "boolean"}, "False", False),  # Qwen3-Coder writes Python's
    ({"type": "object"}, '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}), ({"type": "array"}, "[1, 2]", [1, 2]),
    ({"type": "string"}, "42", "42"), ({"type": "string"}, "true", "true"), ({"type": "string"}, '{"a": 1}', '{"a": 1}'),
    ({"type": ["string", "null"]}, "null", None), ({"type": ["string", "null"]}, "7", "7"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "7", 7),
    ({"type": "integer"}, "seven", "seven"), ({"type": "integer"}, "[7]", "[7]"),  # not what it says: the text
    ({"type": "boolean"}, "1", "1"),
    (None, "3", 3), (None, "hello", "hello"), ({}, '["x"]', ["x"]), ({"description": "no type"}, "null", None),
])
def test_values_are_typed_from_the_schema(schema, text, value):
    assert json.loads(typed_value(text, schema)) == value
    assert typed_value(text, schema) == json.dumps(value, ensure_ascii=False)


def test_values_typed_in_every_format():
    """The same call in each format: integers, numbers, booleans, objects and arrays as JSON where
    the schema says so, strings kept (even one that reads as a number), unknown keys as JSON
    where they read as JSON; without the request's tools, values that read as JSON are JSON."""
    args = {"path": "123", "mode": 5, "ratio": 1.5, "overwrite": False, "options": {"x": [1]}, "tags": ["7"],
            "note": "null", "extra": 9, "other": "free text"}
    want = {**args, "note": None}  # its schema allows null
    outputs = {QWEN_XML: qwen_xml("write_file", args), GLM: glm47("write_file", args),
               MINIMAX_M2: minimax(("write_file", args))}
    for fmt, text in outputs.items():
        call = message_of(parse_events([text], fmt)).tool_calls[0]["function"]
        assert call["arguments"] == dumped(want), fmt.name
        untyped = json.loads(message_of(parse_events([text], fmt, tools=None)).tool_calls[0]["function"]["arguments"])
        assert untyped == {**want, "path": 123}, fmt.name
    # DSML says each value's kind itself: string="true" is the text whatever it reads as
    text = dsml("tool_calls", ("write_file", args))
    assert message_of(parse_events([text], DSML_V4, tools=None)).tool_calls[0]["function"]["arguments"] == dumped(args)


def test_malformed_markup():
    """A call that breaks after its start ends incomplete with what was sent; one that never
    started stays text; a MiniMax or DSML call outside its section is text; a call cut off by
    max_tokens ends incomplete."""
    wrong_tag = "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameters>\n</function>\n</tool_call>"
    events = parse_events([wrong_tag], QWEN_XML)
    assert events == [ToolCallStart(0, "call_0", "search"),  # no </parameter>: the string goes on to the end
                      ToolCallArguments(0, '{"query": "x\\n</parameters>\\n</function>'), ToolCallEnd(0, complete=False)]
    no_name = "<tool_call>\n<function=>\n</function>\n</tool_call>"
    assert message_of(parse_events([no_name], QWEN_XML)).content == no_name
    bare = '<invoke name="search">\n<parameter name="query">x</parameter>\n</invoke>'
    assert parse_events([bare], MINIMAX_M2) == [ContentDelta(bare)]
    missing_end = glm47("search", SEARCH).replace("</arg_value></tool_call>", "</tool_call>")
    assert parse_events([missing_end], GLM)[-1] == ToolCallEnd(0, complete=False)
    cut = dsml("tool_calls", ("write_file", WRITE))
    cut = cut[:cut.index("</｜DSML｜parameter>", cut.index("content")) - 10]
    events = parse_events([cut], DSML_V4)
    assert events[-1] == ToolCallEnd(0, complete=False)
    sent = "".join(e.text for e in events if isinstance(e, ToolCallArguments))
    assert dumped(WRITE).startswith(sent) and len(sent) > len(SOURCE)  # the content's characters so far


# -- the published templates ---------------------------------------------------------------------------------------------

# Qwen3-Coder-480B-A35B-Instruct's chat_template (Apache-2.0; as llama.cpp's models/templates/Qwen3-Coder.jinja):
# its tool prompt and the part that writes an assistant's calls
QWEN3_CODER = """{{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}
{%- for tool_call in message.tool_calls %}
    {%- if tool_call.function is defined %}
        {%- set tool_call = tool_call.function %}
    {%- endif %}
    {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
    {%- if tool_call.arguments is defined %}
        {%- for args_name, args_value in tool_call.arguments|items %}
            {{- '<parameter=' + args_name + '>\\n' }}
            {%- set args_value = args_value if args_value is string else args_value | string %}
            {{- args_value }}
            {{- '\\n</parameter>\\n' }}
        {%- endfor %}
    {%- endif %}
    {{- '</function>\\n</tool_call>' }}
{%- endfor %}"""
# Qwen3.5's (Qwen3-Next's) chat_template: the same markup, objects and lists as JSON
QWEN3_5 = QWEN3_CODER.replace("args_value if args_value is string else args_value | string",
                              "args_value | tojson | safe if args_value is mapping or (args_value is sequence and "
                              "args_value is not string) else args_value | string")
# GLM-4.6's chat_template (MIT; llama.cpp's models/templates/GLM-4.6.jinja)
GLM_4_6 = """For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
...
</tool_call>
{% for tc in message.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\\n<tool_call>' + tc.name }}
{% set _args = tc.arguments or {} %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}"""
# GLM-4.7's and GLM-5's chat_template: no newlines inside a call
GLM_5 = """{% for tc in message.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{- '<tool_call>' + tc.name -}}
{% set _args = tc.arguments %}{% for k, v in _args.items() %}<arg_key>{{ k }}</arg_key><arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>{% endfor %}</tool_call>{% endfor %}"""
# MiniMax-M2's chat_template (modified MIT): its tool-call part
MINIMAX = """{%- set toolcall_begin_token = '<minimax:tool_call>' -%}
{%- set toolcall_end_token = '</minimax:tool_call>' -%}
{{- '\\n' ~ toolcall_begin_token ~ '\\n' }}
{%- for tool_call in message.tool_calls -%}
    {%- if tool_call.function %}
        {%- set tool_call = tool_call.function %}
    {%- endif %}
    {{- '<invoke name="' + tool_call.name + '">\\n' }}
    {%- if tool_call.arguments is defined and tool_call.arguments is mapping -%}
    {% set _args = tool_call.arguments %}
    {%- for k, v in _args|items %}
    {{- '<parameter name="' + k + '">' }}
    {{- v | tojson | string if v is not string else v }}
    {{- '</parameter>' }}
    {% endfor %}{%- endif -%}
    {{- '</invoke>' ~ '\\n' }}
{%- endfor -%}
{{- toolcall_end_token}}"""
# DeepSeek-V3.2's encoding_dsv32.py (MIT): its tool prompt's first lines
DSV32_TOOLS = ('You can invoke functions by writing a "<｜DSML｜function_calls>" block like the following as part of '
               'your reply to the user:\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="$FUNCTION_NAME">')
# Qwen2.5's (Hermes-style) chat_template: JSON calls
HERMES = ('For each function call, return a json object with function name and arguments within <tool_call></tool_call> '
          'XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>')


def render(template: str, calls) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, ensure_ascii=False, **kw: json.dumps(x, ensure_ascii=ensure_ascii, **kw)
    message = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}}
                                                   for n, a in calls]}
    return env.from_string(template).render(message=message)


def our_template(name: str) -> str:
    from importlib import resources
    return (resources.files("pipeline.checkpoints") / "templates" / name).read_text("utf-8")


def v4_template() -> str:
    return our_template("deepseek-v4.jinja")


def test_formats_detected_from_the_published_templates():
    """Qwen3-Coder's and Qwen3.5's templates hold `<tool_call>` too: they are not Hermes' JSON format."""
    assert "<tool_call>" in QWEN3_CODER and "<tool_call>" in QWEN3_5
    assert format_for_template(QWEN3_CODER) is QWEN_XML and format_for_template(QWEN3_5) is QWEN_XML
    assert format_for_template(HERMES) is QWEN
    assert format_for_template(GLM_4_6) is GLM and format_for_template(GLM_5) is GLM
    assert format_for_template(MINIMAX) is MINIMAX_M2
    assert format_for_template(v4_template()) is DSML_V4
    assert format_for_template(DSV32_TOOLS) is DSML_V32
    assert format_for_template(our_template("deepseek-v3.2.jinja")) is DSML_V32


SIMPLE = {"path": "notes/a b.md", "content": SOURCE, "mode": 644, "overwrite": True, "ratio": 0.5}


@pytest.mark.parametrize("template,fmt,args", [
    (QWEN3_CODER, QWEN_XML, SIMPLE),  # scalars only: its template writes Python's str() of anything else
    (QWEN3_5, QWEN_XML, WRITE), (GLM_4_6, GLM, WRITE), (GLM_5, GLM, WRITE), (MINIMAX, MINIMAX_M2, WRITE_STRIPPED),
], ids=["qwen3-coder", "qwen3.5", "glm-4.6", "glm-5", "minimax-m2"])
def test_what_the_published_template_writes_is_read_back(template, fmt, args):
    """An assistant's calls as the template writes them into the conversation (so the model was
    trained to write them so) parse back to the arguments they were rendered from, whole and split."""
    text = render(template, [("write_file", args), ("search", SEARCH)])
    text = text[text.index({QWEN_XML: "<tool_call>\n<function=write_file", GLM: "<tool_call>write_file",
                            MINIMAX_M2: "<minimax:tool_call>\n<invoke"}[fmt]):]  # the calls, not the tool prompt
    want = expected_calls([("write_file", args), ("search", SEARCH)])
    for pieces in [[text], list(text), *splits(text, fmt, seed=1, count=5)]:
        events = parse_events(pieces, fmt)
        check_events(events)
        assert message_of(events).tool_calls == want


def searches_turns() -> list[dict]:
    """The conversation the DeepSeek template tests render (a new list each time: a test may change
    it): a system prompt, a user turn, reasoning and two calls of `search`, their two results."""
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find cats."},
            {"role": "assistant", "content": "", "reasoning_content": "Search twice.", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "search", "arguments": SEARCH}},
                {"id": "b", "type": "function", "function": {"name": "search", "arguments": {"query": "dogs"}}}]},
            {"role": "tool", "tool_call_id": "a", "content": "3 cats"},
            {"role": "tool", "tool_call_id": "b", "content": "no dogs"}]


def test_deepseek_v4_template_writes_tools_calls_and_results_as_published(tmp_path):
    """Our V4 template (pipeline/checkpoints/templates) against V4's encoding_dsv4.py, worked by
    hand for a system prompt, tools, a user turn, an assistant's reasoning and two calls, their two
    results (one user turn of <tool_result> blocks), in thinking mode; and its calls parse back."""
    tokenizer = deepseek_tokenizer(tmp_path, "deepseek_v4")
    tools = TOOLS[1:]
    messages = searches_turns()
    prompt = tokenizer.apply_chat_template(messages, tools=tools, template_kwargs={"thinking": True})
    schema = json.dumps(tools[0]["function"], ensure_ascii=False)
    calls = dsml("tool_calls", ("search", SEARCH), ("search", {"query": "dogs"}))
    assert prompt == (
        "<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n\nYou have access to a set of tools to help answer the user's "
        'question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="$TOOL_NAME">\n<｜DSML｜parameter name="$PARAMETER_NAME" '
        'string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n<｜DSML｜invoke '
        'name="$TOOL_NAME2">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nString parameters should be specified '
        'as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in '
        'JSON format and set `string="false"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output '
        "your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, "
        "output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n"
        f"{schema}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
        "calls.\n<｜User｜>Find cats.<｜Assistant｜><think>Search twice.</think>" + calls + "<｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>3 cats</tool_result>\n\n<tool_result>no dogs</tool_result><｜Assistant｜><think>")
    assert tokenizer.renders_tools() and format_for_template(tokenizer.chat_template) is DSML_V4
    assert message_of(parse_events([calls], DSML_V4, tools)).tool_calls == expected_calls(
        [("search", SEARCH), ("search", {"query": "dogs"})])
    # chat mode: every turn closes its thinking at once
    chat = tokenizer.apply_chat_template(messages, tools=tools)
    assert "<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>" in chat and chat.endswith("<｜Assistant｜></think>")
    # arguments given as JSON text cannot be written one by one: a clear error, not a wrong prompt
    messages[2]["tool_calls"][0]["function"]["arguments"] = json.dumps(SEARCH)
    from pipeline.util.errors import UserError
    with pytest.raises(UserError, match="must be given as an object"):
        tokenizer.apply_chat_template(messages, tools=tools)


def deepseek_tokenizer(folder, model_type):
    """A tokenizer whose folder has no chat template: ours for the model type."""
    from pipeline.checkpoints.tokenizer import Tokenizer

    write_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return Tokenizer.from_folder(folder)


def test_deepseek_v32_template_writes_tools_calls_and_results_as_published(tmp_path):
    """Our V3.2 template against V3.2's encoding_dsv32.py (its render_message, worked by hand): the
    tools after the system prompt (render_tools), the calls as a `function_calls` block, their
    results as one <function_results> block after the assistant's turn (no user turn), which then
    opens <think> (thinking mode, after the last user message) or closes it; a V3.2 model gets it."""
    tokenizer = deepseek_tokenizer(tmp_path, "deepseek_v32")
    tools = TOOLS[1:]
    messages = searches_turns()
    system = (
        "<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\nYou have access to a set of tools you can use to answer the "
        "user's question.\nYou can invoke functions by writing a \"<｜DSML｜function_calls>\" block like the following "
        "as part of your reply to the user:\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"$FUNCTION_NAME\">\n"
        '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n'
        '</｜DSML｜invoke>\n<｜DSML｜invoke name="$FUNCTION_NAME2">\n...\n</｜DSML｜invoke>\n</｜DSML｜function_calls>\n'
        "String and scalar parameters should be specified as is without any escaping or quotes, while lists and "
        'objects should use JSON format. The "string" attribute should be set to "true" for string type parameters '
        'and "false" for other types (numbers, booleans, arrays, objects).\nIf the thinking_mode is enabled, then '
        "after function results you should strongly consider outputting a thinking block. Here is an example:\n"
        "<｜DSML｜function_calls>\n...\n</｜DSML｜function_calls>\n<function_results>\n...\n</function_results>\n"
        "<think>...thinking about results</think>\nHere are the functions available in JSONSchema format:\n"
        f"<functions>\n{json.dumps(tools[0]['function'], ensure_ascii=False)}\n</functions>\n")
    calls = dsml("function_calls", ("search", SEARCH), ("search", {"query": "dogs"}))
    results = "\n\n<function_results>\n<result>3 cats</result>\n<result>no dogs</result>\n</function_results>\n\n"
    prompt = tokenizer.apply_chat_template(messages, tools=tools, template_kwargs={"thinking": True})
    assert prompt == (system + "<｜User｜>Find cats.<｜Assistant｜><think>Search twice.</think>" + calls
                      + "<｜end▁of▁sentence｜>" + results + "<think>")
    assert tokenizer.apply_chat_template(messages, tools=tools) == (
        system + "<｜User｜>Find cats.<｜Assistant｜></think>" + calls + "<｜end▁of▁sentence｜>" + results + "</think>")
    # the answer and a new user turn: the results before it close the thinking, earlier reasoning is not written
    messages += [{"role": "assistant", "content": "3 cats, no dogs."}, {"role": "user", "content": "Thanks"}]
    assert tokenizer.apply_chat_template(messages, tools=tools, template_kwargs={"thinking": True}) == (
        system + "<｜User｜>Find cats.<｜Assistant｜></think>" + calls + "<｜end▁of▁sentence｜>" + results
        + "</think>3 cats, no dogs.<｜end▁of▁sentence｜><｜User｜>Thanks<｜Assistant｜><think>")
    # without a system message the tools open the prompt (as vLLM's V3.2 tokenizer puts them, in an empty one)
    assert tokenizer.apply_chat_template(messages[1:2], tools=tools) == (
        system.replace("Be brief.", "") + "<｜User｜>Find cats.<｜Assistant｜></think>")
    assert tokenizer.renders_tools() and format_for_template(tokenizer.chat_template) is DSML_V32
    assert message_of(parse_events([calls], DSML_V32, tools)).tool_calls == expected_calls(
        [("search", SEARCH), ("search", {"query": "dogs"})])
    from pipeline.util.errors import UserError
    with pytest.raises(UserError, match=r"messages\[1\]: a tool result without a call"):
        tokenizer.apply_chat_template([messages[1], messages[3]])


# Qwen3.5's template around the excerpt above: its tool prompt, then each turn, the calls argument by argument
QWEN3_5_TOOL_PROMPT, QWEN3_5_CALLS = QWEN3_5.split("\n", 1)
QWEN3_5_CHAT = ("{%- if tools %}<|im_start|>system\n# Tools" + QWEN3_5_TOOL_PROMPT + "<|im_end|>\n{% endif %}"
                "{%- for message in messages %}{%- if message.role == 'assistant' %}<|im_start|>assistant\n"
                "{{- message.content or '' }}" + QWEN3_5_CALLS + "<|im_end|>\n"
                "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{- message.content }}"
                "\n</tool_response><|im_end|>\n{%- else %}<|im_start|>{{ message.role }}\n{{- message.content }}"
                "<|im_end|>\n{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def a_call_and_its_result(arguments):
    """A conversation as a client sends it back: an assistant's call (`arguments` as given) and its result."""
    return [{"role": "user", "content": "Find cats."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3 cats"}]


@pytest.mark.parametrize("source", ["qwen3.5", "deepseek_v32", "deepseek_v4"])
def test_earlier_calls_reach_markup_templates_as_objects(source, tmp_path):
    """serve's one rendering step (prompts.chat_prompt_ids, for Chat Completions, Messages and
    Responses alike) gives a template that writes arguments one by one each earlier call's
    arguments as the object their JSON text holds: the prompt is the render of the objects (the
    text alone fails in these templates); the request's messages stay as sent; no arguments are
    `{}`; text that is not a JSON object is a 400 naming the call."""
    from pipeline.checkpoints.tokenizer import Tokenizer
    from pipeline.serve.prompts import chat_prompt_ids
    from pipeline.serve.protocol import APIError

    if source == "qwen3.5":
        write_tokenizer(tmp_path)
        (tmp_path / "chat_template.jinja").write_text(QWEN3_5_CHAT)
        tokenizer = Tokenizer.from_folder(tmp_path)
    else:
        tokenizer = deepseek_tokenizer(tmp_path, source)
    sent = a_call_and_its_result(json.dumps(SEARCH))
    rendered = tokenizer.apply_chat_template(a_call_and_its_result(SEARCH), tools=TOOLS)
    assert chat_prompt_ids(tokenizer, sent, 10**6, TOOLS) == tokenizer.encode(rendered, add_special_tokens=False)
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == json.dumps(SEARCH)
    written = {"qwen3.5": qwen_xml("search", SEARCH), "deepseek_v32": dsml("function_calls", ("search", SEARCH)),
               "deepseek_v4": dsml("tool_calls", ("search", SEARCH))}[source]
    assert written in rendered
    empty = tokenizer.apply_chat_template(a_call_and_its_result({}), tools=TOOLS)
    assert chat_prompt_ids(tokenizer, a_call_and_its_result(""), 10**6, TOOLS) == tokenizer.encode(
        empty, add_special_tokens=False)
    for bad in ['[1, 2]', '{"query": ']:
        with pytest.raises(APIError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: tool call "
                                           r"'call_1' \('search'\) has arguments that are not a JSON object") as e:
            chat_prompt_ids(tokenizer, a_call_and_its_result(bad), 10**6, TOOLS)
        assert e.value.status == 400 and e.value.param == "messages"


# Qwen2.5's chat_template (Apache-2.0): an assistant's calls, their arguments written with tojson
QWEN2_5 = ("{%- for message in messages %}{%- if message.role == 'assistant' %}<|im_start|>assistant\n"
           "{{- message.content or '' }}{%- for tool_call in message.tool_calls or [] %}"
           "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
           "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
           "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}<|im_end|>\n"
           "{%- else %}<|im_start|>{{ message.role }}\n{{- message.content }}<|im_end|>\n{%- endif %}{%- endfor %}")


@pytest.mark.parametrize("template,written", [
    ("deepseek-v3.1", 'search<｜tool▁sep｜>{"query":"cats",  "limit":3}<｜tool▁call▁end｜>'),
    (QWEN2_5, '<tool_call>\n{"name": "search", "arguments": {"query": "cats", "limit": 3}}\n</tool_call>'),
], ids=["deepseek-v3.1", "qwen2.5"])
def test_json_format_templates_get_what_they_print(template, written, tmp_path):
    """The JSON formats' templates, probed (prompts.wants_argument_objects): DeepSeek V3.1's published
    one writes a call's arguments text as is, and gets the client's text, spacing and all (an object
    there fails); Qwen2.5's writes them with tojson, and gets the object (the text would be a quoted
    string)."""
    from importlib import resources

    from pipeline.checkpoints.tokenizer import Tokenizer
    from pipeline.serve.prompts import chat_prompt_ids

    write_tokenizer(tmp_path)
    if template == "deepseek-v3.1":
        template = (resources.files("pipeline.chat") / "templates" / "deepseek-v3.1.jinja").read_text("utf-8")
    (tmp_path / "chat_template.jinja").write_text(template)
    tokenizer = Tokenizer.from_folder(tmp_path)
    sent = a_call_and_its_result('{"query":"cats",  "limit":3}')
    ids = chat_prompt_ids(tokenizer, sent, 10**6)
    rendered = tokenizer.decode(ids)
    assert written in rendered
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)


def test_the_request_tools_reach_the_parser():
    """ChatOutputParser.for_prompt (what serve's output_parser calls) types values from `tools`."""
    text = glm47("search", {"query": "42", "limit": 42})
    typed = ChatOutputParser.for_prompt(GLM_5, "<|assistant|>", True, new_id=ids(), tools=TOOLS)
    untyped = ChatOutputParser.for_prompt(GLM_5, "<|assistant|>", True, new_id=ids())
    assert message_of(typed.feed(text) + typed.finish()).tool_calls == expected_calls([("search", {"query": "42",
                                                                                                   "limit": 42})])
    assert json.loads(message_of(untyped.feed(text) + untyped.finish()).tool_calls[0]["function"]["arguments"]) == {
        "query": 42, "limit": 42}
    assert jinja2  # the renderer the templates above need


@pytest.mark.parametrize("template,prompt,fmt,calls_text", [
    (GLM_5 + "<think>", "<|user|>Write it.<|assistant|><think>", GLM, glm47("search", SEARCH)),
    (MINIMAX + "<think>", "]~b]user\nWrite it.[e~[\n]~b]ai\n<think>\n", MINIMAX_M2, minimax(("search", SEARCH))),
    (v4_template(), "<｜User｜>Write it.<｜Assistant｜><think>", DSML_V4, dsml("tool_calls", ("search", SEARCH))),
], ids=["glm-5", "minimax-m2", "deepseek-v4"])
def test_thinking_then_calls(template, prompt, fmt, calls_text):
    """These templates open the thinking in the prompt: the output's reasoning, up to `</think>`, is
    reasoning (a call written in it is thinking too), then the calls; split anywhere."""
    thought = "I should search " + calls_text.replace("\n", " ")[:40]
    text = thought + "\n</think>\n\n" + calls_text
    for pieces in [[text], list(text), *splits(text, fmt, seed=3, count=5)]:
        parser = ChatOutputParser.for_prompt(template, prompt, True, new_id=ids(), tools=TOOLS)
        message = ChatMessage()
        for piece in pieces:
            message.add(parser.feed(piece))
        message.add(parser.finish())
        assert message.reasoning == thought
        assert message.tool_calls == expected_calls([("search", SEARCH)]) and not (message.content or "").strip()


@pytest.mark.parametrize("fmt", MARKUP_FORMATS, ids=lambda f: f.name)
def test_openai_client_accumulates_the_chunks(fmt):
    """Chat Completions chunks of a markup call, put together by the official `openai` client's stream
    helper, are the calls of the plain response: the expected ones."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from pipeline.runtime.requests import Finished, Tokens
    from pipeline.serve.adapters import ChatAdapter

    text, content, calls = CASES[fmt][0]
    rng = random.Random(5)
    cuts = sorted(rng.sample(range(1, len(text)), len(text) // 4))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    adapter = ChatAdapter("chatcmpl-1", 1, "m", str, False, False,
                          output=ChatOutputParser(in_reasoning=None, tool_format=fmt, new_id=ids(), schemas=SCHEMAS))
    chunks = adapter.opening()
    for i, piece in enumerate(pieces):
        chunks += adapter.tokens(Tokens(i, piece))
    chunks += adapter.finished(Finished("stop", text, "", prompt_tokens=5, completion_tokens=len(pieces),
                                        cached_tokens=0, queued_s=0.0, ttft_s=0.1, total_s=1.0))
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.get_final_completion().choices[0]
    plain = adapter.response()["choices"][0]
    assert streamed.finish_reason == plain["finish_reason"] == "tool_calls"
    assert [{"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in streamed.message.tool_calls] == plain["message"]["tool_calls"] == expected_calls(calls)
    assert (streamed.message.content or None) == plain["message"]["content"] == content


@pytest.mark.parametrize("fmt", MARKUP_FORMATS, ids=lambda f: f.name)
def test_a_call_opened_for_the_model_reads_on(fmt):
    """markup_call_opening (a forced call's prefix), then the model's rest of the call: the call."""
    from pipeline.chat.tool_calls import markup_call_opening

    whole = {QWEN_XML: qwen_xml("search", SEARCH), GLM: glm45("search", SEARCH), MINIMAX_M2: minimax(("search", SEARCH)),
             DSML_V32: dsml("function_calls", ("search", SEARCH)), DSML_V4: dsml("tool_calls", ("search", SEARCH))}[fmt]
    opening = markup_call_opening(fmt, "search")
    assert whole.startswith(opening) and opening.startswith(markup_call_opening(fmt, None) + "search")
    parser = ChatOutputParser(in_reasoning=None, tool_format=fmt, new_id=ids(), schemas=SCHEMAS)
    events = parser.feed(opening)
    assert events[:1] == ([] if fmt is GLM else [ToolCallStart(0, "call_0", "search")])  # GLM's name ends at what follows
    assert message_of(events + parser.feed(whole[len(opening):]) + parser.finish()).tool_calls == expected_calls(
        [("search", SEARCH)])
    assert markup_call_opening(QWEN, "search") is None
