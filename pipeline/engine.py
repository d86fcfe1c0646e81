"""Rank 0's generation loop for one sequence: prefill the prompt through the ring, then
sample one token at a time, streaming text as it becomes printable."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from .sampling import Sampler, SamplingParams
from .stage import Stage, ring_forward
from .tokenizer import StreamingDetokenizer, Tokenizer
from .transport import Transport

PREFILL_CHUNK = 512  # prompt tokens per forward pass: bounds activation memory on long prompts


@dataclass
class Generation:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    prefill_s: float  # time to first token
    decode_s: float  # time for the remaining tokens

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
             on_text: Callable[[str], None] = lambda text: None) -> Generation:
    model = stage.model
    sampler = Sampler(sampling)
    detokenizer = StreamingDetokenizer(tokenizer, stop_strings=list(stop))
    history = list(prompt_ids)
    context = model.config.max_position_embeddings
    max_tokens = min(max_tokens, context - len(prompt_ids))

    def next_logits(token_ids: list[int]) -> mx.array:
        hidden = model.embed(mx.array([token_ids]))
        hidden = ring_forward(stage, transport, hidden)
        return model.logits(hidden[:, -1, :])[0]

    # On one rank, without a repetition penalty (which needs each token in hand), the next step
    # is built and started before this token is read, as mlx-lm does: Python building its graph
    # overlaps the CPU computing this one. Same tokens; at the end one step is computed unused.
    overlap = transport.size == 1 and sampling.repetition_penalty == 1.0

    def following_token(token: mx.array) -> mx.array:
        hidden = stage.run_layers(model.embed(token.reshape(1, 1)), evaluate=False, last_only=True)
        return sampler.lazy(model.logits(hidden[:, -1, :])[0])

    start = time.perf_counter()
    for chunk_start in range(0, len(prompt_ids), PREFILL_CHUNK):
        logits = next_logits(prompt_ids[chunk_start:chunk_start + PREFILL_CHUNK])
    tokens: list[int] = []
    finish_reason = "length"
    first_token_at = None
    pending = sampler.lazy(logits) if overlap else None
    while len(tokens) < max_tokens:
        if overlap:
            following = None
            if len(tokens) + 1 < max_tokens:
                following = following_token(pending)
                mx.async_eval(following)
            token = int(pending.item())
            pending = following
        else:
            token = sampler(logits, history)
        if first_token_at is None:
            first_token_at = time.perf_counter()
        if token in tokenizer.eos_token_ids:
            finish_reason = "stop"
            break
        tokens.append(token)
        history.append(token)
        on_text(detokenizer.add(token))
        if detokenizer.stopped:
            finish_reason = "stop"
            break
        if len(tokens) < max_tokens and not overlap:
            logits = next_logits([token])
    if not detokenizer.stopped:
        on_text(detokenizer.finish())
    end = time.perf_counter()
    first_token_at = first_token_at or end
    return Generation(detokenizer.text, tokens, finish_reason, len(prompt_ids),
                      prefill_s=first_token_at - start, decode_s=end - first_token_at)
