"""Moving activations between ranks.

A `Transport` only needs raw point-to-point `send`/`recv` of contiguous numpy buffers; the
message framing (a small fixed-size header, then the hidden-state payload) lives here once,
so a second transport (e.g. MLX distributed over Thunderbolt RDMA) only implements the two.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from enum import IntEnum

import mlx.core as mx
import numpy as np


class Kind(IntEnum):
    FORWARD = 1  # payload: hidden states to run through the next stage's layers
    STOP = 2  # no payload: the job is over; pass it on and exit


# Wire dtypes: numpy has no bfloat16, so it travels as its raw uint16 bits.
_WIRE = {mx.float32: (0, np.float32), mx.float16: (1, np.float16), mx.bfloat16: (2, np.uint16)}
_FROM_CODE = {code: (mx_dtype, np_dtype) for mx_dtype, (code, np_dtype) in _WIRE.items()}
_HEADER_LEN = 8  # kind, dtype code, ndim, up to 4 dims, one spare


class Transport(ABC):
    rank: int
    size: int

    @abstractmethod
    def send(self, buf: np.ndarray, dest: int) -> None:
        """Send a contiguous buffer; returns when `buf` may be reused."""

    @abstractmethod
    def recv(self, buf: np.ndarray, source: int) -> None:
        """Fill `buf` with the next message from `source`."""

    def send_message(self, kind: Kind, dest: int, hidden: mx.array | None = None) -> None:
        header = np.zeros(_HEADER_LEN, dtype=np.int64)
        header[0] = kind
        if hidden is not None:
            code, _ = _WIRE[hidden.dtype]
            header[1], header[2] = code, hidden.ndim
            header[3:3 + hidden.ndim] = hidden.shape
        self.send(header, dest)
        if hidden is not None:
            wire = hidden.view(mx.uint16) if hidden.dtype == mx.bfloat16 else hidden
            self.send(np.ascontiguousarray(wire), dest)

    def recv_message(self, source: int) -> tuple[Kind, mx.array | None]:
        header = np.empty(_HEADER_LEN, dtype=np.int64)
        self.recv(header, source)
        kind = Kind(int(header[0]))
        if kind != Kind.FORWARD:
            return kind, None
        mx_dtype, np_dtype = _FROM_CODE[int(header[1])]
        shape = tuple(int(d) for d in header[3:3 + int(header[2])])
        payload = np.empty(shape, dtype=np_dtype)
        self.recv(payload, source)
        hidden = mx.array(payload)
        return kind, hidden.view(mx_dtype) if mx_dtype == mx.bfloat16 else hidden


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
