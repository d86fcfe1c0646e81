"""One chat answer's text, as it streams, split into reasoning, answer and tool calls: the
reasoning parser first (tool calls inside the thinking are thinking), then the tool-call parser
over the answer. Front-ends make one ChatOutputParser per request and turn its events into their
own format; ChatMessage collects them into the whole message.
"""

from __future__ import annotations

from typing import Callable

from .events import ContentDelta, Event, ReasoningDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from .reasoning import ReasoningParser, prompt_opens_reasoning, template_thinks
from .markup_arguments import Schemas, tool_schemas
from .tool_calls import ToolCallFormat, ToolCallParser, format_for_template, new_call_id


class ChatOutputParser:
    def __init__(self, *, in_reasoning: bool | None, tool_format: ToolCallFormat | None,
                 new_id: Callable[[], str] = new_call_id, schemas: Schemas | None = None):
        """in_reasoning: None when the model does not think (no reasoning is split off), else
        whether its output starts inside the thinking. tool_format: None when tool calls are
        not parsed (no tools in the request, or tool_choice "none"). schemas: the request's tool
        schemas, which type the values of formats that write every value as text."""
        self._reasoning = ReasoningParser(in_reasoning) if in_reasoning is not None else None
        self._tools = ToolCallParser(tool_format, new_id, schemas) if tool_format is not None else None

    @classmethod
    def for_prompt(cls, chat_template: str | None, prompt_text: str, parse_tools: bool,
                   new_id: Callable[[], str] = new_call_id, tools: list | None = None) -> "ChatOutputParser":
        """The parser for a prompt rendered with `chat_template` (its text decides where the
        output starts); tool calls in the template's format when `parse_tools`, their values typed
        from `tools` (the request's, OpenAI's or Anthropic's shape) where the format needs it."""
        thinks = template_thinks(chat_template)
        return cls(in_reasoning=prompt_opens_reasoning(prompt_text) if thinks else None,
                   tool_format=format_for_template(chat_template) if parse_tools else None, new_id=new_id,
                   schemas=tool_schemas(tools))

    @property
    def reasoned(self) -> bool:
        """The output had a thinking block (perhaps an empty one)."""
        return self._reasoning is not None and self._reasoning.opened

    @property
    def tool_calls(self) -> int:
        """Calls started so far (one broken off after its start counts: it was sent as a call)."""
        return self._tools.calls if self._tools is not None else 0

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        events = self._reasoning.feed(text) if self._reasoning is not None else [ContentDelta(text)]
        return self._answer(events)

    def finish(self) -> list[Event]:
        events = self._answer(self._reasoning.finish() if self._reasoning is not None else [])
        if self._tools is not None:
            events += self._tools.finish()
        return events

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI's finish reason: "tool_calls" where the model stopped after calling tools; "length"
        where the tokens ran out, even inside a call whose pieces went out (it ends incomplete)."""
        return "tool_calls" if engine_reason == "stop" and self.tool_calls else engine_reason

    def _answer(self, events: list[Event]) -> list[Event]:
        if self._tools is None:
            return events
        out: list[Event] = []
        for event in events:
            out += self._tools.feed(event.text) if isinstance(event, ContentDelta) else [event]
        return out


class ChatMessage:
    """The events of one answer collected into the message: reasoning (None where the model did
    not think), content, and tool calls in OpenAI's shape."""

    def __init__(self):
        self.reasoning: str | None = None
        self._content: list[str] = []
        self.tool_calls: list[dict] = []

    def add(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, ReasoningDelta):
                self.reasoning = (self.reasoning or "") + event.text
            elif isinstance(event, ContentDelta):
                self._content.append(event.text)
            elif isinstance(event, ToolCallStart):
                self.tool_calls.append({"id": event.id, "type": "function",
                                        "function": {"name": event.name, "arguments": ""}})
            elif isinstance(event, ToolCallArguments):
                self.tool_calls[event.index]["function"]["arguments"] += event.text
            elif not isinstance(event, ToolCallEnd):
                raise TypeError(f"not a chat output event: {event!r}")

    @property
    def content(self) -> str | None:
        """The answer's text; None (as OpenAI's API has it) where the answer is only tool calls."""
        text = "".join(self._content)
        return None if self.tool_calls and not text.strip() else text


def parse_output(text: str, *, in_reasoning: bool | None, tool_format: ToolCallFormat | None,
                 new_id: Callable[[], str] = new_call_id, schemas: Schemas | None = None) -> ChatMessage:
    """A whole output at once."""
    parser = ChatOutputParser(in_reasoning=in_reasoning, tool_format=tool_format, new_id=new_id, schemas=schemas)
    message = ChatMessage()
    message.add(parser.feed(text) + parser.finish())
    if parser.reasoned and message.reasoning is None:
        message.reasoning = ""
    return message
