"""Engine events (scheduler.Tokens, Finished, Failed) turned into the OpenAI wire format: the
chunks of a stream, or the one response body of a request that does not stream.

One adapter per request. It sees every event in order; streaming sends what `opening`, `tokens`
and `finished` return as they come, a plain request sends `response()` at the end. Both come
from the same events, so a streamed text and a plain one are the same text.
"""

from __future__ import annotations

from typing import Callable

from ..scheduler import Finished, TokenLogprob, Tokens
from . import protocol


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
    """/v1/chat/completions: `chat.completion`, or `chat.completion.chunk`s with deltas."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.entries: list[dict] = []  # logprobs of every token, for the plain response

    def _chunk(self, delta: dict | None, finish_reason: str | None = None, logprobs: list[dict] | None = None,
               usage: dict | None = None) -> dict:
        return protocol.chat_chunk(self.id, self.created, self.model, delta, finish_reason, logprobs, usage,
                                   self.include_usage)

    def opening(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def tokens(self, event: Tokens) -> list[dict]:
        if event.logprob is None:
            return [self._chunk({"content": event.text})] if event.text else []
        entry = protocol.chat_token_logprob(self.token_text(event.token_id), event.logprob.logprob,
                                            self._alternatives(event.logprob))
        self.entries.append(entry)
        # A token whose text is held back (half a character, a possible stop string) still has its logprob
        return [self._chunk({"content": event.text}, logprobs=[entry])]

    def finished(self, event: Finished) -> list[dict]:
        self.finish = event
        chunks = [self._chunk({"content": event.tail})] if event.tail else []
        chunks.append(self._chunk({}, event.reason))
        if self.include_usage:
            chunks.append(self._chunk(None, usage=self.usage(event)))
        return chunks

    def response(self) -> dict:
        return protocol.chat_completion(self.id, self.created, self.model, self.finish.text, self.finish.reason,
                                        self.usage(self.finish), self.entries if self.logprobs else None)


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
