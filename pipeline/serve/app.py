"""The HTTP routes of `pipeline serve`: a Starlette app that uvicorn runs in a thread of rank 0.

    POST /v1/chat/completions, POST /v1/completions   (streaming or not)
    GET  /v1/models, /v1/models/{id}, /health, /metrics
    GET  /                                            the chat page (static/chat.html)

A request is checked (API key, schema, model name), tokenized in a worker thread, and handed to
the scheduler through the gateway; its events come back and an adapter writes them out. Every
MLX and MPI call stays on the scheduler's thread. A client that goes away cancels its request
at once, whether it is streaming, waiting for a whole response, or still queued.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field
from importlib import resources
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..runtime.requests import Failed, Finished, SamplingParams, Tokens
from ..checkpoints.tokenizer import Tokenizer
from . import chat_output, protocol
from .adapters import ChatAdapter, CompletionAdapter
from .gateway import Gateway, Submission, shutting_down
from .metrics import CONTENT_TYPE, Metrics
from .prompts import chat_prompt_ids, completion_prompt_ids
from .protocol import APIError, ChatCompletionRequest, CompletionRequest

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ALIAS = "default"  # the model's other name, for clients that do not ask /v1/models first


@dataclass
class ServedModel:
    id: str  # as /v1/models lists it
    tokenizer: Tokenizer
    context: int  # the model's context length, in tokens
    vocab_size: int  # rows of its embedding: the token ids a prompt may hold
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Defaults:
    """What a request that sets none gets: the command line's sampling flags, --stop, --max-tokens
    (the cap of a request without max_tokens, which otherwise gets the rest of the context)."""
    sampling: SamplingParams
    stop: list[str]
    max_tokens: int


def log(line: str) -> None:
    print(f"[pipeline] serve: {line}", file=sys.stderr, flush=True)


class EventStream:
    """An ASGI response of server-sent events that calls `on_disconnect` the moment its client goes
    away, even while no chunk is due (a queued request, a long prompt), not at the next write."""

    def __init__(self, chunks: AsyncIterator[bytes], on_disconnect: Callable[[], None]):
        self.chunks, self.on_disconnect = chunks, on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        watcher = asyncio.ensure_future(_call_on_disconnect(receive, self.on_disconnect))
        try:
            async for chunk in self.chunks:  # after a disconnect, to the end: the request's last event
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-write (an ASGI server of spec 2.4 says so this way)
            self.on_disconnect()
        finally:
            watcher.cancel()


async def _call_on_disconnect(receive, callback: Callable[[], None]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    callback()


class Server:
    def __init__(self, model: ServedModel, defaults: Defaults, gateway: Gateway, metrics: Metrics,
                 api_key: str | None = None):
        self.model, self.defaults, self.gateway, self.metrics = model, defaults, gateway, metrics
        self.api_key = api_key

    def app(self) -> Starlette:
        routes = [Route("/", self.chat_page, methods=["GET"]),
                  Route(CHAT, self.chat_completions, methods=["POST"]),
                  Route(COMPLETIONS, self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model_card, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics_text, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _internal_error})

    # -- routes ---------------------------------------------------------------------------------------------

    async def chat_completions(self, http: HTTPRequest) -> Response:
        return await self._generate(http, CHAT)

    async def completions(self, http: HTTPRequest) -> Response:
        return await self._generate(http, COMPLETIONS)

    async def models(self, http: HTTPRequest) -> Response:
        return self._answer("/v1/models", http, lambda: protocol.models_list(self.model.id, self.model.created))

    async def model_card(self, http: HTTPRequest) -> Response:
        def card():
            self._check_model(http.path_params["model"])
            return protocol.model_card(self.model.id, self.model.created)
        return self._answer("/v1/models", http, card)

    async def chat_page(self, http: HTTPRequest) -> Response:
        """The chat page (static/chat.html): it calls this server's own API, with the key the user types."""
        return HTMLResponse(_chat_page())

    async def health(self, http: HTTPRequest) -> Response:
        if self.gateway.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, http: HTTPRequest) -> Response:
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)

    # -- checks ---------------------------------------------------------------------------------------------

    def _authorize(self, http: HTTPRequest) -> None:
        if self.api_key is None:
            return
        scheme, _, key = http.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError("no API key: send the header 'Authorization: Bearer KEY'", status=401,
                           code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError("incorrect API key", status=401, code="invalid_api_key")

    def _check_model(self, name: str) -> None:
        if name not in (ALIAS, self.model.id):
            raise APIError(f"the model '{name}' does not exist: this server has '{self.model.id}' (also called "
                           f"'{ALIAS}')", status=404, param="model", code="model_not_found")

    def _answer(self, endpoint: str, http: HTTPRequest, body: Callable[[], dict]) -> Response:
        try:
            self._authorize(http)
            response = JSONResponse(body())
        except APIError as e:
            response = error_response(e)
        self.metrics.answered(endpoint, response.status_code)
        return response

    # -- generation -----------------------------------------------------------------------------------------

    async def _generate(self, http: HTTPRequest, endpoint: str) -> Response:
        chat = endpoint == CHAT
        try:
            submission, adapter, stream = await self._submit(http, chat)
        except APIError as e:
            self.metrics.answered(endpoint, e.status)
            return error_response(e)
        if stream:
            self.metrics.answered(endpoint, 200)
            return EventStream(self._stream(submission, adapter), submission.cancel)
        watcher = asyncio.ensure_future(_call_on_disconnect(http.receive, submission.cancel))
        outcome = None
        try:
            async for event in submission.events():
                outcome = self._take(submission, adapter, event)
        finally:
            watcher.cancel()
            if outcome is None:  # this task was cancelled (the server stopping) before the request ended
                submission.cancel()
        if isinstance(outcome, APIError):
            response = error_response(outcome)
        else:
            response = JSONResponse(adapter.response())
        self.metrics.answered(endpoint, response.status_code)
        return response

    async def _submit(self, http: HTTPRequest, chat: bool):
        """The checks, in the order OpenAI makes them; then the request handed to the scheduler."""
        self._authorize(http)
        if self.gateway.draining:
            raise shutting_down()
        body = protocol.parse(ChatCompletionRequest if chat else CompletionRequest, await http.body())
        self._check_model(body.model)
        sampling = body.sampling(self.defaults.sampling)
        logprobs = body.top_logprobs_wanted() if chat else body.logprobs
        model = self.model
        output = None
        if chat:
            tools = body.template_tools()
            if tools is not None:
                chat_output.check_tools(model.tokenizer)
            ids = await run_in_threadpool(chat_prompt_ids, model.tokenizer, body.template_messages(), model.context,
                                          tools, body.chat_template_kwargs)
            output = chat_output.output_parser(model.tokenizer, ids, parse_tools=tools is not None)
        else:
            ids = await run_in_threadpool(completion_prompt_ids, model.tokenizer, body.prompt, model.context,
                                          model.vocab_size)
        max_tokens = body.token_limit() or min(self.defaults.max_tokens, model.context - len(ids))
        stop = body.stop if body.stop is not None else self.defaults.stop
        id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        submission = self.gateway.submit(ids, sampling, max_tokens, stop, logprobs, tag=id)
        if chat:
            adapter = ChatAdapter(id, int(submission.submitted), model.id, self._token_text, logprobs is not None,
                                  body.include_usage, output=output)
        else:
            adapter = CompletionAdapter(id, int(submission.submitted), model.id, self._token_text,
                                        logprobs is not None, body.include_usage)
        return submission, adapter, bool(body.stream)

    def _token_text(self, token_id: int) -> str:
        return self.model.tokenizer.decode([token_id])

    async def _stream(self, submission: Submission, adapter) -> AsyncIterator[bytes]:
        ended = False
        try:
            for chunk in adapter.opening():
                yield protocol.sse(chunk)
            async for event in submission.events():
                outcome = self._take(submission, adapter, event)
                ended = not isinstance(event, Tokens)
                if isinstance(outcome, APIError):  # the openai client raises it as an APIError
                    yield protocol.sse(outcome.body())
                else:
                    for chunk in outcome:
                        yield protocol.sse(chunk)
            yield protocol.sse("[DONE]")
        finally:
            if not ended:  # the response task itself was cancelled (the server stopping)
                submission.cancel()

    def _take(self, submission: Submission, adapter, event):
        """One event of the request: the chunks it makes, or the APIError that ends it."""
        id = submission.request.tag
        if isinstance(event, Tokens):
            return adapter.tokens(event)
        if isinstance(event, Failed):
            self.metrics.failed()
            log(f"{id} failed: {event.message}")
            return APIError(f"the request failed: {event.message}", status=500)
        self.metrics.ended(event)
        log(request_line(id, event))
        if event.reason == "cancelled":  # the client left (no one reads this), or the server is shutting down
            return APIError("the request was cancelled: the server is shutting down", status=503,
                            code="cancelled", type="server_error")
        return adapter.finished(event)


def request_line(id: str, finished: Finished) -> str:
    """The log line of a request: id, tokens, time to first token (from submission), decode speed."""
    decode_s = finished.total_s - finished.ttft_s
    speed = (finished.completion_tokens - 1) / decode_s if finished.completion_tokens > 1 and decode_s > 0 else 0.0
    return (f"{id} prompt {finished.prompt_tokens} tokens ({finished.cached_tokens} cached), completion "
            f"{finished.completion_tokens} tokens, TTFT {finished.queued_s + finished.ttft_s:.3f} s, "
            f"{speed:.1f} tok/s, finish {finished.reason}")


@functools.cache
def _chat_page() -> str:
    return resources.files(__package__).joinpath("static", "chat.html").read_text(encoding="utf-8")


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _http_error(http: HTTPRequest, exc: HTTPException) -> Response:
    """Starlette's own 404 (no such route) and 405, as OpenAI-style bodies."""
    message = f"{http.method} {http.url.path}: {exc.detail}"
    return error_response(APIError(message, status=exc.status_code))


async def _internal_error(http: HTTPRequest, exc: Exception) -> Response:
    traceback.print_exception(exc, file=sys.stderr)
    return error_response(APIError(f"internal error: {type(exc).__name__}: {exc}", status=500))
