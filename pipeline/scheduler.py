"""The batch schedule: continuous batching on rank 0, micro-batches flowing round the ring.

Rank 0 holds up to `max_batch` sequences in progress and keeps up to `microbatches` micro-batches
in flight: it embeds one micro-batch's next tokens and runs its own layers, hands the hidden
states to rank 1 and, without waiting, starts the next, so while rank 1 runs micro-batch A rank 0
runs B (GPipe for decoding). When a micro-batch comes back from the last rank (each sequence's
last hidden state only), rank 0 applies the final norm and head, samples each sequence's next
token, writes the records of those that finished, and the micro-batch goes round again with their
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

No deadlock: rank 0 never blocks in a send (`isend_message`), and only ever waits for the oldest
micro-batch in flight, which every other rank forwards in order; followers send without waiting
too, keeping a bounded number of sends pending.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from . import blas
from .batch import Request, error_record, result_record
from .engine import PREFILL_CHUNK
from .errors import UserError
from .head_share import HeadSplit, combined_argmax, returned_rows, split_returned
from .models.base import segments
from .sampling import Sampler
from .stage import Stage
from .tokenizer import StreamingDetokenizer, Tokenizer
from .trace import COMPUTE, RECV, SEND, Timeline
from .transport import Kind, Transport

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


def forward_stage(stage: Stage, hidden: mx.array, seq_ids: list[int], lengths: list[int], group_rows: int) -> mx.array:
    """This rank's layers over a micro-batch, its sequences sharing products `group_rows` at a time.
    The rank with the model's final layer returns each sequence's last position only."""
    groups = row_groups(lengths, group_rows)
    if len(groups) == 1:
        return stage.run_layers(hidden, seq_ids, lengths, last_only=True)
    tokens = segments(lengths)  # each sequence's [begin, end) among the packed tokens
    outputs = [stage.run_layers(hidden[:, tokens[b][0]:tokens[e - 1][1]], seq_ids[b:e], lengths[b:e], evaluate=False,
                                last_only=True)
               for b, e in groups]
    out = mx.concatenate(outputs, axis=1)
    mx.eval(out)
    return out


@dataclass
class Sequence:
    seq_id: int
    request: Request
    prompt_ids: list[int]
    max_tokens: int
    sampler: Sampler
    detokenizer: StreamingDetokenizer
    admitted_at: float
    fed: int = 0  # prompt tokens already run
    next_input: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def take_input(self) -> list[int]:
        """The tokens of this sequence's next forward pass: a prompt chunk, or its last token."""
        if self.fed < len(self.prompt_ids):
            chunk = self.prompt_ids[self.fed:self.fed + PREFILL_CHUNK]
            self.fed += len(chunk)
            return chunk
        return self.next_input

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


@dataclass
class BatchStats:
    done: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    head_share: float | None = None  # mean fraction of the LM head the last rank computed, if shared

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


class Scheduler:
    def __init__(self, stage: Stage, transport: Transport, tokenizer: Tokenizer, requests: list[Request],
                 write: Callable[[dict], None], *, max_batch: int, microbatches: int, group_rows: int,
                 use_chat_template: bool, timeline: Timeline, progress=None, prefill_budget: int = PREFILL_BUDGET,
                 head_split: HeadSplit | None = None):
        self.stage, self.transport, self.tokenizer = stage, transport, tokenizer
        self.model = stage.model
        self.waiting = deque(requests)
        self.write = write
        self.max_batch, self.microbatches, self.group_rows = max_batch, microbatches, group_rows
        self.use_chat_template = use_chat_template
        self.prefill_budget = prefill_budget
        self.timeline = timeline
        self.progress = progress
        self.head_split = head_split
        self.context = self.model.config.max_position_embeddings
        self.ready: deque[Sequence] = deque()  # in progress, not in flight
        self.in_flight: deque[Microbatch] = deque()
        self.sends: list = []  # pending isends (rank 0 keeps at most `microbatches` FORWARDs + RELEASEs)
        self.active = 0
        self.next_seq_id = 0
        self.next_number = 0
        self.stats = BatchStats()
        self.start = time.perf_counter()

    # -- the loop -------------------------------------------------------------------------------------------

    def run(self) -> BatchStats:
        self.start = time.perf_counter()
        while True:
            with self.timeline.span(COMPUTE, "admit"):
                self._admit()
            while len(self.in_flight) < self.microbatches and self.ready:
                self.in_flight.append(self._launch(self._take()))
            if not self.in_flight:
                break
            microbatch = self.in_flight.popleft()
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

    def _admit(self) -> None:
        """Start waiting requests while there is room; a request that cannot run gets its record."""
        while self.active < self.max_batch and self.waiting:
            request = self.waiting.popleft()
            try:
                ids = self._prompt_ids(request)
            except UserError as e:
                self._record(error_record(request.id, request.line, str(e)), error=True)
                continue
            seq = Sequence(self.next_seq_id, request, ids, min(request.max_tokens, self.context - len(ids)),
                           Sampler(request.sampling), StreamingDetokenizer(self.tokenizer, request.stop),
                           admitted_at=time.perf_counter())
            self.next_seq_id += 1
            self.active += 1
            self.stats.prompt_tokens += len(ids)
            self.ready.append(seq)

    def _prompt_ids(self, request: Request) -> list[int]:
        if request.messages is not None:
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(request.messages), add_special_tokens=False)
        else:
            ids = self.tokenizer.prompt_ids(request.prompt, system=request.system,
                                            use_chat_template=self.use_chat_template)
        if not ids:
            raise UserError("the prompt is empty")
        if len(ids) >= self.context:
            raise UserError(f"the prompt has {len(ids)} tokens but the model's context is {self.context}: shorten it")
        return ids

    def _take(self) -> list[Sequence]:
        """The next micro-batch from the sequences ready to run, oldest first: an even share of
        the sequences in progress (so `microbatches` of them fill the ring), with prompt chunks up
        to `prefill_budget` tokens in all (at least one), so new prompts do not stall the ring."""
        share = math.ceil(self.active / self.microbatches)
        taken, skipped, prompt_tokens = [], deque(), 0
        while self.ready and len(taken) < share:
            seq = self.ready.popleft()
            if seq.prefilling:
                chunk = min(PREFILL_CHUNK, len(seq.prompt_ids) - seq.fed)
                if prompt_tokens and prompt_tokens + chunk > self.prefill_budget:
                    skipped.append(seq)
                    continue
                prompt_tokens += chunk
            taken.append(seq)
        self.ready.extendleft(reversed(skipped))
        return taken

    def _launch(self, seqs: list[Sequence]) -> Microbatch:
        number = self.next_number
        self.next_number += 1
        with self.timeline.span(COMPUTE, f"mb {number}: embed + layers ({len(seqs)} seqs)"):
            inputs = [seq.take_input() for seq in seqs]
            lengths = [len(tokens) for tokens in inputs]
            seq_ids = [seq.seq_id for seq in seqs]
            hidden = self.model.embed(mx.array([[t for tokens in inputs for t in tokens]]))
            hidden = forward_stage(self.stage, hidden, seq_ids, lengths, self.group_rows)
        microbatch = Microbatch(number, seqs, lengths)
        if self.transport.size == 1:
            microbatch.hidden = hidden  # each sequence's last position (rank 0 holds the final layer)
        else:
            # Sampling rows need every logit: only all-greedy micro-batches share the head.
            if self.head_split is not None and all(seq.sampler.greedy for seq in seqs):
                microbatch.head_columns = self.head_split.columns
            with self.timeline.span(SEND, f"mb {number}"):
                self.sends.append(self.transport.isend_message(1, Kind.FORWARD, seq_ids, lengths, hidden,
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
        """Head and sampling for each sequence whose prompt is all in; records for the finished."""
        with self.timeline.span(COMPUTE, f"mb {microbatch.number}: head + sample"):
            index = [i for i, seq in enumerate(microbatch.seqs) if not seq.prefilling]
            sampling = [microbatch.seqs[i] for i in index]
            for seq in microbatch.seqs:
                if seq.prefilling:  # more prompt chunks to go: no token yet
                    self.ready.append(seq)
            if not sampling:
                return
            rows, share = split_returned(microbatch.hidden, self.model.config.hidden_size)
            if len(index) < rows.shape[0]:  # some sequences are still reading their prompt
                rows, share = rows[mx.array(index)], None if share is None else share[mx.array(index)]
            own = self.model.config.vocab_size - microbatch.head_columns  # the entries rank 0 computes
            started = time.perf_counter()
            logits = [self.model.logits(rows[b:e], vocab_end=own if share is not None else None)
                      for b, e in row_groups([1] * len(index), self.group_rows)]
            logits = logits[0] if len(logits) == 1 else mx.concatenate(logits, axis=0)  # [rows, own]
            # Every row's argmax in one op, read back at once: what greedy requests take (the same
            # index a row's own argmax gives); a sync per row cost rank 0 ~1 ms a micro-batch.
            if share is None:
                greedy = mx.argmax(logits, axis=-1)
            else:
                greedy = combined_argmax(logits, share, own)
                self.head_split.note_shared(microbatch.head_columns)
            mx.eval(logits, greedy)
            if self.head_split is not None:
                self.head_split.observe_cost(time.perf_counter() - started, len(index), own)
            greedy = greedy.tolist()
            finished = []
            now = time.perf_counter()
            for i, seq in enumerate(sampling):
                token = greedy[i] if seq.sampler.greedy else seq.sampler(logits[i], seq.history)
                if seq.first_token_at is None:
                    seq.first_token_at = now
                reason = None
                if token in self.tokenizer.eos_token_ids:
                    reason = "stop"
                else:
                    seq.tokens.append(token)
                    seq.detokenizer.add(token)
                    self.stats.generated_tokens += 1
                    if seq.detokenizer.stopped:
                        reason = "stop"
                    elif len(seq.tokens) >= seq.max_tokens:
                        reason = "length"
                if reason is None:
                    seq.next_input = [token]
                    self.ready.append(seq)
                else:
                    self._finish(seq, reason)
                    finished.append(seq.seq_id)
        if finished:
            self.stage.release(finished)
            if self.transport.size > 1:
                with self.timeline.span(SEND, "release"):
                    self.sends.append(self.transport.isend_message(1, Kind.RELEASE, finished))

    def _finish(self, seq: Sequence, reason: str) -> None:
        if not seq.detokenizer.stopped:
            seq.detokenizer.finish()
        now = time.perf_counter()
        self.active -= 1
        self._record(result_record(seq.request, seq.detokenizer.text, reason, len(seq.prompt_ids), len(seq.tokens),
                                   queued_s=seq.admitted_at - self.start,
                                   ttft_s=(seq.first_token_at or now) - seq.admitted_at,
                                   total_s=now - seq.admitted_at))

    def _record(self, record: dict, error: bool = False) -> None:
        self.write(record)
        if error:
            self.stats.errors += 1
        else:
            self.stats.done += 1
        if self.progress is not None:
            elapsed = time.perf_counter() - self.start
            self.progress.set_postfix_str(f"{self.stats.generated_tokens / elapsed if elapsed else 0:.1f} tok/s",
                                          refresh=False)
            self.progress.update(1)


def stop_followers(transport: Transport, timeline: Timeline) -> None:
    """Rank 0: STOP round the ring, after everything sent before it."""
    if transport.size > 1:
        with timeline.span(SEND, "stop"):
            transport.isend_message(1, Kind.STOP).wait()


def follow(stage: Stage, transport: Transport, timeline: Timeline, group_rows: int) -> None:
    """Ranks 1..N-1 in a batch job: run each micro-batch through this rank's layers and pass it
    on, in order, until STOP comes round; sends do not wait for the next rank to receive."""
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
            with timeline.span(COMPUTE, f"layers ({len(message.seq_ids)} seqs, {sum(message.lengths)} tokens)"):
                hidden = forward_stage(stage, message.hidden, message.seq_ids, message.lengths, group_rows)
                if nxt == 0:  # back to rank 0: the last positions, with the head's share if asked
                    groups = row_groups([1] * hidden.shape[1], group_rows)
                    hidden = returned_rows(stage.model, hidden, message.head_share, groups)
                    mx.eval(hidden)
            if nxt == 0:
                send(Kind.FORWARD, message.seq_ids, message.lengths, hidden, idle_us=round(waited * 1e6))
            else:
                send(Kind.FORWARD, message.seq_ids, message.lengths, hidden, head_share=message.head_share)
            continue
        if message.kind == Kind.RELEASE:
            stage.release(message.seq_ids)
        if nxt != 0:  # RELEASE and STOP go round the ring once
            send(message.kind, message.seq_ids)
        if message.kind == Kind.STOP:
            with timeline.span(SEND, "drain"):
                for p in pending:
                    p.wait()
            return
