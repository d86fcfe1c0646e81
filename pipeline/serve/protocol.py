"""The OpenAI wire format: request schemas (validated by pydantic), response and chunk bodies,
and error bodies, for `POST /v1/chat/completions` and `POST /v1/completions`.

What the official `openai` client sends is accepted. Fields of the OpenAI API that this server
does not implement are accepted where their value cannot change the output (`user`, `store`,
`presence_penalty: 0`, `response_format: {"type": "text"}`, ...) and refused, naming the field,
where it would (`n: 2`, `tool_choice: "required"`, `echo: true`, ...). A field that is not in the
API at all is refused, so a misspelt `temprature` is an error, not a silently ignored setting.
Besides OpenAI's own fields, `top_k`, `min_p` and `repetition_penalty` are read (as vLLM and
mlx-lm do), and `chat_template_kwargs` (the chat template's switches, as vLLM reads them).

Nothing here touches the engine: these are plain data in, plain dicts out.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..util.errors import UserError
from ..runtime.requests import SamplingParams

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; also ours for completions (OpenAI's is 5 there)


class APIError(Exception):
    """A request the server answers with an OpenAI-style error body instead of a completion."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- requests -------------------------------------------------------------------------------------------------

def _anything(value) -> bool:
    return True


def _zero(value) -> bool:
    return value is None or value == 0


def _one(value) -> bool:
    return value is None or value == 1


def _empty(value) -> bool:
    return value is None or value == [] or value == {}


def _names_a_function(value) -> bool:
    return (isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict)
            and isinstance(value["function"].get("name"), str))


def _null(value) -> bool:
    return value is None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None
    include_obfuscation: Any = None  # we never pad chunks: nothing to turn off


class _Request(BaseModel):
    """The fields both endpoints share."""

    # strict: "0.5" is not a number and true is not 1, as in OpenAI's API
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None

    # OpenAI's fields that this server does not implement: {field: (accepted value?, why not another)}
    UNIMPLEMENTED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "n": (_one, "one choice per request: send several requests"),
        "frequency_penalty": (_zero, "use repetition_penalty"),
        "presence_penalty": (_zero, "use repetition_penalty"),
        "logit_bias": (lambda v: _empty(v) or (isinstance(v, dict) and all(b == 0 for b in v.values())),
                       "logit biases are not supported"),
        "user": (_anything, ""),
    }
    # Typed loosely: their values are checked against UNIMPLEMENTED, not used.
    n: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None
    user: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value):
        return [value] if isinstance(value, str) else value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        """This request's sampling settings over the server's defaults (its --temp, --seed, ...)."""
        params = SamplingParams(
            defaults.temperature if self.temperature is None else self.temperature,
            defaults.top_p if self.top_p is None else self.top_p,
            defaults.top_k if self.top_k is None else self.top_k,
            defaults.min_p if self.min_p is None else self.min_p,
            defaults.repetition_penalty if self.repetition_penalty is None else self.repetition_penalty,
            defaults.seed if self.seed is None else self.seed)
        try:
            return params.validate()
        except UserError as e:  # its message starts with the field's name ("top_p must be in (0, 1], ...")
            message = str(e)
            field = message.split(" ", 1)[0]
            raise APIError(message, param=field if field in type(self).model_fields else None) from None

    def check_unimplemented(self) -> None:
        for name, (accepted, why) in self.UNIMPLEMENTED.items():
            value = getattr(self, name)
            if not accepted(value):
                raise APIError(f"{name}={json.dumps(value)} is not supported by this server: {why}", param=name,
                               code="unsupported_value")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str  # a JSON object, as text (as OpenAI's API has it)


class ToolCall(BaseModel):
    """A call the model made in an earlier assistant turn (pipeline/chat parsed it then)."""
    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    # An assistant turn's calls and thinking (the model's template decides what it keeps of them),
    # and the call a tool turn answers
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None
    # Only their empty values: we keep no audio (a history that holds it would be a different prompt)
    function_call: None = None
    refusal: str | None = None
    audio: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value):
        """Content parts joined with newlines (as vLLM joins them); only text parts."""
        if not isinstance(value, list):
            return value
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part {i} is {json.dumps(kind) if kind else 'not a text part'}: only "
                                 f"text parts ({{\"type\": \"text\", \"text\": ...}}) are supported")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ValueError(f"content part {i} must be {{\"type\": \"text\", \"text\": STRING}}")
            texts.append(part["text"])
        return "\n".join(texts)

    @model_validator(mode="after")
    def _tool_turn_names_its_call(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def for_template(self) -> dict:
        """What the chat template sees: role and content (a developer message is the system
        message of models that predate the role), and the name, tool calls (arguments as JSON
        text), the call a tool turn answers and the reasoning where they were given."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    UNIMPLEMENTED = {
        **_Request.UNIMPLEMENTED,
        "response_format": (lambda v: v is None or v == {"type": "text"}, "only {\"type\": \"text\"}"),
        "tool_choice": (lambda v: v in (None, "none", "auto", "required") or _names_a_function(v),
                        '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}'),
        "functions": (_empty, "this server does not call functions"),
        "function_call": (lambda v: v in (None, "none", "auto"), "this server does not call functions"),
        "audio": (_null, "text only"),
        "modalities": (lambda v: v is None or v == ["text"], "text only"),
        "reasoning_effort": (_null, "the model's reasoning cannot be set"),
        "verbosity": (_null, "the model's verbosity cannot be set"),
        "web_search_options": (_null, "this server does not search the web"),
        "moderation": (_null, "this server does not moderate"),
        # Hints and bookkeeping that never change the text
        "prediction": (_anything, ""),
        "metadata": (_anything, ""),
        "store": (_anything, ""),
        "service_tier": (_anything, ""),
        "safety_identifier": (_anything, ""),
        "prompt_cache_key": (_anything, ""),
        "prompt_cache_retention": (_anything, ""),
        "prompt_cache_options": (_anything, ""),
        "parallel_tool_calls": (_anything, ""),
    }
    response_format: Any = None
    tools: list[Tool] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own switches: {"thinking": true}, ...
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prediction: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    parallel_tool_calls: Any = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        """The engine's `logprobs`: None for off, else how many alternatives per token."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def forced_call(self) -> str | None:
        """The call tool_choice makes the answer open with (forced_calls.py): "" for any tool
        ("required"), a function's name (`{"type": "function", "function": {"name": ...}}`), or None."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return None
        if not self.tools:
            raise APIError(f"tool_choice={json.dumps(choice)} needs tools to call: none were given",
                           param="tool_choice")
        if choice == "required":
            return ""
        name = choice["function"]["name"]
        if name not in [tool.function.name for tool in self.tools]:
            raise APIError(f"tool_choice: no tool named {json.dumps(name)} was given", param="tool_choice")
        return name

    def template_tools(self) -> list[dict] | None:
        """The tools for the chat template; None where there are none or tool_choice is "none"
        (the model is then not told of them, and its output is not read for calls)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


class CompletionRequest(_Request):
    # One prompt: text, or token ids (a list of one of either is the same prompt)
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    UNIMPLEMENTED = {
        **_Request.UNIMPLEMENTED,
        "best_of": (_one, "one choice per request"),
        "echo": (lambda v: v in (None, False), "the prompt is not echoed"),
        "suffix": (lambda v: v in (None, ""), "no insertion after a suffix"),
    }
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
            if len(value) > 1:
                raise ValueError(f"{len(value)} prompts: this server takes one prompt per request")
            return value[0]
        return value


def parse(kind: type[_Request], body: bytes) -> _Request:
    """A request body as `kind`, or APIError(400) naming the first thing wrong with it."""
    try:
        request = kind.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None
    request.check_unimplemented()
    return request


# The tags pydantic puts in a location for the member of a union it tried ("str", "list[int]"):
# not fields, so not in a parameter's name
UNION_TAGS = ("str", "list[int]", "list[str]")


def validation_error(e: ValidationError, union_tags: tuple[str, ...] = UNION_TAGS, prefix: tuple = (),
                     pydantic_words: bool = False) -> APIError:
    """The first thing wrong with a request as APIError(400) naming its parameter. `union_tags`
    are left out of that name (a discriminated union's are also the item types it takes);
    `prefix` goes before pydantic's location (for a part validated on its own); with
    `pydantic_words` a missing field and a bad value keep pydantic's words and the value is not
    echoed (Anthropic's API words its errors so: "max_tokens: Field required")."""
    error = e.errors(include_url=False)[0]
    kind, loc = error["type"], prefix + tuple(error["loc"])
    param = parameter_name(loc, union_tags)
    if kind == "json_invalid":
        return APIError(f"the body is not valid JSON: {error['msg'].removeprefix('Invalid JSON: ')}",
                        code="invalid_json")
    if kind == "model_type" and not loc:
        return APIError("the body must be a JSON object")
    if kind == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", param=param,
                        code="unrecognized_argument")
    if kind == "union_tag_invalid":
        tag = error.get("ctx", {}).get("tag")
        return APIError(f"{param}: items of type {json.dumps(tag)} are not supported (only "
                        f"{', '.join(union_tags)})", param=param, code="invalid_value")
    if kind == "missing" and not pydantic_words:
        return APIError(f"missing required field: {param}", param=param)
    message = error["msg"].removeprefix("Value error, ")
    if "input" in error and kind != "value_error" and not pydantic_words:
        message += f", got {_short(error['input'])}"
    return APIError(f"{param}: {message}", param=param, code="invalid_value")


def parameter_name(loc: tuple, union_tags: tuple[str, ...] = UNION_TAGS) -> str:
    """pydantic's location as OpenAI names a parameter: messages[0].content"""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not text:
            text = str(part)
        elif part not in union_tags:
            text += f".{part}"
    return text


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- responses ------------------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_completion(id: str, created: int, model: str, text: str | None, finish_reason: str, usage: dict,
                    logprobs: list[dict] | None = None, reasoning: str | None = None,
                    tool_calls: list[dict] | None = None, timing: dict | None = None) -> dict:
    """The message has `reasoning_content` where the model thought (DeepSeek's and Moonshot's field)
    and `tool_calls` where it called tools; `timing` is our extension (see `timing`)."""
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    body = {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": None if logprobs is None else {"content": logprobs},
                         "finish_reason": finish_reason}],
            "usage": usage}
    if timing is not None:
        body["timing"] = timing
    return body


def timing(queued_s: float, ttft_s: float, total_s: float, completion_tokens: int) -> dict:
    """Our extension field of a chat completion and of its stream's finish chunk (clients that do
    not know it ignore it): the same `timing` object as a batch record, whose decode speed the
    chat page shows. Seconds from admission; decode speed over the tokens after the first."""
    decode_s = total_s - ttft_s
    return {"queued_s": round(queued_s, 4), "time_to_first_token_s": round(ttft_s, 4), "total_s": round(total_s, 4),
            "decode_tokens_per_s": round((completion_tokens - 1) / decode_s, 2)
            if completion_tokens > 1 and decode_s > 0 else None}


def chat_chunk(id: str, created: int, model: str, delta: dict | None, finish_reason: str | None = None,
               logprobs: list[dict] | None = None, usage: dict | None = None, include_usage: bool = False) -> dict:
    """One streamed chunk; delta None: the usage chunk (no choices). With include_usage every
    chunk has a `usage` key, null but in the last."""
    chunk = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": []}
    if delta is not None:
        chunk["choices"].append({"index": 0, "delta": delta,
                                 "logprobs": None if logprobs is None else {"content": logprobs},
                                 "finish_reason": finish_reason})
    if include_usage:
        chunk["usage"] = usage
    return chunk


def text_completion(id: str, created: int, model: str, text: str, finish_reason: str | None,
                    usage: dict | None, logprobs: dict | None = None, include_usage: bool = True,
                    choices: bool = True) -> dict:
    """A completion, or (streaming) one chunk of it: both are `text_completion` objects."""
    body = {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
            if choices else []}
    if include_usage:
        body["usage"] = usage
    return body


def chat_token_logprob(token: str, logprob: float, top: list[tuple[str, float]]) -> dict:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": t, "logprob": _finite(lp), "bytes": list(t.encode("utf-8"))} for t, lp in top]}


def completion_logprobs(tokens: list[str], logprobs: list[float], tops: list[list[tuple[str, float]]],
                        offset: int) -> dict:
    """The completions API's logprobs of `tokens`, the first starting at character `offset`."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [_finite(lp) for lp in logprobs],
            "top_logprobs": [{t: _finite(lp) for t, lp in top} for top in tops], "text_offset": offsets}


def _finite(logprob: float) -> float:
    """JSON has no -Infinity: a token of probability 0 gets OpenAI's floor instead."""
    return logprob if math.isfinite(logprob) else -9999.0


def models_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(model_id, created)]}


def model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "pipeline"}


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: {...}` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode("utf-8")
