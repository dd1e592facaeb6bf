"""The remote tier over Redis (``gr serve --tier-redis redis://host:port/db``), shared by servers on
several machines: ``gr.serving.shared_tier``'s ``TierStore``, each entry one Redis string
(``gr:kv:<model version>:<user id as JSON>``) holding its blob.

Redis bounds it: run the server with ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (or give
the tier a database of its own on such a server), and Redis evicts the least recently used entries
past the bound. A purge deletes the old model version's keys (SCAN, then UNLINK in batches). Needs
the ``redis`` client package.
"""

from __future__ import annotations

from typing import List, Optional, cast

import redis

from gr.serving.redis_client import connect, location
from gr.serving.shared_tier import TierError, TierStore

KEY_PREFIX = "gr:kv:"
TIMEOUT_S = 2.0  # connect and socket timeouts: an unreachable tier is a miss, never a hung request
PURGE_BATCH = 512  # keys per UNLINK while purging


class RedisTier(TierStore):
    """Entries in the Redis database at ``url``; TierError when it does not answer."""

    name = "remote"

    def __init__(self, url: str) -> None:
        self.url = url
        try:
            self._client = connect(url, TIMEOUT_S)
        except (redis.RedisError, ValueError) as exc:
            raise TierError(f"remote tier {self.location}: {exc}") from None

    @property
    def location(self) -> str:
        return location(self.url)

    def get(self, version: str, user: str) -> Optional[bytes]:
        try:
            return cast(Optional[bytes], self._client.get(f"{KEY_PREFIX}{version}:{user}"))
        except redis.RedisError as exc:
            raise TierError(f"remote tier {self.location}: get: {exc}") from None

    def put(self, version: str, user: str, blob: bytes) -> None:
        try:
            self._client.set(f"{KEY_PREFIX}{version}:{user}", blob)
        except redis.RedisError as exc:
            raise TierError(f"remote tier {self.location}: put: {exc}") from None

    def touch(self, version: str, user: str) -> None:
        """Nothing: Redis marks a key used when ``get`` reads it."""

    def purge(self, version: str) -> None:
        try:
            batch: List[bytes] = []
            for key in self._client.scan_iter(match=f"{KEY_PREFIX}{_glob_escaped(version)}:*", count=PURGE_BATCH):
                batch.append(key)
                if len(batch) == PURGE_BATCH:
                    self._client.unlink(*batch)
                    batch = []
            if batch:
                self._client.unlink(*batch)
        except redis.RedisError as exc:
            raise TierError(f"remote tier {self.location}: purge: {exc}") from None

    def close(self) -> None:
        self._client.close()


def _glob_escaped(text: str) -> str:
    """``text`` matched literally by a Redis SCAN pattern."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)
