"""A byte-bounded LRU of per-user serving state, safe to share between request threads."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable, List, Optional, Protocol


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


class UserCache:
    """{user id: entry} holding at most ``max_bytes`` (sum of ``entry.nbytes``), least recently used out first.

    ``model_version`` counts model reloads: ``invalidate`` drops everything and bumps it, and
    ``put`` refuses an entry computed under an older model version, so a request that raced a
    reload cannot store stale state. An entry larger than ``max_bytes`` is never stored.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"UserCache.max_bytes: expected >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: "OrderedDict[Hashable, Sized]" = OrderedDict()
        self._bytes = 0
        self._model_version = 0
        self._lock = threading.Lock()

    @property
    def model_version(self) -> int:
        with self._lock:
            return self._model_version

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def users(self) -> List[Hashable]:
        """User ids from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def get(self, user: Hashable) -> Optional[Sized]:
        with self._lock:
            entry = self._entries.get(user)
            if entry is not None:
                self._entries.move_to_end(user)
            return entry

    def put(self, user: Hashable, entry: Sized, model_version: int) -> bool:
        """Store ``entry`` (replacing the user's old one) and evict LRU users to fit; -> stored?"""
        size = int(entry.nbytes)
        with self._lock:
            if model_version != self._model_version:
                return False
            old = self._entries.pop(user, None)
            if old is not None:
                self._bytes -= int(old.nbytes)
            if size > self.max_bytes:
                return False
            while self._entries and self._bytes + size > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= int(evicted.nbytes)
            self._entries[user] = entry
            self._bytes += size
            return True

    def invalidate(self) -> None:
        """Drop every entry (the model changed)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self._model_version += 1
