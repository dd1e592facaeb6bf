"""Rank requests in flight together run as one batch (``Ranker.rank_prepared``).

The HTTP server's handler threads hand their rank requests to a ``RankBatcher``: the first
request of a window starts a timer of ``window_ms``; every request that arrives before it fires
(or until ``max_batch`` are waiting) joins the batch, which then runs as shared HSTU passes and
one postfix run. Each request is validated on its own, so a bad request fails alone and never
changes what the others return; a batch whose scores are not finite is re-run one request at a
time, so only the request that produces them fails.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import List, Optional, Tuple

from gr.serving.errors import RequestError, ScoringError
from gr.serving.request import RankRequest
from gr.serving.runtime import PreparedRank, Ranker, RankResult


class RankBatcher:
    """Batches concurrent ``rank`` calls. window_ms: how long the first request of a batch waits
    for company; max_batch: a batch runs as soon as this many requests wait."""

    def __init__(self, ranker: Ranker, window_ms: float, max_batch: int = 64) -> None:
        if window_ms <= 0 or max_batch < 1:
            raise ValueError(f"RankBatcher: window_ms must be > 0 and max_batch >= 1, got {window_ms}, {max_batch}")
        self.ranker, self.window_s, self.max_batch = ranker, window_ms / 1e3, max_batch
        self.batch_sizes: List[int] = []  # of every batch run, for metrics and tests
        self._waiting: List[Tuple[RankRequest, Future]] = []
        self._lock = threading.Lock()

    def rank(self, request: RankRequest) -> RankResult:
        """Rank ``request`` with whatever else arrives within the window; blocks until its result."""
        future: Future = Future()
        full: Optional[List[Tuple[RankRequest, Future]]] = None
        with self._lock:
            self._waiting.append((request, future))
            if len(self._waiting) >= self.max_batch:
                full, self._waiting = self._waiting, []
            elif len(self._waiting) == 1:
                timer = threading.Timer(self.window_s, self._flush)
                timer.daemon = True
                timer.start()
        if full is not None:
            self._run(full)
        return future.result()

    def _flush(self) -> None:
        with self._lock:
            batch, self._waiting = self._waiting, []
        if batch:
            self._run(batch)

    def _run(self, batch: List[Tuple[RankRequest, Future]]) -> None:
        self.batch_sizes.append(len(batch))
        prepared: List[Tuple[PreparedRank, Future]] = []
        for request, future in batch:
            try:
                prepared.append((self.ranker.prepare_rank(request), future))
            except RequestError as exc:
                future.set_exception(exc)
        try:
            results = self.ranker.rank_prepared([p for p, _ in prepared])
        except ScoringError:
            for p, future in prepared:
                _settle(future, lambda p=p: self.ranker.rank_prepared([p])[0])
            return
        except BaseException as exc:  # a bug: every waiting request reports it
            for _, future in prepared:
                future.set_exception(exc)
            return
        for (_, future), result in zip(prepared, results):
            future.set_result(result)


def _settle(future: Future, run) -> None:
    try:
        future.set_result(run())
    except BaseException as exc:
        future.set_exception(exc)
