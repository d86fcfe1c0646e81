"""Moving activations between ranks.

A `Transport` only needs raw point-to-point `send`/`recv` of contiguous numpy buffers; the
message framing (a small fixed-size header, then the hidden-state payload) lives here once,
so a second transport (e.g. MLX distributed over Thunderbolt RDMA) only implements the two.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from enum import IntEnum
from typing import NamedTuple

import mlx.core as mx
import numpy as np


class Kind(IntEnum):
    FORWARD = 1  # sequence layout + hidden states to run through the next stage's layers
    RELEASE = 2  # sequence ids whose caches can be freed
    STOP = 3  # the job is over: pass it on and exit


class Message(NamedTuple):
    kind: Kind
    seq_ids: list[int]  # FORWARD, RELEASE: the sequences concerned
    lengths: list[int]  # FORWARD: new tokens of each sequence, packed in this order
    hidden: mx.array | None  # FORWARD: [1, sum(lengths), hidden]


# Wire dtypes: numpy has no bfloat16, so it travels as its raw uint16 bits.
_WIRE = {mx.float32: (0, np.float32), mx.float16: (1, np.float16), mx.bfloat16: (2, np.uint16)}
_FROM_CODE = {code: (mx_dtype, np_dtype) for mx_dtype, (code, np_dtype) in _WIRE.items()}
_HEADER_LEN = 8  # kind, number of sequences, dtype code, ndim, up to 4 dims


class Transport(ABC):
    rank: int
    size: int

    @abstractmethod
    def send(self, buf: np.ndarray, dest: int) -> None:
        """Send a contiguous buffer; returns when `buf` may be reused."""

    @abstractmethod
    def recv(self, buf: np.ndarray, source: int) -> None:
        """Fill `buf` with the next message from `source`."""

    def send_message(self, dest: int, kind: Kind, seq_ids: list[int] = (), lengths: list[int] = (),
                     hidden: mx.array | None = None) -> None:
        """Header, then (if any sequences) their ids and lengths, then (FORWARD) the payload."""
        header = np.zeros(_HEADER_LEN, dtype=np.int64)
        header[0], header[1] = kind, len(seq_ids)
        if hidden is not None:
            header[2], _ = _WIRE[hidden.dtype]
            header[3] = hidden.ndim
            header[4:4 + hidden.ndim] = hidden.shape
        self.send(header, dest)
        if seq_ids:
            self.send(np.array([*seq_ids, *lengths], dtype=np.int64), dest)
        if hidden is not None:
            wire = hidden.view(mx.uint16) if hidden.dtype == mx.bfloat16 else hidden
            self.send(np.ascontiguousarray(wire), dest)

    def recv_message(self, source: int) -> Message:
        header = np.empty(_HEADER_LEN, dtype=np.int64)
        self.recv(header, source)
        kind, num_seqs = Kind(int(header[0])), int(header[1])
        seq_ids, lengths = [], []
        if num_seqs:
            layout = np.empty(num_seqs * (2 if kind == Kind.FORWARD else 1), dtype=np.int64)
            self.recv(layout, source)
            seq_ids, lengths = layout[:num_seqs].tolist(), layout[num_seqs:].tolist()
        hidden = None
        if kind == Kind.FORWARD:
            mx_dtype, np_dtype = _FROM_CODE[int(header[2])]
            payload = np.empty(tuple(int(d) for d in header[4:4 + int(header[3])]), dtype=np_dtype)
            self.recv(payload, source)
            hidden = mx.array(payload)
            if mx_dtype == mx.bfloat16:
                hidden = hidden.view(mx.bfloat16)
        return Message(kind, seq_ids, lengths, hidden)


class MpiTransport(Transport):
    """mpi4py point-to-point on buffers (no pickling on the hot path).

    Receives poll `Test` with a growing sleep instead of blocking in `Recv`: MPICH's blocking
    receive spins a whole core, which starves the working rank when ranks share cores.
    """

    max_sleep_s = 0.0005

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def send(self, buf: np.ndarray, dest: int) -> None:
        self.comm.Send(buf, dest=dest)

    def recv(self, buf: np.ndarray, source: int) -> None:
        request = self.comm.Irecv(buf, source=source)
        sleep = 0.0
        while not request.Test():
            if sleep:
                time.sleep(sleep)
            sleep = min(self.max_sleep_s, sleep * 2 or 0.00002)
