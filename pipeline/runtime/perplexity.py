"""Perplexity of a text with llama.cpp's protocol (its `llama-perplexity`), run on the scheduler's
batched path so that every rank works on a chunk at once.

The protocol, as tools/perplexity/perplexity.cpp runs it with its defaults:
- the text as `-f` reads it (one trailing newline dropped), tokenized whole, with the special
  tokens the tokenizer adds (a BOS where the model's tokenizer adds one);
- cut into non-overlapping chunks of `context` tokens (the rest of the text is left out), and the
  first token of each chunk replaced by that BOS, where the tokenizer adds one;
- each chunk run from an empty cache; position j's logits predict token j + 1, and only the
  positions from context // 2 to context - 2 are scored (the first half is context for them):
  context - 1 - context // 2 tokens per chunk;
- perplexity = exp(mean negative log-likelihood) over every scored token, printed after each chunk
  as `[i]value,`, and at the end with its error: the standard error of the mean NLL (its sample
  variance over count - 1) carried through exp, i.e. times the perplexity.

The scheduler returns every position of a scoring request's prompt (requests.Request.score_from)
to rank 0, which holds the LM head; it computes the logprob of each scored position's next token
with batch-invariant products (scheduler.next_token_logprobs), so the figure is the same on any
number of ranks and with any number of chunks in flight. Chunks are summed in their order in the text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..util.errors import UserError
from .requests import Failed, Finished, ListSource, Request, SamplingParams, Scores
from .scheduler import Scheduler


def read_text(path: Path) -> str:
    """The text of `path` as llama-perplexity's -f reads it: one trailing newline dropped."""
    if path.is_dir():
        raise UserError(f"--text {path} is a folder: give a text file")
    if not path.is_file():
        raise UserError(f"--text {path} does not exist")
    data = path.read_bytes()
    if data.endswith(b"\n"):
        data = data[:-1]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--text {path} is not UTF-8 text (byte {e.start}): convert it to UTF-8") from None
    if not text:
        raise UserError(f"--text {path} is empty: give it some text")
    return text


def text_tokens(tokenizer, text: str) -> tuple[list[int], int | None]:
    """The text tokenized whole, with the special tokens the tokenizer adds, and the BOS it puts
    first (None where it adds none), which the chunks start with."""
    ids = tokenizer.encode(text, add_special_tokens=True)
    plain = tokenizer.encode(text, add_special_tokens=False)
    bos = ids[0] if len(ids) == len(plain) + 1 and ids[1:] == plain else None
    return ids, bos


def chunks(ids: list[int], context: int, bos: int | None) -> list[list[int]]:
    """Non-overlapping chunks of `context` tokens, each starting with `bos` where there is one."""
    if len(ids) < 2 * context:
        raise UserError(f"the text has {len(ids)} tokens: perplexity with --context {context} needs at least "
                        f"{2 * context} (two chunks); give a longer text or a smaller --context")
    pieces = [ids[i * context:(i + 1) * context] for i in range(len(ids) // context)]
    return [[bos, *piece[1:]] if bos is not None else piece for piece in pieces]


def first_scored(context: int) -> int:
    """The first position of a chunk whose next token is scored: the first half is context."""
    return context // 2


def scored_per_chunk(context: int) -> int:
    return context - 1 - first_scored(context)


@dataclass
class Estimate:
    """The running perplexity: sums of the scored tokens' NLL and its square, in double, as llama.cpp's."""
    count: int = 0
    nll: float = 0.0
    nll2: float = 0.0
    chunks: list[float] = field(default_factory=list)  # the running perplexity after each chunk

    def add(self, logprobs: list[float]) -> None:
        for logprob in logprobs:
            self.nll -= logprob
            self.nll2 += logprob * logprob
            self.count += 1
        self.chunks.append(self.perplexity)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.count) if self.count else math.nan

    @property
    def error(self) -> float:
        """The perplexity's ± as llama-perplexity prints it (NaN where the variance is not positive)."""
        if self.count < 2:
            return math.nan
        mean = self.nll / self.count
        variance = self.nll2 / self.count - mean * mean
        return math.sqrt(variance / (self.count - 1)) * self.perplexity if variance > 0 else math.nan

    def running(self) -> str:
        """llama-perplexity's line of running values: [1]x,[2]y,..."""
        return "".join(f"[{i}]{value:.4f}," for i, value in enumerate(self.chunks, 1))

    def final(self) -> str:
        return f"Final estimate: PPL = {self.perplexity:.4f} +/- {self.error:.5f}"


def measure(stage, transport, tokenizer, token_chunks: list[list[int]], *, max_batch: int, microbatches: int,
            group_rows: int, timeline, on_chunk: Callable[[Estimate], None] = lambda estimate: None):
    """Rank 0: the perplexity of the chunks (each a scoring request, up to `max_batch` in progress),
    added to the estimate in their order as they finish (on_chunk after each). Returns
    (Estimate, the scheduler's BatchStats). The other ranks run scheduler.follow meanwhile."""
    context = len(token_chunks[0])
    first = first_scored(context)
    estimate = Estimate()
    finished: dict[int, list[float]] = {}
    failures: list[str] = []

    def request(index: int, chunk: list[int]) -> Request:
        scores: list[float] = []

        def on_event(event) -> None:
            if isinstance(event, Scores):
                scores.extend(event.logprobs)
            elif isinstance(event, Finished):
                if len(scores) != scored_per_chunk(context):
                    failures.append(f"chunk {index + 1} came back with {len(scores)} scores, not "
                                    f"{scored_per_chunk(context)}")
                finished[index] = scores
                while estimate_next() in finished:
                    estimate.add(finished.pop(estimate_next()))
                    on_chunk(estimate)
            elif isinstance(event, Failed):
                failures.append(f"chunk {index + 1}: {event.message}")

        return Request(chunk, SamplingParams(), 1, on_event, score_from=first)

    def estimate_next() -> int:
        return len(estimate.chunks)

    scheduler = Scheduler(stage, transport, tokenizer, ListSource(request(i, c) for i, c in enumerate(token_chunks)),
                          max_batch=max_batch, microbatches=microbatches, group_rows=group_rows, timeline=timeline)
    stats = scheduler.run()
    if failures:
        raise RuntimeError("perplexity: " + "; ".join(failures))
    return estimate, stats
