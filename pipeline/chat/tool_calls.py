"""A model's tool calls, parsed from its text as it streams, in each model family's own format as
its published chat template writes calls back into a conversation (and its docs describe them):

- DeepSeek V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{ARGS}\\n```
  <｜tool▁call▁end｜>` (more calls joined by a newline) `<｜tool▁calls▁end｜>`
- DeepSeek V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`
- Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{ARGS}
  <|tool_call_end|>...<|tool_calls_section_end|>` (Moonshot's docs/tool_call_guidance.md; the id
  `functions.NAME:IDX` is kept as the call's id, because Kimi's template writes it back as is)
- Qwen and Hermes-style templates: `<tool_call>\\n{"name": NAME, "arguments": {ARGS}}\\n</tool_call>`

and, with every value written as text (markup_arguments.py reads them into a JSON object, typed
from the request's tool schemas):

- Qwen3-Coder and Qwen3.5: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>` (their templates also hold `<tool_call>`: told from Hermes by `<function=`)
- GLM-4.5 to GLM-5: `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>...</tool_call>`
  (GLM-4.7 and later without the newlines)
- MiniMax-M2: `<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE</parameter>\\n...
  </invoke>\\n</minimax:tool_call>`
- DeepSeek V3.2 and V4 (DSML, their encoding_dsv32.py / encoding_dsv4.py): `<｜DSML｜function_calls>` (V3.2) or
  `<｜DSML｜tool_calls>` (V4), then `\\n<｜DSML｜invoke name="NAME">\\n<｜DSML｜parameter name="KEY"
  string="true|false">VALUE</｜DSML｜parameter>\\n...</｜DSML｜invoke>` per call and the section's end tag;
  `string="true"` values are the text, `string="false"` ones JSON

A call streams as the model writes it: ToolCallStart once its name is known and its arguments
have begun as a JSON object (`{`), then its arguments in ToolCallArguments pieces, each only text
that is certainly part of them (a possible end marker's first characters, and an unfinished number
or constant, wait for the next piece; nothing after the object closes), then ToolCallEnd. The
pieces joined are exactly the arguments the call's whole text parses to: the model's JSON text as
written (DeepSeek, Kimi: stripped, as the whole parse has it), or, for Qwen, whose whole parse
re-serializes the object, the same re-serialization token by token (scan.JsonObjectScanner).
A Qwen call written another way (keys in another order, arguments as a JSON string) is passed on
whole at its end marker. A markup call starts once its name is read; its arguments go out as
markup_arguments.py reads them (`{` at once, each key with its value, a string's characters as they
come), and its object closes at the arguments' closing tag or the call's end marker. Where a format
wraps its calls in a section (MiniMax, DSML), a call begins only inside one.

A call that never starts (no name, no JSON object after it, or a malformed start) is passed on as
plain text, markers and all, once it is known to be malformed or the output ends inside it, so the
text is never lost and a bad output never becomes an error. A call that started and then turns
out malformed (its JSON breaks, text follows it inside the markers, a new call or the section's
end comes before its end marker), or that the output ends inside (max_tokens), stays a call: the
pieces sent cannot be taken back, so it ends with ToolCallEnd(complete=False), its arguments the
pieces sent (a JSON object's beginning, or all of one), and the rest of its text is dropped.
Every decision depends only on the text before it, so any split of an output gives the same
events joined. Blank space before the first call (an answer's opening blank space) and between calls
is dropped; other text around them is the answer's text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

from .events import ContentDelta, Event, ToolCallArguments, ToolCallEnd, ToolCallStart
from .markup_arguments import NEWLINE, SPACE, Markup, MarkupArgumentsScanner, Schemas
from .scan import JsonObjectScanner, JsonPairs, dump_json, find_first, partial_tail, read_json


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str        # a JSON object, as text
    id: str | None = None  # the model's own id for the call, where its format has one


@dataclass(frozen=True)
class CallHead:
    """A call's beginning, read before its end: its name and where its arguments' `{` is."""
    name: str
    arguments_at: int
    id: str | None = None


# A call's text so far: its CallHead, None while that cannot be told yet, or NOT_STREAMED where the
# call will not stream (its whole text decides at its end marker)
NOT_STREAMED = False
HEAD_LIMIT = 1024  # a call whose head is not in its first this many characters does not stream


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    call_begin: str
    call_end: str
    section_begin: str | None    # formats that wrap their calls in a section
    section_end: str | None
    # a call's text between its markers, and the request's tool schemas: the call, or None when malformed
    parse: Callable[[str, Schemas | None], ParsedCall | None]
    head: Callable[[str], CallHead | None | bool]  # a call's text so far: CallHead, None or NOT_STREAMED
    normalizes: bool = False     # parse re-serializes the arguments (else they are the JSON text as written)
    markup: Markup | None = None  # arguments written as markup, from the head's arguments_at (else JSON)
    section_required: bool = False  # a call begins only inside a section

    def arguments_scanner(self, name: str, schemas: Schemas | None):
        """What reads the arguments of a call of tool `name` as they stream: `feed(text)` gives back
        pieces of their JSON text, `finish()` the last one at the call's end marker."""
        if self.markup is not None:
            return MarkupArgumentsScanner(self.markup, (schemas or {}).get(name))
        return JsonObjectScanner(self.normalizes)


def _json_object(text: str) -> str | None:
    """`text` when it is one JSON object (as the arguments must be), else None."""
    text = text.strip()
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # nested deeper than Python's json can read: malformed here
        return None
    return text if isinstance(value, dict) else None


def _good_name(name: str) -> bool:
    return bool(name) and not any(c.isspace() for c in name)


def _call(name: str, arguments: str | None, id: str | None = None) -> ParsedCall | None:
    name = name.strip()
    if arguments is None or not _good_name(name):
        return None
    return ParsedCall(name, arguments, id)


def _head(name: str, text: str, after: int, id: str | None = None) -> CallHead | None | bool:
    """The head of a call whose arguments come from `text[after:]`: known once their first
    character (after blank space) is there, and only a good name before a `{` streams."""
    rest = text[after:]
    stripped = rest.lstrip()
    if not stripped:
        return None
    if not _good_name(name.strip()) or stripped[0] != "{":
        return NOT_STREAMED
    return CallHead(name.strip(), after + len(rest) - len(stripped), id)


DEEPSEEK_SEP = "<｜tool▁sep｜>"
_DEEPSEEK_V3_HEAD = r"\s*function" + DEEPSEEK_SEP + r"([^\n]*)\n```(?:json)?\n"
_DEEPSEEK_V3_CALL = re.compile(_DEEPSEEK_V3_HEAD + r"(.*)\n```\s*", re.DOTALL)
_DEEPSEEK_V3_START = re.compile(_DEEPSEEK_V3_HEAD)


def _parse_deepseek_v3(text: str, schemas: Schemas | None = None) -> ParsedCall | None:  # JSON: typed as written
    match = _DEEPSEEK_V3_CALL.fullmatch(text)
    return _call(match[1], _json_object(match[2])) if match else None


def _head_deepseek_v3(text: str) -> CallHead | None | bool:
    match = _DEEPSEEK_V3_START.match(text)
    return _head(match[1], text, match.end()) if match else None


def _parse_deepseek_v31(text: str, schemas: Schemas | None = None) -> ParsedCall | None:  # JSON: typed as written
    name, sep, arguments = text.partition(DEEPSEEK_SEP)
    return _call(name, _json_object(arguments)) if sep else None


def _head_deepseek_v31(text: str) -> CallHead | None | bool:
    name, sep, _ = text.partition(DEEPSEEK_SEP)
    return _head(name, text, len(name) + len(sep)) if sep else None


KIMI_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
_KIMI_ID = re.compile(r"(?:functions\.)?([^\s:]+):\d+")


def _parse_kimi_k2(text: str, schemas: Schemas | None = None) -> ParsedCall | None:  # JSON: typed as written
    call_id, sep, arguments = text.partition(KIMI_ARGUMENT_BEGIN)
    call_id = call_id.strip()
    match = _KIMI_ID.fullmatch(call_id)
    return _call(match[1], _json_object(arguments), call_id) if sep and match else None


def _head_kimi_k2(text: str) -> CallHead | None | bool:
    call_id, sep, _ = text.partition(KIMI_ARGUMENT_BEGIN)
    if not sep:
        return None
    match = _KIMI_ID.fullmatch(call_id.strip())
    return _head(match[1], text, len(call_id) + len(sep), call_id.strip()) if match else NOT_STREAMED


def _parse_qwen(text: str, schemas: Schemas | None = None) -> ParsedCall | None:  # JSON: typed as written
    try:
        call = read_json(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, JsonPairs):
        return None
    fields = dict(call)  # a repeated key's last value, as json.loads has it
    if not isinstance(fields.get("name"), str):
        return None
    arguments = fields.get("arguments", JsonPairs())
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _json_object(arguments)
        return _call(fields["name"], arguments)
    if not isinstance(arguments, JsonPairs):
        return None
    # written as json.dumps writes the object, but with a repeated key kept (as streaming sent it)
    return _call(fields["name"], dump_json(arguments))


_SPACE = r"[ \t\n\r]*"  # JSON's blank space
_QWEN_START = re.compile(_SPACE + r"\{" + _SPACE + r'"name"' + _SPACE + ":" + _SPACE + r'("(?:[^"\\]|\\.)*")'
                         + _SPACE + "," + _SPACE + r'"arguments"' + _SPACE + ":" + _SPACE)


def _head_qwen(text: str) -> CallHead | None | bool:
    """Streams only the way the model card and template write a call: name first, then the
    arguments as an object."""
    match = _QWEN_START.match(text)
    if not match or match.end() == len(text):
        return None
    try:
        name = json.loads(match[1])
    except ValueError:
        return NOT_STREAMED
    return _head(name, text, match.end()) if text[match.end()] == "{" else NOT_STREAMED


DEEPSEEK_V3 = ToolCallFormat("deepseek_v3", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                             "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _parse_deepseek_v3, _head_deepseek_v3)
DEEPSEEK_V31 = ToolCallFormat("deepseek_v31", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                              "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _parse_deepseek_v31,
                              _head_deepseek_v31)
KIMI_K2 = ToolCallFormat("kimi_k2", "<|tool_call_begin|>", "<|tool_call_end|>",
                         "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", _parse_kimi_k2, _head_kimi_k2)
QWEN = ToolCallFormat("qwen", "<tool_call>", "</tool_call>", None, None, _parse_qwen, _head_qwen, normalizes=True)
FORMATS = (DEEPSEEK_V3, DEEPSEEK_V31, KIMI_K2, QWEN)  # the formats whose arguments are JSON text


# -- formats whose arguments are markup (markup_arguments.py) ---------------------------------------------------------

def _markup_head(match: re.Match | None, text: str, prefix: str) -> CallHead | None | bool:
    """The head of a markup call from `match` (its group 1 the name, the arguments after it): None
    while `text` (after blank space) could still become a match of the head's `prefix...>`."""
    if match is not None:
        return CallHead(match[1].strip(), match.end()) if _good_name(match[1].strip()) else NOT_STREAMED
    stripped = text.lstrip()
    if prefix.startswith(stripped) or (stripped.startswith(prefix) and ">" not in stripped):
        return None
    return NOT_STREAMED


def _parse_markup(format: "ToolCallFormat", text: str, schemas: Schemas | None) -> ParsedCall | None:
    """A markup call's whole text: its head, then its arguments read by the same scanner that
    streams them (so the two agree however the text was split)."""
    head = format.head(text)
    if not isinstance(head, CallHead):
        return None
    scanner = format.arguments_scanner(head.name, schemas)
    arguments = scanner.feed(text[head.arguments_at:]) + scanner.finish()
    return None if scanner.broken or not scanner.closed else ParsedCall(head.name, arguments)


_QWEN_XML_HEAD = re.compile(r"[ \t\n\r]*<function=([^>\n]*)>")


def _head_qwen_xml(text: str) -> CallHead | None | bool:
    return _markup_head(_QWEN_XML_HEAD.match(text), text, "<function=")


def _parse_qwen_xml(text: str, schemas: Schemas | None = None) -> ParsedCall | None:
    return _parse_markup(QWEN_XML, text, schemas)


GLM_ARG_KEY = "<arg_key>"
_GLM_NAME_END = re.compile(r"\n|" + GLM_ARG_KEY)


def _head_glm(text: str) -> CallHead | None | bool:
    """The name runs to its line's end (GLM-4.5/4.6) or to the first `<arg_key>` (GLM-4.7, 5)."""
    start = len(text) - len(text.lstrip())
    end = _GLM_NAME_END.search(text, start)
    if end is None:
        return None
    name = text[start:end.start()].strip()
    return CallHead(name, end.start()) if _good_name(name) and "<" not in name else NOT_STREAMED


def _parse_glm(text: str, schemas: Schemas | None = None) -> ParsedCall | None:
    if _GLM_NAME_END.search(text, len(text) - len(text.lstrip())) is None:  # a call with no arguments
        name = text.strip()
        return ParsedCall(name, "{}") if _good_name(name) and "<" not in name else None
    return _parse_markup(GLM, text, schemas)


_INVOKE_HEAD = re.compile(r'[ \t\n\r]+name="([^"\n]*)"[ \t]*>')  # after `<invoke` / `<｜DSML｜invoke`


def _head_invoke(text: str) -> CallHead | None | bool:
    return _markup_head(_INVOKE_HEAD.match(text), text, 'name="')


def _parse_minimax(text: str, schemas: Schemas | None = None) -> ParsedCall | None:
    return _parse_markup(MINIMAX_M2, text, schemas)


def _parse_dsml_v32(text: str, schemas: Schemas | None = None) -> ParsedCall | None:
    return _parse_markup(DSML_V32, text, schemas)


def _parse_dsml_v4(text: str, schemas: Schemas | None = None) -> ParsedCall | None:
    return _parse_markup(DSML_V4, text, schemas)


DSML = "｜DSML｜"
_DSML_PARAMETER = Markup(f"<{DSML}parameter", ">", re.compile(
    f'<{DSML}parameter[ \\t]+name="(?P<key>[^"]*)"(?:[ \\t]+string="(?P<string>true|false)")?[ \\t]*>'),
    f"</{DSML}parameter>")
QWEN_XML = ToolCallFormat("qwen_xml", "<tool_call>", "</tool_call>", None, None, _parse_qwen_xml, _head_qwen_xml,
                          markup=Markup("<parameter=", ">", re.compile(r"<parameter=(?P<key>[^>\n]*)>"), "</parameter>",
                                        arguments_end="</function>", trim=NEWLINE))
GLM = ToolCallFormat("glm", "<tool_call>", "</tool_call>", None, None, _parse_glm, _head_glm,
                     markup=Markup(GLM_ARG_KEY, "<arg_value>", re.compile(
                         r"<arg_key>(?P<key>[^<]*)</arg_key>[ \t\n\r]*<arg_value>"), "</arg_value>"))
MINIMAX_M2 = ToolCallFormat("minimax_m2", "<invoke", "</invoke>", "<minimax:tool_call>", "</minimax:tool_call>",
                            _parse_minimax, _head_invoke, section_required=True,
                            markup=Markup("<parameter", ">", re.compile(r'<parameter[ \t]+name="(?P<key>[^"]*)"[ \t]*>'),
                                          "</parameter>", trim=SPACE))
DSML_V32 = ToolCallFormat("dsml_v32", f"<{DSML}invoke", f"</{DSML}invoke>", f"<{DSML}function_calls>",
                          f"</{DSML}function_calls>", _parse_dsml_v32, _head_invoke, section_required=True,
                          markup=_DSML_PARAMETER)
DSML_V4 = ToolCallFormat("dsml_v4", f"<{DSML}invoke", f"</{DSML}invoke>", f"<{DSML}tool_calls>",
                         f"</{DSML}tool_calls>", _parse_dsml_v4, _head_invoke, section_required=True,
                         markup=_DSML_PARAMETER)
MARKUP_FORMATS = (QWEN_XML, GLM, MINIMAX_M2, DSML_V32, DSML_V4)
ALL_FORMATS = FORMATS + MARKUP_FORMATS


def markup_call_opening(format: ToolCallFormat, name: str | None) -> str | None:
    """The text that opens a call of tool `name` in a markup format, up to where its arguments
    begin, as the published templates write it (to force a call: the model writes the rest); with
    `name` None, up to where the name begins. None for the other formats. DSML's block follows a blank
    line, even after no text (encoding_dsv32.py / encoding_dsv4.py; V3.2's parser looks for it)."""
    if format is QWEN_XML:
        return f"{format.call_begin}\n<function=" + ("" if name is None else f"{name}>\n")
    if format is GLM:
        return f"{format.call_begin}{name or ''}"
    if format in (MINIMAX_M2, DSML_V32, DSML_V4):
        blank = "\n\n" if format is not MINIMAX_M2 else ""
        return f'{blank}{format.section_begin}\n{format.call_begin} name="' + ("" if name is None else f'{name}">\n')
    return None


def format_for_template(chat_template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template writes calls back in (so the model was trained to
    make them that way), or None when it has none of ours."""
    if not chat_template:
        return None
    if KIMI_K2.call_begin in chat_template or KIMI_K2.section_begin in chat_template or "tool_declare" in chat_template:
        return KIMI_K2
    if DSML in chat_template:  # V3.2 calls its section function_calls, V4 tool_calls
        return DSML_V32 if DSML_V32.section_begin in chat_template else DSML_V4
    if DEEPSEEK_V3.call_begin in chat_template:
        # V3 / R1 fence the arguments in a ```json block; V3.1 writes them straight after the name
        return DEEPSEEK_V3 if "```json" in chat_template else DEEPSEEK_V31
    if MINIMAX_M2.section_begin in chat_template:
        return MINIMAX_M2
    # GLM's, Qwen3-Coder's and Qwen3.5's templates hold <tool_call> too, with their own markup inside
    if GLM_ARG_KEY in chat_template:
        return GLM
    if "<function=" in chat_template:
        return QWEN_XML
    if QWEN.call_begin in chat_template:
        return QWEN
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_TEXT, _BETWEEN, _CALL = "text", "between", "call"


class _Streamed:
    """A call whose start has been sent: what of its arguments went out so far."""

    def __init__(self, index: int, head: CallHead, scanner):
        self.index = index
        self.head = head
        self.scanner = scanner
        self.read = head.arguments_at  # how much of the call's text the scanner has read
        self.sent = ""


class ToolCallParser:
    """Answer text pieces in; ContentDelta and ToolCallStart/Arguments/End events out."""

    def __init__(self, format: ToolCallFormat, new_id: Callable[[], str] = new_call_id, schemas: Schemas | None = None):
        """schemas: the request's tool schemas (markup_arguments.tool_schemas), which type the
        values of formats that write them as text."""
        self.format = format
        self._new_id = new_id
        self._schemas = schemas
        self.calls = 0            # calls started so far (the next call's index)
        # blank space opening the answer is held as between calls: dropped where a call follows (DSML's
        # encoding puts "\n\n" before its block, a chat-mode answer that is only calls has no content)
        self._state = _BETWEEN
        self._in_section = False  # between a section's begin and end markers
        self._held = ""           # text not yet decided on (it may be the start of a marker)
        self._space = ""          # blank space after a call: dropped if another call follows
        self._call = ""           # the current call's text so far, after its begin marker
        self._streamed: _Streamed | None = None  # the current call, once its start was sent
        self._whole = False       # the current call does not stream: its end decides it whole
        self._section_open = ""   # a section's begin marker, passed on as text if no call in it parses
        self._section_parsed = False  # a call in the current section parsed (its markers are not text)

    def _markers(self) -> tuple[str, ...]:
        f = self.format
        if self._state == _CALL:
            # a new call, or the section's end, before this call ended: this call is malformed
            return (f.call_end, f.call_begin) + ((f.section_end,) if self._in_section else ())
        if self._in_section:
            return (f.call_begin, f.section_end)
        return ((f.call_begin,) if not f.section_required else ()) + ((f.section_begin,) if f.section_begin else ())

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._held += text
        while self._held:
            markers = self._markers()
            found = find_first(self._held, markers)
            if found is None:
                keep = partial_tail(self._held, markers)
                self._take(self._held[:len(self._held) - keep], events)
                self._held = self._held[len(self._held) - keep:]
                break
            at, marker = found
            self._take(self._held[:at], events)
            self._held = self._held[at + len(marker):]
            self._marker(marker, events)
        return events

    def finish(self) -> list[Event]:
        """The output ended: a held-back part of a marker is text, and so is an unfinished call
        that had not started; one that had ends, incomplete (see the module's docstring)."""
        events: list[Event] = []
        held, self._held = self._held, ""
        self._take(held, events)
        if self._state == _CALL:
            self._broken(events)
        if self._section_open:  # a section the output ended in, with no call parsed: text
            self._text(self._space, events)
        return events

    def _take(self, text: str, events: list[Event]) -> None:
        """Text that holds no marker, in the current state."""
        if not text:
            return
        if self._state == _CALL:
            self._call += text
            self._stream(events)
        elif self._state == _BETWEEN or self._in_section:
            text = self._space + text
            if text.strip():  # words after the calls: the answer goes on
                self._space = ""
                if not self._in_section:
                    self._state = _TEXT
                self._text(text if self._section_open else text.lstrip(), events)
            else:
                self._space = text
        else:
            events.append(ContentDelta(text))

    def _stream(self, events: list[Event]) -> None:
        """The current call's text grew: start it once its head is known, then send what of its
        arguments is certain."""
        if self._whole:
            return
        call = self._streamed
        if call is None:
            # only the first characters are read, so that where a piece ends cannot decide it
            head = self.format.head(self._call[:HEAD_LIMIT])
            if head is None and len(self._call) < HEAD_LIMIT:
                return
            if head is None or head is NOT_STREAMED:
                self._whole = True
                return
            scanner = self.format.arguments_scanner(head.name, self._schemas)
            call = self._streamed = _Streamed(self._start(head.id, head.name, events), head, scanner)
        piece = call.scanner.feed(self._call[call.read:])
        call.read = len(self._call)
        if piece:
            call.sent += piece
            events.append(ToolCallArguments(call.index, piece))

    def _start(self, id: str | None, name: str, events: list[Event]) -> int:
        index = self.calls
        self.calls += 1
        # the section holds a call: its markers are not text
        self._section_open, self._space, self._section_parsed = "", "", True
        events.append(ToolCallStart(index, id or self._new_id(), name))
        return index

    def _text(self, text: str, events: list[Event]) -> None:
        """Text from inside a section: while no call in it has parsed, its begin marker goes first."""
        events.append(ContentDelta(self._section_open + text))
        self._section_open = ""

    def _marker(self, marker: str, events: list[Event]) -> None:
        f = self.format
        if self._state == _CALL:
            if marker == f.call_end:
                self._end(events)
                self._state = _BETWEEN
                return
            self._broken(events)  # a call that never ended
            self._state = _BETWEEN
        if marker == f.section_begin:
            self._in_section, self._section_open, self._section_parsed = True, marker, False
        elif marker == f.section_end:
            if not self._section_parsed:  # no call in the section parsed: it all stays text
                self._text(self._space + marker, events)
            self._in_section, self._space = False, ""
            self._state = _BETWEEN
        elif marker == f.call_begin:
            self._state, self._call, self._streamed, self._whole = _CALL, "", None, False

    def _end(self, events: list[Event]) -> None:
        """The current call's end marker: its whole text decides it."""
        parsed = self.format.parse(self._call, self._schemas)
        call = self._streamed
        if call is None:
            if parsed is None:
                self._unparsed(events, self.format.call_end)
            else:
                index = self._start(parsed.id, parsed.name, events)
                events += [ToolCallArguments(index, parsed.arguments), ToolCallEnd(index)]
            return
        # by its end marker a well-formed call's object has closed (a markup call's closes with it): all
        # of its arguments went out
        last = call.scanner.finish()
        if parsed is None or parsed.name != call.head.name or parsed.arguments != call.sent + last:
            self._broken(events)
            return
        if last:
            events.append(ToolCallArguments(call.index, last))
        events.append(ToolCallEnd(call.index))
        self._streamed = None

    def _broken(self, events: list[Event]) -> None:
        """A call that will not end well-formed: text if it never started, else it ends as sent."""
        if self._streamed is None:
            self._unparsed(events)
            return
        events.append(ToolCallEnd(self._streamed.index, complete=False))
        self._streamed, self._call = None, ""

    def _unparsed(self, events: list[Event], end: str = "") -> None:
        self._text(self._space + self.format.call_begin + self._call + end, events)
        self._call, self._space = "", ""
