"""The APIs over the one request path, and engine events (requests.Tokens, Finished, Failed)
turned into the OpenAI wire format: the chunks of a stream, or the one response body of a request
that does not stream.

Each API (`API`: Chat Completions and Completions here, Anthropic's Messages in
anthropic_adapter.py) parses its body into a `Generation`; app.py renders the prompt, submits it
and feeds the engine's events to the API's adapter.

One adapter per request. It sees every event in order; streaming sends what `opening`, `tokens`
and `finished` return as they come, a plain request sends `response()` at the end. Both come
from the same events, so a streamed text and a plain one are the same text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from ..chat.output import ChatMessage, ChatOutputParser
from ..runtime.requests import Finished, SamplingParams, TokenLogprob, Tokens
from . import chat_output, protocol
from .protocol import APIError, ChatCompletionRequest, CompletionRequest


@dataclass
class Generation:
    """A request of any API reduced to what the one request path needs: the prompt (a chat for the
    template, or a completion's raw prompt), the sampling, the limits, and the parsed body (for
    the adapter, which answers in the request's own terms)."""
    model: str                          # the model the request names
    stream: bool
    sampling: SamplingParams            # the request's settings over the command's flags
    max_tokens: int | None              # None: the rest of the context, capped by --max-tokens
    stop: list[str] | None              # None: the command's --stop
    body: Any                           # the parsed request
    messages: list[dict] | None = None  # a chat in OpenAI's shape, for the chat template
    tools: list[dict] | None = None     # OpenAI's function list for the template; None: no tools, no calls parsed
    template_kwargs: dict | None = None  # the template's own switches ({"thinking": true}, ...)
    prompt: str | list[int] | None = None  # a completion's prompt: text or token ids
    logprobs: int | None = None         # the engine's logprobs: None off, else alternatives per token
    forced_call: str | None = None      # a call the answer must open with: of this tool, or of any where ""
    prompt_tokens: int = 0              # the rendered prompt's length (set once it is rendered)


class API:
    """One HTTP API over the shared request path (app.py's Server): how its body becomes a
    Generation, the adapter that writes the engine's events in its wire format, and its error shape."""
    endpoint: ClassVar[str]   # its route, and its label in /metrics
    id_prefix: ClassVar[str]  # of the ids of its responses
    x_api_key: ClassVar[bool] = False  # the key may come as `x-api-key: KEY` besides `Authorization: Bearer KEY`
    ping_s: ClassVar[float | None] = None  # a stream's keep-alive event, after this long with nothing sent

    def parse(self, body: bytes, sampling: SamplingParams, check_model: Callable[[str], None]) -> Generation:
        """The body as a Generation, or APIError. `sampling`: the command's flags; `check_model`
        raises the 404 of a model this server does not have (for APIs that name models)."""
        raise NotImplementedError

    def adapter(self, id: str, created: int, model: str, token_text: Callable[[int], str], generation: Generation,
                output: ChatOutputParser | None):
        raise NotImplementedError

    def error_body(self, error: APIError) -> dict:
        return error.body()

    def error_status(self, error: APIError) -> int:
        return error.status

    def event(self, chunk: dict) -> bytes:
        """One of the adapter's chunks as a server-sent event."""
        return protocol.sse(chunk)

    def stream_error(self, error: APIError, adapter=None) -> bytes:
        """The error that ends a stream that has begun (the openai client raises it as an APIError);
        `adapter`: the request's, for APIs whose stream ends in the response's own terms (Responses)."""
        return protocol.sse(error.body())

    def stream_end(self) -> bytes:
        return protocol.sse("[DONE]")

    def ping(self) -> bytes:
        raise NotImplementedError


class ChatAPI(API):
    endpoint, id_prefix = "/v1/chat/completions", "chatcmpl-"

    def parse(self, body: bytes, sampling: SamplingParams, check_model: Callable[[str], None]) -> Generation:
        request = protocol.parse(ChatCompletionRequest, body)
        check_model(request.model)
        return Generation(request.model, bool(request.stream), request.sampling(sampling), request.token_limit(),
                          request.stop, request, messages=request.template_messages(),
                          tools=request.template_tools(), template_kwargs=request.chat_template_kwargs,
                          logprobs=request.top_logprobs_wanted(), forced_call=request.forced_call())

    def adapter(self, id, created, model, token_text, generation, output):
        return ChatAdapter(id, created, model, token_text, generation.logprobs is not None,
                           generation.body.include_usage, output=output)


class CompletionsAPI(API):
    endpoint, id_prefix = "/v1/completions", "cmpl-"

    def parse(self, body: bytes, sampling: SamplingParams, check_model: Callable[[str], None]) -> Generation:
        request = protocol.parse(CompletionRequest, body)
        check_model(request.model)
        return Generation(request.model, bool(request.stream), request.sampling(sampling), request.token_limit(),
                          request.stop, request, prompt=request.prompt, logprobs=request.logprobs)

    def adapter(self, id, created, model, token_text, generation, output):
        return CompletionAdapter(id, created, model, token_text, generation.logprobs is not None,
                                 generation.body.include_usage)


class _Adapter:
    def __init__(self, id: str, created: int, model: str, token_text: Callable[[int], str], logprobs: bool,
                 include_usage: bool):
        self.id, self.created, self.model = id, created, model
        self.token_text = token_text  # a token's own text, for logprobs
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.finish: Finished | None = None

    def usage(self, finished: Finished) -> dict:
        return protocol.usage(finished.prompt_tokens, finished.completion_tokens, finished.cached_tokens)

    def _alternatives(self, logprob: TokenLogprob) -> list[tuple[str, float]]:
        return [(self.token_text(token), lp) for token, lp in logprob.top]


class ChatAdapter(_Adapter):
    """/v1/chat/completions: `chat.completion`, or `chat.completion.chunk`s with deltas. The text
    goes through `output` (pipeline.chat): a thinking model's reasoning comes apart from its
    answer, and tool calls as `tool_calls`; without one, all of it is content."""

    def __init__(self, *args, output: ChatOutputParser | None = None, **kw):
        super().__init__(*args, **kw)
        self.entries: list[dict] = []  # logprobs of every token, for the plain response
        self.output = output or ChatOutputParser(in_reasoning=None, tool_format=None)
        self.message = ChatMessage()   # the parsed answer, for the plain response

    def _deltas(self, text: str) -> list[dict]:
        events = self.output.feed(text)
        self.message.add(events)
        return chat_output.deltas(events)

    def _chunk(self, delta: dict | None, finish_reason: str | None = None, logprobs: list[dict] | None = None,
               usage: dict | None = None) -> dict:
        return protocol.chat_chunk(self.id, self.created, self.model, delta, finish_reason, logprobs, usage,
                                   self.include_usage)

    def opening(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def tokens(self, event: Tokens) -> list[dict]:
        deltas = self._deltas(event.text)
        if event.logprob is None:
            return [self._chunk(delta) for delta in deltas]
        entry = protocol.chat_token_logprob(self.token_text(event.token_id), event.logprob.logprob,
                                            self._alternatives(event.logprob))
        self.entries.append(entry)
        # A token whose text is held back (half a character, a possible stop string or marker) still has its logprob
        first = deltas[0] if deltas else {"content": ""}
        return [self._chunk(first, logprobs=[entry])] + [self._chunk(delta) for delta in deltas[1:]]

    def finished(self, event: Finished) -> list[dict]:
        self.finish = event
        events = self.output.feed(event.tail) + self.output.finish()
        self.message.add(events)
        chunks = [self._chunk(delta) for delta in chat_output.deltas(events)]
        last = self._chunk({}, self.output.finish_reason(event.reason))
        last["timing"] = self._timing(event)  # our extension: the chat page shows its decode speed
        chunks.append(last)
        if self.include_usage:
            chunks.append(self._chunk(None, usage=self.usage(event)))
        return chunks

    def _timing(self, event: Finished) -> dict:
        return protocol.timing(event.queued_s, event.ttft_s, event.total_s, event.completion_tokens)

    def response(self) -> dict:
        message = self.message
        reasoning = "" if message.reasoning is None and self.output.reasoned else message.reasoning
        return protocol.chat_completion(self.id, self.created, self.model, message.content,
                                        self.output.finish_reason(self.finish.reason), self.usage(self.finish),
                                        self.entries if self.logprobs else None, reasoning=reasoning,
                                        tool_calls=message.tool_calls, timing=self._timing(self.finish))


class CompletionAdapter(_Adapter):
    """/v1/completions: `text_completion` objects, whole or as chunks."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.tokens_text: list[str] = []
        self.token_logprobs: list[float] = []
        self.tops: list[list[tuple[str, float]]] = []
        self.streamed_chars = 0  # text sent so far, where the next chunk's token offsets start

    def _chunk(self, text: str, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        return protocol.text_completion(self.id, self.created, self.model, text, finish_reason, None, logprobs,
                                        self.include_usage)

    def opening(self) -> list[dict]:
        return []

    def _logprobs(self, event: Tokens) -> dict:
        token = self.token_text(event.token_id)
        top = self._alternatives(event.logprob)
        self.tokens_text.append(token)
        self.token_logprobs.append(event.logprob.logprob)
        self.tops.append(top)
        offset = sum(len(t) for t in self.tokens_text[:-1])
        return protocol.completion_logprobs([token], [event.logprob.logprob], [top], offset)

    def tokens(self, event: Tokens) -> list[dict]:
        if event.logprob is None:
            return [self._chunk(event.text)] if event.text else []
        return [self._chunk(event.text, logprobs=self._logprobs(event))]

    def finished(self, event: Finished) -> list[dict]:
        self.finish = event
        chunks = [self._chunk(event.tail)] if event.tail else []
        chunks.append(self._chunk("", event.reason))
        if self.include_usage:
            chunks.append(protocol.text_completion(self.id, self.created, self.model, "", None, self.usage(event),
                                                   choices=False))
        return chunks

    def response(self) -> dict:
        logprobs = None
        if self.logprobs:
            logprobs = protocol.completion_logprobs(self.tokens_text, self.token_logprobs, self.tops, 0)
        return protocol.text_completion(self.id, self.created, self.model, self.finish.text, self.finish.reason,
                                        self.usage(self.finish), logprobs)
