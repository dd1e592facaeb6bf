"""Rank and recommend requests in flight together run as one batch (``Ranker.run``).

The HTTP server's handler threads hand their rank and recommend requests to a ``RequestBatcher``.
Each request is validated in its caller's thread (``Ranker.prepare``) before it joins a batch, so
a bad request fails alone, with its own error, and never reaches its batch-mates. The one worker
thread runs the batches: every request that arrived while the previous batch ran (up to
``max_batch``) forms the next batch, so an idle server answers a lone request at once and a busy
one packs users into shared HSTU passes, one postfix run and (recommend) one catalogue search per
kind of request (continuous batching).
``window_ms`` > 0 makes the worker wait that long after the first request of a batch for others
to join.

A batch that fails in any way (non-finite scores, or any other exception) is re-run one request
at a time, so only the request that causes the failure reports it. Should the worker thread
itself die, every waiting and later request fails at once with ``BatcherDied`` and ``on_death``
is called (the HTTP server then turns not-ready and exits, for its supervisor to restart it).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from gr.serving.request import RankRequest, RecommendRequest
from gr.serving.runtime import PreparedRank, PreparedRecommend, Ranker, RankResult, RecommendResult

Prepared = Union[PreparedRank, PreparedRecommend]  # the kinds of request the batcher runs

log = logging.getLogger(__name__)


class BatcherDied(RuntimeError):
    """The batcher's worker thread is gone: no batched request can be answered by this process."""


class RequestBatcher:
    """Batches concurrent ``rank`` and ``recommend`` calls on one worker thread. window_ms: how long
    the worker waits after a batch's first request for company (0: no wait); max_batch: requests per
    batch at most; on_death: called with the exception that ended the worker thread (never called
    otherwise); on_batch: called with each batch's size and the requests waiting when it formed
    (its own included), from the worker thread, before the batch runs."""

    def __init__(
        self,
        ranker: Ranker,
        window_ms: float = 0.0,
        max_batch: int = 64,
        on_death: Optional[Callable[[BaseException], None]] = None,
        on_batch: Optional[Callable[[int, int], None]] = None,
    ) -> None:
        if window_ms < 0 or max_batch < 1:
            raise ValueError(f"RequestBatcher: window_ms must be >= 0 and max_batch >= 1, got {window_ms}, {max_batch}")
        self.ranker, self.window_s, self.max_batch = ranker, window_ms / 1e3, max_batch
        self.on_death, self.on_batch = on_death, on_batch
        self.death: Optional[BaseException] = None  # what ended the worker thread, if it ended
        self._waiting: List[Tuple[Prepared, Future]] = []
        self._arrived = threading.Condition()
        threading.Thread(target=self._serve_forever, name="gr-request-batcher", daemon=True).start()

    def rank(self, request: RankRequest) -> RankResult:
        """Validate ``request`` here (its RequestError is raised to this caller alone), rank it in
        the next batch; blocks until its result (or raises its error)."""
        return self._submit(self.ranker.prepare(request))

    def recommend(self, request: RecommendRequest) -> RecommendResult:
        """``rank``'s contract for a recommend request."""
        return self._submit(self.ranker.prepare(request))

    def _submit(self, prepared: Prepared) -> Any:
        future: Future = Future()
        with self._arrived:
            if self.death is not None:
                raise BatcherDied(f"the request batcher stopped: {self.death!r}")
            self._waiting.append((prepared, future))
            self._arrived.notify()
        return future.result()

    def _serve_forever(self) -> None:
        batch: List[Tuple[Prepared, Future]] = []
        try:
            while True:
                batch = self._next_batch()
                self._run(batch)
        except BaseException as exc:  # noqa: B036 - whatever ends the thread must reach the waiting callers
            self._die(exc, batch)

    def _next_batch(self) -> List[Tuple[Prepared, Future]]:
        with self._arrived:
            while not self._waiting:
                self._arrived.wait()
        if self.window_s:
            time.sleep(self.window_s)
        with self._arrived:
            waiting = len(self._waiting)
            batch, self._waiting = self._waiting[: self.max_batch], self._waiting[self.max_batch :]
        if self.on_batch is not None:
            self.on_batch(len(batch), waiting)
        return batch

    def _run(self, batch: List[Tuple[Prepared, Future]]) -> None:
        for kind in (PreparedRank, PreparedRecommend):
            group = [(p, future) for p, future in batch if isinstance(p, kind)]
            if group:
                _run_group(group, lambda prepared: self.ranker.run(prepared))

    def _die(self, exc: BaseException, running: List[Tuple[Prepared, Future]]) -> None:
        log.critical("the request batcher's worker thread stopped: %r", exc, exc_info=exc)
        with self._arrived:
            self.death = exc
            waiting, self._waiting = self._waiting, []
        for _, future in (*running, *waiting):
            if not future.done():
                future.set_exception(BatcherDied(f"the request batcher stopped: {exc!r}"))
        if self.on_death is not None:
            self.on_death(exc)


def _run_group(group: List[Tuple[Prepared, Future]], run: Callable[[Sequence[Prepared]], List[Any]]) -> None:
    """Run requests of one kind as a batch; if it fails, one at a time (only the request that fails reports it)."""
    try:
        results = run([p for p, _ in group])
    except Exception as exc:
        if len(group) == 1:
            group[0][1].set_exception(exc)
            return
        for p, future in group:
            _settle(future, run, p)
        return
    for (_, future), result in zip(group, results):
        future.set_result(result)


def _settle(future: Future, run: Callable[[Sequence[Prepared]], List[Any]], prepared: Prepared) -> None:
    try:
        future.set_result(run([prepared])[0])
    except Exception as exc:
        future.set_exception(exc)
