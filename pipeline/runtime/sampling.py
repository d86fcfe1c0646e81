"""Choosing the next token from logits: repetition penalty, temperature, top-k, top-p, min-p.

Applied in the order Hugging Face's logits processors use. Temperature 0 is greedy argmax.
A seed makes sampling reproducible: each step draws from its own key split off the seed.
The parameters travel with a request (requests.SamplingParams).
"""

from __future__ import annotations

import mlx.core as mx

from .requests import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self._key = mx.random.key(params.seed) if params.seed is not None else None

    @property
    def greedy(self) -> bool:
        """Plain argmax: no temperature, no penalty (nothing else applies then)."""
        return self.params.temperature == 0 and self.params.repetition_penalty == 1.0

    def lazy(self, logits: mx.array) -> mx.array:
        """The next token as an unevaluated scalar, for a caller that starts the following step
        before reading it. Same draws as `__call__`; not with a repetition penalty (it needs the
        history in hand)."""
        assert self.params.repetition_penalty == 1.0
        logits = self.processed_logits(logits, [])
        if self.params.temperature == 0:
            return mx.argmax(logits)
        if self._key is not None:
            self._key, step_key = mx.random.split(self._key)
            return mx.random.categorical(logits, key=step_key)
        return mx.random.categorical(logits)

    def __call__(self, logits: mx.array, history: list[int]) -> int:
        """logits: [vocab] for the next position; history: prompt and generated tokens so far."""
        logits = self.processed_logits(logits, history)
        if self.params.temperature == 0:
            return int(mx.argmax(logits).item())
        if self._key is not None:
            self._key, step_key = mx.random.split(self._key)
            return int(mx.random.categorical(logits, key=step_key).item())
        return int(mx.random.categorical(logits).item())

    # -- for speculative rejection sampling (speculative.verify): draws from the same key chain

    def _next_key(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, step_key = mx.random.split(self._key)
        return step_key

    def probabilities(self, logits: mx.array, history: list[int]) -> mx.array:
        """The distribution the next token is drawn from (temperature > 0)."""
        return mx.softmax(self.processed_logits(logits, history), axis=-1)

    def uniform(self) -> float:
        return mx.random.uniform(key=self._next_key()).item()

    def draw(self, probs: mx.array) -> int:
        return int(mx.random.categorical(mx.log(probs), key=self._next_key()).item())

    def processed_logits(self, logits: mx.array, history: list[int]) -> mx.array:
        """The logits sampling draws from: penalised, tempered, and -inf outside top-k/top-p/min-p."""
        p = self.params
        logits = logits.astype(mx.float32)
        if p.repetition_penalty != 1.0 and history:
            seen = mx.array(sorted(set(history)))
            picked = logits[seen]
            logits[seen] = mx.where(picked > 0, picked / p.repetition_penalty,
                                    picked * p.repetition_penalty)
        if p.temperature == 0:
            return logits
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = mx.sort(logits)[-p.top_k]
            logits = mx.where(logits < kth, -mx.inf, logits)
        if p.top_p < 1.0:
            order = mx.argsort(-logits)
            probs = mx.softmax(logits[order])
            # Keep the smallest prefix of the sorted tokens whose mass reaches top_p
            # (a token is dropped when the mass before it already reaches top_p).
            mass_before = mx.cumsum(probs) - probs
            drop = mx.zeros(logits.shape, dtype=mx.bool_)
            drop[order] = mass_before >= p.top_p
            logits = mx.where(drop, -mx.inf, logits)
        if p.min_p > 0:
            probs = mx.softmax(logits)
            logits = mx.where(probs < p.min_p * probs.max(), -mx.inf, logits)
        return logits
