"""Prometheus metrics: engine-core gauges/counters from the latest stats the core sent, and request latency
histograms observed by the front end."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.messages import EngineStats

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)


class _CoreCollector:
    """Reads the stats snapshot at scrape time, so the engine process is never asked."""

    def __init__(self, model: str, stats: Callable[[], EngineStats], up: Callable[[], bool]):
        self._model, self._stats, self._up = model, stats, up

    def collect(self):
        s, m = self._stats(), [self._model]
        for name, doc, value in (
                ("deploykit_num_requests_running", "Requests in the running batch.", s.num_running),
                ("deploykit_num_requests_waiting", "Requests queued for a batch slot.", s.num_waiting),
                ("deploykit_kv_cache_usage_ratio", "Fraction of KV-cache blocks referenced by requests (0-1); "
                 "cached blocks are not counted.", s.kv_cache_usage),
                ("deploykit_engine_up", "1 while the engine process is serving.", float(self._up()))):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            yield g
        g = GaugeMetricFamily("deploykit_kv_cache_blocks", "KV-cache blocks by state: active (referenced by requests), "
                              "cached (a reusable prefix, evicted when needed), free.", labels=["model_name", "state"])
        for state, n in (("active", s.kv_blocks_active), ("cached", s.kv_blocks_cached),
                         ("free", s.kv_blocks_total - s.kv_blocks_active - s.kv_blocks_cached)):
            g.add_metric([self._model, state], n)
        yield g
        for name, doc, value in (
                ("deploykit_prompt_tokens", "Prompt tokens admitted to the engine.", s.prompt_tokens_total),
                ("deploykit_generation_tokens", "Tokens generated.", s.generation_tokens_total),
                ("deploykit_num_preemptions", "Requests preempted for lack of KV cache.", s.num_preemptions),
                ("deploykit_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 s.prefix_cache_queries_total),
                ("deploykit_prefix_cache_hits", "Prompt tokens found in the prefix cache (their prefill skipped).",
                 s.prefix_cache_hits_total)):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            yield c


class Metrics:
    def __init__(self, model: str, stats: Callable[[], EngineStats], up: Callable[[], bool]):
        self.registry = CollectorRegistry()
        self.registry.register(_CoreCollector(model, stats, up))
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("deploykit_time_to_first_token_seconds", "Request arrival to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r).labels(model)
        self.itl = Histogram("deploykit_inter_token_latency_seconds", "Time between consecutive output tokens.",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(model)
        self.e2e = Histogram("deploykit_e2e_request_latency_seconds", "Request arrival to last token.", labels,
                             buckets=E2E_BUCKETS, registry=r).labels(model)
        self._finished = Counter("deploykit_request_success", "Finished requests by finish reason.",
                                 labels + ["finished_reason"], registry=r)
        self._rejected = Counter("deploykit_request_rejected", "Requests refused before reaching the engine.",
                                 labels + ["status"], registry=r)
        self._model = model

    def finished(self, reason: str | None) -> None:
        self._finished.labels(self._model, reason or "unknown").inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(self._model, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
