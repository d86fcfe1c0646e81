"""Anthropic's Messages API over the one request path: `MessagesAPI` parses a body into the
shared Generation (anthropic_protocol.py does the wire format), and `MessagesAdapter` writes the
chat-output parser's events as Anthropic's content blocks, streamed or whole.

A stream: `message_start` at once (before the prompt's prefill), then per content block
`content_block_start`, its deltas (`thinking_delta` and a closing `signature_delta`,
`text_delta`, `input_json_delta` per piece of a call's arguments, however many the parser
makes), `content_block_stop`; then `message_delta` with the stop reason and the usage, and
`message_stop`. While nothing else is due (a long prefill, a full queue), a `ping` every
PING_S seconds keeps the client from giving up. The whole reply is built from the same events.
"""

from __future__ import annotations

import json
import uuid
from typing import Callable

from ..chat.events import ContentDelta, Event, ReasoningDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from ..chat.output import ChatOutputParser
from ..runtime.requests import Finished, SamplingParams, Tokens
from . import anthropic_protocol as wire
from .adapters import API, Generation
from .anthropic_protocol import CountTokensRequest, MessagesRequest
from .protocol import APIError

PING_S = 5.0  # Claude Code gives up on a stream silent for 300 s; a prefill of its prompt on a cluster takes minutes


class MessagesAPI(API):
    """POST /v1/messages: any model name is served by the one model (the reply names it); the key
    may come as `x-api-key`; errors in Anthropic's shape, a full queue as its 529."""
    endpoint, id_prefix = "/v1/messages", "msg_"
    x_api_key = True
    ping_s = PING_S

    def parse(self, body: bytes, sampling: SamplingParams, check_model: Callable[[str], None]) -> Generation:
        request = wire.parse(MessagesRequest, body)
        tools = request.template_tools()
        forced = None
        if request.forced:
            if tools is None:
                raise APIError("tool_choice forces a tool call, but the request offers no tools", param="tool_choice")
            forced = request.tool_choice.name if request.tool_choice.type == "tool" else ""
        return Generation(request.model, bool(request.stream), request.sampling(sampling), request.max_tokens,
                          request.stop_sequences, request, messages=request.template_messages(), tools=tools,
                          template_kwargs=request.template_kwargs(), forced_call=forced)

    def parse_count(self, body: bytes) -> CountTokensRequest:
        """A count_tokens body: a Messages request less max_tokens and the sampling."""
        return wire.parse(CountTokensRequest, body)

    def adapter(self, id, created, model, token_text, generation, output):
        return MessagesAdapter(id, model, token_text, generation, output)

    def error_body(self, error: APIError) -> dict:
        return wire.error_body(error)

    def error_status(self, error: APIError) -> int:
        return wire.error_status(error)

    def event(self, chunk: dict) -> bytes:
        return wire.event(chunk)

    def stream_error(self, error: APIError, adapter=None) -> bytes:
        return wire.event(wire.error_body(error))

    def stream_end(self) -> bytes:
        return b""  # message_stop, the adapter's last event, ends it

    def ping(self) -> bytes:
        return wire.event({"type": "ping"})


class MessagesAdapter:
    """One request's events as Anthropic's content blocks: `opening`, `tokens` and `finished`
    return the stream's events, `response` the whole message."""

    def __init__(self, id: str, model: str, token_text: Callable[[int], str], generation: Generation,
                 output: ChatOutputParser):
        self.id, self.model, self.token_text = id, model, token_text
        self.output = output
        self.prompt_tokens = generation.prompt_tokens
        self.stop = generation.stop or []
        thinking = generation.body.thinking
        self.omit_thinking = thinking is not None and thinking.display == "omitted"
        self.blocks: list[dict] = []  # the reply's content blocks, as the whole reply has them
        self.open: dict | None = None  # the block being written
        self.arguments: list[str] = []  # the open tool_use block's argument pieces
        self.space = ""  # blank text held back: it opens no text block of its own
        self.token_ids: list[int] = []
        self.finish: Finished | None = None

    def opening(self) -> list[dict]:
        return [{"type": "message_start",
                 "message": wire.message(self.id, self.model, [], None, None,
                                         wire.usage(self.prompt_tokens, 0, 0))}]

    def tokens(self, event: Tokens) -> list[dict]:
        self.token_ids.append(event.token_id)
        return self._events(self.output.feed(event.text))

    def finished(self, event: Finished) -> list[dict]:
        self.finish = event
        chunks = self._events(self.output.feed(event.tail) + self.output.finish()) + self._close()
        stop_reason, stop_sequence = self._stop(event)
        return chunks + [{"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                          "usage": self._usage(event)},
                         {"type": "message_stop"}]

    def response(self) -> dict:
        stop_reason, stop_sequence = self._stop(self.finish)
        return wire.message(self.id, self.model, self.blocks, stop_reason, stop_sequence, self._usage(self.finish))

    def _usage(self, event: Finished) -> dict:
        return wire.usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)

    def _stop(self, event: Finished) -> tuple[str, str | None]:
        if event.reason == "length":
            return "max_tokens", None
        if self.output.tool_calls:
            return "tool_use", None
        matched = self._stop_sequence()
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    def _stop_sequence(self) -> str | None:
        """The stop sequence that ended the answer, if one did: the engine stops at the first
        one its text shows and leaves it out, so one in the tokens' text is the one (an EOS ends
        an answer that shows none)."""
        if not self.stop:
            return None
        text = "".join(self.token_text(t) for t in self.token_ids)
        found = [(text.rfind(s) + len(s), s) for s in self.stop if s and s in text]
        return max(found)[1] if found else None

    # -- content blocks ---------------------------------------------------------------------------------------

    def _events(self, events: list[Event]) -> list[dict]:
        out: list[dict] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                if self._kind() != "thinking":
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                self.open["thinking"] += event.text
                if not self.omit_thinking:
                    out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, ContentDelta):
                if self._kind() != "text":
                    if not event.text.strip():  # blank space opens no block; it goes before text that follows
                        self.space += event.text
                        continue
                    out += self._start({"type": "text", "text": ""})
                text, self.space = self.space + event.text, ""
                self.open["text"] += text
                out.append(self._delta({"type": "text_delta", "text": text}))
            elif isinstance(event, ToolCallStart):
                out += self._start({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": event.name,
                                    "input": {}})
                self.space = ""
            elif isinstance(event, ToolCallArguments):
                self.arguments.append(event.text)
                out.append(self._delta({"type": "input_json_delta", "partial_json": event.text}))
            elif isinstance(event, ToolCallEnd):
                out += self._close()
        return out

    def _kind(self) -> str | None:
        return self.open["type"] if self.open is not None else None

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _start(self, block: dict) -> list[dict]:
        out = self._close()
        self.open = block
        self.blocks.append(block)
        return out + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _close(self) -> list[dict]:
        """The open block's end: a thinking block gets its signature, a call its parsed input."""
        block, self.open = self.open, None
        if block is None:
            return []
        out = []
        if block["type"] == "thinking":
            block["signature"] = wire.signature(block["thinking"])
            if self.omit_thinking:
                block["thinking"] = ""
            out.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                        "delta": {"type": "signature_delta", "signature": block["signature"]}})
        elif block["type"] == "tool_use":
            arguments, self.arguments = "".join(self.arguments), []
            try:
                block["input"] = json.loads(arguments) if arguments.strip() else {}
            except ValueError:  # a call cut off mid-arguments (max_tokens): what was sent stays sent
                block["input"] = {}
        return out + [{"type": "content_block_stop", "index": len(self.blocks) - 1}]
