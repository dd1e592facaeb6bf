"""The history store that ``gr serve --history-store`` (and ``gr predict --history-store``) names:
a Redis URL, else an SQLite file's path (``gr.serving.history_store``)."""

from __future__ import annotations

from gr.serving.history_store import HistoryStore, HistoryStoreError, SqliteHistoryStore

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_history_store(spec: str, max_events: int) -> HistoryStore:
    """The store ``spec`` names: a Redis URL (``redis://host:port/db``, ``rediss://``, ``unix://``;
    ``gr.serving.redis_history_store``), else an SQLite file's path; each keeps ``max_events``
    events per user. HistoryStoreError when it cannot be opened."""
    if spec.startswith(REDIS_SCHEMES):
        try:
            from gr.serving.redis_history_store import RedisHistoryStore  # redis-py: only for a Redis store
        except ImportError as exc:
            raise HistoryStoreError(f"a Redis history store needs the redis package (the redis extra): {exc}") from None
        return RedisHistoryStore(spec, max_events)
    return SqliteHistoryStore(spec, max_events)
