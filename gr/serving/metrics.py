"""Prometheus metrics of one server process, in their own registry (no global state)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from gr.serving.runtime import Ranker

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    """Requests and errors by endpoint, latency histograms, cache hit/extend/miss counts, cache
    bytes and the model version of ``ranker``."""

    def __init__(self, ranker: Ranker) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("gr_requests", "Requests by endpoint", ["endpoint"], registry=self.registry)
        self.errors = Counter(
            "gr_errors", "Failed requests by endpoint and HTTP status", ["endpoint", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "gr_request_seconds",
            "Request latency by endpoint",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.cache = Counter(
            "gr_cache",
            "User history cache lookups by status (hit, extend, miss, off)",
            ["status"],
            registry=self.registry,
        )
        cache_bytes = Gauge("gr_cache_bytes", "Bytes held by the user history cache", registry=self.registry)
        cache_bytes.set_function(lambda: ranker.cache.nbytes)
        version = Gauge("gr_model_version", "Model reloads since start (0: the first model)", registry=self.registry)
        version.set_function(lambda: ranker.cache.model_version)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
