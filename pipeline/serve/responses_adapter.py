"""`POST /v1/responses` on the one request path: `ResponsesAPI` parses a request into a Generation
(its conversation, previous responses' included, as the chat template's messages) and keeps the
responses for GET, DELETE and previous_response_id; `ResponsesAdapter` turns the engine's events
into output items (`reasoning`, `message`, `function_call`) built from the chat-output parser's
events, as the stream of events OpenAI's server sends (each with its `sequence_number`, each
item's with its `output_index`) or as the one `response` object at the end. Both come from the
same events, so a streamed answer and a plain one are the same answer.

The stream, in order: `response.created`, `response.in_progress`; per item
`response.output_item.added`, its parts and deltas (`response.reasoning_summary_part.added`,
`response.reasoning_summary_text.delta`, ... / `response.content_part.added`,
`response.output_text.delta`, ... / `response.function_call_arguments.delta`, ...), their
`...done` events and `response.output_item.done` with the whole item (Codex builds its turn from
that one); then `response.completed` (with the usage), even where the answer was cut off by
max_output_tokens (the response's status then says `incomplete`), or `response.failed`.
"""

from __future__ import annotations

import sys
import uuid
from dataclasses import dataclass
from typing import Callable

from ..chat.events import ContentDelta, Event, ReasoningDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from ..chat.output import ChatOutputParser
from ..runtime.requests import Finished, SamplingParams, Tokens
from . import responses_protocol as rp
from .adapters import API, Generation
from .protocol import APIError
from .responses_protocol import FunctionCallItem, MessageItem, ReasoningItem, ResponsesRequest, ToolNames
from .responses_store import ResponseStore

PING_S = 15.0  # an SSE comment after this long with nothing sent (a long prefill), which clients skip


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ResponsesCall:
    """A parsed request with what its answer needs: the conversation so far (for the store) and
    the tools' names (a namespace's calls go back with their namespace)."""
    request: ResponsesRequest
    conversation: list  # every input item, the previous responses' included
    names: ToolNames


class ResponsesAPI(API):
    """`POST /v1/responses` over the shared request path; `store` keeps the responses for GET,
    DELETE and previous_response_id."""
    endpoint, id_prefix = "/v1/responses", "resp_"
    ping_s = PING_S

    def __init__(self, store: ResponseStore | None = None):
        self.store = store if store is not None else ResponseStore()
        self.left_out: set[str] = set()  # tool types already logged as left out of the prompt

    def parse(self, body: bytes, sampling: SamplingParams, check_model: Callable[[str], None]) -> Generation:
        request = rp.parse(body)
        if request.model is not None:
            check_model(request.model)
        conversation = list(request.input)
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise APIError(f"previous_response_id: no response '{request.previous_response_id}' is stored "
                               f"here (the server keeps the last {self.store.capacity} responses and "
                               f"{self.store.max_chars // 2**20}M characters of their conversations, not those sent "
                               f"with store: false, in memory): resend the conversation's items instead",
                               param="previous_response_id", code="previous_response_not_found")
            conversation = list(previous.conversation) + conversation
        if not conversation:
            raise APIError("input is empty: send a string or at least one item", param="input")
        tools, left_out = request.function_tools()
        for kind in sorted(set(left_out) - self.left_out):
            self.left_out.add(kind)
            print(f"[pipeline] serve: /v1/responses: tools of type '{kind}' are left out of the prompt (only "
                  f"function and namespace tools are offered to the model)", file=sys.stderr, flush=True)
        return Generation(request.model or "", bool(request.stream), request.sampling(sampling),
                          request.max_output_tokens, None, ResponsesCall(request, conversation, ToolNames(tools)),
                          messages=rp.template_messages(request.instructions, conversation),
                          tools=request.template_tools(tools), template_kwargs=request.chat_template_kwargs,
                          forced_call=request.forced_call(tools))

    def adapter(self, id, created, model, token_text, generation, output):
        call = generation.body
        return ResponsesAdapter(id, created, model, call.request, output, call.names,
                                store=self.store if call.request.store is not False else None,
                                conversation=call.conversation)

    def get(self, id: str) -> dict:
        """GET /v1/responses/{id}: the stored response object."""
        stored = self.store.get(id)
        if stored is None:
            raise _not_stored(id, self.store)
        return stored.response

    def delete(self, id: str) -> dict:
        if not self.store.delete(id):
            raise _not_stored(id, self.store)
        return rp.deleted(id)

    def event(self, chunk: dict) -> bytes:
        return rp.sse(chunk)

    def stream_error(self, error: APIError, adapter=None) -> bytes:
        """The response's end where it failed: its open item closed, `response.failed` with the error."""
        if adapter is None:
            return rp.sse({"type": "error", "sequence_number": 0, "code": error.code or error.type,
                           "message": error.message, "param": error.param})
        return b"".join(rp.sse(event) for event in adapter.failed(error.message, error.code or error.type))

    def stream_end(self) -> bytes:
        return b""  # the Responses API ends a stream with response.completed or response.failed, no [DONE]

    def ping(self) -> bytes:
        return b": keep-alive\n\n"


class _OpenItem:
    """An output item being streamed: its dict (as output_item.done will send it) and index."""

    def __init__(self, index: int, item: dict):
        self.index, self.item = index, item
        self.text = ""  # the reasoning, the text or the arguments so far


def _not_stored(id: str, store: ResponseStore) -> APIError:
    return APIError(f"no response '{id}' is stored here: the server keeps the last {store.capacity} responses and "
                    f"{store.max_chars // 2**20}M characters of their conversations (not those sent with store: "
                    f"false), in memory, until it stops", status=404, param="response_id", code="not_found")


class ResponsesAdapter:
    """One request's events in, Responses API events out (`opening`, `tokens`, `finished`,
    `failed`); `response()` is the whole response object once it ended."""

    def __init__(self, id: str, created_at: int, model: str, request: ResponsesRequest, output: ChatOutputParser | None,
                 names: ToolNames, store: ResponseStore | None = None, conversation: list | None = None,
                 new_item_id: Callable[[str], str] = new_id):
        """store: where the response goes once it ended, with `conversation` (its input items) and
        its output; None where the request said store: false."""
        self.id, self.created_at, self.model, self.request = id, created_at, model, request
        self.output = output or ChatOutputParser(in_reasoning=None, tool_format=None)
        self.names, self.new_item_id = names, new_item_id
        self.store, self.conversation = store, conversation or []
        self.items: list[dict] = []        # every output item, in order, as it stands
        self.open: _OpenItem | None = None
        self.blank = ""                    # blank text not yet in a message: dropped if a call or nothing follows
        self.sequence = 0
        self.reasoning_tokens = 0          # tokens sampled before the answer began
        self.answering = False
        self.status, self.incomplete, self.usage, self.error = "in_progress", None, None, None

    # -- the events in ---------------------------------------------------------------------------------------

    def opening(self) -> list[dict]:
        snapshot = self.response()
        return [self._event("response.created", response=snapshot), self._event("response.in_progress",
                                                                                   response=snapshot)]

    def tokens(self, event: Tokens) -> list[dict]:
        out = self._take(self.output.feed(event.text))
        if not self.answering:  # the thinking's tokens, its end marker included
            self.reasoning_tokens += 1
        return out

    def finished(self, event: Finished) -> list[dict]:
        out = self._take(self.output.feed(event.tail) + self.output.finish())
        if self.blank and not self.items:  # an answer of blank text alone is still the answer
            out += self._text(self.blank)
        cut = event.reason == "length"
        out += self._close(incomplete=cut)
        self.status = "incomplete" if cut else "completed"
        self.incomplete = "max_output_tokens" if cut else None
        self.usage = rp.usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens,
                              self.reasoning_tokens if self.output.reasoned else 0)
        if self.store is not None:
            self.store.put(self.response(), self.conversation + self.conversation_items())
        # response.completed whatever the status: Codex retries a stream that lacks it
        return out + [self._event("response.completed", response=self.response())]

    def failed(self, message: str, code: str = "server_error") -> list[dict]:
        out = self._close(incomplete=True)
        self.status, self.error = "failed", {"code": code, "message": message}
        return out + [self._event("response.failed", response=self.response())]

    def response(self) -> dict:
        return rp.response_object(self.id, self.created_at, self.model, self.request, self.status,
                                  [dict(item) for item in self.items], self.usage, self.incomplete, self.error)

    def conversation_items(self) -> list:
        """The output as input items, for a follow-up's previous_response_id."""
        items = []
        for item in self.items:
            if item["type"] == "reasoning":
                items.append(ReasoningItem.model_validate(item))
            elif item["type"] == "message":
                items.append(MessageItem(role="assistant", content=item["content"][0]["text"]))
            else:
                items.append(FunctionCallItem.model_validate(item))
        return items

    # -- parser events to items ------------------------------------------------------------------------------

    def _take(self, events: list[Event]) -> list[dict]:
        out: list[dict] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                out += self._reasoning(event.text)
                continue
            self.answering = True
            if isinstance(event, ContentDelta):
                if self._kind() != "message" and not event.text.strip():
                    self.blank += event.text  # blank space before a call is no message of its own
                else:
                    out += self._text(event.text)
            elif isinstance(event, ToolCallStart):
                self.blank = ""
                out += self._call_start(event)
            elif isinstance(event, ToolCallArguments):
                out += self._arguments(event.text)
            elif isinstance(event, ToolCallEnd):  # one broken off (max_tokens, malformed) is incomplete
                out += self._close(incomplete=not event.complete)
        return out

    def _kind(self) -> str | None:
        return self.open.item["type"] if self.open else None

    def _reasoning(self, text: str) -> list[dict]:
        out = []
        if self._kind() != "reasoning":
            out += self._close()
            out += self._add({"id": self.new_item_id("rs"), "type": "reasoning", "summary": [],
                              "status": "in_progress"})
            out.append(self._item_event("response.reasoning_summary_part.added", summary_index=0,
                                        part={"type": "summary_text", "text": ""}))
        self.open.text += text
        return out + [self._item_event("response.reasoning_summary_text.delta", summary_index=0, delta=text)]

    def _text(self, text: str) -> list[dict]:
        out = []
        if self._kind() != "message":
            out += self._close()
            out += self._add({"id": self.new_item_id("msg"), "type": "message", "role": "assistant",
                              "status": "in_progress", "content": []})
            out.append(self._item_event("response.content_part.added", content_index=0,
                                        part={"type": "output_text", "text": "", "annotations": []}))
            text, self.blank = self.blank + text, ""
        self.open.text += text
        return out + [self._item_event("response.output_text.delta", content_index=0, delta=text, logprobs=[])]

    def _call_start(self, event: ToolCallStart) -> list[dict]:
        out = self._close()
        namespace, name = self.names.split(event.name)
        item = {"id": self.new_item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": event.id,
                "name": name, "arguments": ""}
        if namespace is not None:
            item["namespace"] = namespace
        return out + self._add(item)

    def _arguments(self, text: str) -> list[dict]:
        self.open.text += text
        return [self._item_event("response.function_call_arguments.delta", delta=text)]

    def _add(self, item: dict) -> list[dict]:
        self.open = _OpenItem(len(self.items), item)
        self.items.append(item)
        return [self._event("response.output_item.added", output_index=self.open.index, item=dict(item))]

    def _close(self, incomplete: bool = False) -> list[dict]:
        """The open item's done events, and the item as it ends (whole, as Codex takes it)."""
        if self.open is None:
            return []
        open, item = self.open, self.open.item
        text = open.text
        out = []
        if item["type"] == "reasoning":
            part = {"type": "summary_text", "text": text}
            out += [self._item_event("response.reasoning_summary_text.done", summary_index=0, text=text),
                    self._item_event("response.reasoning_summary_part.done", summary_index=0, part=part)]
            item["summary"] = [part]
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out += [self._item_event("response.output_text.done", content_index=0, text=text, logprobs=[]),
                    self._item_event("response.content_part.done", content_index=0, part=part)]
            item["content"] = [part]
        else:
            out.append(self._item_event("response.function_call_arguments.done", name=item["name"], arguments=text))
            item["arguments"] = text
        item["status"] = "incomplete" if incomplete else "completed"
        self.open = None
        return out + [self._event("response.output_item.done", output_index=open.index, item=dict(item))]

    # -- event envelopes -------------------------------------------------------------------------------------

    def _event(self, type: str, **fields) -> dict:
        event = {"type": type, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _item_event(self, type: str, **fields) -> dict:
        return self._event(type, item_id=self.open.item["id"], output_index=self.open.index, **fields)
