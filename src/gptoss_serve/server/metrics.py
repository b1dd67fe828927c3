"""The server's Prometheus metrics (``GET /metrics``): requests, tokens and their latencies,
and the engine's scheduler (queues, KV cache usage, preemptions, prefix-cache lookups).

One registry per app (tests build many apps in one process). ``RequestTimer`` follows one
generation: ``run`` in responses.py starts it, marks each output token and ends it with the
response's status; a generation cut off by a disconnect or a cancel ends as ``cancelled``.
``EngineCollector`` reads the engine's latest ``SchedulerStats`` at each scrape (nothing for
an engine without a scheduler, the CPU one).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from gptoss_serve.engine.client import FinishedRequest
from gptoss_serve.engine.scheduler_output import SchedulerStats
from gptoss_serve.harmony.replay import ReplayStats

# Seconds: from a few ms (a cached short prompt) to minutes (a long prefill in a busy queue).
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(
        self,
        engine_stats: Callable[[], SchedulerStats | None] | None = None,
        replay_stats: Callable[[], ReplayStats] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        if engine_stats is not None:
            self.registry.register(EngineCollector(engine_stats))
        if replay_stats is not None:
            self.registry.register(ReplayCollector(replay_stats))
        self.requests = Counter(
            "gptoss_requests", "Generations finished, by the response's status.", ["status"],
            registry=self.registry,
        )  # fmt: skip
        self.running = Gauge(
            "gptoss_requests_running", "Generations in progress.", registry=self.registry
        )
        self.prompt_tokens = Counter(
            "gptoss_prompt_tokens", "Prompt tokens of finished generations.",
            registry=self.registry,
        )  # fmt: skip
        self.cached_tokens = Counter(
            "gptoss_prompt_tokens_cached", "Prompt tokens found in the prefix cache.",
            registry=self.registry,
        )  # fmt: skip
        self.output_tokens = Counter(
            "gptoss_output_tokens", "Generated tokens (reasoning included), counted as they come.",
            registry=self.registry,
        )  # fmt: skip
        self.ttft = self._seconds(
            "gptoss_time_to_first_token_seconds", "From the start of generation to a first token."
        )
        self.tpot = self._seconds(
            "gptoss_time_per_output_token_seconds",
            "Mean time between a generation's output tokens after the first.", _TOKEN_BUCKETS,
        )  # fmt: skip
        self.latency = self._seconds(
            "gptoss_request_duration_seconds", "From the start of generation to its end."
        )
        # Where a first token's wait goes: the server's own work, then the engine's.
        self.prepare = self._seconds(
            "gptoss_request_prepare_seconds", "From a request's arrival to the start of its "
            "generation: reading and checking it, its conversation, prompt and grammar.",
        )  # fmt: skip
        self.queue = self._seconds(
            "gptoss_request_queue_seconds",
            "From the start of generation to the engine step that began computing the prompt.",
        )
        self.prefill = self._seconds(
            "gptoss_request_prefill_seconds", "From there to the first token: the prompt's "
            "computing (in one or more steps) and the first sampling.",
        )  # fmt: skip
        self.compactions = Counter(
            "gptoss_compactions", "Conversations summarised: by /v1/responses/compact "
            "(way=\"compact\"), or first in a response past its context_management threshold "
            "(way=\"managed\").", ["way"], registry=self.registry,
        )  # fmt: skip

    def _seconds(
        self, name: str, documentation: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS
    ) -> Histogram:
        return Histogram(name, documentation, buckets=buckets, registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """The scheduler's state as of the engine's latest step, read at scrape time."""

    def __init__(self, stats: Callable[[], SchedulerStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        single = (
            (GaugeMetricFamily, "gptoss_engine_requests_running",
             "Requests in the engine's running batch.", stats.num_running),
            (GaugeMetricFamily, "gptoss_engine_requests_waiting",
             "Requests waiting for a seat or KV cache room.", stats.num_waiting),
            (CounterMetricFamily, "gptoss_engine_preemptions",
             "Requests preempted for KV cache room (recomputed on return).",
             stats.num_preemptions),
            (CounterMetricFamily, "gptoss_prefix_cache_queried_tokens",
             "Prompt tokens of admitted requests looked up in the cache.",
             stats.num_prefix_queried_tokens),
            (CounterMetricFamily, "gptoss_prefix_cache_hit_tokens",
             "Prompt tokens found in the prefix cache.", stats.num_prefix_hit_tokens),
            (CounterMetricFamily, "gptoss_prefix_cache_waits",
             "Admissions put off a step while a running prefill computed the same blocks.",
             stats.num_prefix_waits),
        )  # fmt: skip
        for family, name, text, value in single:
            yield family(name, text, value=value)
        usage = GaugeMetricFamily("gptoss_kv_cache_usage_ratio",
                                  "Fraction of the KV cache's blocks in use, by kind of layer.",
                                  labels=["layers"])  # fmt: skip
        usage.add_metric(["full"], stats.kv_usage)
        usage.add_metric(["sliding"], stats.sliding_kv_usage)
        yield usage


class ReplayCollector(Collector):
    """The generated messages kept for later prompts (harmony/replay.py), read at scrape
    time."""

    def __init__(self, stats: Callable[[], ReplayStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield GaugeMetricFamily("gptoss_replay_cache_messages",
                                "Generated messages kept for the prompts that send them back.",
                                value=stats.num_messages)  # fmt: skip
        yield GaugeMetricFamily("gptoss_replay_cache_tokens",
                                "Their generated tokens (4 bytes each).",
                                value=stats.num_tokens)  # fmt: skip
        yield CounterMetricFamily("gptoss_replayed_messages",
                                  "Messages put into prompts as the model generated them.",
                                  value=stats.num_replayed)  # fmt: skip


@dataclass
class RequestTimer:
    """One generation's clock and counts (``metrics`` None: nothing is recorded)."""

    metrics: ServerMetrics | None
    received_at: float | None = None  # the request's arrival: the prepare time ends at started
    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    num_tokens: int = 0
    ended: bool = False

    def __post_init__(self) -> None:
        if self.metrics is not None:
            self.metrics.running.inc()
            if self.received_at is not None:
                self.metrics.prepare.observe(max(0.0, self.started - self.received_at))

    def token(self) -> None:
        self.num_tokens += 1
        if self.first_token is None:
            self.first_token = time.monotonic()
        if self.metrics is not None:  # as they come: a long generation's rate shows while it runs
            self.metrics.output_tokens.inc()

    def end(
        self, status: str, prompt_tokens: int, cached_tokens: int,
        engine: FinishedRequest | None = None,
    ) -> None:  # fmt: skip
        """``engine``: what the engine reports of the generation (its queue and prefill times
        when it knows them)."""
        self.ended = True
        metrics = self.metrics
        if metrics is None:
            return
        now = time.monotonic()
        metrics.running.dec()
        metrics.requests.labels(status=status).inc()
        metrics.prompt_tokens.inc(prompt_tokens)
        metrics.cached_tokens.inc(cached_tokens)
        metrics.latency.observe(now - self.started)
        if engine is not None and engine.queue_s is not None and engine.prefill_s is not None:
            metrics.queue.observe(engine.queue_s)
            metrics.prefill.observe(engine.prefill_s)
        if self.first_token is not None:
            metrics.ttft.observe(self.first_token - self.started)
            if self.num_tokens > 1:
                metrics.tpot.observe((now - self.first_token) / (self.num_tokens - 1))
