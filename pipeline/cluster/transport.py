"""Moving activations between ranks.

A `Transport` only needs raw point-to-point `send`/`recv` of contiguous numpy buffers; the
message framing (a small fixed-size header, then the hidden-state payload) lives here once,
so a second transport (e.g. MLX distributed over Thunderbolt RDMA) only implements the two.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from abc import ABC, abstractmethod
from enum import IntEnum
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .mpi import AbortJob, abort


class Kind(IntEnum):
    FORWARD = 1  # hidden states of packed sequences, to run through the next stage's layers
    RELEASE = 2  # sequences whose caches can be freed
    STOP = 3  # the job is over: pass it on and exit
    HEARTBEAT = 4  # rank 0 is alive but idle (a server waiting for requests): pass it on, nothing to do
    REWIND = 6  # speculative decoding: drop each sequence's last `dropped` cached positions (rejected drafts)
    FORK = 5  # prefix cache: each new sequence starts from the first `prefix` positions of a kept one
    SAVE = 7  # prompt cache on disk: store each sequence's first `prefix` positions as the entry `entries`
    LOAD = 8  # prompt cache on disk: each new sequence starts from a stored entry's first `prefix` positions;
    # a rank that cannot load its part passes -prefix on (later ranks skip it), and the last rank answers rank 0
    DROP = 9  # prompt cache on disk: remove the stored `entries`


class Message(NamedTuple):
    """One message round the ring. Each field says which kinds carry it; the others leave it empty."""
    kind: Kind
    seq_ids: list[int]  # FORWARD, RELEASE, REWIND: the sequences concerned; FORK: the new sequences
    tokens: list[int]  # FORWARD: new tokens of each sequence, packed in this order
    every_position: list[bool]  # FORWARD: per sequence, whether the final layer returns its every position
    # (drafts being verified, a prompt read by the MTP drafter) rather than its last only
    dropped: list[int]  # REWIND: positions to drop from the end of each sequence's caches
    kept_ids: list[int]  # FORK: the kept sequence each new one starts from
    prefix: list[int]  # FORK: how many of the kept sequence's first positions it starts from; SAVE, LOAD: positions
    hidden: mx.array | None  # FORWARD: [1, sum(tokens), hidden]
    head_share: int = 0  # FORWARD from rank 0 (batch): LM head columns the last rank computes (head_share.py)
    idle_us: int = 0  # FORWARD back to rank 0 (batch): how long the last rank waited for this one, in us
    rewind: int = 0  # FORWARD (generate): positions to drop from the end of its caches first (rejected drafts)
    entries: list[int] = []  # SAVE, LOAD, DROP: the stored entries' keys (prompt_cache_store.entry_key)


# Wire dtypes: numpy has no bfloat16, so it travels as its raw uint16 bits.
_WIRE = {mx.float32: (0, np.float32), mx.float16: (1, np.float16), mx.bfloat16: (2, np.uint16)}
_FROM_CODE = {code: (mx_dtype, np_dtype) for mx_dtype, (code, np_dtype) in _WIRE.items()}
_HEADER_LEN = 11  # kind, number of sequences, dtype code, ndim, up to 4 dims, head_share, idle_us, rewind
_INLINE_SEQS = 28  # FORWARD layouts of up to this many sequences ride in the header: one message less per hop
_LAYOUT_SLOTS = 2 * _INLINE_SEQS  # the header's room for a layout, in int64s
_HEADER_BYTES = (_HEADER_LEN + _LAYOUT_SLOTS) * 8
# A layout's int64s per sequence, by kind: its id, then (FORWARD) its tokens, (REWIND) the positions
# it drops, (FORK) the kept sequence and the prefix length. A FORWARD's tokens travel as -n for a
# sequence whose every position comes back (n >= 1, so the sign is free): no second list on the wire.
# (SAVE, LOAD) the entry's key and the positions; a DROP's layout is its entries' keys alone.
_LAYOUT_WORDS = {Kind.FORWARD: 2, Kind.REWIND: 2, Kind.FORK: 3, Kind.SAVE: 3, Kind.LOAD: 3}


def _layout(kind: Kind, seq_ids, tokens, every_position, dropped, kept_ids, prefix, entries) -> list[int]:
    """A message's sequences as the int64s that follow its header (see _LAYOUT_WORDS)."""
    if kind == Kind.FORWARD:
        every_position = every_position or [False] * len(tokens)
        return [*seq_ids, *(-n if every else n for n, every in zip(tokens, every_position))]
    if kind == Kind.REWIND:
        return [*seq_ids, *dropped]
    if kind == Kind.FORK:
        return [*seq_ids, *kept_ids, *prefix]
    if kind in (Kind.SAVE, Kind.LOAD):
        return [*seq_ids, *entries, *prefix]
    if kind == Kind.DROP:
        return list(entries)
    return list(seq_ids)


def _to_wire(hidden: mx.array) -> np.ndarray:
    """Hidden states as numpy (bf16, which numpy lacks, as its raw uint16 bits)."""
    return np.asarray(hidden.view(mx.uint16) if hidden.dtype == mx.bfloat16 else hidden)


def _from_wire(payload: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """The inverse of `_to_wire` (a copy, so `payload`'s buffer may be reused)."""
    hidden = mx.array(payload)
    return hidden.view(mx.bfloat16) if dtype == mx.bfloat16 else hidden


class Transport(ABC):
    rank: int
    size: int
    # FORWARD payloads up to this many bytes travel in the header's message (one message per hop),
    # for transports whose `recv` takes a message shorter than its buffer (MPI does); 0: never.
    inline_bytes = 0
    _inbox: np.ndarray | None = None

    @abstractmethod
    def send(self, buf: np.ndarray, dest: int) -> None:
        """Send a contiguous buffer; returns when `buf` may be reused."""

    @abstractmethod
    def recv(self, buf: np.ndarray, source: int) -> None:
        """Fill `buf` with the next message from `source`."""

    def send_message(self, dest: int, kind: Kind, seq_ids: list[int] = (), tokens: list[int] = (),
                     hidden: mx.array | None = None, *, every_position: list[bool] = (), dropped: list[int] = (),
                     kept_ids: list[int] = (), prefix: list[int] = (), head_share: int = 0, idle_us: int = 0,
                     rewind: int = 0, entries: list[int] = ()) -> None:
        """Header, then (if any sequences) their layout, then (FORWARD) the payload. The fields are
        Message's, each for the kinds that carry it."""
        header = np.zeros(_HEADER_LEN + _LAYOUT_SLOTS, dtype=np.int64)
        header[0], header[1] = kind, len(entries) if kind == Kind.DROP else len(seq_ids)
        header[8], header[9], header[10] = head_share, idle_us, rewind
        if hidden is not None:
            header[2], _ = _WIRE[hidden.dtype]
            header[3] = hidden.ndim
            header[4:4 + hidden.ndim] = hidden.shape
        layout = _layout(kind, seq_ids, tokens, every_position, dropped, kept_ids, prefix, entries)
        if len(layout) <= _LAYOUT_SLOTS:
            header[_HEADER_LEN:_HEADER_LEN + len(layout)] = layout
        if hidden is not None and self._inlined(len(layout), hidden.nbytes):
            wire = _to_wire(hidden)
            message = np.empty(_HEADER_BYTES + wire.nbytes, dtype=np.uint8)
            message[:_HEADER_BYTES] = header.view(np.uint8)
            message[_HEADER_BYTES:] = wire.reshape(-1).view(np.uint8)
            self.send(message, dest)
            return
        self.send(header, dest)
        if len(layout) > _LAYOUT_SLOTS:
            self.send(np.array(layout, dtype=np.int64), dest)
        if hidden is not None:
            self.send_hidden(hidden, dest)

    def isend(self, buf: np.ndarray, dest: int):
        """Start sending `buf` and return a request whose `Test()` is True once `buf` may be
        reused; the caller keeps `buf` alive until then. This default sends before returning."""
        self.send(buf, dest)
        return _SENT

    def wait_for(self, request, peer: int, sending: bool) -> None:
        """Block until `request` (an isend to, or a receive from, `peer`) is complete."""
        while not request.Test():
            time.sleep(0.0005)

    def isend_message(self, dest: int, kind: Kind, seq_ids: list[int] = (), tokens: list[int] = (),
                      hidden: mx.array | None = None, **fields) -> "PendingSend":
        """`send_message` without waiting for the receiver, so a rank with several messages in
        flight (the batch schedule) never blocks in a send while its peer blocks sending to it.
        Same framing: each buffer `send_message` would `send` is `isend` instead (a payload a
        transport carries on another channel, as MlxTransport does, still goes blocking)."""
        pending = PendingSend(self, dest)
        self.send = lambda buf, to: pending.add(self.isend(buf, to), buf)  # shadows the method
        try:
            self.send_message(dest, kind, seq_ids, tokens, hidden, **fields)
        finally:
            del self.send
        return pending

    def _inlined(self, layout_words: int, payload_bytes: int) -> bool:
        """Whether a payload rides in the header's message: its layout fits the header, and it is small."""
        return layout_words <= _LAYOUT_SLOTS and payload_bytes <= self.inline_bytes

    def recv_message(self, source: int) -> Message:
        if self.inline_bytes:  # one buffer, reused: a header, or a header and its payload
            if self._inbox is None:
                self._inbox = np.empty(_HEADER_BYTES + self.inline_bytes, dtype=np.uint8)
            inbox = self._inbox
        else:
            inbox = np.empty(_HEADER_BYTES, dtype=np.uint8)
        self.recv(inbox, source)
        header = inbox[:_HEADER_BYTES].view(np.int64)
        kind, num_seqs = Kind(int(header[0])), int(header[1])
        words = num_seqs * _LAYOUT_WORDS.get(kind, 1)
        if words <= _LAYOUT_SLOTS:
            layout = header[_HEADER_LEN:_HEADER_LEN + words].tolist()
        else:
            layout = np.empty(words, dtype=np.int64)
            self.recv(layout, source)
            layout = layout.tolist()
        seq_ids, rest = layout[:num_seqs], layout[num_seqs:]
        tokens, every_position, dropped, kept_ids, prefix, entries = [], [], [], [], [], []
        if kind == Kind.DROP:
            seq_ids, entries = [], layout
        elif kind == Kind.FORWARD:
            tokens, every_position = [abs(n) for n in rest], [n < 0 for n in rest]
        elif kind == Kind.REWIND:
            dropped = rest
        elif kind == Kind.FORK:
            kept_ids, prefix = rest[:num_seqs], rest[num_seqs:]
        elif kind in (Kind.SAVE, Kind.LOAD):
            entries, prefix = rest[:num_seqs], rest[num_seqs:]
        hidden = None
        if kind == Kind.FORWARD:
            mx_dtype, np_dtype = _FROM_CODE[int(header[2])]
            shape = tuple(int(d) for d in header[4:4 + int(header[3])])
            nbytes = math.prod(shape) * np.dtype(np_dtype).itemsize
            if self._inlined(words, nbytes):
                hidden = _from_wire(inbox[_HEADER_BYTES:_HEADER_BYTES + nbytes].view(np_dtype).reshape(shape), mx_dtype)
            else:
                hidden = self.recv_hidden(shape, mx_dtype, source)
        return Message(kind, seq_ids, tokens, every_position, dropped, kept_ids, prefix, hidden,
                       head_share=int(header[8]), idle_us=int(header[9]), rewind=int(header[10]), entries=entries)

    def send_hidden(self, hidden: mx.array, dest: int) -> None:
        """The payload of a FORWARD message (a transport may carry it on another channel)."""
        self.send(np.ascontiguousarray(_to_wire(hidden)), dest)

    def recv_hidden(self, shape: tuple[int, ...], dtype: mx.Dtype, source: int) -> mx.array:
        payload = np.empty(shape, dtype=_WIRE[dtype][1])
        self.recv(payload, source)
        return _from_wire(payload, dtype)


class _Sent:
    def Test(self) -> bool:  # noqa: N802 (mpi4py's spelling)
        return True


_SENT = _Sent()


class PendingSend:
    """The requests of one message sent with `isend_message`, and the buffers they read from,
    which stay alive until every request is complete."""

    def __init__(self, transport: "Transport", dest: int):
        self._transport, self._dest = transport, dest
        self._parts: list[tuple[object, np.ndarray]] = []

    def add(self, request, buf: np.ndarray) -> None:
        self._parts.append((request, buf))

    def done(self) -> bool:
        """True once the whole message has left (each call also drives MPI's progress)."""
        self._parts = [(r, b) for r, b in self._parts if not r.Test()]
        return not self._parts

    def wait(self) -> None:
        """Block until sent, as receives wait (polling, then sleeping; under the watchdog)."""
        for request, _ in self._parts:
            self._transport.wait_for(request, self._dest, sending=True)
        self._parts = []


class PeerSilent(AbortJob):
    """A peer sent nothing for longer than the watchdog allows."""


class PeerGone(AbortJob):
    """A peer's process on this host has ended (killed) while this rank waited on it."""


def this_process() -> tuple[str, str, int]:
    """(kernel boot, pid namespace, pid) of this process: ranks whose first two match see each
    other's pids, so a rank can tell that a peer on its host has died without waiting for the
    watchdog (a launcher that does not end the job when one rank dies leaves the others waiting)."""
    def read(how, path: str) -> str:
        try:
            return how(path)
        except OSError:
            return ""

    boot = read(lambda p: open(p).read().strip(), "/proc/sys/kernel/random/boot_id")
    return boot, read(os.readlink, "/proc/self/ns/pid"), os.getpid()


class MpiTransport(Transport):
    """mpi4py point-to-point on buffers (no pickling on the hot path).

    Receives poll `Test` with a growing sleep instead of blocking in `Recv`: MPICH's blocking
    receive spins a whole core, which starves the working rank when ranks share cores.
    A rank with a core of its own (`own_core`) polls without sleeping for `OWN_CORE_SPIN_S` first:
    in a batch job's steady state each wait is a few ms, and waking from a sleep would add up
    to `max_sleep_s` to every hop (measured ~0.45 ms a hop, ~1.5% of a 2-rank batch job).
    The same loop is the watchdog: a wait longer than `watchdog_s` (0: none) aborts the job
    with a message naming the silent peer. Given `processes` (each rank's `this_process()`), it also
    checks every `PEER_CHECK_S` of a wait whether the peer, when it shares this host's pids, still
    exists, and ends the job at once if not.
    """

    max_sleep_s = 0.0005
    inline_bytes = 1 << 20
    SHARED_CORE_SPIN_S = 0.0002  # a reply due in microseconds costs no sleep
    OWN_CORE_SPIN_S = 0.05
    PEER_CHECK_S = 1.0

    def __init__(self, comm, watchdog_s: float = 0.0, hosts: list[str] | None = None, own_core: bool = False,
                 processes: list[tuple[str, str, int]] | None = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.watchdog_s = watchdog_s
        self.hosts = hosts  # host name of each rank, for messages
        self.spin_s = self.OWN_CORE_SPIN_S if own_core else self.SHARED_CORE_SPIN_S
        # The pid of each rank whose pids this process sees (same kernel boot and pid namespace)
        here = processes[self.rank][:2] if processes else None
        self.local_pids = {r: p[2] for r, p in enumerate(processes or [])
                           if r != self.rank and all(here) and p[:2] == here}

    def send(self, buf: np.ndarray, dest: int) -> None:
        # Not a blocking Send: a large message waits for the receiver, and a hung one must trip the watchdog.
        self.wait_for(self.comm.Isend(buf, dest=dest), dest, sending=True)

    def isend(self, buf: np.ndarray, dest: int):
        return self.comm.Isend(buf, dest=dest)

    def recv(self, buf: np.ndarray, source: int) -> None:
        self.wait_for(self.comm.Irecv(buf, source=source), source, sending=False)

    def wait_for(self, request, peer: int, sending: bool) -> None:
        sleep = 0.0
        start = last = time.monotonic()
        check_at = start + self.PEER_CHECK_S if peer in self.local_pids else math.inf
        spin_until = time.perf_counter() + self.spin_s
        while not request.Test():
            if time.perf_counter() < spin_until:
                os.sched_yield()  # a busy core (more ranks than cores) runs its other work meanwhile
                continue
            if sleep:
                time.sleep(sleep)
            sleep = min(self.max_sleep_s, sleep * 2 or 0.00002)
            if check_at != math.inf and time.monotonic() > check_at:
                check_at = time.monotonic() + self.PEER_CHECK_S
                if not _exists(self.local_pids[peer]):
                    raise PeerGone(self.gone(peer))
            if self.watchdog_s:
                now = time.monotonic()
                if now - last > 1.0:  # this process was stopped (SIGSTOP, a suspended laptop): not the peer's fault
                    start += now - last
                last = now
                if now - start > self.watchdog_s:
                    raise PeerSilent(self.silence(peer, sending))

    def _who(self, rank: int) -> str:
        return f"rank {rank}" + (f" ({self.hosts[rank]})" if self.hosts else "")

    def silence(self, peer: int, sending: bool = False) -> str:
        what = f"could not send to {self._who(peer)}" if sending else f"got nothing from {self._who(peer)}"
        return (f"{self._who(self.rank)} {what} for {self.watchdog_s:g} s (--watchdog {self.watchdog_s:g}): "
                f"rank {peer} is hung or its link is down; aborting the job")

    def gone(self, peer: int) -> str:
        return (f"{self._who(self.rank)} was waiting on {self._who(peer)}, whose process (pid "
                f"{self.local_pids[peer]}) has ended; aborting the job")


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # a process another user owns has that pid: not told apart from ours, so taken as alive
    return True


class MlxTransport(MpiTransport):
    """Hidden states over `mlx.core.distributed` (JACCL: RDMA over Thunderbolt 5 on Macs; or
    MLX's TCP ring), everything else over MPI, which stays the control plane.

    The small header of each message still travels by MPI and the wait for it is MpiTransport's
    sleeping poll with its watchdog; only then is the payload received with MLX, whose receive
    busy-polls (measured on the ring backend: a full core for the whole wait) and cannot time out.
    The sender sends the payload right after the header, so MLX's receive never waits long; a
    watchdog thread still guards it in case a peer hangs in between.
    """

    inline_bytes = 0  # payloads always go by MLX

    def __init__(self, comm, group, watchdog_s: float = 0.0, hosts: list[str] | None = None, own_core: bool = False,
                 processes: list[tuple[str, str, int]] | None = None):
        super().__init__(comm, watchdog_s, hosts, own_core, processes)
        self.group = group
        self._guard = _Deadline(self) if watchdog_s else None

    def send_hidden(self, hidden: mx.array, dest: int) -> None:
        if self._guard:
            self._guard.arm(dest, sending=True)
        mx.eval(mx.distributed.send(hidden, dest, group=self.group, stream=mx.cpu))
        if self._guard:
            self._guard.disarm()

    def recv_hidden(self, shape: tuple[int, ...], dtype: mx.Dtype, source: int) -> mx.array:
        if self._guard:
            self._guard.arm(source)
        hidden = mx.distributed.recv(shape, dtype, source, group=self.group, stream=mx.cpu)
        mx.eval(hidden)
        if self._guard:
            self._guard.disarm()
        return hidden

    @contextlib.contextmanager
    def watched(self, peer: int, sending: bool = False):
        """Around a blocking MLX wait on `peer` (a group sum's gather): the watchdog's deadline."""
        if self._guard:
            self._guard.arm(peer, sending)
        try:
            yield
        finally:
            if self._guard:
                self._guard.disarm()


class _Deadline:
    """A thread that aborts the job if an armed (blocking, uninterruptible) wait runs too long."""

    def __init__(self, transport: MpiTransport):
        self.transport = transport
        self.source: int | None = None
        self.sending = False
        self.deadline = 0.0
        self.cond = threading.Condition()
        threading.Thread(target=self._run, name="pipeline-watchdog", daemon=True).start()

    def arm(self, peer: int, sending: bool = False) -> None:
        with self.cond:
            self.source, self.sending = peer, sending
            self.deadline = time.monotonic() + self.transport.watchdog_s
            self.cond.notify()

    def disarm(self) -> None:
        with self.cond:
            self.source = None

    def _run(self) -> None:
        with self.cond:
            while True:
                if self.source is None:
                    self.cond.wait()
                    continue
                left = self.deadline - time.monotonic()
                if left > 0:
                    self.cond.wait(left)
                    continue
                print(f"error: {self.transport.silence(self.source, self.sending)}", file=sys.stderr, flush=True)
                abort(self.transport.comm)
