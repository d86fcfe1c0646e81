"""One rank's stage of the pipeline: its slice of the model, its KV caches, and its place in
the ring 0 -> 1 -> ... -> N-1 -> 0.

Ranks other than 0 only follow messages: receive hidden states from the previous rank, run
their layers, send the result to the next rank, until a STOP comes round.
"""

from __future__ import annotations

from dataclasses import dataclass
import mlx.core as mx

from .config import ModelConfig
from .models import family_for
from .models.base import TransformerSlice
from .transport import Kind, Transport
from .weights import Checkpoint, load_slice


@dataclass
class Stage:
    model: TransformerSlice
    loaded_tensors: list[str]  # checkpoint names this rank read from disk
    cache: list = None

    def __post_init__(self):
        self.reset_cache()

    @classmethod
    def load(cls, config: ModelConfig, checkpoint: Checkpoint, layers: tuple[int, int],
             has_ends: bool, dtype: mx.Dtype, progress: bool = False) -> "Stage":
        family = family_for(config)
        model = TransformerSlice(config, family.DecoderLayer, layers[0], layers[1], has_ends)
        names = load_slice(model, checkpoint, config, dtype, progress=progress)
        return cls(model, names)

    def reset_cache(self) -> None:
        self.cache = self.model.make_cache()

    @property
    def cache_nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache)

    def run_layers(self, hidden: mx.array) -> mx.array:
        hidden = self.model.forward_layers(hidden, self.cache)
        mx.eval(hidden)
        return hidden


def ring_forward(stage: Stage, transport: Transport, hidden: mx.array) -> mx.array:
    """Rank 0: run the hidden states through every stage of the ring and get them back."""
    hidden = stage.run_layers(hidden)
    if transport.size > 1:
        transport.send_message(Kind.FORWARD, 1, hidden)
        _, hidden = transport.recv_message(transport.size - 1)
    return hidden


def serve(stage: Stage, transport: Transport) -> None:
    """Ranks 1..N-1: follow the ring until STOP."""
    prev, nxt = transport.rank - 1, (transport.rank + 1) % transport.size
    while True:
        kind, hidden = transport.recv_message(prev)
        if kind == Kind.STOP:
            if nxt != 0:
                transport.send_message(Kind.STOP, nxt)
            return
        transport.send_message(Kind.FORWARD, nxt, stage.run_layers(hidden))


def stop_ring(transport: Transport) -> None:
    """Rank 0: tell every other rank the job is over."""
    if transport.size > 1:
        transport.send_message(Kind.STOP, 1)
