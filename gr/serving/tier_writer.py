"""A worker's writes to its tiers, done by a thread of their own so that no request waits for them
(``gr.serving.shared_tier.TieredCache``: storing a fresh encoding, writing back an evicted entry,
copying a fetched entry into a nearer tier, marking an entry used).

The queue is bounded in bytes (what its writes hold: a queued write keeps its user's K/V alive).
A write that does not fit is dropped, never waited for, and counted by reason: "queue_full";
"stale", the writes ``discard`` drops (a reload: what they hold is of the old model);
"shutdown", those ``close`` leaves when its time is up or that come after it. A write arriving while
the queue holds no bytes is taken whatever its size, so an entry larger than the bound is still written
when the writer holds nothing else.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Deque, Generic, Optional, Tuple, TypeVar

log = logging.getLogger(__name__)

DROP_REASONS = ("queue_full", "stale", "shutdown")

Item = TypeVar("Item")


class BackgroundWriter(Generic[Item]):
    """Items queued by ``submit`` and handed to ``write`` one at a time, in order, by one thread
    (started by the first ``submit``).

    write: does one item (in the writer's thread; an exception is logged, and the next item goes on)
    max_bytes: the queue's bound (>= 0), in the bytes ``submit`` is told each item holds
    dropped: called with (reason, items) for the items dropped (``DROP_REASONS``)
    """

    def __init__(self, write: Callable[[Item], None], max_bytes: int, dropped: Callable[[str, int], None]) -> None:
        if max_bytes < 0:
            raise ValueError(f"BackgroundWriter.max_bytes: expected >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._write, self._dropped = write, dropped
        self._queue: Deque[Tuple[Item, int]] = deque()
        self._bytes = 0
        self._busy = False  # an item is being written
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._changed = threading.Condition()

    @property
    def pending(self) -> Tuple[int, int]:
        """(items, bytes) queued or being written."""
        with self._changed:
            return len(self._queue) + int(self._busy), self._bytes

    @property
    def thread(self) -> Optional[threading.Thread]:
        """The writer's thread (None before the first ``submit``)."""
        with self._changed:
            return self._thread

    def submit(self, item: Item, nbytes: int) -> bool:
        """Queue ``item`` (holding ``nbytes``) -> whether it was queued (else dropped and counted)."""
        with self._changed:
            if self._closed:
                reason: Optional[str] = "shutdown"
            elif self._bytes and self._bytes + nbytes > self.max_bytes:
                reason = "queue_full"
            else:
                reason = None
                self._queue.append((item, nbytes))
                self._bytes += nbytes
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="gr-tier-writer", daemon=True)
                    self._thread.start()
                self._changed.notify_all()
        if reason is not None:
            self._dropped(reason, 1)
        return reason is None

    def discard(self) -> int:
        """Drop every queued item (counted "stale"; one being written finishes) -> how many."""
        return self._drop_queued("stale")

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every item queued so far is written -> False when ``timeout`` seconds passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float) -> None:
        """Write what is queued for at most ``timeout`` seconds, drop the rest (counted "shutdown")
        and stop the thread; later items are dropped too."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self.flush(timeout)
        self._drop_queued("shutdown")
        thread = self.thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _drop_queued(self, reason: str) -> int:
        """Drop every queued item, counted under ``reason`` -> how many."""
        with self._changed:
            count = len(self._queue)
            self._bytes -= sum(size for _, size in self._queue)
            self._queue.clear()
            self._changed.notify_all()
        if count:
            self._dropped(reason, count)
        return count

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed, nothing left
                item, size = self._queue.popleft()
                self._busy = True
            try:
                self._write(item)
            except Exception:  # a bug in one write must not stop the others
                log.exception("tier writer: a write failed")
            del item  # what it holds (a user's K/V pages) is freed now, not at the next item
            with self._changed:
                self._bytes -= size
                self._busy = False
                self._changed.notify_all()
