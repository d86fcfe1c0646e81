"""--tensor-parallel T at run time: a stage is a group of T consecutive ranks, each holding its share
of the stage's layers (models/tensor_parallel.py). The ring (engine, scheduler, followers) runs over
the stage leaders (ranks 0, T, 2T, ...) exactly as over the ranks of a pipeline; rank 0 is stage 0's
leader, so nothing above the Stage changes.

A leader's Stage is a `LeaderStage`: each method that changes state (run_layers, release, rewind,
fork) first sends the same command (a small header, the sequences' layout, the hidden states) to the
group's other ranks, its mates, which `follow_leader` executes on their own shards until STOP. Inside
each layer every member computes its partial output, and the group's sum (cluster/tensor_group.py
GroupSum: gathered, added in rank order in float32) gives all members the same bits.

A mate waits for its leader's next command without the watchdog (a server may idle for hours; its
leader has its own watchdog on the ring, and a dead process on the same host is still noticed); the
group sums and the leader's sends to its mates wait under the watchdog.

Stage 0's group splits the LM head by vocabulary (models/vocab_split.py): each member holds a slice of
its rows, and rank 0 (which embeds, and holds the whole embedding) asks its mates for their slices'
logits with a HEAD command (`SplitHead`): every logit where the caller reads the whole vocabulary
(sampling, drafts, perplexity), or only a summary of each slice (max, argmax, logsumexp, top entries)
where greedy tokens and their logprobs are all it needs.

The prompt cache on disk (serve --prompt-cache-dir): each member stores and loads its own share of an
entry in files of its own (prompt_cache_store.py, named by its shard); a leader's `save_stored`,
`load_from_store` and `remove_stored` send SAVE, LOAD and DROP to its mates first, and a LOAD waits
for every mate's answer: the entry starts the sequence only where every member loaded its share, else
the whole group releases it and the request runs cold.

Under --transport mlx (MLX 0.32 cannot split its group: T = ranks only), the sums, the router's choices,
the commands' hidden states and the head's slices go over MLX's group (cluster/mlx_group_sum.py), the
commands' headers over MPI. Not yet: families other than Llama's, Qwen3-MoE and the MLA families (DeepSeek V3/V3.2, Kimi K2; models/tensor_parallel.py
check_family).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..cluster.mlx_group_sum import open_mlx_group
from ..cluster.tensor_group import GroupSum, split
from .group_sums import make_group_sum
from ..cluster.transport import MlxTransport, MpiTransport, this_process
from ..models.stage_slice import head_columns
from ..models.tensor_parallel import Shard
from ..models.vocab_split import combine, summary, vocab_share
from ..kernels import blas
from ..util import cores
from ..util.errors import UserError
from .stage import Stage

RUN, RELEASE, REWIND, FORK, STOP, HEAD = 1, 2, 3, 4, 5, 6
SAVE, LOAD, DROP = 7, 8, 9  # the prompt cache on disk: each member its own share (module docstring)
FULL, SUMMARY = 0, 1  # what a member returns of its head slice for a HEAD command
_HEADER = 12  # command, sequences, last_only, full given, dtype code, ndim, 4 dims, positions (REWIND), spare
_WIRE = {mx.float32: (0, np.float32), mx.float16: (1, np.float16), mx.bfloat16: (2, np.uint16)}
_FROM_CODE = {code: (mx_dtype, np_dtype) for mx_dtype, (code, np_dtype) in _WIRE.items()}
_MX_WIRE = {np.float32: mx.float32, np.float16: mx.float16, np.uint16: mx.uint16}  # a payload's dtype on MLX's wire


def check_tensor_parallel(t: int, ranks: int, transport: str = "mpi") -> None:
    """One line for a --tensor-parallel the job cannot run (every rank checks the same)."""
    if t < 1 or ranks % t:
        divisors = ", ".join(str(d) for d in range(1, ranks + 1) if ranks % d == 0)
        raise UserError(f"--tensor-parallel {t} must divide the {ranks} ranks (ranks = stages x T), e.g. {divisors}")
    if 1 < t < ranks and transport == "mlx":
        raise UserError(f"--tensor-parallel {t} on {ranks} ranks makes {ranks // t} stages of {t}, which --transport "
                        f"mlx cannot run (MLX's distributed group cannot be split into stage groups): use --transport "
                        f"mpi, or --tensor-parallel {ranks} (pure tensor parallelism) or 1 with --transport mlx")


@dataclass
class Group:
    """This rank's place under --tensor-parallel (size 1: today's pipeline, no group)."""
    size: int = 1
    stage: int = 0
    member: int = 0
    ring: object = None  # the communicator the ring's transport runs over (leaders'), None on mates
    link: MpiTransport | None = None  # the group's communicator, under the watchdog
    waiting: MpiTransport | None = None  # the same without the watchdog: a mate waiting for commands
    group_sum: GroupSum | None = None

    @property
    def leads(self) -> bool:
        return self.member == 0

    @property
    def shard(self) -> Shard | None:
        return Shard(self.member, self.size) if self.size > 1 else None

    def ms_per_step(self, stage: Stage) -> float:
        """Milliseconds this rank spent in group sums per forward step (two sums a layer)."""
        if self.group_sum is None or not self.group_sum.calls:
            return 0.0
        steps = self.group_sum.calls / max(1, 2 * len(stage.model.layers))
        return 1000 * self.group_sum.seconds / steps


def form_group(comm, t: int, transport: str = "mpi", watchdog: float = 0.0, mlx_backend: str = "auto") -> Group:
    """Collective: the stage groups of --tensor-parallel t over `comm`'s ranks (with --transport mlx, one
    group of them all over MLX's distributed group)."""
    check_tensor_parallel(t, comm.Get_size(), transport)
    if t == 1:
        return Group(ring=comm)
    comms = split(comm, t)
    hosts = comm.allgather(socket.gethostname())
    placement = comm.allgather((socket.gethostname(), cores.cpus_allowed()))
    processes = comm.allgather(this_process())
    members = range(comms.stage * t, comms.stage * t + t)
    labels = [f"{hosts[r]}, job rank {r}" for r in members]
    own_core = cores.has_own_core(placement, comm.Get_rank())
    group_processes = [processes[r] for r in members]
    waiting = MpiTransport(comms.group, 0.0, labels, own_core, group_processes)
    if transport == "mlx":
        link, group_sum = open_mlx_group(comms.group, mlx_backend, watchdog, labels, own_core, group_processes)
        if link.unbound:  # (the stats line no longer says "bound, 1 CPU/rank")
            blas.note_binding("")
        return Group(t, comms.stage, comms.member, comms.leaders, link, waiting, group_sum)
    link = MpiTransport(comms.group, watchdog, labels, own_core, group_processes)
    return Group(t, comms.stage, comms.member, comms.leaders, link, waiting, make_group_sum(link))


@dataclass
class LeaderStage(Stage):
    """A stage leader's Stage: each change of state goes to its mates first (see the module docstring)."""
    group: Group | None = None

    def run_layers(self, hidden: mx.array, seq_ids: list[int] = (0,), lengths: list[int] | None = None,
                   evaluate: bool = True, last_only: bool = False, full: list[bool] | None = None) -> mx.array:
        lengths = [hidden.shape[1]] if lengths is None else list(lengths)
        layout = [*seq_ids, *lengths] + ([int(f) for f in full] if full is not None else [])
        wire = np.asarray(hidden.view(mx.uint16) if hidden.dtype == mx.bfloat16 else hidden)
        send(self.group, RUN, len(seq_ids), layout, wire, dtype=hidden.dtype, last_only=last_only,
             full_given=full is not None)
        out = super().run_layers(hidden, seq_ids, lengths, evaluate=evaluate, last_only=last_only, full=full)
        if not evaluate:
            # The mates compute this command now and wait in its group sums for this member's partials: a
            # lazy result left unstarted while the next command is sent (a micro-batch's second row group,
            # whose hidden states a mate receives only after its first) would hang the group.
            mx.async_eval(out)
        return out

    def release(self, seq_ids: list[int]) -> None:
        send(self.group, RELEASE, len(seq_ids), list(seq_ids))
        super().release(seq_ids)

    def rewind(self, seq_ids: list[int], positions: int) -> None:
        if positions:
            send(self.group, REWIND, len(seq_ids), list(seq_ids), positions=positions)
        super().rewind(seq_ids, positions)

    def fork(self, new_ids: list[int], kept_ids: list[int], lengths: list[int]) -> None:
        send(self.group, FORK, len(new_ids), [*new_ids, *kept_ids, *lengths])
        super().fork(new_ids, kept_ids, lengths)

    def save_stored(self, store, seq_id: int, key: int, positions: int, tokens=None) -> None:
        send(self.group, SAVE, 1, [seq_id, key, positions])
        super().save_stored(store, seq_id, key, positions, tokens)

    def load_from_store(self, store, seq_id: int, key: int, positions: int) -> bool:
        """The mates read theirs while the leader reads its own; True where every member loaded its share,
        else the group releases whatever some loaded (the request runs cold)."""
        send(self.group, LOAD, 1, [seq_id, key, positions])
        own = super().load_from_store(store, seq_id, key, positions)
        answers = mates_answers(self.group, 1)
        if own and all(a[0] > 0 for a in answers):
            return True
        self.release([seq_id])  # (a member that loaded nothing holds nothing to release)
        return False

    def remove_stored(self, store, keys: list[int]) -> None:
        if keys:
            send(self.group, DROP, len(keys), list(keys))
        super().remove_stored(store, keys)


class SplitHead:
    """Rank 0 under --tensor-parallel: the LM head split by vocabulary over stage 0's group, as the
    callable TransformerSlice.vocab_split (see the module docstring). Counts the seconds rank 0
    spends waiting for its mates' slices."""

    def __init__(self, group: Group, vocab_size: int):
        self.group = group
        self.bounds = [vocab_share(vocab_size, group.size, m) for m in range(group.size)]
        self.own_end = self.bounds[0][1]
        self.seconds = 0.0

    def __call__(self, rows: mx.array, own, top: int | None = None):
        """rows [n, hidden], normed; own(rows): rank 0's logits of entries [0, own_end). top None: the
        logits of every entry [n, vocab]; else the whole vocabulary's summary (vocab_split.Combined)."""
        mx.eval(rows)
        wire = np.asarray(rows.view(mx.uint16) if rows.dtype == mx.bfloat16 else rows)
        n = rows.shape[0]
        send(self.group, HEAD, n, [FULL if top is None else SUMMARY, top or 0], wire, dtype=rows.dtype)
        mine = own(rows)
        mine = mine if top is None else summary(mine, top)
        mx.eval(mine)
        started = time.perf_counter()
        parts = []
        for member, (begin, end) in enumerate(self.bounds[1:], start=1):
            width = end - begin if top is None else 3 + 2 * min(top, end - begin)
            parts.append(recv_slice(self.group.link, (n, width), member))
        self.seconds += time.perf_counter() - started
        if top is None:  # in member order: the whole vocabulary's logits
            return mx.concatenate([mine] + [mx.array(p).astype(mine.dtype) for p in parts], axis=-1)
        return combine([np.asarray(mine)] + parts, [b for b, _ in self.bounds], top)


def head_slice_reply(stage: Stage, group: Group, rows: mx.array, mode: int, top: int) -> None:
    """A mate of stage 0: its slice's logits of `rows` (normed by rank 0), or their summary, to rank 0."""
    head = stage.model.head_share
    logits = head_columns(head, rows, 0, head.weight.shape[0])
    out = summary(logits, top) if mode == SUMMARY else logits.astype(mx.float32)
    link = group.link
    if isinstance(link, MlxTransport):  # over MLX's group (cluster/mlx_group_sum.py)
        link.send_hidden(out, 0)
        return
    buf = np.ascontiguousarray(np.asarray(out))
    link.wait_for(link.isend(buf, 0), 0, sending=True)


def recv_slice(link: MpiTransport, shape: tuple[int, int], member: int) -> np.ndarray:
    """Rank 0: a mate's float32 slice of the head's logits (or its summary)."""
    if isinstance(link, MlxTransport):
        return np.asarray(link.recv_hidden(shape, mx.float32, member))
    buf = np.empty(shape, dtype=np.float32)
    link.recv(buf, member)
    return buf


def send(group: Group, command: int, count: int, layout: list[int] = (), payload: np.ndarray | None = None,
         dtype: mx.Dtype = mx.float32, last_only: bool = False, full_given: bool = False, positions: int = 0) -> None:
    """Leader: one command to each mate (header, layout, payload), sent to all before waiting."""
    header = np.zeros(_HEADER, dtype=np.int64)
    header[0], header[1], header[2], header[3] = command, count, last_only, full_given
    header[10] = positions
    if payload is not None:
        header[4], header[5] = _WIRE[dtype][0], payload.ndim
        header[6:6 + payload.ndim] = payload.shape
    buffers = [header] + ([np.array(layout, dtype=np.int64)] if len(layout) else [])
    link = group.link
    over_mlx = payload is not None and isinstance(link, MlxTransport)  # the payload by MLX, after the header
    if payload is not None and not over_mlx:
        buffers.append(np.ascontiguousarray(payload))
    pending = [(link.isend(buf, mate), mate) for mate in range(1, group.size) for buf in buffers]
    for request, mate in pending:
        link.wait_for(request, mate, sending=True)
    if over_mlx:
        wire = mx.array(payload)  # bfloat16 as its uint16 bits, as by MPI
        for mate in range(1, group.size):
            link.send_hidden(wire, mate)


def stop_mates(group: Group) -> None:
    """Leader: the job is over for its mates."""
    if group.size > 1 and group.leads:
        send(group, STOP, 0)


def mates_answers(group: Group, count: int) -> list[list[int]]:
    """Leader: each mate's answer to a LOAD of `count` entries (positions loaded, or -positions)."""
    answers = []
    for mate in range(1, group.size):
        buf = np.empty(count, dtype=np.int64)
        group.link.recv(buf, mate)
        answers.append(buf.tolist())
    return answers


def follow_stored_command(stage: Stage, group: Group, store, command: int, layout: list[int]) -> None:
    """A mate's part of SAVE, LOAD or DROP: its own share's files (`store`: its PromptCacheStore); a LOAD
    is answered to the leader (positions, or -positions where this member could not load its share)."""
    if command == DROP:
        stage.remove_stored(store, layout)
        return
    count = len(layout) // 3
    entries = zip(layout[:count], layout[count:2 * count], layout[2 * count:])
    if command == SAVE:
        for seq_id, key, positions in entries:
            stage.save_stored(store, seq_id, key, positions)
        return
    answers = np.array([p if stage.load_from_store(store, s, k, p) else -p
                        for s, k, p in entries], dtype=np.int64)
    link = group.link
    link.wait_for(link.isend(answers, 0), 0, sending=True)


def follow_leader(stage: Stage, group: Group, store=None) -> None:
    """A mate (member > 0): run its leader's commands on its own shard until STOP. store: its own files
    of the prompt cache on disk (SAVE, LOAD, DROP), where the job has one."""
    waiting, link = group.waiting, group.link
    header = np.empty(_HEADER, dtype=np.int64)
    while True:
        waiting.recv(header, 0)
        command, count = int(header[0]), int(header[1])
        if command == STOP:
            return
        words = {RUN: 2 * count + (count if header[3] else 0), RELEASE: count, REWIND: count, FORK: 3 * count,
                 HEAD: 2, SAVE: 3 * count, LOAD: 3 * count, DROP: count}[command]
        layout = np.empty(words, dtype=np.int64)
        if words:
            link.recv(layout, 0)
        layout = layout.tolist()
        if command in (RUN, HEAD):
            mx_dtype, np_dtype = _FROM_CODE[int(header[4])]
            shape = tuple(int(d) for d in header[6:6 + int(header[5])])
            if isinstance(link, MlxTransport):
                hidden = link.recv_hidden(shape, _MX_WIRE[np_dtype], 0)
            else:
                payload = np.empty(shape, dtype=np_dtype)
                link.recv(payload, 0)
                hidden = mx.array(payload)
            if mx_dtype == mx.bfloat16:
                hidden = hidden.view(mx.bfloat16)
        if command == HEAD:
            head_slice_reply(stage, group, hidden, layout[0], layout[1])
        elif command == RUN:
            full = [bool(f) for f in layout[2 * count:]] if header[3] else None
            stage.run_layers(hidden, layout[:count], layout[count:2 * count], last_only=bool(header[2]), full=full)
        elif command == RELEASE:
            stage.release(layout)
        elif command == REWIND:
            stage.rewind(layout, int(header[10]))
        elif command == FORK:
            stage.fork(layout[:count], layout[count:2 * count], layout[2 * count:])
        elif command in (SAVE, LOAD, DROP):
            follow_stored_command(stage, group, store, command, layout)
