"""What serve does with pipeline.chat: whether a request's `tools` can go to this model (its chat
template must write them into the prompt, and its tool-call format must be one we parse), the
parser for a request's answer, and the parser's events as the deltas of streamed chunks
(`reasoning_content`, `content`, `tool_calls`)."""

from __future__ import annotations

from ..chat.events import ContentDelta, Event, ReasoningDelta, ToolCallArguments, ToolCallStart
from ..chat.output import ChatOutputParser
from ..chat.tool_calls import format_for_template
from ..checkpoints.tokenizer import Tokenizer
from .protocol import APIError


def check_tools(tokenizer: Tokenizer) -> None:
    """A request with tools (and tool_choice "auto"): refused where they would be dropped or
    their calls not understood, rather than answered as if the model had not seen them."""
    if not tokenizer.has_chat_template:
        raise APIError("the model has no chat template, so it cannot be given tools", param="tools")
    if not tokenizer.renders_tools():
        raise APIError("this model's chat template does not render tools: describe them in the system message, "
                       "or put a chat_template.jinja that renders `tools` into the model folder", param="tools",
                       code="unsupported_value")
    if format_for_template(tokenizer.chat_template) is None:
        raise APIError("this model's tool-call format is not one the server parses (DeepSeek V3/R1, V3.1, V3.2/V4 "
                       "DSML, Kimi K2, Qwen <tool_call> JSON or <function=...> XML, GLM, MiniMax-M2)", param="tools",
                       code="unsupported_value")


def output_parser(tokenizer: Tokenizer, prompt_ids: list[int], parse_tools: bool,
                  tools: list | None = None) -> ChatOutputParser:
    """The parser of one answer. Whether the answer starts inside a thinking block is in the
    rendered prompt's last tokens (R1's and V3.1's templates open `<think>` there). `tools`: the
    request's, whose schemas type the values of the formats that write every value as text (Qwen
    XML, GLM, MiniMax); without them such values are JSON where they read as JSON."""
    return ChatOutputParser.for_prompt(tokenizer.chat_template, tokenizer.decode(prompt_ids[-16:]), parse_tools,
                                       tools=tools)


def deltas(events: list[Event]) -> list[dict]:
    """One chunk delta per event: a call's first delta carries its index, id, type and name with
    `arguments: ""`, the next ones only its index and a piece of its arguments as the model writes
    them (as OpenAI streams them: clients join the pieces by index); a call's end needs no chunk."""
    out = []
    for event in events:
        if isinstance(event, ReasoningDelta):
            out.append({"reasoning_content": event.text})
        elif isinstance(event, ContentDelta):
            out.append({"content": event.text})
        elif isinstance(event, ToolCallStart):
            out.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                        "function": {"name": event.name, "arguments": ""}}]})
        elif isinstance(event, ToolCallArguments):
            out.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
    return out
