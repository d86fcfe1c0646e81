"""A rank's tensors from disk to memory at the speed of the disk: read in file order, the kernel
asked to read ahead, conversions evaluated in groups on a CPU stream per core, the bar in bytes.

Where the time went before (a Llama-1B-shaped bf16 folder, 2.15 GB, to fp32 on one rank: 3.7 s,
against 0.24 s to read the bytes): each tensor was read into a Python bytes object, copied into
an MLX array, cast into a third buffer, and evaluated alone, on one core, each new buffer paid
for in page faults (the allocator's cache was off). Now MLX reads each tensor's bytes straight
into the array that keeps them (`Checkpoint.read` is lazy), the format adapters' work (casts,
FP8 scaling, re-quantization) is evaluated a group at a time, each tensor's graph on the least
busy of one CPU stream per core the rank may use (MLX's CPU operations run on one thread each),
while the next group's graph is built, and freed temporaries are reused from a bounded cache
instead of being faulted in again.

Where pipeline's kernels' extension is built (Linux, CPU), a tensor is not read at all but mapped
(mapped_files.py): held as stored it stays on the page cache's pages, and a conversion reads from them.

With a cold page cache the reading itself overlaps the conversions: `posix_fadvise(WILLNEED)`
asks the kernel to read the next PREFETCH_BYTES of the rank's byte ranges in the background.
A caller's `after_group` sees each group once evaluated, while the next one reads (the int8
products' repack, int8_repack.Int8WhileLoading).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import mlx.core as mx
from tqdm import tqdm

from ..util import cores
from .format_adapters import Requantize, adapt_tensors

GROUP_BYTES = 16 << 20  # file bytes evaluated together, per stream
PREFETCH_BYTES = 512 << 20  # how far ahead of the reader the kernel is asked to read
CACHE_BYTES = (64 << 20, 512 << 20)  # freed temporaries MLX may keep for reuse: 1/16 of the bytes read, within
MAX_STREAMS = 16

_streams: list = []


def load_streams() -> list:
    """One CPU stream per CPU this rank may use (at least 2, so reading overlaps converting; made
    once per process): MLX runs each on its own thread, and its CPU operations use one thread each."""
    if not _streams:
        _streams.extend(mx.new_stream(mx.cpu) for _ in range(max(2, min(MAX_STREAMS, len(cores.cpus_allowed())))))
    return _streams


class Prefetch:
    """Asks the kernel to read the byte ranges a rank will read, a window ahead of the reader."""

    def __init__(self, spans: list[tuple[Path, int, int]], window: int = PREFETCH_BYTES):
        self.spans, self.window = spans, window
        self.next = 0  # the first span not asked for yet
        self.asked = 0  # bytes asked for so far
        self.files: dict[Path, int] = {}
        self.enabled = hasattr(os, "posix_fadvise")

    def advance(self, done: int) -> None:
        """`done` bytes have been read: keep `window` bytes asked for beyond them."""
        while self.enabled and self.next < len(self.spans) and self.asked < done + self.window:
            path, begin, end = self.spans[self.next]
            try:
                if path not in self.files:
                    self.files[path] = os.open(path, os.O_RDONLY)
                os.posix_fadvise(self.files[path], begin, end - begin, os.POSIX_FADV_WILLNEED)
            except OSError:  # only a hint: the reads themselves report real errors
                pass
            self.next += 1
            self.asked += end - begin

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()


class CountedReads:
    """The checkpoint's `read`, counting the bytes of the distinct byte ranges read so far (the three
    arrays of a GGUF's quantized tensor come from one range): what the bar and the groups measure."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        self.spans: set = set()  # (file, begin) of each range read
        self.bytes = 0

    def read(self, name: str) -> mx.array:
        for path, begin, end in self.checkpoint.spans(name):
            if (path, begin) not in self.spans:
                self.spans.add((path, begin))
                self.bytes += end - begin
        return self.checkpoint.read(name)


class GroupedEvaluation:
    """Evaluates the arrays in groups, one group converting while the next one's graphs are built:
    `hand_over` starts the group built so far and waits for the one before it, which it then passes
    to `after_group` and counts on the bar."""

    def __init__(self, weights: dict[str, mx.array], bar,
                 after_group: Callable[[dict[str, mx.array], list[str]], None] | None):
        self.weights, self.bar, self.after_group = weights, bar, after_group
        self.building: list[str] = []  # names of the tensors whose graphs are being built
        self.converting: list[str] = []  # the group handed over last, being evaluated
        self.converting_bytes = 0  # the bytes read for it
        self.evaluated = 0  # bytes read for the arrays evaluated or being evaluated

    def add(self, name: str, array: mx.array) -> None:
        self.weights[name] = array
        self.building.append(name)

    def hand_over(self, read_bytes: int) -> None:
        """The group built so far starts evaluating; the one before it is waited for."""
        mx.async_eval([self.weights[name] for name in self.building])
        done, done_bytes = self.converting, self.converting_bytes
        mx.eval([self.weights[name] for name in done])  # one group converts while the next is built
        self.converting, self.converting_bytes = self.building, read_bytes - self.evaluated
        self.building = []
        if self.after_group is not None and done:
            self.after_group(self.weights, done)  # while the group just handed over reads
        self.bar.update(done_bytes)
        self.evaluated = read_bytes


def load_tensors(checkpoint, names: list[str], dtype: mx.Dtype, requantize: Requantize | None = None,
                 keep_float32: Callable[[str], bool] | None = None, progress: bool = False,
                 desc: str = "loading",
                 after_group: Callable[[dict[str, mx.array], list[str]], None] | None = None) -> dict[str, mx.array]:
    """The arrays our modules hold for the checkpoint tensors `names` (through the format adapters),
    evaluated, under the adapters' checkpoint-style names. after_group(weights, names): called with
    each group's names once evaluated, while the next group is read; it may replace their arrays."""
    order = sorted(names, key=lambda name: checkpoint.spans(name)[0][:2])  # file order: sequential reads
    spans, seen = [], set()
    for name in order:
        for span in checkpoint.spans(name):
            if span[:2] not in seen:
                seen.add(span[:2])
                spans.append(span)
    total = sum(end - begin for _, begin, end in spans)
    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not progress, delay=2.0)
    prefetch = Prefetch(spans)
    reads = CountedReads(checkpoint)
    streams = load_streams()
    weights: dict[str, mx.array] = {}
    groups = GroupedEvaluation(weights, bar, after_group)

    # Loading makes short-lived tensors (bytes before a cast, floats before re-quantization): a
    # bounded cache lets the next group reuse their buffers instead of faulting in new ones.
    cache_limit = mx.set_cache_limit(min(max(total // 16, CACHE_BYTES[0]), CACHE_BYTES[1]))
    adapted = adapt_tensors(order, checkpoint.tensors, reads.read, dtype, requantize, keep_float32)
    try:
        prefetch.advance(0)
        assigned = [0] * len(streams)  # bytes read for each stream's work so far
        while True:
            least = assigned.index(min(assigned))  # the next tensor's graph on the least busy stream
            before = reads.bytes
            with mx.stream(streams[least]):
                item = next(adapted, None)
            assigned[least] += reads.bytes - before
            if item is None:
                break
            groups.add(*item)
            if reads.bytes - groups.evaluated >= GROUP_BYTES * len(streams):
                prefetch.advance(reads.bytes)
                groups.hand_over(reads.bytes)
        groups.hand_over(reads.bytes)  # the last group starts evaluating ...
        groups.hand_over(reads.bytes)  # ... and is waited for
    finally:
        prefetch.close()
        mx.set_cache_limit(cache_limit)
        mx.clear_cache()
        bar.close()
    return weights
