"""Rank requests in flight together run as one batch (``Ranker.rank_prepared``).

The HTTP server's handler threads hand their rank requests to a ``RankBatcher``, whose one worker
thread runs them: every request that arrived while the previous batch ran (up to ``max_batch``)
forms the next batch, so an idle server answers a lone request at once and a busy one packs
users into shared HSTU passes and one postfix run (continuous batching). ``window_ms`` > 0 makes
the worker wait that long after the first request of a batch for others to join. Each request is
validated on its own, so a bad request fails alone and never changes what the others return; a
batch whose scores are not finite is re-run one request at a time, so only the request that
produces them fails.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import List, Tuple

from gr.serving.errors import RequestError, ScoringError
from gr.serving.request import RankRequest
from gr.serving.runtime import PreparedRank, Ranker, RankResult


class RankBatcher:
    """Batches concurrent ``rank`` calls on one worker thread. window_ms: how long the worker waits
    after a batch's first request for company (0: no wait); max_batch: requests per batch at most."""

    def __init__(self, ranker: Ranker, window_ms: float = 0.0, max_batch: int = 64) -> None:
        if window_ms < 0 or max_batch < 1:
            raise ValueError(f"RankBatcher: window_ms must be >= 0 and max_batch >= 1, got {window_ms}, {max_batch}")
        self.ranker, self.window_s, self.max_batch = ranker, window_ms / 1e3, max_batch
        self.batch_sizes: List[int] = []  # of every batch run, for metrics and tests
        self._waiting: List[Tuple[RankRequest, Future]] = []
        self._arrived = threading.Condition()
        threading.Thread(target=self._serve_forever, name="gr-rank-batcher", daemon=True).start()

    def rank(self, request: RankRequest) -> RankResult:
        """Rank ``request`` in the next batch; blocks until its result (or raises its error)."""
        future: Future = Future()
        with self._arrived:
            self._waiting.append((request, future))
            self._arrived.notify()
        return future.result()

    def _serve_forever(self) -> None:
        while True:
            with self._arrived:
                while not self._waiting:
                    self._arrived.wait()
            if self.window_s:
                time.sleep(self.window_s)
            with self._arrived:
                batch, self._waiting = self._waiting[: self.max_batch], self._waiting[self.max_batch :]
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
