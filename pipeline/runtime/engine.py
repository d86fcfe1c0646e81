"""Rank 0's generation loop for one sequence: prefill the prompt through the ring, then
sample one token at a time, streaming text as it becomes printable."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import mlx.core as mx

from ..checkpoints.tokenizer import StreamingDetokenizer, Tokenizer
from ..cluster.transport import Transport
from .requests import SamplingParams
from .sampling import Sampler
from .speculative import DraftStats, NgramDrafter, mtp_state, verify
from .stage import Stage, ring_forward, round_the_ring

PREFILL_CHUNK = 512  # prompt tokens per forward pass: bounds activation memory on long prompts


@dataclass
class Generation:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    prefill_s: float  # time to first token
    decode_s: float  # time for the remaining tokens
    draft: DraftStats | None = None  # speculative decoding's figures, when drafting

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes out of prefill; decode produced the others.
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s else 0.0


def generate(stage: Stage, transport: Transport, tokenizer: Tokenizer, prompt_ids: list[int],
             sampling: SamplingParams, max_tokens: int, stop: list[str] = (),
             on_text: Callable[[str], None] = lambda text: None, drafter: NgramDrafter | None = None) -> Generation:
    """drafter: speculative decoding (speculative.py): each trip round the ring checks its drafts."""
    model = stage.model
    sampler = Sampler(sampling)
    detokenizer = StreamingDetokenizer(tokenizer, stop_strings=list(stop))
    history = list(prompt_ids)
    context = model.config.max_position_embeddings
    max_tokens = min(max_tokens, context - len(prompt_ids))
    tokens: list[int] = []
    finish_reason = "length"
    first_token_at = None

    def take(token: int) -> bool:
        """A new token for the output; True once the generation is over."""
        nonlocal finish_reason, first_token_at
        if first_token_at is None:
            first_token_at = time.perf_counter()
        if token in tokenizer.eos_token_ids:
            finish_reason = "stop"
            return True
        tokens.append(token)
        history.append(token)
        on_text(detokenizer.add(token))
        if detokenizer.stopped:
            finish_reason = "stop"
            return True
        return len(tokens) >= max_tokens

    wants_hidden = getattr(drafter, "wants_hidden", False)  # the MTP drafter reads every prompt position

    def next_logits(token_ids: list[int]) -> mx.array:
        hidden = model.embed(mx.array([token_ids]))
        hidden = ring_forward(stage, transport, hidden, all_positions=wants_hidden)
        if wants_hidden:
            drafter.returned(mtp_state(model, hidden[0]))
        return model.logits(hidden[:, -1, :])[0]

    start = time.perf_counter()
    for chunk_start in range(0, len(prompt_ids), PREFILL_CHUNK):
        logits = next_logits(prompt_ids[chunk_start:chunk_start + PREFILL_CHUNK])
    draft = None
    if max_tokens > 0:
        if drafter is not None:
            draft = _speculate(stage, transport, sampler, drafter, sampler(logits, history), history, take,
                               room=lambda: min(max_tokens - len(tokens), context - len(history)),
                               overlap=sampling.repetition_penalty == 1.0 and not wants_hidden)
        elif sampling.repetition_penalty == 1.0:
            _overlapped(stage, transport, sampler, logits, take, more=lambda: len(tokens) + 1 < max_tokens)
        else:
            while not take(sampler(logits, history)):
                logits = next_logits([history[-1]])
    if not detokenizer.stopped:
        on_text(detokenizer.finish())
    end = time.perf_counter()
    first_token_at = first_token_at or end
    return Generation(detokenizer.text, tokens, finish_reason, len(prompt_ids),
                      prefill_s=first_token_at - start, decode_s=end - first_token_at, draft=draft)


class Overlapped(NamedTuple):
    """How `_overlapped` ended."""
    ended: bool  # take() ended the generation; False: more() stopped it (the last token taken has not run)
    taken: int  # tokens handed to take()


def _overlapped(stage: Stage, transport: Transport, sampler: Sampler, logits: mx.array, take: Callable[[int], bool],
                more: Callable[[], bool]) -> Overlapped:
    """Without a repetition penalty (which needs each token in hand): the next step is built and
    started before this token is read, as mlx-lm does, so Python building its graph overlaps the
    CPU computing this one. On one rank that is the whole step; on several, rank 0's layers (sent
    on once the token is read and taken). Same tokens; at the end one step (or rank 0's part of
    it) is computed unused. more(): whether a token after the pending one may still be wanted."""
    model = stage.model
    pending = sampler.lazy(logits)
    mx.async_eval(pending)  # where `logits` is not computed yet (one rank): it runs while the next step is built
    taken = 0
    while True:
        following = None
        if more():
            following = stage.run_layers(model.embed(pending.reshape(1, 1)), evaluate=False, last_only=True)
            if transport.size == 1:
                following = _next_token(model, sampler, following[:, -1, :])
            mx.async_eval(following)
        taken += 1
        if take(int(pending.item())):
            return Overlapped(ended=True, taken=taken)
        if following is None:
            return Overlapped(ended=False, taken=taken)
        if transport.size > 1:
            following = _next_token(model, sampler, round_the_ring(transport, following)[:, -1, :])
        pending = following


def _next_token(model, sampler: Sampler, last: mx.array) -> mx.array:
    """The token after `last` ([1, hidden], before the norm) as `sampler.lazy` gives it; greedy with the
    LM head split by vocabulary (--tensor-parallel), from the slices' maxima alone (stage_slice.head_summary)."""
    if sampler.greedy and model.vocab_split is not None:
        return mx.array(int(model.head_summary(last).tokens[0]), dtype=mx.uint32)
    return sampler.lazy(model.logits(last)[0])


def _speculate(stage: Stage, transport: Transport, sampler: Sampler, drafter: NgramDrafter, token: int,
               history: list[int], take: Callable[[int], bool], room: Callable[[], int],
               overlap: bool = False) -> DraftStats:
    """Decode with drafts, from `token` (sampled, not yet taken): each trip runs the last token and
    its drafts, keeps the drafts the model agrees with and its own next token, and tells every rank
    to drop the rest from its caches with the next trip (rewind). overlap: while the drafter
    proposes nothing (no earlier match, or its back-off), decode as without drafts, each step
    started before the token it follows is read (`_overlapped`), so an open question, where drafts
    rarely land, is not slower than --draft none. Whether to go on overlapping is asked of the
    tokens already read: a match that only the pending token makes is drafted from one trip later."""
    model = stage.model
    stats = DraftStats()
    rewind = 0  # rejected drafts of the last trip, to drop from every rank's caches with the next
    wants_hidden = getattr(drafter, "wants_hidden", False)  # the MTP drafter reads the positions run

    def nothing_to_draft() -> bool:
        """Whether overlapped steps go on: room for a token after the pending one, and no drafts for it."""
        return room() > 1 and not drafter.propose(history, room() - 1)

    if take(token):
        return stats
    while True:  # `token` is taken and has still to run
        # Room for r more tokens: r - 1 drafts at most (the model adds one), and their positions in the cache.
        drafts = drafter.propose(history, room() - 1)
        stats.trips += 1
        if not drafts and overlap:
            # on one rank the trip stays lazy: the next step is built while it is computed
            hidden = ring_forward(stage, transport, model.embed(mx.array([[token]])), rewind=rewind, evaluate=False)
            logits, rewind = model.logits(hidden[:, -1, :])[0], 0
            # This trip's token, then one per overlapped step while nothing is proposed.
            run = _overlapped(stage, transport, sampler, logits, take, more=nothing_to_draft)
            stats.trips, stats.tokens = stats.trips + run.taken - 1, stats.tokens + run.taken
            if run.ended:
                return stats
            token = history[-1]  # taken by the last overlapped step, and not run: the next trip runs it
            continue
        hidden = ring_forward(stage, transport, model.embed(mx.array([[token, *drafts]])),
                              all_positions=bool(drafts), rewind=rewind)
        if wants_hidden:  # the states of the positions run (of the drafts: kept as far as accepted)
            drafter.returned(mtp_state(model, hidden[0]))
        if drafts:
            accepted, token = verify(sampler, model.logits(hidden[0]), drafts, history)
            drafter.observe(len(drafts), accepted)
            stats.drafted += len(drafts)
            stats.accepted += accepted
            stats.tokens += accepted + 1
            rewind = len(drafts) - accepted
            for draft in drafts[:accepted]:
                if take(draft):
                    return stats
        else:
            token, rewind = sampler(model.logits(hidden[:, -1, :])[0], history), 0
            stats.tokens += 1
        if take(token):
            return stats
