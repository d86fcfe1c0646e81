"""Speculative decoding: guess the next few tokens cheaply, check them all in one trip round the ring.

One stream visits the stages in turn, so each new token costs a full trip. Rank 0 instead sends
its last token and K drafted ones as one chunk; every rank runs them through its layers (for a
dense model about the same weight reads as one token), and rank 0 keeps the longest prefix of the
drafts the model agrees with, plus the model's own next token: 1 to K+1 tokens per trip. The
rejected positions are dropped from every rank's caches before the next chunk.

Exact: the K+1 positions round as they do one at a time (products through the batch-invariant
BLAS kernel; attention through pipeline's kernel, attention.py, which rounds each query alone, or
MLX's attending each query alone: models/layers.attend), so greedy output is the same with or
without drafts. Sampling uses speculative rejection sampling (Leviathan et al. 2023; a draft that
is one token with certainty, q = 1, is accepted with probability p(draft), and on rejection the
next token is drawn from p with the draft removed), so the output distribution is the model's.

Drafts:
- `NgramDrafter` (prompt lookup): the continuation of the most recent earlier occurrence of the
  longest suffix (n = ngram_max down to ngram_min, 2 by default) of prompt + output. Free to
  compute, and right often on what people do with long prompts: summarize, edit, quote, repeat.
  While it has nothing to propose (no match, or backing off after misses) the engine decodes as
  without drafts, overlapped, so an open question costs nearly nothing over plain decoding.
- `MtpDrafter`: DeepSeek's multi-token-prediction module (models/mtp.py) on rank 0, fed the main
  model's final hidden state of every position the ring confirms (the prompt's too), drafts the
  next-but-one token, and K > 1 by repeating its step on its own output.

A drafter's interface: `propose(history, limit)`, `observe(drafted, accepted)` after each trip
that carried drafts, and for those that read hidden states (`wants_hidden`) `returned(rows)`: the
normed final hidden states of the positions a trip ran, in order, handed on before `observe`; and
`starts_at(position)` when a sequence's first positions come from the prefix cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from .sampling import Sampler


@dataclass
class DraftStats:
    drafted: int = 0
    accepted: int = 0
    trips: int = 0  # decode trips round the ring
    tokens: int = 0  # tokens those trips produced

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_trip(self) -> float:
        return self.tokens / self.trips if self.trips else 0.0

    def describe(self) -> str:
        return (f"drafted {self.drafted}, accepted {self.accepted} ({100 * self.acceptance:.0f}%), "
                f"{self.tokens_per_trip:.2f} tokens per trip")


class NgramDrafter:
    """Prompt-lookup drafts from the sequence's own tokens, with an index per n-gram length so a
    step costs O(ngram_max), not a scan of the history."""

    MISSES_BEFORE_BACKOFF = 2
    MAX_BACKOFF = 32
    # Below this recent share of drafted tokens accepted, the odd hit does not pay for the misses
    # (measured on open questions: 9% acceptance decoded 0.90x of --draft none), so a hit then does
    # not end the back-off. RECENT: the newest round's weight in that share.
    MIN_ACCEPTANCE = 0.2
    RECENT = 0.3
    # A draft at depth i lands only if the i - 1 before it do: about recent ** i. Deeper drafts
    # than that odds can pay for cost a verified position each and are not proposed, so a stream
    # whose drafts keep missing checks one token per round, not K (open questions: 29 wasted
    # positions out of 33 drafted in 96 tokens with K = 4).
    DEEPEST_ODDS = 0.2
    wants_hidden = False

    def __init__(self, draft_tokens: int, ngram_max: int = 3, ngram_min: int = 2):
        self.k, self.ngram_max = draft_tokens, ngram_max
        self.ngram_min = min(ngram_min, ngram_max)
        self.tokens: list[int] = []
        self.indexed = 0  # n-grams ending before this position are in `last_seen`
        self.last_seen = [dict() for _ in range(ngram_max + 1)]  # [n]: n-gram -> position just after it
        self.misses = 0  # drafting rounds with nothing accepted since acceptance last paid off
        self.skip = 0  # steps left without drafting
        self.recent = 1.0  # recent share of drafted tokens accepted (hopeful at first)

    def propose(self, history: list[int], limit: int) -> list[int]:
        """Up to min(K, limit) tokens expected after `history` (which only ever grows)."""
        self.tokens = history
        if self.skip:
            self.skip -= 1
            return []
        # Index every n-gram that ends before the last token (the suffix itself is what we look up).
        while self.indexed < len(history) - 1:
            end = self.indexed + 1
            for n in range(self.ngram_min, self.ngram_max + 1):
                if end >= n:
                    self.last_seen[n][tuple(history[end - n:end])] = end
            self.indexed = end
        k = min(self.k, limit, self.depth())
        if k <= 0:
            return []
        for n in range(min(self.ngram_max, len(history) - 1), self.ngram_min - 1, -1):
            after = self.last_seen[n].get(tuple(history[-n:]))
            if after is not None:
                return history[after:after + k]
        return []

    def depth(self) -> int:
        """How many tokens to draft now: the deepest whose odds, recent ** depth, are at least
        DEEPEST_ODDS (one at least: a hit is what lifts `recent` again)."""
        if self.recent >= 1.0:
            return self.k
        if self.recent <= self.DEEPEST_ODDS:
            return 1
        return max(1, int(math.log(self.DEEPEST_ODDS) / math.log(self.recent)))

    def observe(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.recent += self.RECENT * (accepted / drafted - self.recent)
        if accepted and self.recent >= self.MIN_ACCEPTANCE:
            self.misses = 0
            return
        if not accepted:
            self.misses += 1
        if self.misses >= self.MISSES_BEFORE_BACKOFF:
            self.skip = min(2 ** (self.misses - self.MISSES_BEFORE_BACKOFF), self.MAX_BACKOFF)


class MtpDrafter:
    """One sequence's drafts from DeepSeek's MTP module (models/mtp.py), greedy (so a draft is one
    token with certainty, as `verify` assumes).

    The module's cache must hold, for every position j the main model has confirmed, the entry of
    (h_j, t_{j+1}): the prompt's positions (their states come back from a prefill that returns
    every position) and each trip's last token plus the drafts accepted. Drafting K tokens adds
    K - 1 entries made from the module's own states and drafts; they are dropped (rewound) before
    the next round, which enters the main model's states for those positions instead."""

    wants_hidden = True

    def __init__(self, mtp, model, draft_tokens: int):
        """mtp: the MTPModule; model: rank 0's slice (its embedding, and its head for the drafts)."""
        self.mtp, self.model, self.k = mtp, model, draft_tokens
        self.cache = mtp.make_cache()
        self.first = 0  # the position of the first state handed on (after a prefix-cache hit, not 0)
        self.confirmed: list[mx.array] = []  # states of positions after those in the cache, in order
        self.unconfirmed: mx.array | None = None  # a trip's states while its drafts await verification
        self.in_flight = 0  # drafts proposed and not yet observed
        self.speculative = 0  # cache entries made from the module's own states (to rewind)

    def starts_at(self, position: int) -> None:
        self.first = position

    def returned(self, rows: mx.array) -> None:
        if self.in_flight:
            self.unconfirmed = rows
        else:
            self.confirmed.append(rows)

    def observe(self, drafted: int, accepted: int) -> None:
        if self.unconfirmed is not None:  # the trip's last token and the accepted drafts: confirmed
            self.confirmed.append(self.unconfirmed[:accepted + 1])
            self.unconfirmed = None
        self.in_flight = 0

    def propose(self, history: list[int], limit: int) -> list[int]:
        if self.speculative:
            self.cache.offset -= self.speculative
            self.speculative = 0
        self.in_flight = 0
        k = min(self.k, limit)
        if k <= 0 or not self.confirmed:
            return []
        states = self.confirmed[0] if len(self.confirmed) == 1 else mx.concatenate(self.confirmed, axis=0)
        self.confirmed = []
        start = self.first + self.cache.offset  # the position of states[0]
        following = history[start + 1:start + 1 + states.shape[0]]  # t_{j+1} of each
        if len(following) != states.shape[0]:
            raise RuntimeError(f"MTP drafter: states for positions {start}..{start + states.shape[0] - 1} "
                               f"but {len(history)} tokens")
        state = self.mtp(self.model.embed(mx.array([following])), states[None], self.cache)[:, -1:]
        drafts: list[int] = []
        while True:
            drafts.append(mx.argmax(self._logits(state[0, 0])).item())
            if len(drafts) == k:
                break
            state = self.mtp(self.model.embed(mx.array([drafts[-1:]])), state, self.cache)
            self.speculative += 1
        self.in_flight = len(drafts)
        return drafts

    def _logits(self, state: mx.array) -> mx.array:
        """The main model's LM head on a state the module's shared_head.norm made (DeepSeek V4's:
        its streams, which its own hc_head and norm collapse first)."""
        model = self.model
        if hasattr(self.mtp, "head_input"):
            state = self.mtp.head_input(state)
        return model.embed_tokens.as_linear(state) if model.config.tie_word_embeddings else model.lm_head(state)


def mtp_state(model, rows: mx.array) -> mx.array:
    """What an MTP drafter reads of the main model's final hidden states [positions, ...]: what its
    head reads (after the final norm; DeepSeek V3), or DeepSeek V4's residual streams as the last
    layer left them (its module's hnorm reads each; models/deepseek_v4_mtp.py)."""
    return rows if hasattr(model, "collapse") else model.norm(rows)


def make_drafter(kind: str, draft_tokens: int, ngram_max: int, ngram_min: int, mtp=None, model=None):
    """mtp, model: the MTP module and rank 0's slice, for kind "mtp" (job.load_stage loads it)."""
    if kind == "ngram":
        return NgramDrafter(draft_tokens, ngram_max, ngram_min)
    if kind == "mtp":
        return MtpDrafter(mtp, model, draft_tokens)
    return None


def verify(sampler: Sampler, logits: mx.array, drafts: list[int], history: list[int]) -> tuple[int, int]:
    """logits: [len(drafts) + 1, vocab], the model's at the last token and at each draft.
    Returns (drafts accepted, the next token after them)."""
    if sampler.greedy:
        best = mx.argmax(logits, axis=-1).tolist()  # one op, one read for all positions
        accepted = 0
        while accepted < len(drafts) and best[accepted] == drafts[accepted]:
            accepted += 1
        return accepted, best[accepted]
    if sampler.params.temperature == 0:  # greedy with a repetition penalty: it depends on each draft taken
        for j, draft in enumerate(drafts):
            token = sampler(logits[j], history + drafts[:j])
            if token != draft:
                return j, token
        return len(drafts), sampler(logits[len(drafts)], history + drafts)
    for j, draft in enumerate(drafts):
        probs = sampler.probabilities(logits[j], history + drafts[:j])
        if sampler.uniform() < probs[draft].item():
            continue
        # Rejected: draw from the model's distribution with the draft taken out, renormalised.
        rest = mx.where(mx.arange(probs.shape[-1]) == draft, 0.0, probs)
        return j, sampler.draw(rest / rest.sum())
    return len(drafts), sampler.draw(sampler.probabilities(logits[len(drafts)], history + drafts))
