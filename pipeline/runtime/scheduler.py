"""The engine under batch and serve: continuous batching on rank 0, micro-batches round the ring.

Front-ends hand the scheduler `Request`s (token ids, sampling, limits, and a callback) through a
source (`ListSource` for a batch file, `QueueSource` for a server's requests arriving from another
thread) and get back events: `Tokens` as each token is sampled, then `Finished` or, for a request
that failed on its own, `Failed` (all in requests.py, which front-ends import instead of this
module). The scheduler knows nothing of files, HTTP or argparse.

Rank 0 holds up to `max_batch` sequences in progress and keeps up to `microbatches` micro-batches
in flight: it embeds one micro-batch's next tokens and runs its own layers, hands the hidden
states to rank 1 and, without waiting, starts the next, so while rank 1 runs micro-batch A rank 0
runs B (GPipe for decoding). When a micro-batch comes back from the last rank (each sequence's
last hidden state only), rank 0 applies the final norm and head, samples each sequence's next
token, reports those that finished, and the micro-batch goes round again with their
places given to waiting requests, whose prompts (in chunks, as `generate` takes them) ride along
with the others' decoding. The last rank computes a share of the head for greedy micro-batches,
sized as the ring runs so that neither end waits for the other (head_share.py).

Exactness: attention runs per sequence against its own cache, and a matrix product must round
each sequence's rows as it would alone. OpenBLAS does not (its kernels, and so its roundings,
change with the row count), so on Linux products of up to 64 rows go to the batch-invariant kernel
of pipeline's BLAS shim (blas_shim.c), and the sequences of a micro-batch share their products in
groups of up to that many rows; a prompt chunk longer than that runs alone, in the very shape
`generate` gives it. Without the shim each sequence runs on its own. Either way greedy text equals
`generate`'s for that request alone. `--packed-matmuls` puts all rows of a micro-batch in one product
whatever the BLAS (e.g. on a GPU): results then within float rounding of that.

Faults: an exception in one request's own code path (its sampler, its detokenizer, the
front-end's callback) ends that request with `Failed`, and the others go on; only a fault of the
ring itself (a rank, the transport, a shared product) ends the job.

No deadlock: rank 0 never blocks in a send (`isend_message`), and only ever waits for the oldest
micro-batch in flight, which every other rank forwards in order; followers send without waiting
too, keeping a bounded number of sends pending.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from ..checkpoints.tokenizer import StreamingDetokenizer, Tokenizer
from ..cluster.transport import Kind, Transport
from ..kernels import blas
from ..models.cache import resume_points
from ..models.packing import segments
from ..models.vocab_split import Combined
from .engine import PREFILL_CHUNK
from .head_share import HeadSplit, combined_argmax, returned_rows, split_returned
from .prefix_cache import PrefixCache, StoredIndex
from .prompt_cache_store import PromptCacheStore
from .requests import Failed, Finished, Request, Scores, TokenLogprob, Tokens
from .sampling import Sampler
from .settings import DraftSettings
from .speculative import DraftStats, mtp_state, verify
from .stage import Stage
from .trace import COMPUTE, RECV, SEND, Timeline

FOLLOWER_MAX_PENDING = 4  # sends a follower may leave in flight before it waits for the oldest
# Prompt tokens one micro-batch may carry (at least one chunk): prompts are spread over several
# round trips, riding along with the others' decoding, so that every micro-batch (and so every
# stage) gets a like share of the prefill work; big lumps of prefill idle the other ranks.
# A prompt's own chunks stay `generate`'s, so results do not change. Whole prompts fill it unevenly
# (two or three of ~40 tokens), and in a ring of two micro-batches one's excess is the other rank's
# wait: 96 rather than 128 took the 2-rank, 32 x 64 job's bubble from 5-6% to 3.4-4.2% (3 of 3
# paired runs faster, +1.6-4.6%).
PREFILL_BUDGET = 96


def row_groups(lengths: list[int], group_rows: int) -> list[tuple[int, int]]:
    """Which consecutive sequences of a micro-batch share their matrix products, as [begin, end)
    index ranges: runs of up to `group_rows` rows in all, a longer sequence alone (0: each alone)."""
    groups, begin, rows = [], 0, 0
    for i, n in enumerate(lengths):
        if i > begin and rows + n > group_rows:
            groups.append((begin, i))
            begin, rows = i, 0
        rows += n
    groups.append((begin, len(lengths)))
    return groups


def exact_group_rows(packed: bool) -> int:
    """How many rows of different sequences one product may hold on this rank (see the module
    docstring): the BLAS shim's batch-invariant limit, unbounded when packing was asked for."""
    return sys.maxsize if packed else blas.invariant_rows()


def forward_stage(stage: Stage, hidden: mx.array, seq_ids: list[int], lengths: list[int], group_rows: int,
                  full: list[bool] | None = None) -> mx.array:
    """This rank's layers over a micro-batch, its sequences sharing products `group_rows` at a time.
    The rank with the model's final layer returns each sequence's last position only (every
    position of those marked `full`: drafts being verified)."""
    full = full or [False] * len(lengths)
    groups = row_groups(lengths, group_rows)
    if len(groups) == 1:
        return stage.run_layers(hidden, seq_ids, lengths, last_only=True, full=full)
    tokens = segments(lengths)  # each sequence's [begin, end) among the packed tokens
    outputs = [stage.run_layers(hidden[:, tokens[b][0]:tokens[e - 1][1]], seq_ids[b:e], lengths[b:e], evaluate=False,
                                last_only=True, full=full[b:e])
               for b, e in groups]
    out = mx.concatenate(outputs, axis=1)
    mx.eval(out)
    return out


# -- the schedule ---------------------------------------------------------------------------------------------

@dataclass
class Sequence:
    seq_id: int
    request: Request
    max_tokens: int
    sampler: Sampler
    detokenizer: StreamingDetokenizer
    admitted_at: float
    fed: int = 0  # prompt tokens already run
    next_input: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    sent_chars: int = 0  # text passed on in Tokens events
    queued_s: float = 0.0
    cached: int = 0  # prompt positions reused from the prefix cache
    decoded_fed: int = 0  # generated tokens run through the model (the last one sampled never is)
    drafter: object = None  # speculative decoding (speculative.py), if this sequence drafts
    drafts: list[int] = field(default_factory=list)  # drafted tokens in flight behind next_input

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.tokens

    @property
    def wants_hidden(self) -> bool:
        """Its drafter reads the final hidden states (the MTP module): every position of its prompt comes back."""
        return getattr(self.drafter, "wants_hidden", False)

    @property
    def full_logits(self) -> bool:
        """Its next token needs every logit (sampling, logprobs, drafts, scores), not just the argmax."""
        return not self.sampler.greedy or self.request.logprobs is not None or bool(self.drafts) or self.scores

    @property
    def scores(self) -> bool:
        """It scores its prompt (Request.score_from): every position of it comes back, and it generates nothing."""
        return self.request.score_from is not None

    def take_input(self) -> list[int]:
        """The tokens of this sequence's next forward pass: a prompt chunk, or its last token."""
        if self.fed < len(self.prompt_ids):
            chunk = self.prompt_ids[self.fed:self.fed + PREFILL_CHUNK]
            self.fed += len(chunk)
            return chunk
        # Room for r more tokens: r - 1 drafts at most (the model adds one); within the context, as
        # max_tokens was capped to it at admission.
        room = self.max_tokens - len(self.tokens) - 1
        self.drafts = self.drafter.propose(self.history, room) if self.drafter is not None and room > 0 else []
        self.decoded_fed += len(self.next_input)
        return self.next_input + self.drafts

    @property
    def computed(self) -> list[int]:
        """The tokens whose keys and values this sequence's caches hold."""
        return self.prompt_ids[:self.fed] + self.tokens[:self.decoded_fed]

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt_ids)


@dataclass
class Microbatch:
    number: int
    seqs: list[Sequence]
    lengths: list[int]
    head_columns: int = 0  # LM head columns the last rank computes for it (head_share.py)
    hidden: mx.array | None = None  # the result once back on rank 0: each sequence's last position
    full: list[bool] = field(default_factory=list)  # per sequence: every position back (drafts to verify)


@dataclass
class PendingLoad:
    """A sequence starting from a stored entry (--prompt-cache-dir), in flight until the last rank says
    whether every rank loaded its part: it runs only then, from the entry or without it."""
    seq: Sequence
    key: int
    positions: int
    own: bool = True  # rank 0 loaded its part


@dataclass
class BatchStats:
    done: int = 0  # requests that finished (cancelled ones included)
    errors: int = 0  # requests that failed on their own
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    head_share: float | None = None  # mean fraction of the LM head the last rank computed, if shared
    draft: DraftStats | None = None  # speculative decoding, when sequences draft

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


class Scheduler:
    def __init__(self, stage: Stage, transport: Transport, tokenizer: Tokenizer, source, *, max_batch: int,
                 microbatches: int, group_rows: int, timeline: Timeline, prefill_budget: int = PREFILL_BUDGET,
                 head_split: HeadSplit | None = None, heartbeat_s: float | None = None,
                 prefix_cache: PrefixCache | None = None, draft: DraftSettings | None = None,
                 stored: StoredIndex | None = None, store: PromptCacheStore | None = None):
        """source: ListSource, QueueSource, or anything with their `get(timeout)` and `closed`.
        heartbeat_s: while idle (nothing in flight, the source open), send a HEARTBEAT round the
        ring this often, so that the other ranks' watchdogs see a live rank 0, and wait (under rank
        0's watchdog) for it to come back, so that rank 0 sees a live ring whatever launched the job.
        prefix_cache: keep finished sequences' caches and start requests from them (prefix_cache.py).
        draft: each sequence drafts tokens and the ring checks them with its next token (speculative.py).
        stored, store: the prompt cache on disk (--prompt-cache-dir): rank 0's index of the entries
        every rank stores, and rank 0's own files (prompt_cache_store.py); with a prefix cache only."""
        self.stage, self.transport, self.tokenizer = stage, transport, tokenizer
        self.model = stage.model
        self.source = source
        self.max_batch, self.microbatches, self.group_rows = max_batch, microbatches, group_rows
        self.prefill_budget = prefill_budget
        self.timeline = timeline
        self.head_split = head_split
        self.heartbeat_s = heartbeat_s
        self.prefix_cache = prefix_cache
        self.stored, self.store = (stored, store) if prefix_cache is not None else (None, None)
        self.draft = draft if draft is not None and draft.kind != "none" else None
        self._ended: dict[int, list[int]] = {}  # finished sequences' computed tokens, for the prefix cache
        self.context = self.model.config.max_position_embeddings
        self.ready: deque[Sequence] = deque()  # in progress, not in flight
        self.in_flight: deque[Microbatch | PendingLoad] = deque()  # in the order sent, as they come back
        self.sends: list = []  # pending isends (rank 0 keeps at most `microbatches` FORWARDs + RELEASEs)
        self.active = 0
        self.next_seq_id = 0
        self.next_number = 0
        self.stats = BatchStats(draft=DraftStats() if self.draft else None)
        self.start = time.perf_counter()

    # -- the loop -------------------------------------------------------------------------------------------

    def run(self) -> BatchStats:
        self.start = time.perf_counter()
        while True:
            with self.timeline.span(COMPUTE, "admit"):
                self._admit()
            while len(self.in_flight) < self.microbatches and self.ready:
                seqs = self._take()
                if seqs:
                    self.in_flight.append(self._launch(seqs))
            if not self.in_flight:
                if self.source.closed:
                    break
                self._idle()
                continue
            microbatch = self.in_flight.popleft()
            if isinstance(microbatch, PendingLoad):
                self._loaded(microbatch)
                continue
            if microbatch.hidden is None:
                self._receive(microbatch)
            self._step(microbatch)
        for pending in self.sends:
            pending.wait()
        self.sends = []
        self.stats.wall_s = time.perf_counter() - self.start
        if self.head_split is not None:
            self.stats.head_share = self.head_split.mean_columns() / self.model.config.vocab_size
        return self.stats

    def _idle(self) -> None:
        """Nothing in progress: wait for the next request, keeping the ring's watchdogs fed."""
        request = self.source.get(timeout=self.heartbeat_s)
        if request is not None:
            self._start(request)
        elif not self.source.closed and self.transport.size > 1:
            self.sends.append(self.transport.isend_message(1, Kind.HEARTBEAT))
            self._reap()
            # Back round the ring (nothing else is on its way: nothing is in flight). A rank gone, and a
            # launcher that lets the others run on (srun), ends the job here instead of at the next request
            back = self.transport.recv_message(self.transport.size - 1)
            if back.kind != Kind.HEARTBEAT:
                raise RuntimeError(f"rank 0 expected its heartbeat back, got {back.kind.name}")

    def _admit(self) -> None:
        """Start requests while there is room."""
        while self.active < self.max_batch:
            request = self.source.get(timeout=0)
            if request is None:
                return
            self._start(request)

    def _start(self, request: Request) -> None:
        now = time.perf_counter()
        queued_s = now - (request.submitted_at or self.start)
        if request.cancelled:
            self.stats.done += 1
            self._emit(request, Finished("cancelled", "", "", len(request.prompt_ids), 0, 0, queued_s, 0.0, 0.0))
            return
        if not 0 < len(request.prompt_ids) < self.context:  # the front-end checks; never run past the context
            self._fail(request, f"the prompt has {len(request.prompt_ids)} tokens; it must have 1 to "
                                f"{self.context - 1} (the model's context is {self.context})")
            return
        try:
            seq = Sequence(self.next_seq_id, request, min(request.max_tokens, self.context - len(request.prompt_ids)),
                           Sampler(request.sampling), StreamingDetokenizer(self.tokenizer, request.stop),
                           admitted_at=now, queued_s=queued_s, drafter=self.draft and self.draft.drafter(self.stage))
        except Exception as e:  # noqa: BLE001 -- this request's own set-up: its failure is its alone
            self._fail(request, _describe(e))
            return
        self.next_seq_id += 1
        self.active += 1
        self.stats.prompt_tokens += len(request.prompt_ids)
        if self.stored is not None:  # the disk's entry where it offers more than the memory's
            in_memory = self.prefix_cache.best(request.prompt_ids)[1]
            key, positions = self.stored.lookup(request.prompt_ids, beyond=in_memory)
            if key is not None and self._load(seq, key, positions):
                return  # it runs once every rank has loaded the entry (_loaded)
        if self.prefix_cache is not None:
            kept, length = self.prefix_cache.lookup(request.prompt_ids)
            if kept is not None:
                self.stage.fork([seq.seq_id], [kept], [length])
                if self.transport.size > 1:
                    self.sends.append(self.transport.isend_message(1, Kind.FORK, [seq.seq_id], kept_ids=[kept],
                                                                   prefix=[length]))
                seq.fed = seq.cached = length
                if seq.wants_hidden:
                    seq.drafter.starts_at(length)
        self.ready.append(seq)

    def _load(self, seq: Sequence, key: int, positions: int) -> bool:
        """Start `seq` from a stored entry's first `positions` positions: the other ranks load theirs on
        LOAD (sent first, so that every rank reads at once), rank 0 its own, and the answer (_loaded)
        lets it run. False on one rank where its part fails (its one warning said why): the entry
        goes, and the request runs as if never stored."""
        if self.transport.size > 1:
            self.sends.append(self.transport.isend_message(1, Kind.LOAD, [seq.seq_id], entries=[key],
                                                           prefix=[positions]))
        started = time.perf_counter()
        with self.timeline.span(COMPUTE, "load stored entry"):
            own = self.stage.load_from_store(self.store, seq.seq_id, key, positions)
        self.stored.load_s += time.perf_counter() - started
        if self.transport.size > 1:
            self.in_flight.append(PendingLoad(seq, key, positions, own))
        elif own:
            self._loaded(PendingLoad(seq, key, positions), loaded=True)
        else:
            self._unstore([key], failed=True)
            return False
        return True

    def _loaded(self, load: PendingLoad, loaded: bool | None = None) -> None:
        """The answer to a LOAD (or `loaded`, on one rank): the sequence starts from the entry, or, where a
        rank could not load its part, without it (its caches go on every rank, and the entry too)."""
        seq = load.seq
        if loaded is None:
            message = self.transport.recv_message(self.transport.size - 1)
            if message.kind != Kind.LOAD or message.seq_ids != [seq.seq_id]:
                raise RuntimeError(f"expected the answer to loading sequence {seq.seq_id} from the last rank, "
                                   f"got {message.kind.name} for sequences {message.seq_ids}")
            loaded = message.prefix[0] > 0 and load.own
        if loaded:
            self.stored.loads += 1
            self.stored.loaded_tokens += load.positions
            seq.fed = seq.cached = load.positions
            if seq.wants_hidden:
                seq.drafter.starts_at(load.positions)
        else:
            self.stage.release([seq.seq_id])
            if self.transport.size > 1:  # before its first FORWARD: it starts with empty caches everywhere
                self.sends.append(self.transport.isend_message(1, Kind.RELEASE, [seq.seq_id]))
            self._unstore([load.key], failed=True)
        self.ready.append(seq)

    def _unstore(self, keys: list[int], failed: bool = False) -> None:
        """Remove stored entries on every rank (evicted, or a rank failed to load one)."""
        if not keys:
            return
        for key in keys:
            self.stored.forget(key)
        self.stored.failed += failed
        self.stage.remove_stored(self.store, keys)
        if self.transport.size > 1:
            self.sends.append(self.transport.isend_message(1, Kind.DROP, entries=keys))

    def _take(self) -> list[Sequence]:
        """The next micro-batch from the sequences ready to run, oldest first: an even share of
        the sequences in progress (so `microbatches` of them fill the ring), with prompt chunks up
        to `prefill_budget` tokens in all (at least one), so new prompts do not stall the ring."""
        share = math.ceil(self.active / self.microbatches)
        taken, skipped, prompt_tokens, cancelled = [], deque(), 0, []
        while self.ready and len(taken) < share:
            seq = self.ready.popleft()
            if seq.request.cancelled:
                self._finish(seq, "cancelled")
                cancelled.append(seq.seq_id)
                continue
            if seq.prefilling:
                chunk = min(PREFILL_CHUNK, len(seq.prompt_ids) - seq.fed)
                if prompt_tokens and prompt_tokens + chunk > self.prefill_budget:
                    skipped.append(seq)
                    continue
                prompt_tokens += chunk
            taken.append(seq)
        self.ready.extendleft(reversed(skipped))
        self._release(cancelled)
        return taken

    def _launch(self, seqs: list[Sequence]) -> Microbatch:
        number = self.next_number
        self.next_number += 1
        with self.timeline.span(COMPUTE, f"mb {number}: embed + layers ({len(seqs)} seqs)"):
            # every prompt state back for the MTP, or to score the prompt
            prompt = [seq.prefilling and (seq.wants_hidden or seq.scores) for seq in seqs]
            inputs = [seq.take_input() for seq in seqs]
            lengths = [len(tokens) for tokens in inputs]
            full = [bool(seq.drafts) or p for seq, p in zip(seqs, prompt)]
            seq_ids = [seq.seq_id for seq in seqs]
            hidden = self.model.embed(mx.array([[t for tokens in inputs for t in tokens]]))
            hidden = forward_stage(self.stage, hidden, seq_ids, lengths, self.group_rows, full)
        microbatch = Microbatch(number, seqs, lengths, full=full)
        if self.transport.size == 1:
            microbatch.hidden = hidden  # each sequence's last position (rank 0 holds the final layer)
        else:
            # Rows that sample or report logprobs need every logit: only argmax micro-batches share the head
            # (and not those returning a prompt's every position for the MTP: no logits wanted there; nor,
            # drafting with DeepSeek V4's MTP, its states: the share returns streams already collapsed).
            if (self.head_split is not None and not any(seq.full_logits for seq in seqs) and not any(prompt)
                    and not any(seq.wants_hidden for seq in seqs)):
                microbatch.head_columns = self.head_split.columns
            with self.timeline.span(SEND, f"mb {number}"):
                self.sends.append(self.transport.isend_message(1, Kind.FORWARD, seq_ids, lengths, hidden,
                                                               every_position=full,
                                                               head_share=microbatch.head_columns))
                self._reap()
        return microbatch

    def _receive(self, microbatch: Microbatch) -> None:
        start = time.perf_counter()
        with self.timeline.span(RECV, f"mb {microbatch.number}"):
            message = self.transport.recv_message(self.transport.size - 1)
        waited = time.perf_counter() - start
        if message.kind != Kind.FORWARD or message.seq_ids != [s.seq_id for s in microbatch.seqs]:
            raise RuntimeError(f"expected micro-batch {microbatch.number} back from the last rank, "
                               f"got {message.kind.name} for sequences {message.seq_ids}")
        microbatch.hidden = message.hidden
        if self.head_split is not None:
            self.head_split.update(waited, message.idle_us / 1e6, sum(not s.prefilling for s in microbatch.seqs))
        self._reap()

    def _reap(self) -> None:
        self.sends = [pending for pending in self.sends if not pending.done()]

    def _step(self, microbatch: Microbatch) -> None:
        """Head and sampling for each sequence whose prompt is all in; events for each."""
        finished = []
        with self.timeline.span(COMPUTE, f"mb {microbatch.number}: head + sample"):
            if any(seq.wants_hidden for seq in microbatch.seqs):
                self._hand_hidden(microbatch)
            scored = self._score(microbatch) if any(seq.scores for seq in microbatch.seqs) else []
            finished += scored
            for seq in microbatch.seqs:
                if seq.seq_id in scored:
                    continue
                if seq.request.cancelled:
                    self._finish(seq, "cancelled")
                    finished.append(seq.seq_id)
                elif seq.prefilling:  # more prompt chunks to go: no token yet
                    self.ready.append(seq)
            index = [i for i, seq in enumerate(microbatch.seqs)
                     if not seq.prefilling and not seq.request.cancelled and not seq.scores]
            if index:
                finished += self._sample(microbatch, index)
        self._release(finished)

    def _hand_hidden(self, microbatch: Microbatch) -> None:
        """Each MTP-drafting sequence's final hidden states of the positions it ran (normed, as the
        head reads them), to its drafter, which keeps those the verification confirms."""
        rows, _ = split_returned(microbatch.hidden, self.model.config.hidden_size)
        bounds = segments([n if f else 1 for n, f in zip(microbatch.lengths, microbatch.full)])
        for seq, (begin, end) in zip(microbatch.seqs, bounds):
            if seq.wants_hidden:
                seq.drafter.returned(mtp_state(self.model, rows[begin:end]))

    def _score(self, microbatch: Microbatch) -> list[int]:
        """Each scoring sequence's logprobs of its prompt tokens at the positions it just ran (from
        its score_from on), in a Scores event; returns the ids of those that ended (prompt all in:
        Finished "scored"; or failed)."""
        rows, _ = split_returned(microbatch.hidden, self.model.config.hidden_size)
        bounds = segments([n if f else 1 for n, f in zip(microbatch.lengths, microbatch.full)])
        ended = []
        for seq, n, (begin, _) in zip(microbatch.seqs, microbatch.lengths, bounds):
            if not seq.scores or seq.request.cancelled:
                continue
            try:
                ran = seq.fed - n  # the prompt position of this piece's first row
                # Row j predicts prompt token j + 1: the last prompt position predicts nothing scored.
                first, end = max(seq.request.score_from, ran), min(seq.fed, len(seq.prompt_ids) - 1)
                logprobs = []
                if first < end:
                    logprobs = next_token_logprobs(self.model, rows[begin + first - ran:begin + end - ran],
                                                   seq.prompt_ids[first + 1:end + 1], self.group_rows)
                seq.request.on_event(Scores(logprobs))
            except Exception as e:  # noqa: BLE001 -- this request's own code path: it fails alone
                self._drop(seq)
                self._fail(seq.request, _describe(e))
                ended.append(seq.seq_id)
                continue
            if not seq.prefilling:
                self._finish(seq, "scored")
                ended.append(seq.seq_id)
        return ended

    def _release(self, seq_ids: list[int]) -> None:
        """Free the caches of ended sequences on every rank (or keep them in the prefix cache)."""
        if self.prefix_cache is not None:
            seq_ids = self._keep(seq_ids)
        if not seq_ids:
            return
        self.stage.release(seq_ids)
        if self.transport.size > 1:
            with self.timeline.span(SEND, "release"):
                self.sends.append(self.transport.isend_message(1, Kind.RELEASE, seq_ids))

    def _keep(self, seq_ids: list[int]) -> list[int]:
        """Of the ended sequences, the ids to release now: the others stay in the prefix cache, and
        what they push out goes instead."""
        ended = {seq_id: self._ended.pop(seq_id) for seq_id in seq_ids if seq_id in self._ended}
        release = [seq_id for seq_id in seq_ids if seq_id not in ended]
        for seq_id, tokens in ended.items():
            if self.stored is not None:  # before any RELEASE of it: every rank writes it from its caches
                self._save(seq_id, tokens)
            # (Qwen3.5's linear states resume only from the points they kept)
            caches, measure = self.stage.caches[seq_id], self.prefix_cache.measure
            release += self.prefix_cache.add(seq_id, tokens, resume_points(caches, len(tokens)),
                                             size=None if measure is None else measure(caches, len(tokens)))
        return release

    def _save(self, seq_id: int, tokens: list[int]) -> None:
        """Store a finished sequence on disk where the index wants it: every rank queues its file
        (its writer thread copies and writes it, off the ring's path), and what it outdates goes."""
        whole = resume_points(self.stage.caches[seq_id], len(tokens)) is not None  # states resumed at their end only
        key, removed = self.stored.add(tokens, [len(tokens)] if whole else None)
        self._unstore(removed)
        if key is None:
            return
        started = time.perf_counter()
        with self.timeline.span(COMPUTE, "save stored entry"):
            self.stage.save_stored(self.store, seq_id, key, len(tokens), tokens=tokens)
        self.stored.save_s += time.perf_counter() - started
        if self.transport.size > 1:
            self.sends.append(self.transport.isend_message(1, Kind.SAVE, [seq_id], entries=[key],
                                                           prefix=[len(tokens)]))

    def _sample(self, microbatch: Microbatch, index: list[int]) -> list[int]:
        """The next token(s) of the micro-batch's sequences at `index`; returns the ids of those that ended."""
        sampling = [microbatch.seqs[i] for i in index]
        rows, share = split_returned(microbatch.hidden, self.model.config.hidden_size)
        # Each sequence's rows among those returned: its last position, or every position of a draft.
        bounds = segments([n if f else 1 for n, f in zip(microbatch.lengths, microbatch.full)])
        # (A prompt's every position comes back for an MTP drafter; its token reads the last.)
        picked = [r for i in index for r in range(bounds[i][1] - len(microbatch.seqs[i].drafts) - 1, bounds[i][1])]
        if len(picked) < rows.shape[0]:  # some sequences are still reading their prompt (or were cancelled)
            rows, share = rows[mx.array(picked)], None if share is None else share[mx.array(picked)]
        own = self.model.config.vocab_size - microbatch.head_columns  # the entries rank 0 computes
        started = time.perf_counter()
        if self.model.vocab_split is not None and all(seq.sampler.greedy for seq in sampling):
            # --tensor-parallel, the head split by vocabulary: greedy tokens and their logprobs from each
            # slice's summary (models/vocab_split.py), not every logit
            top = max(seq.request.logprobs or 0 for seq in sampling)
            logits = Combined.concatenate([self.model.head_summary(rows[b:e], top)
                                           for b, e in row_groups([1] * len(picked), self.group_rows)])
            greedy = logits.tokens.tolist()
        else:
            logits = [self.model.logits(rows[b:e], vocab_end=own if share is not None else None)
                      for b, e in row_groups([1] * len(picked), self.group_rows)]
            logits = logits[0] if len(logits) == 1 else mx.concatenate(logits, axis=0)  # [rows, own]
            greedy = None
        # Every row's argmax in one op, read back at once: what greedy requests take (the same
        # index a row's own argmax gives); a sync per row cost rank 0 ~1 ms a micro-batch.
        if greedy is None:
            if share is None:
                greedy = mx.argmax(logits, axis=-1)
            else:
                greedy = combined_argmax(logits, share, own)
                self.head_split.note_shared(microbatch.head_columns)
            mx.eval(logits, greedy)
            if self.head_split is not None:
                self.head_split.observe_cost(time.perf_counter() - started, len(index), own)
            greedy = greedy.tolist()
        ended, rewinds = [], []
        now = time.perf_counter()
        row = 0
        for seq in sampling:
            count = len(seq.drafts) + 1
            try:
                reason, rewind = self._advance(seq, greedy[row:row + count], logits[row:row + count], now)
            except Exception as e:  # noqa: BLE001 -- this request's own code path: it fails alone
                self._drop(seq)
                self._fail(seq.request, _describe(e))
                ended.append(seq.seq_id)
                continue
            finally:
                row += count
            if reason is None:
                if rewind:
                    rewinds.append((seq.seq_id, rewind))
                self.ready.append(seq)
            else:
                self._finish(seq, reason)
                ended.append(seq.seq_id)
        if rewinds:  # rejected drafts leave every rank's caches before the sequence's next step
            ids, counts = [i for i, _ in rewinds], [n for _, n in rewinds]
            for seq_id, n in rewinds:
                self.stage.rewind([seq_id], n)
            if self.transport.size > 1:
                self.sends.append(self.transport.isend_message(1, Kind.REWIND, ids, dropped=counts))
        return ended

    def _advance(self, seq: Sequence, argmax: list[int], logits: mx.array, now: float) -> tuple[str | None, int]:
        """Take the sequence's next token, or with drafts those of them the model agrees with and its
        own next one; returns (the finish reason if it ends here, positions to rewind)."""
        if seq.first_token_at is None:
            seq.first_token_at = now
        drafts, seq.drafts = seq.drafts, []
        if not drafts:
            token = argmax[0] if seq.sampler.greedy else seq.sampler(logits[0], seq.history)
            return self._accept(seq, token, logits[0]), 0
        if seq.sampler.greedy:  # the argmax already read back: no more ops
            accepted = 0
            while accepted < len(drafts) and argmax[accepted] == drafts[accepted]:
                accepted += 1
            following = argmax[accepted]
        else:
            accepted, following = verify(seq.sampler, logits, drafts, seq.history)
        seq.drafter.observe(len(drafts), accepted)
        stats = self.stats.draft
        stats.drafted, stats.accepted = stats.drafted + len(drafts), stats.accepted + accepted
        stats.trips, stats.tokens = stats.trips + 1, stats.tokens + accepted + 1
        seq.decoded_fed += accepted  # the accepted drafts' positions stay in the caches
        for j, token in enumerate([*drafts[:accepted], following]):
            reason = self._accept(seq, token, logits[j])
            if reason is not None:
                return reason, 0
        return None, len(drafts) - accepted

    def _accept(self, seq: Sequence, token: int, logits: mx.array) -> str | None:
        """One new token of `seq`, passed on; the finish reason if it ends here."""
        if token in self.tokenizer.eos_token_ids:
            return "stop"
        logprob = None if seq.request.logprobs is None else token_logprob(logits, token, seq.request.logprobs)
        seq.tokens.append(token)
        text = seq.detokenizer.add(token)
        seq.sent_chars += len(text)
        self.stats.generated_tokens += 1
        seq.request.on_event(Tokens(token, text, logprob))  # a failure here fails this request (see _sample)
        if seq.detokenizer.stopped:
            return "stop"
        if len(seq.tokens) >= seq.max_tokens:
            return "length"
        seq.next_input = [token]
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Report a sequence's end. Its caches are released by the caller, unless kept (`_keep`)."""
        self._drop(seq)
        if self.prefix_cache is not None:
            self._ended[seq.seq_id] = seq.computed
        try:
            if not seq.detokenizer.stopped:
                seq.detokenizer.finish()
            text = seq.detokenizer.text
        except Exception as e:  # noqa: BLE001
            self._fail(seq.request, _describe(e))
            return
        now = time.perf_counter()
        self.stats.done += 1
        self._emit(seq.request, Finished(
            reason, text, text[seq.sent_chars:], len(seq.prompt_ids), len(seq.tokens), seq.cached, seq.queued_s,
            ttft_s=(seq.first_token_at or now) - seq.admitted_at, total_s=now - seq.admitted_at))

    def _drop(self, seq: Sequence) -> None:
        self.active -= 1

    def _fail(self, request: Request, message: str) -> None:
        self.stats.errors += 1
        self._emit(request, Failed(message))

    def _emit(self, request: Request, event: Finished | Failed) -> None:
        """A request's last event. If the front-end's handler fails on it, there is no one left to
        tell but stderr."""
        try:
            request.on_event(event)
        except Exception as e:  # noqa: BLE001
            print(f"[pipeline] a request's event handler failed: {_describe(e)}", file=sys.stderr, flush=True)


def token_logprob(logits: mx.array, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability under the raw logits, and the `top` most likely tokens'.
    logits: one row's, or (the head split by vocabulary, a greedy token) its vocab_split.Combined."""
    if isinstance(logits, Combined):
        assert int(logits.tokens[0]) == token, (logits.tokens[0], token)
        return TokenLogprob(token, logits.logprob(0), logits.top_logprobs(0, top))
    logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32))
    alternatives: list[tuple[int, float]] = []
    if top:
        best = mx.argsort(-logprobs)[:top]
        alternatives = list(zip(best.tolist(), logprobs[best].tolist()))
    return TokenLogprob(token, logprobs[token].item(), alternatives)


def next_token_logprobs(model, rows: mx.array, targets: list[int], group_rows: int) -> list[float]:
    """Final hidden states [n, hidden] (before the norm) -> each position's log-probability of its
    target token under the raw logits. The head runs on `group_rows` rows at a time, as sampling's does
    (batch-invariant products), so a sequence's logprobs do not depend on what ran beside it."""
    picked = []
    for b, e in row_groups([1] * len(targets), group_rows):
        logits = model.logits(rows[b:e]).astype(mx.float32)
        target = mx.take_along_axis(logits, mx.array(targets[b:e])[:, None], axis=-1)[:, 0]
        picked.append(target - mx.logsumexp(logits, axis=-1))
        mx.eval(picked[-1])  # one group's logits at a time in memory (rows x vocabulary)
    return mx.concatenate(picked).tolist() if picked else []


def _describe(e: BaseException) -> str:
    """One line for a request-level failure; the traceback goes to stderr for the bug report."""
    traceback.print_exception(e, file=sys.stderr)
    return f"internal error while generating: {type(e).__name__}: {e}"


def follow_stored(stage: Stage, store: PromptCacheStore | None, message) -> list[int]:
    """A follower's part of SAVE, LOAD or DROP (prompt cache on disk); returns the positions to pass
    on: a LOAD this rank could not serve (or an earlier rank could not) goes on as -positions."""
    if message.kind == Kind.DROP:
        stage.remove_stored(store, message.entries)
        return []
    if message.kind == Kind.SAVE:
        for seq_id, key, positions in zip(message.seq_ids, message.entries, message.prefix):
            stage.save_stored(store, seq_id, key, positions)
        return message.prefix
    answers = []
    for seq_id, key, positions in zip(message.seq_ids, message.entries, message.prefix):
        if positions > 0:
            if not stage.load_from_store(store, seq_id, key, positions):
                positions = -positions
        answers.append(positions)
    return answers


def stop_followers(transport: Transport, timeline: Timeline) -> None:
    """Rank 0: STOP round the ring, after everything sent before it."""
    if transport.size > 1:
        with timeline.span(SEND, "stop"):
            transport.isend_message(1, Kind.STOP).wait()


def follow(stage: Stage, transport: Transport, timeline: Timeline, group_rows: int,
           store: PromptCacheStore | None = None) -> None:
    """Ranks 1..N-1 in a batch job: run each micro-batch through this rank's layers and pass it
    on, in order, until STOP comes round; sends do not wait for the next rank to receive.
    store: this rank's files of the prompt cache on disk (SAVE, LOAD, DROP)."""
    prev, nxt = transport.rank - 1, (transport.rank + 1) % transport.size
    pending: deque = deque()

    def send(*message, **fields) -> None:
        with timeline.span(SEND, "send"):
            pending.append(transport.isend_message(nxt, *message, **fields))
            while pending and pending[0].done():
                pending.popleft()
            while len(pending) > FOLLOWER_MAX_PENDING:
                pending.popleft().wait()

    while True:
        start = time.perf_counter()
        with timeline.span(RECV, "recv"):
            message = transport.recv_message(prev)
        waited = time.perf_counter() - start
        if message.kind == Kind.FORWARD:
            with timeline.span(COMPUTE, f"layers ({len(message.seq_ids)} seqs, {sum(message.tokens)} tokens)"):
                hidden = forward_stage(stage, message.hidden, message.seq_ids, message.tokens, group_rows,
                                       message.every_position)
                if nxt == 0:  # back to rank 0: the last positions, with the head's share if asked
                    groups = row_groups([1] * hidden.shape[1], group_rows)
                    hidden = returned_rows(stage.model, hidden, message.head_share, groups)
                    mx.eval(hidden)
            if nxt == 0:
                send(Kind.FORWARD, message.seq_ids, message.tokens, hidden, every_position=message.every_position,
                     idle_us=round(waited * 1e6))
            else:
                send(Kind.FORWARD, message.seq_ids, message.tokens, hidden, every_position=message.every_position,
                     head_share=message.head_share)
            continue
        if message.kind == Kind.RELEASE:
            stage.release(message.seq_ids)
        if message.kind == Kind.REWIND:
            for seq_id, n in zip(message.seq_ids, message.dropped):
                stage.rewind([seq_id], n)
            if nxt != 0:
                send(Kind.REWIND, message.seq_ids, dropped=message.dropped)
            continue
        if message.kind == Kind.FORK:
            stage.fork(message.seq_ids, message.kept_ids, message.prefix)
            if nxt != 0:
                send(Kind.FORK, message.seq_ids, kept_ids=message.kept_ids, prefix=message.prefix)
            continue
        if message.kind in (Kind.SAVE, Kind.LOAD, Kind.DROP):
            with timeline.span(COMPUTE, f"prompt cache: {message.kind.name.lower()}"):
                prefix = follow_stored(stage, store, message)
            if message.kind == Kind.LOAD or nxt != 0:  # the last rank answers a LOAD to rank 0
                send(message.kind, message.seq_ids, entries=message.entries, prefix=prefix)
            continue
        if nxt != 0 or message.kind == Kind.HEARTBEAT:  # RELEASE and STOP go round the ring once, HEARTBEAT
            send(message.kind, message.seq_ids)        # back to rank 0 too (Scheduler._idle waits for it)
        if message.kind == Kind.STOP:
            with timeline.span(SEND, "drain"):
                for p in pending:
                    p.wait()
            return
