"""Anthropic's Messages API on the wire: the request schema (validated by pydantic), its
conversion into the chat of OpenAI's shape that the chat template reads, the error shape, and
the reply's bodies and stream events, for `POST /v1/messages` and `/v1/messages/count_tokens`.

What the official `anthropic` client and Claude Code send is accepted. Unlike the OpenAI API's
schema (protocol.py), fields this server does not know are accepted and ignored: Anthropic adds
fields with each client release (`cache_control`, `context_management`, `container`, `speed`,
...) and Claude Code sends them to any server. What would change the output and cannot be done
here is refused with a 400 naming it: `output_config.format` (structured output), image and
document content, an assistant turn to continue (prefill), a forced tool call with thinking on.

Nothing here touches the engine: plain data in, plain dicts out.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..util.errors import UserError
from ..runtime.requests import SamplingParams
from .protocol import APIError, validation_error

BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's first system block: changes per conversation

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); a full queue is
# its "overloaded" 529, which its clients retry
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
QUEUE_FULL = 529


# -- requests -------------------------------------------------------------------------------------------------

class _Open(BaseModel):
    """Fields not named here are accepted and ignored (see the module's docstring)."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class Message(_Open):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class Tool(_Open):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom", or a server tool's (web search, bash, ...): those are not offered


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # of "tool"
    disable_parallel_tool_use: bool | None = None  # ignored: the model makes the calls it makes


class Thinking(_Open):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None  # ignored: the model thinks as long as it does, within max_tokens
    display: Literal["summarized", "omitted"] | None = None


class OutputConfig(_Open):
    effort: str | None = None  # accepted, ignored
    format: Any = None         # refused: no constrained decoding


class CountTokensRequest(_Open):
    model: str
    messages: list[Message]
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    def check(self) -> None:
        if self.output_config is not None and self.output_config.format is not None:
            raise APIError("output_config.format (structured output) is not supported by this server: drop it and "
                           "describe the format in the prompt", param="output_config.format")
        if self.tool_choice is not None and self.tool_choice.type == "tool" and not self.tool_choice.name:
            raise APIError("tool_choice: a choice of type \"tool\" needs the tool's name", param="tool_choice")
        if self.forced and self.thinking_on:
            raise APIError("thinking may not be enabled when tool_choice forces tool use: use tool_choice \"auto\" "
                           "or turn thinking off", param="tool_choice")

    @property
    def thinking_on(self) -> bool | None:
        """The template's thinking switch; None where the request does not say (the template's default)."""
        if self.thinking is None:
            return None
        return self.thinking.type != "disabled"

    @property
    def forced(self) -> bool:
        return self.tool_choice is not None and self.tool_choice.type in ("any", "tool")

    def template_kwargs(self) -> dict | None:
        """The thinking switch under both names templates use for it (DeepSeek V3.1's `thinking`,
        Qwen3's `enable_thinking`); a template reads the one it knows."""
        on = self.thinking_on
        return None if on is None else {"thinking": on, "enable_thinking": on}

    def template_tools(self) -> list[dict] | None:
        """The request's own tools as OpenAI's function list for the template; None where there are
        none to offer or tool_choice is "none" (the model is not told of them, its calls not parsed)."""
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return None
        tools = [{"type": "function", "function": {"name": tool.name, **({"description": tool.description}
                                                                         if tool.description else {}),
                                                   "parameters": tool.input_schema or {"type": "object"}}}
                 for tool in self.tools if tool.type in (None, "custom")]
        if self.tool_choice is not None and self.tool_choice.type == "tool":
            if self.tool_choice.name not in {t["function"]["name"] for t in tools}:
                raise APIError(f"tool_choice names the tool '{self.tool_choice.name}', which is not in tools",
                               param="tool_choice.name")
        return tools or None

    def template_messages(self) -> list[dict]:
        """The conversation in OpenAI's shape, which the chat template reads (as Chat Completions
        hands it over): one system message first (the system prompt, without Claude Code's billing
        header, and any `role: "system"` messages folded in), tool results as `tool` turns."""
        system = _system_text(self.system)
        messages: list[dict] = []
        for i, message in enumerate(self.messages):
            where = f"messages[{i}]"
            if message.role == "system":
                system.append(_text_of(message.content, where))
            elif message.role == "user":
                messages += _user_turns(message.content, where)
            else:
                messages.append(_assistant_turn(message.content, where))
        if not messages:
            raise APIError("messages: the conversation needs a user message", param="messages")
        if messages[-1]["role"] == "assistant":
            raise APIError("the last message is the assistant's: continuing an assistant turn (prefill) is not "
                           "supported; end with a user message", param=f"messages[{len(self.messages) - 1}]")
        text = "\n\n".join(t for t in system if t)
        return ([{"role": "system", "content": text}] if text else []) + messages


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # a cap: the engine stops at the end of the context
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        """temperature, top_p and top_k where sent, else the command's flags."""
        params = SamplingParams(defaults.temperature if self.temperature is None else self.temperature,
                                defaults.top_p if self.top_p is None else self.top_p,
                                defaults.top_k if self.top_k is None else self.top_k,
                                defaults.min_p, defaults.repetition_penalty, defaults.seed)
        try:
            return params.validate()
        except UserError as e:  # its message starts with the field's name ("top_p must be in (0, 1], ...")
            raise APIError(str(e), param=str(e).split(" ", 1)[0]) from None


# The union members content and system may be (pydantic names them in a location; not fields)
UNION_TAGS = ("str", "list[dict[str,any]]")


def parse(kind: type[CountTokensRequest], body: bytes) -> CountTokensRequest:
    """A request body as `kind`, or APIError(400) naming the first thing wrong with it."""
    try:
        request = kind.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e, UNION_TAGS, pydantic_words=True) from None
    request.check()
    return request


def _system_text(system: str | list[dict] | None) -> list[str]:
    if system is None:
        return []
    if isinstance(system, str):
        return [system]
    blocks = list(system)
    if blocks and isinstance(blocks[0].get("text"), str) and blocks[0]["text"].startswith(BILLING_HEADER):
        blocks = blocks[1:]  # it changes per conversation: left in, no prompt would ever hit the prefix cache
    return [_text_of(blocks, "system")]


def _text_of(content: str | list[dict], where: str) -> str:
    """A string, or text blocks joined with newlines."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _unsupported(block, f"{where}.content[{j}]" if where != "system" else f"system[{j}]", "text")
        texts.append(block["text"])
    return "\n".join(texts)


def _user_turns(content: str | list[dict], where: str) -> list[dict]:
    """A user message: its tool results as `tool` turns and its text as a user turn, in order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    turns: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        kind, at = block.get("type"), f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if texts:
                turns.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(f"{at}.tool_use_id: a tool_result needs the id of the tool_use it answers",
                               param=f"{at}.tool_use_id")
            result = _text_of(block.get("content") or "", at)
            if block.get("is_error"):
                result = f"Error: {result}"
            turns.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            raise _unsupported(block, at, "text and tool_result")
    if texts or not turns:
        turns.append({"role": "user", "content": "\n".join(texts)})
    return turns


def _assistant_turn(content: str | list[dict], where: str) -> dict:
    """An earlier answer: its text, its thinking given back (`reasoning_content`, which the
    template keeps or drops), its tool_use blocks as tool calls (arguments as JSON text)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(content):
        kind, at = block.get("type"), f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])  # its signature is not checked: it was ours, and opaque
        elif kind == "redacted_thinking":
            pass
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise APIError(f"{at}: a tool_use block needs an id, a name and an input object", param=at)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        else:
            raise _unsupported(block, at, "text, thinking, redacted_thinking and tool_use")
    turn = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        turn["reasoning_content"] = "\n".join(thoughts)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _unsupported(block, where: str, supported: str) -> APIError:
    kind = block.get("type") if isinstance(block, dict) else None
    what = f"a block of type {json.dumps(kind)}" if kind else "not a content block"
    return APIError(f"{where}: {what} is not supported here (this server reads {supported} blocks)", param=where)


# -- errors ---------------------------------------------------------------------------------------------------

def error_status(error: APIError) -> int:
    """A full queue (the gateway's 429) is Anthropic's 529 overloaded_error."""
    return QUEUE_FULL if error.status == 429 else error.status


def error_body(error: APIError) -> dict:
    status = error_status(error)
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = error.message
    if error.code == "context_length_exceeded":  # Anthropic's words, which Claude Code recognizes and explains
        message = f"prompt is too long: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


# -- replies --------------------------------------------------------------------------------------------------

def signature(thinking: str) -> str:
    """A thinking block's opaque signature: the client gives it back with the block; this server
    does not check it (the block only goes back into the prompt)."""
    return "pipeline-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()[:32]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """Anthropic's convention: input_tokens are the prompt tokens that were not read from the cache
    (OpenAI's prompt_tokens include them), cache_read_input_tokens those that were."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def message(id: str, model: str, content: list[dict], stop_reason: str | None, stop_sequence: str | None,
            usage: dict) -> dict:
    return {"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def event(data: dict) -> bytes:
    """One server-sent event as Anthropic sends them: `event: TYPE` and its data."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {data['type']}\ndata: {text}\n\n".encode("utf-8")
