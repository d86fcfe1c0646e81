"""OpenAI's Responses API (`POST /v1/responses`) as plain data: the request schema (pydantic), its
input items as the chat template's messages, its tools as the template's functions, and the
response object and output items this server sends back.

What Codex CLI and the official `openai` client send is read: `input` (a string, or items:
`message`s with text parts in roles user / developer / system / assistant, `function_call`,
`function_call_output`, `reasoning`), `instructions`, `tools` of type `function` and `namespace`
(a group of functions: the model sees each as a function named NAMESPACE__NAME, and a call to
one comes back with its `namespace` and `name` apart, as Codex routes it), `tool_choice`,
`max_output_tokens`, `temperature`, `top_p`, `stream`, `store`, `previous_response_id`; a
`tool_choice` of "required" or a named function opens the answer with a call (forced_calls.py). Tools
of other types (`web_search`, `file_search`, `custom`, ...) are left out of the prompt, not
refused: an agent offers them whatever the server. Fields that change nothing here (`include`,
`reasoning`, `prompt_cache_key`, `client_metadata`, ...) and fields this server has never heard
of are accepted and ignored, as OpenAI's own server ignores what it does not know; a value that
would change the output in a way this server cannot (`text.format` json_schema, `background`,
`tool_choice: {"type": "allowed_tools", ...}`) is refused with 400 naming it.

Nothing here touches the engine: plain data in, plain dicts out.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Callable, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator

from ..runtime.requests import SamplingParams
from ..util.errors import UserError
from .protocol import APIError, FunctionDefinition, Tool, validation_error

NAMESPACE_SEPARATOR = "__"  # a namespace's function as the model sees it: NAMESPACE__NAME


# -- input items ----------------------------------------------------------------------------------------------

TEXT_PARTS = ("input_text", "output_text", "text")
# A tool's output part this server cannot show the model (Codex's view_image returns an image): the
# model is told so in its place, rather than the agent's whole turn failing on a 400
UNSEEN_PART = "[{kind} left out: this server reads text only]"


def _text_of_parts(value, allowed: tuple[str, ...] = TEXT_PARTS, unseen_ok: bool = False):
    """Text content parts joined with newlines (as chat's are); any other part is refused, or
    with `unseen_ok` replaced by UNSEEN_PART."""
    if not isinstance(value, list):
        return value
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed and unseen_ok and isinstance(kind, str):
            texts.append(UNSEEN_PART.format(kind=kind))
            continue
        if kind not in allowed:
            raise ValueError(f"content part {i} is {json.dumps(kind) if kind else 'not a text part'}: only text "
                             f"parts ({', '.join(allowed)}) are supported, this server reads text")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"content part {i} must have a string `text`")
        texts.append(part["text"])
    return "\n".join(texts)


class _Item(BaseModel):
    # Fields an item carries that change nothing here (`id`, `status`, `annotations`, ...) are ignored
    model_config = ConfigDict(extra="ignore", strict=True)


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value):
        return _text_of_parts(value)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    namespace: str | None = None  # the namespace tool the function belongs to (Codex's MCP and agent tools)


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str

    @field_validator("output", mode="before")
    @classmethod
    def _text(cls, value):
        return _text_of_parts(value, unseen_ok=True)


class _SummaryText(_Item):
    type: Literal["summary_text"] = "summary_text"
    text: str


class _ReasoningText(_Item):
    type: Literal["reasoning_text", "text"] = "reasoning_text"
    text: str


class ReasoningItem(_Item):
    """The model's thinking given back: its summary (here the whole thinking), or its text."""
    type: Literal["reasoning"]
    summary: list[_SummaryText] = []
    content: list[_ReasoningText] | None = None
    encrypted_content: Any = None  # ours is never encrypted: nothing to decrypt

    @property
    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "\n".join(part.text for part in parts)


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(value) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")  # {"role": ..., "content": ...} is a message
    return getattr(value, "type", "")


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_type)]


# -- tools ----------------------------------------------------------------------------------------------------

class FunctionTool(_Item):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_template(self, name: str | None = None) -> dict:
        """The tool as a Chat Completions request's `tools` entry is rendered (the same dict)."""
        definition = FunctionDefinition(name=name or self.name, description=self.description,
                                        parameters=self.parameters, strict=self.strict)
        return Tool(type="function", function=definition).model_dump(exclude_none=True)


class NamespaceTool(_Item):
    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionTool]


def flat_name(namespace: str | None, name: str) -> str:
    """A namespace's function as the model sees and calls it."""
    if namespace is None:
        return name
    return namespace + name if namespace.endswith(NAMESPACE_SEPARATOR) else namespace + NAMESPACE_SEPARATOR + name


class ToolNames:
    """The names the model calls, back to the (namespace, name) a client routes a call by."""

    def __init__(self, tools: list[FunctionTool | NamespaceTool]):
        self._flat: dict[str, tuple[str, str]] = {}
        children: dict[str, list[str]] = {}
        for namespace in (tool for tool in tools if isinstance(tool, NamespaceTool)):
            for tool in namespace.tools:
                self._flat[flat_name(namespace.name, tool.name)] = (namespace.name, tool.name)
                children.setdefault(tool.name, []).append(namespace.name)
        plain = {tool.name for tool in tools if isinstance(tool, FunctionTool)}
        # A model that drops the namespace from a name only one namespace has: still that function
        self._bare = {name: (spaces[0], name) for name, spaces in children.items()
                      if len(spaces) == 1 and name not in plain}

    def split(self, called: str) -> tuple[str | None, str]:
        return self._flat.get(called) or self._bare.get(called) or (None, called)


# -- the request ----------------------------------------------------------------------------------------------

class ResponsesRequest(BaseModel):
    # strict: "0.5" is not a number, as in OpenAI's API. Unknown fields are ignored, as OpenAI's
    # Responses server ignores them (agents send fields newer than any server).
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str | None = None
    input: list[InputItem] = []
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    # Our extensions, as Chat Completions reads them
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    # Accepted, echoed where the response object has them, otherwise ignored
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    # Checked against REFUSED
    text: Any = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    truncation: Any = None

    # {field: (accepted value?, why another is refused)}
    REFUSED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "text": (lambda v: v is None or not isinstance(v, dict) or v.get("format") in (None, {"type": "text"}),
                 "structured output is not supported (no constrained decoding): only {\"format\": {\"type\": \"text\"}}"),
        "background": (lambda v: v in (None, False), "background responses are not supported: stream instead"),
        "conversation": (lambda v: v is None, "conversations are not kept: use previous_response_id or resend the "
                                              "items"),
        "prompt": (lambda v: v is None, "prompt templates are not supported: send input and instructions"),
        "top_logprobs": (lambda v: v in (None, 0), "logprobs are not supported on /v1/responses: use "
                                                   "/v1/chat/completions"),
        "truncation": (lambda v: v in (None, "disabled"), "only \"disabled\": a prompt longer than the context is "
                                                          "an error, never cut"),
    }

    @field_validator("input", mode="before")
    @classmethod
    def _string_input(cls, value):
        return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value

    def check_refused(self) -> None:
        for name, (accepted, why) in self.REFUSED.items():
            value = getattr(self, name)
            if not accepted(value):
                raise APIError(f"{name}={json.dumps(value)} is not supported by this server: {why}", param=name,
                               code="unsupported_value")

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        """This request's sampling settings over the server's defaults (its --temp, --seed, ...)."""
        def pick(name: str):
            value = getattr(self, name)
            return getattr(defaults, name) if value is None else value

        try:
            return SamplingParams(*(pick(name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                            "repetition_penalty", "seed"))).validate()
        except UserError as e:  # its message starts with the field's name ("top_p must be in (0, 1], ...")
            raise APIError(str(e), param=str(e).split(" ", 1)[0]) from None

    # -- tools --

    def function_tools(self) -> tuple[list[FunctionTool | NamespaceTool], list[str]]:
        """The request's tools the model can call (functions, namespaces of functions), in their
        order, and the types of those left out of the prompt."""
        tools, left_out = [], []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            try:
                if kind == "function":
                    tools.append(FunctionTool.model_validate(tool))
                elif kind == "namespace":
                    tools.append(NamespaceTool.model_validate(tool))
                else:
                    left_out.append(str(kind))
            except ValidationError as e:
                raise validation_error(e, ITEM_TYPES, prefix=("tools", i)) from None
        return tools, left_out

    def forced_call(self, tools: list[FunctionTool | NamespaceTool]) -> str | None:
        """The call tool_choice forces the answer to open with: "" for any tool ("required"), the
        function's name as the model sees it (`{"type": "function", "name": ...}`), or None."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return None
        offered = [name for tool in tools for name in
                   ([flat_name(tool.name, child.name) for child in tool.tools] if isinstance(tool, NamespaceTool)
                    else [tool.name])]
        if not offered:
            raise APIError(f"tool_choice={json.dumps(choice)} needs a function tool to call: none was given",
                           param="tool_choice")
        if choice == "required":
            return ""
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            name = flat_name(choice.get("namespace"), choice["name"])
            if name not in offered:
                raise APIError(f"tool_choice: no function tool named {json.dumps(name)} was given",
                               param="tool_choice")
            return name
        raise APIError(f"tool_choice={json.dumps(choice)} is not supported by this server: only \"auto\", "
                       f"\"none\", \"required\" and {{\"type\": \"function\", \"name\": ...}}", param="tool_choice",
                       code="unsupported_value")

    def template_tools(self, tools: list[FunctionTool | NamespaceTool]) -> list[dict] | None:
        """The tools for the chat template, a namespace's as functions of their own; None where
        there are none or tool_choice is "none" (the model is then not told of them, and its
        output is not read for calls)."""
        if self.tool_choice == "none":
            return None
        functions = []
        for tool in tools:
            if isinstance(tool, NamespaceTool):
                functions += [child.for_template(flat_name(tool.name, child.name)) for child in tool.tools]
            else:
                functions.append(tool.for_template())
        return functions or None


def parse(body: bytes) -> ResponsesRequest:
    """A request body, or APIError(400) naming the first thing wrong with it."""
    try:
        request = ResponsesRequest.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e, ITEM_TYPES) from None
    request.check_refused()
    return request


# -- input items as chat template messages ---------------------------------------------------------------------

def template_messages(instructions: str | None, items: list) -> list[dict]:
    """The conversation as the chat template's messages (those a Chat Completions request of the
    same turns gives): instructions and leading developer / system messages as one system
    message (templates that take a single system message at the start take Codex's too), a
    response's reasoning, text and calls as one assistant turn, each call's output as a tool turn."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    turn: dict | None = None  # the assistant turn being put together

    def assistant() -> dict:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        return turn

    for item in items:
        if isinstance(item, MessageItem) and item.role == "assistant":
            message = assistant()
            message["content"] = message["content"] + "\n" + item.content if message["content"] else item.content
            continue
        if isinstance(item, ReasoningItem):
            message = assistant()
            message["reasoning_content"] = message.get("reasoning_content", "") + item.text
            continue
        if isinstance(item, FunctionCallItem):
            name = flat_name(item.namespace, item.name)
            assistant().setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": item.arguments}})
            continue
        turn = None
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        elif item.role in ("system", "developer"):
            if messages and messages[-1]["role"] == "system" and len(messages) == 1:
                messages[0]["content"] += "\n\n" + item.content
            else:
                messages.append({"role": "system", "content": item.content})
        else:
            messages.append({"role": "user", "content": item.content})
    return messages


# -- the response ---------------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    """The Responses API's usage: input_tokens counts the cached ones too, as prompt_tokens does."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens}


def response_object(id: str, created_at: int, model: str, request: ResponsesRequest, status: str,
                    output: list[dict], usage: dict | None = None, incomplete: str | None = None,
                    error: dict | None = None) -> dict:
    """A `response` object; the request's settings echoed as OpenAI echoes them."""
    return {"id": id, "object": "response", "created_at": created_at, "status": status, "background": False,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": model, "output": output, "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": (request.reasoning or {}).get("effort"),
                          "summary": (request.reasoning or {}).get("summary")},
            "store": request.store is not False, "temperature": request.temperature,
            "text": {"format": {"type": "text"}}, "tool_choice": request.tool_choice or "auto",
            "tools": request.tools or [], "top_p": request.top_p, "truncation": "disabled", "usage": usage,
            "user": request.user, "metadata": request.metadata or {},
            "completed_at": int(time.time()) if status == "completed" else None}


def deleted(id: str) -> dict:
    return {"id": id, "object": "response.deleted", "deleted": True}


def sse(event: dict) -> bytes:
    """One server-sent event as OpenAI's Responses server writes it: `event: TYPE` and its data."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode("utf-8")
