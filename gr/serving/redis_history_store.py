"""The history store over Redis (``gr serve --history-store redis://host:port/db``), shared by
several servers: ``gr.serving.history_store``'s contract, each user's events a Redis list
(``gr:history:<user id as JSON>``) of the events' JSON, oldest first.

An append is one optimistic transaction (WATCH the list, check its last event, then MULTI: RPUSH
the events and LTRIM the list to ``max_events``; retried when another client changed the list
meanwhile); a read is one LRANGE. Needs the ``redis`` client package.
"""

from __future__ import annotations

from typing import Any, Hashable, List, cast

import redis

from gr.serving.history_store import HistoryStore, HistoryStoreError, Tail, check_follows
from gr.serving.redis_client import connect, location

KEY_PREFIX = "gr:history:"
TIMEOUT_S = 5.0  # connect and socket timeouts: an unreachable store fails the request, never hangs it


class RedisHistoryStore(HistoryStore):
    """Users' events in the Redis database at ``url``; HistoryStoreError when it does not answer."""

    def __init__(self, url: str, max_events: int) -> None:
        super().__init__(max_events)
        self.url = url
        try:
            self._client = connect(url, TIMEOUT_S, decode_responses=True)
        except (redis.RedisError, ValueError) as exc:
            raise HistoryStoreError(f"history store {self.location}: {exc}") from None

    @property
    def location(self) -> str:
        return location(self.url)

    def _append(self, key: str, encoded: List[str], first: Tail, user_id: Hashable) -> int:
        key = KEY_PREFIX + key

        def append(pipe: Any) -> None:
            last = pipe.lindex(key, -1)  # immediate: the list is watched, not yet in MULTI
            check_follows(last, first, user_id)
            pipe.multi()
            pipe.rpush(key, *encoded)
            pipe.ltrim(key, -self.max_events, -1)

        try:
            # the replies of MULTI's commands: RPUSH's length, LTRIM's OK
            pushed, _ = cast(List[Any], self._client.transaction(append, key))
        except redis.RedisError as exc:
            raise HistoryStoreError(f"history store {self.location}: append: {exc}") from None
        return min(int(pushed), self.max_events)

    def _read(self, key: str, last: int) -> List[str]:
        try:
            values = self._client.lrange(KEY_PREFIX + key, -last, -1)
        except redis.RedisError as exc:
            raise HistoryStoreError(f"history store {self.location}: read: {exc}") from None
        return cast(List[str], values)  # decode_responses: str

    def close(self) -> None:
        self._client.close()
