"""A model's tool calls, parsed from its text as it streams, in each model family's own format as
its published chat template writes calls back into a conversation (and its docs describe them):

- DeepSeek V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{ARGS}\\n```
  <｜tool▁call▁end｜>` (more calls joined by a newline) `<｜tool▁calls▁end｜>`
- DeepSeek V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`
- Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{ARGS}
  <|tool_call_end|>...<|tool_calls_section_end|>` (Moonshot's docs/tool_call_guidance.md; the id
  `functions.NAME:IDX` is kept as the call's id, because Kimi's template writes it back as is)
- Qwen and Hermes-style templates: `<tool_call>\\n{"name": NAME, "arguments": {ARGS}}\\n</tool_call>`

A call is passed on once it is complete and well-formed: a name and a JSON object of arguments.
A malformed call, or one the output ends inside, is passed on as plain text instead (markers and
all), so the text is never lost and a bad output never becomes an error. Blank space between
calls is dropped; other text around them is the answer's text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

from .events import ContentDelta, Event, ToolCallArguments, ToolCallEnd, ToolCallStart
from .scan import find_first, partial_tail


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str        # a JSON object, as text
    id: str | None = None  # the model's own id for the call, where its format has one


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    call_begin: str
    call_end: str
    section_begin: str | None    # formats that wrap their calls in a section
    section_end: str | None
    parse: Callable[[str], ParsedCall | None]  # a call's text between its markers, or None when malformed


def _json_object(text: str) -> str | None:
    """`text` when it is one JSON object (as the arguments must be), else None."""
    text = text.strip()
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return text if isinstance(value, dict) else None


def _call(name: str, arguments: str | None, id: str | None = None) -> ParsedCall | None:
    name = name.strip()
    if not name or arguments is None or any(c.isspace() for c in name):
        return None
    return ParsedCall(name, arguments, id)


DEEPSEEK_SEP = "<｜tool▁sep｜>"
_DEEPSEEK_V3_CALL = re.compile(r"\s*function" + DEEPSEEK_SEP + r"([^\n]*)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)


def _parse_deepseek_v3(text: str) -> ParsedCall | None:
    match = _DEEPSEEK_V3_CALL.fullmatch(text)
    return _call(match[1], _json_object(match[2])) if match else None


def _parse_deepseek_v31(text: str) -> ParsedCall | None:
    name, sep, arguments = text.partition(DEEPSEEK_SEP)
    return _call(name, _json_object(arguments)) if sep else None


KIMI_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
_KIMI_ID = re.compile(r"(?:functions\.)?([^\s:]+):\d+")


def _parse_kimi_k2(text: str) -> ParsedCall | None:
    call_id, sep, arguments = text.partition(KIMI_ARGUMENT_BEGIN)
    call_id = call_id.strip()
    match = _KIMI_ID.fullmatch(call_id)
    return _call(match[1], _json_object(arguments), call_id) if sep and match else None


def _parse_qwen(text: str) -> ParsedCall | None:
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _json_object(arguments)
        return _call(call["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return _call(call["name"], json.dumps(arguments, ensure_ascii=False))


DEEPSEEK_V3 = ToolCallFormat("deepseek_v3", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                             "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _parse_deepseek_v3)
DEEPSEEK_V31 = ToolCallFormat("deepseek_v31", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                              "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _parse_deepseek_v31)
KIMI_K2 = ToolCallFormat("kimi_k2", "<|tool_call_begin|>", "<|tool_call_end|>",
                         "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", _parse_kimi_k2)
QWEN = ToolCallFormat("qwen", "<tool_call>", "</tool_call>", None, None, _parse_qwen)
FORMATS = (DEEPSEEK_V3, DEEPSEEK_V31, KIMI_K2, QWEN)


def format_for_template(chat_template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template writes calls back in (so the model was trained to
    make them that way), or None when it has none of ours."""
    if not chat_template:
        return None
    if KIMI_K2.call_begin in chat_template or KIMI_K2.section_begin in chat_template or "tool_declare" in chat_template:
        return KIMI_K2
    if DEEPSEEK_V3.call_begin in chat_template:
        # V3 / R1 fence the arguments in a ```json block; V3.1 writes them straight after the name
        return DEEPSEEK_V3 if "```json" in chat_template else DEEPSEEK_V31
    if QWEN.call_begin in chat_template:
        return QWEN
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_TEXT, _BETWEEN, _CALL = "text", "between", "call"


class ToolCallParser:
    """Answer text pieces in; ContentDelta and ToolCallStart/Arguments/End events out."""

    def __init__(self, format: ToolCallFormat, new_id: Callable[[], str] = new_call_id):
        self.format = format
        self._new_id = new_id
        self.calls = 0            # calls passed on so far
        self._state = _TEXT
        self._in_section = False  # between a section's begin and end markers
        self._held = ""           # text not yet decided on (it may be the start of a marker)
        self._space = ""          # blank space after a call: dropped if another call follows
        self._call = ""           # the current call's text so far, after its begin marker
        self._section_open = ""   # a section's begin marker, passed on as text if no call in it parses
        self._section_parsed = False  # a call in the current section parsed (its markers are not text)

    def _markers(self) -> tuple[str, ...]:
        f = self.format
        if self._state == _CALL:
            # a new call, or the section's end, before this call ended: this call is malformed
            return (f.call_end, f.call_begin) + ((f.section_end,) if self._in_section else ())
        if self._in_section:
            return (f.call_begin, f.section_end)
        return (f.call_begin,) + ((f.section_begin,) if f.section_begin else ())

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
        """The output ended: a held-back part of a marker is text, and so is an unfinished call."""
        events: list[Event] = []
        held, self._held = self._held, ""
        self._take(held, events)
        if self._state == _CALL:
            self._unparsed(events)
        if self._section_open:  # a section the output ended in, with no call parsed: text
            self._text(self._space, events)
        return events

    def _take(self, text: str, events: list[Event]) -> None:
        """Text that holds no marker, in the current state."""
        if not text:
            return
        if self._state == _CALL:
            self._call += text
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

    def _text(self, text: str, events: list[Event]) -> None:
        """Text from inside a section: while no call in it has parsed, its begin marker goes first."""
        events.append(ContentDelta(self._section_open + text))
        self._section_open = ""

    def _marker(self, marker: str, events: list[Event]) -> None:
        f = self.format
        if self._state == _CALL:
            if marker == f.call_end:
                parsed = f.parse(self._call)
                if parsed is None:
                    self._unparsed(events, f.call_end)
                else:
                    self._emit(parsed, events)
                self._state = _BETWEEN
                return
            self._unparsed(events)  # a call that never ended: its text stays text
            self._state = _BETWEEN
        if marker == f.section_begin:
            self._in_section, self._section_open, self._section_parsed = True, marker, False
        elif marker == f.section_end:
            if not self._section_parsed:  # no call in the section parsed: it all stays text
                self._text(self._space + marker, events)
            self._in_section, self._space = False, ""
            self._state = _BETWEEN
        elif marker == f.call_begin:
            self._state, self._call = _CALL, ""

    def _emit(self, call: ParsedCall, events: list[Event]) -> None:
        index = self.calls
        self.calls += 1
        # the section held a call: its markers were not text
        self._section_open, self._space, self._section_parsed = "", "", True
        events += [ToolCallStart(index, call.id or self._new_id(), call.name),
                   ToolCallArguments(index, call.arguments), ToolCallEnd(index)]

    def _unparsed(self, events: list[Event], end: str = "") -> None:
        self._text(self._space + self.format.call_begin + self._call + end, events)
        self._call, self._space = "", ""
