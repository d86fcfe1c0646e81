"""Engine events (requests.Tokens, Finished, Failed) turned into the OpenAI wire format: the
chunks of a stream, or the one response body of a request that does not stream.

One adapter per request. It sees every event in order; streaming sends what `opening`, `tokens`
and `finished` return as they come, a plain request sends `response()` at the end. Both come
from the same events, so a streamed text and a plain one are the same text.
"""

from __future__ import annotations

from typing import Callable

from ..chat.output import ChatMessage, ChatOutputParser
from ..runtime.requests import Finished, TokenLogprob, Tokens
from . import chat_output, protocol


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
