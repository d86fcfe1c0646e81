"""Where each rank's time goes during a batch job: computing, waiting to receive, sending.

Every rank keeps a `Timeline`: totals per kind of span always, and the spans themselves when a
Chrome trace was asked for (`batch --trace FILE`). At the end rank 0 gathers them, prints one
summary line per rank and the pipeline bubble (the share of rank-time spent not computing), and
writes the trace-event JSON that chrome://tracing and https://ui.perfetto.dev open, one track
per rank. Times are relative to a barrier all ranks pass at the start (one host shares a clock;
across hosts the barrier aligns them to within a message latency).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

COMPUTE, RECV, SEND = "compute", "recv", "send"


@dataclass
class Timeline:
    rank: int
    keep_spans: bool = False
    start: float = field(default_factory=time.perf_counter)
    totals: dict[str, float] = field(default_factory=lambda: {COMPUTE: 0.0, RECV: 0.0, SEND: 0.0})
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)  # kind, name, begin, end
    end: float | None = None

    def restart(self) -> None:
        """Time zero: call right after a barrier every rank passes."""
        self.start = time.perf_counter()

    def add(self, kind: str, name: str, begin: float, end: float) -> None:
        self.totals[kind] = self.totals.get(kind, 0.0) + (end - begin)
        if self.keep_spans:
            self.spans.append((kind, name, begin - self.start, end - self.start))

    @contextmanager
    def span(self, kind: str, name: str = ""):
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, name or kind, begin, time.perf_counter())

    def finish(self) -> None:
        self.end = time.perf_counter()

    @property
    def wall_s(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    def summary(self) -> dict:
        """What rank 0 gathers: plain numbers (and the spans, if kept)."""
        return {"rank": self.rank, "wall_s": self.wall_s, "totals": dict(self.totals), "spans": self.spans}


def idle_fraction(summary: dict) -> float:
    wall = summary["wall_s"]
    return max(0.0, 1.0 - summary["totals"][COMPUTE] / wall) if wall > 0 else 0.0


def bubble_fraction(summaries: list[dict]) -> float:
    """Share of all ranks' time spent not computing, over the span of the slowest rank."""
    wall = max(s["wall_s"] for s in summaries)
    if wall <= 0:
        return 0.0
    return max(0.0, 1.0 - sum(s["totals"][COMPUTE] for s in summaries) / (wall * len(summaries)))


def summary_lines(summaries: list[dict], hosts: list[str] | None = None) -> list[str]:
    lines = []
    for s in summaries:
        t = s["totals"]
        host = f" ({hosts[s['rank']]})" if hosts else ""
        lines.append(f"[pipeline] rank {s['rank']}{host}: compute {t[COMPUTE]:.2f} s, waiting to receive "
                     f"{t[RECV]:.2f} s, sending {t[SEND]:.2f} s, idle {100 * idle_fraction(s):.1f}% "
                     f"of {s['wall_s']:.2f} s")
    lines.append(f"[pipeline] pipeline bubble {100 * bubble_fraction(summaries):.1f}% "
                 f"(rank-time not computing, {len(summaries)} rank{'s' if len(summaries) != 1 else ''})")
    return lines


def chrome_trace(summaries: list[dict], hosts: list[str] | None = None) -> dict:
    """Trace-event JSON: one thread track per rank, a complete ("X") event per span."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "pipeline batch"}}]
    for s in summaries:
        rank = s["rank"]
        label = f"rank {rank}" + (f" ({hosts[rank]})" if hosts else "")
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": label}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"sort_index": rank}})
        for kind, name, begin, end in s["spans"]:
            events.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": rank,
                           "ts": round(begin * 1e6, 1), "dur": round((end - begin) * 1e6, 1)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: Path, summaries: list[dict], hosts: list[str] | None = None) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(chrome_trace(summaries, hosts)))
    tmp.replace(path)


def split_hint(summaries: list[dict], counts: list[int], min_gain: float = 0.05) -> str | None:
    """A `--split` that the measured times say would balance the stages better, or None.

    Per-layer time comes from the followers (all their compute is their layers); rank 0's extra
    work (embedding, head, sampling, bookkeeping) is its compute beyond that many layers. Layers
    are taken as equally costly, so it is a hint, not a promise; offered only when it predicts
    at least `min_gain` more throughput."""
    ranks = len(counts)
    if ranks < 2 or len(summaries) != ranks:
        return None
    follower_compute = sum(s["totals"][COMPUTE] for s in summaries[1:])
    per_layer = follower_compute / sum(counts[1:])
    if per_layer <= 0:
        return None
    extra = max(0.0, summaries[0]["totals"][COMPUTE] - counts[0] * per_layer)
    layers = sum(counts)

    def slowest(split: list[int]) -> float:
        return max(extra + split[0] * per_layer, *(n * per_layer for n in split[1:]))

    best, best_time = counts, slowest(counts)
    for first in range(1, layers - ranks + 2):
        rest, others = layers - first, ranks - 1
        split = [first] + [rest // others + (1 if i < rest % others else 0) for i in range(others)]
        if min(split) >= 1 and slowest(split) < best_time:
            best, best_time = split, slowest(split)
    gain = slowest(counts) / best_time - 1
    if best == counts or gain < min_gain:
        return None
    return (f"[pipeline] the stages are unbalanced: --split {','.join(map(str, best))} would take about "
            f"{100 * gain:.0f}% more throughput by these times (now {','.join(map(str, counts))})")
