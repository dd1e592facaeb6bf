"""Users' histories kept by the service: ``POST /v1/events`` appends a user's events, and a request
that names only its ``user_id`` is answered from them (``Ranker.history``).

A store keeps, per user, the last ``max_events`` events, oldest first, each a JSON object of the
request history's columns at one token (``{"item_id": 12, "timestamps": 1000, ...}``: raw ids as
sent, timestamps in integer seconds). Each append is one transaction: it is refused (a
RequestError naming ``history.timestamps``) when its first event is earlier than the user's last
stored one (equal times are allowed, as in a history), or when its events carry other features
than the stored ones; then its events are added and the oldest past ``max_events`` dropped. A read
is one snapshot, so it sees a prefix of the appends, never part of one.

``SqliteHistoryStore`` is the embedded default (one SQLite file in WAL mode: the threads and worker
processes of a server share it, and it is kept across restarts); ``gr.serving.redis_history_store``
keeps the same over Redis, for several servers. ``gr.serving.history_store_spec`` opens either from
``gr serve --history-store``'s value. A store that cannot be reached raises HistoryStoreError.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from gr.serving.errors import RequestError
from gr.timestamps import TIMESTAMPS

SQLITE_FORMAT = 1  # PRAGMA user_version of a history store file
BUSY_TIMEOUT_S = 10.0  # how long an SQLite writer waits for another process's transaction

# operation ("append" | "read"), seconds, whether it failed (HistoryStoreError)
Observer = Callable[[str, float, bool], None]


class HistoryStoreError(RuntimeError):
    """The history store cannot be read or written (unreachable, locked past its timeout, not a
    history store): a server-side fault."""


class HistoryStore(ABC):
    """The last ``max_events`` events of each user (see the module docstring).

    observer: called after each append and read with the operation, its seconds and whether it
    failed (the server's metrics)."""

    def __init__(self, max_events: int) -> None:
        if max_events < 1:
            raise ValueError(f"history store: max_events: expected >= 1, got {max_events}")
        self.max_events = max_events
        self.observer: Optional[Observer] = None

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the events are kept (a file, a Redis URL without its password), for the start-up line."""

    def append(self, user_id: Hashable, events: Sequence[Mapping[str, Any]]) -> int:
        """Append ``events`` (one JSON-ready object per event, at least one, each with the same
        features and integer ``timestamps``, oldest first) to the user's history in one transaction
        -> the events now held for the user (at most ``max_events``). RequestError when they would
        go back in time or change the features (nothing is appended then)."""
        if not events:
            raise ValueError("HistoryStore.append: no events")
        encoded = [json.dumps(dict(event), separators=(",", ":"), allow_nan=False) for event in events]
        first = Tail(int(events[0][TIMESTAMPS]), tuple(sorted(events[0])))
        return self._timed("append", lambda: self._append(_key(user_id), encoded, first, user_id))

    def read(self, user_id: Hashable, last: int) -> Dict[str, List[Any]]:
        """The user's ``last`` most recent events (at most) as a request history's columns
        ({feature: [one value per event]}, oldest first); {} for a user without events."""
        texts = self._timed("read", lambda: self._read(_key(user_id), last))
        events = [json.loads(text) for text in texts]
        return {name: [event[name] for event in events] for name in (events[0] if events else {})}

    @abstractmethod
    def close(self) -> None:
        """Release the connection (a closed store is not used again)."""

    @abstractmethod
    def _append(self, key: str, encoded: List[str], first: "Tail", user_id: Hashable) -> int:
        """Append in one transaction, refusing what ``check_follows`` refuses -> the events held."""

    @abstractmethod
    def _read(self, key: str, last: int) -> List[str]:
        """The key's ``last`` most recent encoded events, oldest first, from one snapshot."""

    def _timed(self, operation: str, call: Callable[[], Any]) -> Any:
        started, failed = time.perf_counter(), False
        try:
            return call()
        except HistoryStoreError:
            failed = True
            raise
        finally:
            if self.observer is not None:
                self.observer(operation, time.perf_counter() - started, failed)


@dataclass(frozen=True)
class Tail:
    """An event's time and features: the last stored one's, or an append's first."""

    timestamp: int
    features: Tuple[str, ...]

    @classmethod
    def of(cls, encoded: str) -> "Tail":
        event = json.loads(encoded)
        return cls(int(event[TIMESTAMPS]), tuple(sorted(event)))


def check_follows(stored: Optional[str], first: Tail, user_id: Hashable) -> None:
    """RequestError unless an append whose first event is ``first`` may follow the user's last
    stored event ``stored`` (None: the user has none): not earlier, and the same features."""
    if stored is None:
        return
    last = Tail.of(stored)
    if first.timestamp < last.timestamp:
        raise RequestError(
            f"history.timestamps: [0] = {first.timestamp} is earlier than the last stored event of user "
            f"{user_id!r} ({last.timestamp}): events are appended in time order (equal times allowed)"
        )
    if first.features != last.features:
        raise RequestError(
            f"history: user {user_id!r}'s stored events carry {list(last.features)}, these carry "
            f"{list(first.features)}: send the same features with every append"
        )


def _key(user_id: Hashable) -> str:
    """A user's key: its JSON, so that the user 7 and the user "7" stay two users, as in the user cache."""
    return json.dumps(user_id)


class SqliteHistoryStore(HistoryStore):
    """The events in one SQLite file (WAL mode), created when missing and kept across restarts;
    threads of a process share one connection, processes each open their own."""

    def __init__(self, path: str | Path, max_events: int) -> None:
        super().__init__(max_events)
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            self._create()
        except sqlite3.Error as exc:
            raise HistoryStoreError(f"history store {self.path}: {exc}") from None

    @property
    def location(self) -> str:
        return str(self.path)

    def _create(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if version != SQLITE_FORMAT and (version or tables):
            raise HistoryStoreError(
                f"history store {self.path}: an SQLite file of another kind (tables {sorted(tables)}, "
                f"user_version {version}); expected a gr history store (user_version {SQLITE_FORMAT}) or a new file"
            )
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("BEGIN IMMEDIATE")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS events (user TEXT NOT NULL, seq INTEGER NOT NULL, event TEXT NOT NULL, "
            "PRIMARY KEY (user, seq)) WITHOUT ROWID"
        )
        self._db.execute(f"PRAGMA user_version = {SQLITE_FORMAT}")
        self._db.execute("COMMIT")

    def _append(self, key: str, encoded: List[str], first: Tail, user_id: Hashable) -> int:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")  # the write lock first: no other append between check and insert
                try:
                    row = self._db.execute(
                        "SELECT seq, event FROM events WHERE user = ? ORDER BY seq DESC LIMIT 1", (key,)
                    ).fetchone()
                    check_follows(None if row is None else row[1], first, user_id)
                    start = 0 if row is None else row[0] + 1
                    kept = encoded[-self.max_events :]
                    start += len(encoded) - len(kept)
                    self._db.executemany(
                        "INSERT INTO events (user, seq, event) VALUES (?, ?, ?)",
                        [(key, start + i, text) for i, text in enumerate(kept)],
                    )
                    end = start + len(kept)
                    self._db.execute("DELETE FROM events WHERE user = ? AND seq < ?", (key, end - self.max_events))
                    held = self._db.execute("SELECT COUNT(*) FROM events WHERE user = ?", (key,)).fetchone()[0]
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                raise HistoryStoreError(f"history store {self.path}: append: {exc}") from None
        return int(held)

    def _read(self, key: str, last: int) -> List[str]:
        with self._lock:
            try:
                rows = self._db.execute(
                    "SELECT event FROM events WHERE user = ? ORDER BY seq DESC LIMIT ?", (key, last)
                ).fetchall()
            except sqlite3.Error as exc:
                raise HistoryStoreError(f"history store {self.path}: read: {exc}") from None
        return [row[0] for row in reversed(rows)]

    def close(self) -> None:
        with self._lock:
            self._db.close()
