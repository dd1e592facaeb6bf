"""A byte-bounded LRU of per-user serving state, safe to share between request threads."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Generic, Hashable, List, Optional, Protocol, Tuple, TypeVar

# The Python objects around one entry's arrays (the LRU's node, the entry and its tensors'
# headers), counted per user besides its key and the arrays' bytes.
ENTRY_OVERHEAD_BYTES = 1024


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


Entry = TypeVar("Entry", bound=Sized)


def kept_bytes(user: Hashable, entry: Sized) -> int:
    """What the cache counts for ``user``'s ``entry``: its arrays, its key and the objects around them."""
    return int(entry.nbytes) + sys.getsizeof(user) + ENTRY_OVERHEAD_BYTES


class UserCache(Generic[Entry]):
    """{user id: entry} holding at most ``max_bytes``, least recently used out first. An entry
    counts everything kept for its user: ``entry.nbytes``, the key's size and ENTRY_OVERHEAD_BYTES.

    ``model_version`` counts model reloads: ``invalidate`` drops everything and bumps it, and
    ``put`` refuses an entry computed under an older model version, so a request that raced a
    reload cannot store stale state. An entry larger than ``max_bytes`` is never stored.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"UserCache.max_bytes: expected >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: "OrderedDict[Hashable, Tuple[Entry, int]]" = OrderedDict()  # user -> (entry, its bytes)
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

    def get(self, user: Hashable) -> Optional[Entry]:
        with self._lock:
            kept = self._entries.get(user)
            if kept is None:
                return None
            self._entries.move_to_end(user)
            return kept[0]

    def put(self, user: Hashable, entry: Entry, model_version: int) -> bool:
        """Store ``entry`` (replacing the user's old one) and evict LRU users to fit; -> stored?"""
        size = kept_bytes(user, entry)
        evicted: List[Tuple[Hashable, Entry]] = []
        with self._lock:
            if model_version != self._model_version:
                return False
            self._drop(user)
            if size > self.max_bytes:
                return False
            while self._entries and self._bytes + size > self.max_bytes:
                old, (kept, old_size) = self._entries.popitem(last=False)
                self._bytes -= old_size
                evicted.append((old, kept))
            self._entries[user] = (entry, size)
            self._bytes += size
        if evicted:
            self.evicted(evicted)
        return True

    def evict_oldest(self) -> bool:
        """Drop the least recently used entry (a full page pool asks for room: ``PagePool.on_full``);
        -> whether there was one."""
        with self._lock:
            if not self._entries:
                return False
            user, (evicted, size) = self._entries.popitem(last=False)
            self._bytes -= size
        self.evicted([(user, evicted)])
        del evicted  # outside the lock: freeing its pages takes the pool's lock
        return True

    def evicted(self, entries: List[Tuple[Hashable, Entry]]) -> None:
        """Called outside the lock with the (user, entry) pairs the LRU just evicted (default: nothing;
        ``gr.serving.shared_tier.TieredCache`` writes them back to its tiers)."""

    def discard(self, user: Hashable) -> None:
        """Forget ``user``'s entry, if any."""
        with self._lock:
            self._drop(user)

    def _drop(self, user: Hashable) -> None:
        old = self._entries.pop(user, None)
        if old is not None:
            self._bytes -= old[1]

    def advance(self, model_version: Optional[int] = None) -> None:
        """The model changed, but not what any entry was computed from: keep every entry; the
        model version becomes ``model_version`` (default: one more)."""
        with self._lock:
            self._model_version = self._model_version + 1 if model_version is None else model_version

    def invalidate(self, model_version: Optional[int] = None) -> None:
        """Drop every entry (the model changed); the model version becomes ``model_version``
        (default: one more)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self._model_version = self._model_version + 1 if model_version is None else model_version
