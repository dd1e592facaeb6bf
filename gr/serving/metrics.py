"""Prometheus metrics of a server, added up over its worker processes.

One process (``serve --workers 1``, or an app built in a test): the metrics live in their own
registry. Several (``serve --workers N``): ``serve`` creates a directory for the server, names it
in ``PROMETHEUS_MULTIPROC_DIR`` before the workers start, and prometheus-client writes each
worker's values there (its multiprocess mode); /metrics, whichever worker answers, reads them
all: counters and histograms summed over every worker that ran (a restarted worker's counts are
kept), gauges summed (cache bytes, workers) or the largest (model version) over the live workers.
A worker that died is marked dead (its gauges dropped) at the next scrape; one that shuts down
marks itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from gr.serving.runtime import Ranker

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # requests per batch, requests waiting
TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # history tokens encoded per request
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus-client when it is first imported


class ServerMetrics:
    """Requests and client disconnects by endpoint, errors by endpoint, HTTP status and kind (the
    ``error`` name of the answer: bad_request, limit_exceeded, internal, ...), latency histograms,
    the request batcher's batch sizes and queue depths (``observe_batch``), cache hit/extend/miss
    counts, cache entries and bytes, K/V pages used and free, fallback answers by kind, the history
    store's latency and errors by operation (append, read; ``observe_store``), where each request's
    encoded history came from (tiers local, shared, remote: ``gr.serving.shared_tier``; a request
    encoded from scratch counts as a ``gr_cache`` miss), the tiers' misses by reason, fetch and
    store latency, failed stores and the writes dropped before reaching them, the history tokens
    each request encoded, the model version of ``ranker`` and the live worker processes. ``refresh``
    sets this process's gauges (after each request and reload; a scrape reads the other workers'
    last values)."""

    def __init__(self, ranker: Ranker) -> None:
        self.ranker = ranker
        self.directory: Optional[str] = os.environ.get(MULTIPROC_ENV)  # None: one process
        self.registry = CollectorRegistry()
        self.requests = Counter("gr_requests", "Requests by endpoint", ["endpoint"], registry=self.registry)
        self.errors = Counter(
            "gr_errors",
            "Failed requests by endpoint, HTTP status and error kind",
            ["endpoint", "status", "kind"],
            registry=self.registry,
        )
        self.disconnects = Counter(
            "gr_client_disconnects",
            "Requests whose client closed the connection before the body arrived, by endpoint (not errors)",
            ["endpoint"],
            registry=self.registry,
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
        self.batch_size = Histogram(
            "gr_batch_size",
            "Requests per batch the request batcher ran",
            buckets=COUNT_BUCKETS,
            registry=self.registry,
        )
        self.queue_depth = Histogram(
            "gr_queue_depth",
            "Requests waiting in the request batcher when it formed a batch",
            buckets=COUNT_BUCKETS,
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "gr_fallback",
            "Answers to an empty history by kind (user_features: the new-user query; popularity: most popular items)",
            ["kind"],
            registry=self.registry,
        )
        self.left_out = Counter(
            "gr_history_tokens_left_out",
            "History tokens of items the model has no row for, left out under unknown_ids oov",
            registry=self.registry,
        )
        self.store_latency = Histogram(
            "gr_history_store_seconds",
            "History store latency by operation (append, read)",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.store_errors = Counter(
            "gr_history_store_errors",
            "History store operations that failed (unreachable, locked, unreadable) by operation (append, read)",
            ["operation"],
            registry=self.registry,
        )
        if ranker.history_store is not None:
            ranker.history_store.observer = self.observe_store
        self.tier_hits = Counter(
            "gr_cache_tier_hits",
            "Requests whose encoded history came from a tier (local: the worker's cache, shared: the server's "
            "shared tier, remote: Redis), by tier",
            ["tier"],
            registry=self.registry,
        )
        self.tier_misses = Counter(
            "gr_cache_tier_misses",
            "Tier lookups without a usable entry by tier and reason (absent, other_history, corrupt, unreachable)",
            ["tier", "reason"],
            registry=self.registry,
        )
        self.tier_latency = Histogram(
            "gr_cache_tier_seconds",
            "Tier latency by tier and operation (fetch, store)",
            ["tier", "operation"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tier_store_errors = Counter(
            "gr_cache_tier_store_errors",
            "Tier stores and purges that failed (unreachable, locked) by tier",
            ["tier"],
            registry=self.registry,
        )
        self.tier_writes_dropped = Counter(
            "gr_cache_tier_writes_dropped",
            "Tier writes dropped before reaching the tiers by reason (queue_full: the writer's queue was full; "
            "stale: a reload came first; shutdown: the worker stopped)",
            ["reason"],
            registry=self.registry,
        )
        self.recomputed = Histogram(
            "gr_tokens_recomputed",
            "History tokens each request encoded (0: its whole history came from a tier)",
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        ranker.cache.observer = self
        self.cache_entries = Gauge(
            "gr_cache_entries",
            "Users held by the user history caches of the live workers",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.cache_bytes = Gauge(
            "gr_cache_bytes",
            "Bytes held by the user history caches of the live workers",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.pages_used = Gauge(
            "gr_cache_pages_used",
            "K/V pages held by cached histories in the page pools of the live workers",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.pages_free = Gauge(
            "gr_cache_pages_free",
            "Free K/V pages in the page pools of the live workers",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.model_version = Gauge(
            "gr_model_version",
            "Model reloads since start (0: the first model); the largest over the live workers",
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        workers = Gauge("gr_workers", "Live worker processes", registry=self.registry, multiprocess_mode="livesum")
        workers.set(1)
        self.refresh()

    def observe_batch(self, size: int, waiting: int) -> None:
        """A batch of ``size`` requests formed while ``waiting`` requests waited (``RequestBatcher.on_batch``)."""
        self.batch_size.observe(size)
        self.queue_depth.observe(waiting)

    def observe_store(self, operation: str, seconds: float, failed: bool) -> None:
        """One history store operation (``HistoryStore.observer``)."""
        self.store_latency.labels(operation).observe(seconds)
        if failed:
            self.store_errors.labels(operation).inc()

    def tier_fetched(self, tier: str, seconds: float, reason: str) -> None:
        """One fetch from ``tier`` (``TieredCache.observer``): reason "" for a hit, else the miss's."""
        self.tier_latency.labels(tier, "fetch").observe(seconds)
        if reason:
            self.tier_misses.labels(tier, reason).inc()

    def tier_stored(self, tier: str, seconds: float, failed: bool) -> None:
        """One entry written to ``tier`` (``TieredCache.observer``)."""
        self.tier_latency.labels(tier, "store").observe(seconds)
        if failed:
            self.tier_store_errors.labels(tier).inc()

    def tier_write_dropped(self, reason: str, count: int) -> None:
        """``count`` tier writes dropped (``TieredCache.observer``, from the tier writer's thread)."""
        self.tier_writes_dropped.labels(reason).inc(count)

    def encoded(self, tier: Optional[str], recomputed: int) -> None:
        """One request's history (``TieredCache.observer``): the tier its state came from (None:
        encoded from scratch) and the tokens it encoded."""
        if tier is not None:
            self.tier_hits.labels(tier).inc()
        self.recomputed.observe(recomputed)

    def refresh(self) -> None:
        """Set this process's cache entries, cache bytes, pages used and free and model version."""
        self.cache_entries.set(len(self.ranker.cache))
        self.cache_bytes.set(self.ranker.cache.nbytes)
        used, free = self.ranker.pages()
        self.pages_used.set(used)
        self.pages_free.set(free)
        self.model_version.set(self.ranker.cache.model_version)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric, over every worker."""
        self.refresh()
        if self.directory is None:
            return generate_latest(self.registry)
        mark_dead_workers(self.directory)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=self.directory)
        return generate_latest(registry)

    def close(self) -> None:
        """This worker is shutting down: its gauges stop counting."""
        if self.directory is not None:
            multiprocess.mark_process_dead(os.getpid(), self.directory)


def mark_dead_workers(directory: str) -> None:
    """Drop the live gauges of every process that wrote to ``directory`` and is gone."""
    pids = {int(path.stem.rsplit("_", 1)[1]) for path in Path(directory).glob("gauge_live*_*.db")}
    for pid in pids:
        if not _alive(pid):
            multiprocess.mark_process_dead(pid, directory)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
