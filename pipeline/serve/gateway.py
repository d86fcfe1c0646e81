"""The hand-off between the HTTP server's threads and the scheduler's thread on rank 0.

Requests enter the scheduler's `QueueSource` here, and their events come back through the
submitting event loop (`call_soon_threadsafe`), so the scheduler's `on_event` never blocks and
no MLX or MPI call ever runs outside the scheduler's thread. The gateway also counts what is in
progress: past `capacity` (--max-batch running plus --max-queue waiting) a request is refused
with 429, and once draining (SIGTERM) every new one with 503.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator

from ..runtime.requests import Failed, Finished, QueueSource, Request, SamplingParams
from .protocol import APIError

RETRY_AFTER_S = 1  # what a 429 asks the client to wait: a slot frees as soon as any request ends


class Submission:
    """One request handed to the scheduler, seen from the HTTP side: its events, in order."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.submitted = time.time()
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()

    def deliver(self, event) -> None:
        """On the scheduler's thread: pass the event to the HTTP thread's loop, without waiting."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the HTTP loop has closed (the server is gone): no one is listening
            pass

    async def events(self) -> AsyncIterator:
        """Every event of the request up to and including its last (Finished or Failed)."""
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, (Finished, Failed)):
                return

    def cancel(self) -> None:
        self.request.cancel()


class Gateway:
    def __init__(self, source: QueueSource, capacity: int):
        self.source = source
        self.capacity = capacity
        self.accepting = True
        self._open: set[Request] = set()  # submitted, not yet ended
        self._changed = threading.Condition()
        self._deadline: float | None = None  # while draining: when what is left gets cancelled

    # -- the HTTP side ------------------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int, stop: list[str],
               logprobs: int | None, tag=None) -> Submission:
        """Queue a request for the scheduler; APIError 429 at capacity, 503 once draining.
        Call from the event loop that will read the submission's events."""
        loop = asyncio.get_running_loop()
        submission = None

        def on_event(event) -> None:  # the scheduler's thread
            if isinstance(event, (Finished, Failed)):
                self._ended(submission.request)
            submission.deliver(event)

        request = Request(prompt_ids, sampling, max_tokens, on_event, stop=stop, logprobs=logprobs, tag=tag,
                          submitted_at=time.perf_counter())
        submission = Submission(request, loop)
        with self._changed:
            if not self.accepting:
                raise shutting_down()
            if len(self._open) >= self.capacity:
                raise APIError(f"the server is at capacity ({len(self._open)} requests running or waiting): "
                               f"retry in a moment", status=429, code="rate_limit_exceeded", type="requests",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            self._open.add(request)
            # Under the lock, so that a drain beginning now closes the source after this put
            self.source.put(request)
        return submission

    @property
    def in_progress(self) -> int:
        """Requests submitted and not yet ended (running or waiting)."""
        return len(self._open)

    @property
    def waiting(self) -> int:
        """Requests not yet taken by the scheduler."""
        return len(self.source)

    def _ended(self, request: Request) -> None:
        with self._changed:
            self._open.discard(request)
            self._changed.notify_all()

    # -- shutting down ------------------------------------------------------------------------------------------

    def drain(self, seconds: float) -> None:
        """Stop taking requests, let those in progress finish for up to `seconds`, cancel the rest,
        and close the source (the scheduler's run then returns). Blocks: run it on a thread of its own."""
        with self._changed:
            self.accepting = False
            self._deadline = time.monotonic() + seconds
            while self._open and time.monotonic() < self._deadline:
                self._changed.wait(self._deadline - time.monotonic())
            left = list(self._open)
        for request in left:
            request.cancel()
        self.source.close()

    def hurry(self) -> None:
        """A second signal while draining: cancel what is left now."""
        with self._changed:
            self._deadline = time.monotonic()
            self._changed.notify_all()

    @property
    def draining(self) -> bool:
        return not self.accepting


def shutting_down() -> APIError:
    return APIError("the server is shutting down: it takes no new requests", status=503, code="shutting_down",
                    type="server_error")
