"""`GET /metrics`: the server's counters in Prometheus' text format (prometheus-client), on a
registry of its own so that nothing else in the process adds to it."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..runtime.requests import Finished

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Time to first token, from submission: tens of milliseconds for a short prompt on an idle
# server, up to minutes for a long one behind a full queue on a big model.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _RankBusy:
    """pipeline_rank_busy_seconds{rank}: each rank's seconds computing since the server started."""

    def __init__(self, busy_seconds: Callable[[], dict[int, float]]):
        self.busy_seconds = busy_seconds

    def collect(self):
        family = GaugeMetricFamily("pipeline_rank_busy_seconds",
                                   "seconds each rank has spent computing since the server started", labels=["rank"])
        for rank, seconds in sorted(self.busy_seconds().items()):
            family.add_metric([str(rank)], seconds)
        yield family


class Metrics:
    def __init__(self, queue_depth: Callable[[], int], in_flight: Callable[[], int],
                 busy_seconds: Callable[[], dict[int, float]]):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("pipeline_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=registry)
        self.finished = Counter("pipeline_finished_requests", "generation requests ended, by finish reason",
                                ["reason"], registry=registry)
        self.prompt_tokens = Counter("pipeline_prompt_tokens", "prompt tokens of the requests that ran",
                                     registry=registry)
        self.cached_tokens = Counter("pipeline_prompt_cached_tokens",
                                     "prompt tokens whose caches were reused from the prefix cache", registry=registry)
        self.generated_tokens = Counter("pipeline_generation_tokens", "tokens generated", registry=registry)
        self.ttft = Histogram("pipeline_time_to_first_token_seconds",
                              "from a request's submission to its first token", buckets=TTFT_BUCKETS,
                              registry=registry)
        Gauge("pipeline_queue_depth", "requests waiting for a place in the batch",
              registry=registry).set_function(queue_depth)
        Gauge("pipeline_sequences_in_flight", "requests in the running batch",
              registry=registry).set_function(in_flight)
        Gauge("pipeline_prefix_cache_hit_rate", "share of prompt tokens reused from the prefix cache so far",
              registry=registry).set_function(self._hit_rate)
        registry.register(_RankBusy(busy_seconds))
        self._prompt = self._cached = 0  # the hit rate's terms (counters do not read back)

    def _hit_rate(self) -> float:
        return self._cached / self._prompt if self._prompt else 0.0

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def ended(self, finished: Finished) -> None:
        self.finished.labels(finished.reason).inc()
        self.prompt_tokens.inc(finished.prompt_tokens)
        self._prompt += finished.prompt_tokens
        self._cached += finished.cached_tokens
        self.cached_tokens.inc(finished.cached_tokens)
        self.generated_tokens.inc(finished.completion_tokens)
        if finished.reason != "cancelled":
            self.ttft.observe(finished.queued_s + finished.ttft_s)

    def failed(self) -> None:
        self.finished.labels("error").inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
