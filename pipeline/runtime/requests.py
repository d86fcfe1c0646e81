"""What front-ends hand the engine and get back: the only part of the runtime that `serve` sees.

A front-end builds a `Request` (token ids, `SamplingParams`, limits, and a callback), hands it to
the scheduler through a source (`ListSource` for requests known up front, a batch file;
`QueueSource` for a server's requests arriving from other threads), and gets back events:
`Tokens` as each token is sampled, then `Finished` or, for a request that failed on its own,
`Failed`. Plain Python only: importing this module loads neither MLX nor MPI, so the HTTP
threads may build requests while the scheduler's thread owns every MLX and MPI call.
"""

from __future__ import annotations

import math
import queue
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..util.errors import UserError

MAX_SEED = 2**64 - 1  # what mx.random.key takes


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are drawn (sampling.Sampler applies them); checked by `validate`."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None

    def validate(self, flags: bool = False) -> "SamplingParams":
        """Refuse values sampling cannot use, naming them as a request's fields (temperature,
        top_p, ...) or, with flags=True, as the command line's (--temp, --top-p, ...)."""
        def name(field: str, flag: str) -> str:
            return flag if flags else field

        for field, flag in (("temperature", "--temp"), ("top_p", "--top-p"), ("min_p", "--min-p"),
                            ("repetition_penalty", "--repetition-penalty")):
            value = getattr(self, field)
            if not math.isfinite(value):
                raise UserError(f"{name(field, flag)} must be a finite number, got {value}")
        if not self.temperature >= 0:
            raise UserError(f"{name('temperature', '--temp')} must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"{name('top_p', '--top-p')} must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"{name('top_k', '--top-k')} must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise UserError(f"{name('min_p', '--min-p')} must be in [0, 1), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise UserError(f"{name('repetition_penalty', '--repetition-penalty')} must be > 0 (1 turns it off), "
                            f"got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"{name('seed', '--seed')} must be an integer from 0 to 2**64-1, got {self.seed}")
        return self


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float  # of the model's distribution at this position (raw logits, before any sampling setting)
    top: list[tuple[int, float]]  # the most likely tokens and their logprobs, most likely first


@dataclass
class Tokens:
    """One sampled token."""
    token_id: int
    text: str  # the text that became printable with it (may be "": a partial character or stop string is held)
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


@dataclass
class Scores:
    """A scoring request's (Request.score_from) log-probabilities of the prompt tokens at the
    positions just run, in prompt order: each of a token given the tokens before it (raw logits)."""
    logprobs: list[float]


@dataclass
class Finished:
    """The last event of a request that ran."""
    reason: str  # "stop" (EOS or a stop string), "length", "cancelled", or "scored" (Request.score_from)
    text: str  # the whole completion
    tail: str  # its end not yet passed on in a Tokens event (text held back until the finish)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose caches were reused (prefix cache)
    queued_s: float  # from submission (or the scheduler's start) to admission
    ttft_s: float  # from admission to the first token
    total_s: float  # from admission to the end


@dataclass
class Failed:
    """The last event of a request that failed on its own; the job goes on."""
    message: str


Event = Tokens | Scores | Finished | Failed


@dataclass(eq=False)
class Request:
    """One generation request. prompt_ids: tokenized by the front-end (chat template applied),
    non-empty and shorter than the context. on_event runs on the scheduler's thread, in order,
    and must not block."""
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    on_event: Callable[[Event], None]
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: off; k: each token's logprob and its k most likely alternatives
    # None: generate. k: score the prompt instead (perplexity): the logprob of each prompt token after
    # position k, given those before it, comes in Scores events as the prompt runs; then Finished
    # ("scored"), no token generated. Its positions a prefix-cache hit skips are not scored.
    score_from: int | None = None
    tag: Any = None  # the front-end's own
    submitted_at: float | None = None  # time.perf_counter() at submission (None: the scheduler's start)
    cancelled: bool = False

    def cancel(self) -> None:
        """From any thread: the scheduler drops the request at its next step (Finished, "cancelled")."""
        self.cancelled = True


class ListSource:
    """Requests known up front (a batch file), taken in order; taking them lazily lets the front-end
    prepare each (tokenize it) only when there is room for it."""

    def __init__(self, requests: Iterable[Request]):
        self._requests = iter(requests)
        self.closed = False

    def get(self, timeout: float | None = 0) -> Request | None:
        if self.closed:
            return None
        request = next(self._requests, None)
        if request is None:
            self.closed = True
        return request


class QueueSource:
    """Requests arriving from other threads (a server): `put` from anywhere, `close` to end the
    run once what is in flight is done."""

    _CLOSE = object()

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self.closed = False

    def put(self, request: Request) -> None:
        self._queue.put(request)

    def close(self) -> None:
        self._queue.put(self._CLOSE)

    def __len__(self) -> int:
        return self._queue.qsize()

    def get(self, timeout: float | None = 0) -> Request | None:
        """The next request, waiting up to `timeout` seconds for one (None: forever)."""
        if self.closed:
            return None
        try:
            item = self._queue.get(block=timeout != 0, timeout=timeout or None)
        except queue.Empty:
            return None
        if item is self._CLOSE:
            self.closed = True
            return None
        return item
