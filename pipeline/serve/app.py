"""The HTTP routes of `pipeline serve`: a Starlette app that uvicorn runs in a thread of rank 0.

    POST /v1/chat/completions, POST /v1/completions   (streaming or not)
    POST /v1/responses, GET and DELETE /v1/responses/{id}   (OpenAI's Responses API)
    POST /v1/messages, /v1/messages/count_tokens      (Anthropic's Messages API)
    GET  /v1/models, /v1/models/{id}, /health, /metrics
    GET  /                                            the chat page (static/chat.html)
    GET  /static/NAME                                 the chat page's vendored scripts and style (static/vendor/)

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

from ..cluster import mpi
from ..runtime.requests import Failed, Finished, SamplingParams, Tokens
from ..checkpoints.tokenizer import Tokenizer
from . import chat_output, limits, protocol
from ..chat.reasoning import prompt_opens_reasoning, template_thinks
from ..chat.tool_calls import format_for_template
from .adapters import API, ChatAPI, CompletionsAPI, Generation
from .anthropic_adapter import MessagesAPI
from .forced_calls import forced_call_prefix
from .gateway import Gateway, Submission, shutting_down
from .metrics import CONTENT_TYPE, Metrics
from .prompts import chat_prompt_ids, check_length, completion_prompt_ids
from .responses_adapter import ResponsesAPI
from .protocol import APIError

CHAT, COMPLETIONS, MESSAGES = ChatAPI(), CompletionsAPI(), MessagesAPI()
COUNT_TOKENS = "/v1/messages/count_tokens"
COUNT_LIMIT = 4  # count_tokens counts prompts up to this many times the context
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
    (the cap of a request without max_tokens, which otherwise gets the rest of the context); and
    the most bytes any request's body may have (--max-request-mb; limits.py)."""
    sampling: SamplingParams
    stop: list[str]
    max_tokens: int
    max_request_bytes: int


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
        self.responses = ResponsesAPI()  # its store of responses is this server's

    def app(self) -> Starlette:
        routes = [Route("/", self.chat_page, methods=["GET"]),
                  Route("/static/{name}", self.static_file, methods=["GET"]),
                  Route(CHAT.endpoint, self.chat_completions, methods=["POST"]),
                  Route(COMPLETIONS.endpoint, self.completions, methods=["POST"]),
                  Route(MESSAGES.endpoint, self.messages, methods=["POST"]),
                  Route(COUNT_TOKENS, self.count_tokens, methods=["POST"]),
                  Route(self.responses.endpoint, self.create_response, methods=["POST"]),
                  Route(self.responses.endpoint + "/{id}", self.stored_response, methods=["GET", "DELETE"]),
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

    async def messages(self, http: HTTPRequest) -> Response:
        return await self._generate(http, MESSAGES)

    async def count_tokens(self, http: HTTPRequest) -> Response:
        """Anthropic's count_tokens: the prompt's tokens as /v1/messages renders it, counted up to
        COUNT_LIMIT contexts (past that a 400: tokenizing megabytes whole would hold the GIL for
        seconds, stalling every other request, to count a prompt that can never run)."""
        tokenizer = self.model.tokenizer
        try:
            self._authorize(http, x_api_key=True)
            body = await limits.read_body(http, self.defaults.max_request_bytes)
            request = await run_in_threadpool(MESSAGES.parse_count, body)
            tools = request.template_tools()
            if tools is not None:
                chat_output.check_tools(tokenizer)
            ids = await run_in_threadpool(chat_prompt_ids, tokenizer, request.template_messages(),
                                          COUNT_LIMIT * self.model.context, tools,
                                          request.template_kwargs())
            response = JSONResponse({"input_tokens": len(ids)})
        except APIError as e:
            response = error_response(e, MESSAGES)
        self.metrics.answered(COUNT_TOKENS, response.status_code)
        return response

    async def create_response(self, http: HTTPRequest) -> Response:
        return await self._generate(http, self.responses)

    async def stored_response(self, http: HTTPRequest) -> Response:
        id, store = http.path_params["id"], self.responses
        return self._answer(store.endpoint, http, lambda: store.delete(id) if http.method == "DELETE" else store.get(id))

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

    async def static_file(self, http: HTTPRequest) -> Response:
        """A vendored script or style of the chat page (static/vendor/: only its .js and .css files), which
        the browser may cache for a day."""
        types = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
        vendor = resources.files(__package__).joinpath("static", "vendor")
        name = http.path_params["name"]
        suffix = name[name.rfind("."):]
        if suffix not in types or name not in {f.name for f in vendor.iterdir()}:
            raise HTTPException(404, "no such file")
        return Response(vendor.joinpath(name).read_bytes(), media_type=types[suffix],
                        headers={"cache-control": "public, max-age=86400"})

    async def health(self, http: HTTPRequest) -> Response:
        if mpi.job_ending():  # a rank is known gone (or another failure): the job ends in a moment
            return JSONResponse({"status": "ending", "reason": mpi.job_ending()}, status_code=503)
        if self.gateway.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, http: HTTPRequest) -> Response:
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)

    # -- checks ---------------------------------------------------------------------------------------------

    def _authorize(self, http: HTTPRequest, x_api_key: bool = False) -> None:
        """The key of --api-key, as `Authorization: Bearer KEY` (or, where `x_api_key`, as Anthropic's
        `x-api-key: KEY`)."""
        if self.api_key is None:
            return
        scheme, _, key = http.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            key = http.headers.get("x-api-key", "") if x_api_key else ""
        if not key:
            where = "'x-api-key: KEY' or 'Authorization: Bearer KEY'" if x_api_key else "'Authorization: Bearer KEY'"
            raise APIError(f"no API key: send the header {where}", status=401, code="invalid_api_key")
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

    async def _generate(self, http: HTTPRequest, api: API) -> Response:
        """Any API's request, along the one path: checked and parsed (`_submit`), handed to the
        scheduler, its events written out by the API's adapter as a stream or one body."""
        try:
            submission, adapter, stream = await self._submit(http, api)
        except APIError as e:
            response = error_response(e, api)
            self.metrics.answered(api.endpoint, response.status_code)
            return response
        if stream:
            self.metrics.answered(api.endpoint, 200)
            return EventStream(self._stream(submission, adapter, api), submission.cancel)
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
            response = error_response(outcome, api)
        else:
            response = JSONResponse(adapter.response())
        self.metrics.answered(api.endpoint, response.status_code)
        return response

    async def _submit(self, http: HTTPRequest, api: API):
        """The checks, in the order OpenAI makes them; then the prompt rendered (the same for every
        API), and the request handed to the scheduler with the API's adapter for its events."""
        self._authorize(http, api.x_api_key)
        if self.gateway.draining:
            raise shutting_down()
        body = await limits.read_body(http, self.defaults.max_request_bytes)
        # In a worker thread: a body of megabytes takes milliseconds to parse, which the loop's other requests need
        request = await run_in_threadpool(api.parse, body, self.defaults.sampling, self._check_model)
        del body  # the parsed request holds what is needed of it
        ids, output = await self._prompt(request)
        max_tokens = request.max_tokens or min(self.defaults.max_tokens, self.model.context - len(ids))
        stop = request.stop = request.stop if request.stop is not None else self.defaults.stop
        id = f"{api.id_prefix}{uuid.uuid4().hex[:24]}"
        submission = self.gateway.submit(ids, request.sampling, max_tokens, stop, request.logprobs, tag=id)
        adapter = api.adapter(id, int(submission.submitted), self.model.id, self._token_text, request, output)
        return submission, adapter, request.stream

    async def _prompt(self, request: Generation):
        """The prompt's token ids, in a worker thread, and for a chat the parser of its answer."""
        model = self.model
        if request.messages is None:
            ids = await run_in_threadpool(completion_prompt_ids, model.tokenizer, request.prompt, model.context,
                                          model.vocab_size)
            return ids, None
        if request.tools is not None:
            chat_output.check_tools(model.tokenizer)
        ids = await run_in_threadpool(chat_prompt_ids, model.tokenizer, request.messages, model.context,
                                      request.tools, request.template_kwargs)
        output = chat_output.output_parser(model.tokenizer, ids, parse_tools=request.tools is not None,
                                            tools=request.tools)
        if request.forced_call is not None and request.tools is not None:
            ids = self._force_call(request, ids, output)
        request.prompt_tokens = len(ids)
        return ids, output

    def _force_call(self, request: Generation, ids: list[int], output) -> list[int]:
        """The prompt with the answer opened by a call (forced_calls.py), which the parser reads first."""
        tokenizer = self.model.tokenizer
        if template_thinks(tokenizer.chat_template) and prompt_opens_reasoning(tokenizer.decode(ids[-16:])):
            raise APIError("this model's template opens a thinking block in the prompt, so a tool call cannot be "
                           "forced: use tool_choice auto", param="tool_choice")
        calls_so_far = sum(len(m.get("tool_calls") or []) for m in request.messages)
        prefix = forced_call_prefix(format_for_template(tokenizer.chat_template), request.forced_call or None,
                                    calls_so_far)
        ids = ids + tokenizer.encode(prefix, add_special_tokens=False)
        check_length(len(ids), self.model.context, "messages")
        output.feed(prefix)  # no events: the parser is now inside the call
        return ids

    def _token_text(self, token_id: int) -> str:
        return self.model.tokenizer.decode([token_id])

    async def _stream(self, submission: Submission, adapter, api: API) -> AsyncIterator[bytes]:
        ended = False
        try:
            for chunk in adapter.opening():
                yield api.event(chunk)
            async for event in with_pings(submission.events(), api.ping_s):
                if event is None:  # nothing to send for a while (a long prompt, a full queue): keep the line alive
                    yield api.ping()
                    continue
                outcome = self._take(submission, adapter, event)
                ended = not isinstance(event, Tokens)
                if isinstance(outcome, APIError):
                    yield api.stream_error(outcome, adapter)
                else:
                    for chunk in outcome:
                        yield api.event(chunk)
            end = api.stream_end()
            if end:
                yield end
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


async def with_pings(events: AsyncIterator, every_s: float | None) -> AsyncIterator:
    """`events`, with a None put in whenever `every_s` seconds pass without one (never, where None)."""
    if every_s is None:
        async for event in events:
            yield event
        return
    iterator = events.__aiter__()
    next_event = asyncio.ensure_future(iterator.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({next_event}, timeout=every_s)
            if not done:
                yield None
                continue
            try:
                event = next_event.result()
            except StopAsyncIteration:
                return
            yield event
            next_event = asyncio.ensure_future(iterator.__anext__())
    finally:
        next_event.cancel()


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


def error_response(error: APIError, api: API = CHAT) -> JSONResponse:
    """`error` in `api`'s shape and status (OpenAI's unless said)."""
    return JSONResponse(api.error_body(error), status_code=api.error_status(error), headers=error.headers)


def _path_error(http: HTTPRequest, error: APIError) -> JSONResponse:
    """An error outside any route's own handling, in the shape of the API its path belongs to."""
    return error_response(error, MESSAGES if http.url.path.startswith(MESSAGES.endpoint) else CHAT)


async def _http_error(http: HTTPRequest, exc: HTTPException) -> Response:
    """Starlette's own 404 (no such route) and 405, as OpenAI-style (or Anthropic-style) bodies."""
    message = f"{http.method} {http.url.path}: {exc.detail}"
    return _path_error(http, APIError(message, status=exc.status_code))


async def _internal_error(http: HTTPRequest, exc: Exception) -> Response:
    traceback.print_exception(exc, file=sys.stderr)
    return _path_error(http, APIError(f"internal error: {type(exc).__name__}: {exc}", status=500))
