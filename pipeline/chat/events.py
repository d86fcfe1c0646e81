"""The events a chat-output parser yields as the model's text streams in.

Concatenating every ReasoningDelta gives the reasoning, every ContentDelta the answer; a tool
call is a ToolCallStart, its arguments in ToolCallArguments pieces (joined, the arguments' JSON
text), then a ToolCallEnd.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0, 1, ... in the order the model made its calls
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    text: str   # a piece of the arguments' JSON text


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    # False where the call broke off after its start was sent: the output ended inside it (max_tokens),
    # or it turned out malformed. Its arguments are then the pieces sent, perhaps not a whole JSON object.
    complete: bool = True


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArguments | ToolCallEnd
