"""One rank's stage of the pipeline: its slice of the model, the KV caches of the sequences
in flight (for its own layers only), and its place in the ring 0 -> 1 -> ... -> N-1 -> 0.

Ranks other than 0 only follow messages: receive hidden states from the previous rank, run
their layers, send the result to the next rank, until a STOP comes round.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..checkpoints.format_adapters import Requantize
from ..checkpoints.safetensors_checkpoint import Checkpoint
from ..checkpoints.share_reads import narrowed, read_shares, widen
from ..checkpoints.weights import dequantize_slice, load_slice
from ..cluster.transport import Kind, Transport
from ..models.config import ModelConfig
from ..models.registry import family_for
from ..models.stage_slice import TransformerSlice
from ..models.tensor_parallel import Shard, set_group_sum, shard_modules, shard_weights
from ..util.switches import turned_off
from .prompt_cache_store import StateArray

SHARE_READS = "PIPELINE_SHARE_READS"  # =0: a --tensor-parallel rank reads whole tensors and cuts them (A/B)


@dataclass
class Stage:
    model: TransformerSlice
    loaded_tensors: list[str]  # checkpoint names this rank read from disk
    caches: dict[int, list] = field(default_factory=dict)  # sequence id -> per-layer caches
    mtp: object = None  # rank 0 with --draft mtp: DeepSeek's MTP module (models/mtp.py)

    @classmethod
    def load(cls, config: ModelConfig, checkpoint: Checkpoint, layers: tuple[int, int],
             has_ends: bool, dtype: mx.Dtype, requantize: Requantize | None = None,
             progress: bool = False, dense: bool = False, head_rows: int = 0,
             int8_in_place: bool | None = None, shard: Shard | None = None,
             group_sum: Callable[[mx.array], mx.array] | None = None,
             group_choice: Callable[[mx.array], mx.array] | None = None,
             vocab_slice: tuple[int, int] | None = None) -> "Stage":
        """dense: hold MLX-quantized weights dequantized to `dtype` (--weights-in-memory).
        head_rows: also hold the LM head's last rows (the last rank of a batch job, head_share.py).
        int8_in_place: not None, the layers' quantized matrices take the int8 layout while loading
        (weights.load_slice).
        shard: --tensor-parallel T > 1, this rank's member of its stage's group: its share of each layer
        (models/tensor_parallel.py), whose partial outputs `group_sum` adds up over the group (and a MoE
        layer's top-k choices `group_choice` takes from the group's first member).
        vocab_slice: --tensor-parallel, stage 0's group: the LM head's rows [begin, end) this rank computes
        (models/vocab_split.py): rank 0 holds only those of an untied head (a tied one stays whole, the
        embedding), another member holds them as its `head_share`."""
        family = family_for(config).module()
        slice_class = getattr(family, "Slice", TransformerSlice)  # DeepSeek V4: its residual streams
        if vocab_slice is not None and not has_ends:
            head_rows = vocab_slice[1] - vocab_slice[0]
        model = slice_class(config, family.DecoderLayer, layers[0], layers[1], has_ends, head_rows)
        if vocab_slice is not None and not has_ends:
            model.head_begin = vocab_slice[0]
        elif vocab_slice is not None and "lm_head" in model:
            model.lm_head = nn.Linear(config.hidden_size, vocab_slice[1], bias=False)
        cut, shares, placed = None, {}, {}
        if shard is not None and shard.size > 1:
            shard_modules(model, config, shard)
            if not turned_off(SHARE_READS) and family_for(config).module_name in ("llama", "qwen3_moe", "deepseek_v3",
                                                                                 "deepseek_v32"):
                # only the share's bytes of each tensor read (checkpoints/share_reads.py)
                shares = read_shares(checkpoint.tensors, config, shard, vocab_slice, has_ends)

            def cut(weights: dict, names: list[str]) -> None:
                widen(weights, names, placed)
                shard_weights(weights, config, shard, names)

            int8_in_place = None  # int8 after
        group = requantize.group_size if requantize else None
        with narrowed(checkpoint, shares, group) if shares else nullcontext({}) as placed:
            names = load_slice(model, checkpoint, dtype, requantize, progress=progress,
                               int8_in_place=None if dense else int8_in_place, cut=cut)
        if cut is not None:
            set_group_sum(model, group_sum, group_choice)
        if dense:
            dequantize_slice(model, dtype)
        return cls(model, names)

    def run_layers(self, hidden: mx.array, seq_ids: list[int] = (0,), lengths: list[int] | None = None,
                   evaluate: bool = True, last_only: bool = False, full: list[bool] | None = None) -> mx.array:
        """Run packed new tokens of the given sequences through this slice's layers.
        A sequence id seen for the first time starts with empty caches. evaluate=False returns
        the result unevaluated (for a caller that overlaps building the graph with computing).
        last_only: where this slice ends the model, each sequence's last position only (what
        generating reads; see TransformerSlice.forward_layers), but every position of the sequences
        marked `full` (drafts being verified)."""
        if lengths is None:
            lengths = [hidden.shape[1]]
        caches = [self.caches.setdefault(s, self.model.make_cache()) for s in seq_ids]
        if full is not None and any(full):
            hidden = self.model.forward_layers(hidden, caches, lengths, last_only=last_only, full=full)
        else:
            hidden = self.model.forward_layers(hidden, caches, lengths, last_only=last_only)
        if evaluate:
            mx.eval(hidden)
        return hidden

    def release(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self.caches.pop(s, None)

    def rewind(self, seq_ids: list[int], positions: int) -> None:
        """Drop the last `positions` positions of these sequences' caches (rejected drafts)."""
        if positions:
            for s in seq_ids:
                for cache in self.caches[s]:
                    cache.offset -= positions

    def fork(self, new_ids: list[int], kept_ids: list[int], lengths: list[int]) -> None:
        """Start each new sequence from the first `length` positions of a kept one (prefix cache)."""
        for new, kept, length in zip(new_ids, kept_ids, lengths):
            self.caches[new] = [cache.prefix(length) for cache in self.caches[kept]]

    def stored_arrays(self, seq_id: int, positions: int) -> list[StateArray]:
        """A finished sequence's caches after its first `positions` positions, for the prompt cache on
        disk (prompt_cache_store.save): each layer's state as its cache names it (`state_arrays`: a KV
        cache's keys and values, a linear-attention or DeepSeek V4 layer's fixed-size states, each in
        its own dtype, bfloat16 as its raw bits), as numpy views (no copy; nothing writes to a finished
        sequence's caches, and forks of it copy before they grow). A state past `positions` (a sequence
        that ended within a verify trip) is taken back there first (its cache's `prefix`)."""
        named = []
        for layer, cache in enumerate(self.caches[seq_id]):
            state = cache if cache.offset == positions else cache.prefix(positions)
            named += [(f"{layer}.{name}", array, axis) for name, array, axis in state.state_arrays()]
        mx.eval([array for _, array, _ in named])
        stored = []
        for name, array, axis in named:
            dtype = str(array.dtype).removeprefix("mlx.core.")
            stored.append(StateArray(name, np.asarray(array.view(mx.uint16) if dtype == "bfloat16" else array),
                                     dtype, axis))
        return stored

    def load_stored(self, seq_id: int, arrays: list[StateArray], positions: int) -> bool:
        """Start a sequence from a stored entry's arrays at `positions` (`stored_arrays`' layout, read
        back by prompt_cache_store.load); False, leaving nothing behind, where they do not fit this slice."""
        caches = self.model.make_cache()
        named: list[dict] = [{} for _ in caches]
        for stored in arrays:
            layer, _, name = stored.name.partition(".")
            if not layer.isdigit() or int(layer) >= len(caches):
                return False
            array = mx.array(stored.data)  # a copy: the file's buffer goes
            named[int(layer)][name] = array.view(mx.bfloat16) if stored.dtype == "bfloat16" else array
        try:
            for cache, state in zip(caches, named):
                cache.load_state_arrays(state, positions)
        except ValueError:
            return False
        mx.eval([array for state in named for array in state.values()])
        self.caches[seq_id] = caches
        return True

    def save_stored(self, store, seq_id: int, key: int, positions: int, tokens=None) -> None:
        """Queue this rank's file of a finished sequence's first `positions` positions as the stored entry
        `key` (store: its prompt_cache_store.PromptCacheStore; tokens: rank 0's token ids). A tensor-parallel
        leader (tensor_group.LeaderStage) tells its mates to store theirs first."""
        store.save(key, positions, self.stored_arrays(seq_id, positions), tokens=tokens)

    def load_from_store(self, store, seq_id: int, key: int, positions: int) -> bool:
        """Start a sequence from this rank's file of the stored entry `key` (`load_stored`); False, leaving
        nothing behind, where it cannot be read or does not fit (its one warning said why)."""
        stored = store.load(key, positions)
        return stored is not None and self.load_stored(seq_id, stored, positions)

    def remove_stored(self, store, keys: list[int]) -> None:
        """Remove this rank's files of these stored entries."""
        store.remove(keys)

    @property
    def cache_nbytes(self) -> int:
        return sum(c.nbytes for caches in self.caches.values() for c in caches)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token of one sequence takes on this rank (all its layers)."""
        return max((sum(c.bytes_per_token for c in caches) for caches in self.caches.values()), default=0)

    @property
    def weight_nbytes(self) -> int:
        held = [self.model] + ([self.mtp] if self.mtp is not None else [])  # rank 0's MTP module counts too
        return sum(a.nbytes for module in held for _, a in tree_flatten(module.parameters()))


def ring_forward(stage: Stage, transport: Transport, hidden: mx.array, seq_ids: list[int] = (0,),
                 lengths: list[int] | None = None, all_positions: bool = False, rewind: int = 0,
                 evaluate: bool = True) -> mx.array:
    """Rank 0: run packed hidden states through every stage of the ring and get back each
    sequence's last position (all_positions: every position). rewind: drop that many positions
    from the end of the sequences' caches first, on every rank (rejected speculative drafts).
    evaluate=False: on one rank the result stays lazy (on several, sending evaluates it anyway)."""
    lengths = [hidden.shape[1]] if lengths is None else lengths
    stage.rewind(seq_ids, rewind)
    hidden = stage.run_layers(hidden, seq_ids, lengths, evaluate=evaluate, last_only=True,
                              full=[all_positions] * len(lengths))
    return round_the_ring(transport, hidden, seq_ids, lengths, all_positions, rewind)


def round_the_ring(transport: Transport, hidden: mx.array, seq_ids: list[int] = (0,), lengths: list[int] | None = None,
                   all_positions: bool = False, rewind: int = 0) -> mx.array:
    """Rank 0: the rest of `ring_forward` once rank 0's own layers are built (run or not): through
    the other ranks and back."""
    if transport.size > 1:
        lengths = [hidden.shape[1]] if lengths is None else lengths
        transport.send_message(1, Kind.FORWARD, seq_ids, lengths, hidden,
                               every_position=[all_positions] * len(lengths), rewind=rewind)
        hidden = transport.recv_message(transport.size - 1).hidden
    return hidden


def follow_single_stream(stage: Stage, transport: Transport) -> None:
    """Ranks 1..N-1 of a single-stream job (`generate`; engine.py on rank 0): run each FORWARD
    through this rank's layers and pass it on, until STOP comes round. (A batch or server job's
    followers run scheduler.follow.)"""
    prev, nxt = transport.rank - 1, (transport.rank + 1) % transport.size
    while True:
        message = transport.recv_message(prev)
        if message.kind == Kind.FORWARD:
            stage.rewind(message.seq_ids, message.rewind)
            # every_position: every position of the final layer, each sequence's last computed as
            # without (stage_slice.TransformerSlice.forward_layers), so the next token is the same either way
            hidden = stage.run_layers(message.hidden, message.seq_ids, message.tokens, last_only=True,
                                      full=message.every_position)
            transport.send_message(nxt, Kind.FORWARD, message.seq_ids, message.tokens, hidden,
                                   every_position=message.every_position, rewind=message.rewind)
            continue
        if message.kind == Kind.RELEASE:
            stage.release(message.seq_ids)
        if nxt != 0:  # RELEASE and STOP go round the ring once
            transport.send_message(nxt, message.kind, message.seq_ids)
        if message.kind == Kind.STOP:
            return


def stop_ring(transport: Transport) -> None:
    """Rank 0: tell every other rank the job is over."""
    if transport.size > 1:
        transport.send_message(1, Kind.STOP)
