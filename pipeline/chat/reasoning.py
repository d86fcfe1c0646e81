"""A model's thinking apart from its answer: `<think>` ... `</think>` (DeepSeek R1 and V3.1 with
thinking on, Kimi K2 Thinking, Qwen3), parsed from text that streams in pieces split anywhere.

Where the thinking starts depends on the chat template, not the model's output: R1's and V3.1's
templates open `<think>` in the prompt itself (the model's output then starts inside the
thinking and only closes it), Kimi K2 Thinking and Qwen3 leave it to the model to write
`<think>` first. So a parser is made knowing how the rendered prompt ends
(`prompt_opens_reasoning`). A `<think>` only opens a thinking block at the very start of the
output (after blank space); anywhere else it is text, as is everything in an output that never
opens one.

Blank space around the thinking is dropped: after `<think>`, before `</think>` and after it
(templates put newlines there; DeepSeek's and Moonshot's own APIs return neither field with them).
"""

from __future__ import annotations

from .events import ContentDelta, Event, ReasoningDelta
from .scan import find_first, partial_tail

OPEN, CLOSE = "<think>", "</think>"

_START, _REASONING, _ANSWER, _PLAIN = "start", "reasoning", "answer", "plain"


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template knows thinking blocks at all (it opens one, or strips them from
    earlier turns): only then is a model's output split into reasoning and answer."""
    return chat_template is not None and (OPEN in chat_template or CLOSE in chat_template)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open thinking block (`...<｜Assistant｜><think>\\n`)."""
    return prompt_text.rstrip().endswith(OPEN)


class ReasoningParser:
    """Text pieces in, ReasoningDelta / ContentDelta events out; `finish()` at the end."""

    def __init__(self, in_reasoning: bool):
        self._state = _REASONING if in_reasoning else _START
        self.opened = in_reasoning   # a thinking block was seen (the output has a reasoning part)
        self._held = ""              # text that may be the start of a marker, or the start of the output
        self._space = ""             # blank space at the end of the reasoning so far: dropped if </think> follows
        self._leading = True         # at the start of the reasoning or of the answer: blank space is dropped

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._held += text
        while self._held:
            if self._state == _START:
                stripped = self._held.lstrip()
                if stripped.startswith(OPEN):
                    self._held = stripped[len(OPEN):]
                    self._state, self.opened, self._leading = _REASONING, True, True
                    continue
                if OPEN.startswith(stripped):  # blank, or a part of "<think>": wait for more
                    break
                self._state = _PLAIN
                continue
            if self._state == _PLAIN:
                events.append(ContentDelta(self._held))
                self._held = ""
            elif self._state == _REASONING:
                found = find_first(self._held, (CLOSE,))
                if found is None:
                    keep = partial_tail(self._held, (CLOSE,))
                    self._reasoning(self._held[:len(self._held) - keep], events)
                    self._held = self._held[len(self._held) - keep:]
                    break
                at, marker = found
                self._reasoning(self._held[:at], events)
                self._held = self._held[at + len(marker):]
                self._state, self._leading = _ANSWER, True
            else:  # _ANSWER
                text, self._held = self._held, ""
                if self._leading:
                    text = text.lstrip()
                    self._leading = not text
                if text:
                    events.append(ContentDelta(text))
        return events

    def finish(self) -> list[Event]:
        """The text still held back: a possible marker that never completed is text after all."""
        held, self._held = self._held, ""
        if not held:
            return []
        if self._state == _START:
            return [ContentDelta(held)]
        if self._state == _REASONING:
            events: list[Event] = []
            self._reasoning(held, events)
            return events
        return []  # _PLAIN and _ANSWER hold nothing back

    def _reasoning(self, text: str, events: list[Event]) -> None:
        """Pass reasoning text on, holding back blank space at its end until more text follows."""
        if self._leading:
            text = text.lstrip()
            self._leading = not text
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if body:
            events.append(ReasoningDelta(body))


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """A whole output as (reasoning, answer); reasoning None where it has no thinking block."""
    parser = ReasoningParser(in_reasoning)
    events = parser.feed(text) + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return (reasoning if parser.opened else None), content
