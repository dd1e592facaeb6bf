"""A paged KV cache: every cached history's K/V in fixed-size pages of one preallocated pool.

``PagePool``: per layer one K tensor [H, P * page_size, Da] and one V tensor [H, P * page_size, Dl]
(head-major, the layout ``gr.hstu.cache.HistoryCache`` and the cached-attention kernels read),
allocated once; its size is the cache's bound. ``PagedKV``: one history's page table and length.
Extending a history writes only the new tokens, into the free slots of its last page and new
pages: the prefix is never copied.

Sharing and reuse. A ``PagedKV`` is immutable: it reads rows [0, length) of its pages, and those
rows are never written again while any ``PagedKV`` holds the page. Each page counts the
``PagedKV`` objects holding it (a history and its extensions share their prefix pages); a page
returns to the free list when the last one is gone (Python frees it when no request and no cache
entry references it: a request that reads a history pins its pages, so a page is never reused
under a reader). Two extensions of one history race for its last page's free slots: the first
claims them, the other copies the partial page into a new one (copy-on-write of at most one page).
When the pool has too few free pages, ``on_full`` (e.g. the user cache's LRU eviction) is called
until enough are free or it has nothing left to drop; then the write fails (None) and the caller
keeps that history unpaged.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from gr.hstu.config import HSTUConfig
from gr.hstu.kernels.cached_attention import PagedCache, PageTables


def page_bytes(config: HSTUConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page: ``page_size`` tokens' K and V in every layer."""
    element = torch.empty(0, dtype=dtype).element_size()
    return page_size * config.num_layers * config.num_heads * (config.attention_dim + config.linear_dim) * element


class PagePool:
    """Preallocated per-layer K/V pages of ``page_size`` tokens, shared by threads.

    config: the HSTU whose K/V it holds (layers, heads, attention_dim, linear_dim)
    pages: how many pages; dtype, device: of every page (the engine's)
    on_full: called (no argument) while too few pages are free; returns whether it released
        something (e.g. evicted a user), False when it has nothing left to drop
    """

    def __init__(
        self,
        config: HSTUConfig,
        pages: int,
        page_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if pages < 0 or page_size < 1:
            raise ValueError(f"PagePool: expected pages >= 0 and page_size >= 1, got {pages} and {page_size}")
        rows, heads = pages * page_size, config.num_heads
        self.page_size = int(page_size)
        self.dtype = dtype
        self.keys = [
            torch.empty(heads, rows, config.attention_dim, dtype=dtype, device=device) for _ in range(config.num_layers)
        ]
        self.values = [
            torch.empty(heads, rows, config.linear_dim, dtype=dtype, device=device) for _ in range(config.num_layers)
        ]
        self.page_bytes = page_bytes(config, page_size, dtype)
        self.on_full: Optional[Callable[[], bool]] = None
        self._refs = [0] * pages  # PagedKV objects holding each page
        self._fill = [0] * pages  # slots written in each page (claimed by the history at its tip)
        self._free = list(range(pages - 1, -1, -1))  # pop() hands out low pages first
        self._lock = threading.RLock()  # re-entered when a release runs inside a pool call

    @classmethod
    def of_bytes(
        cls,
        config: HSTUConfig,
        max_bytes: int,
        page_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "PagePool":
        """The largest pool of ``max_bytes`` or less."""
        pages = max(0, max_bytes) // page_bytes(config, page_size, dtype)
        return cls(config, pages, page_size, dtype=dtype, device=device)

    @property
    def pages(self) -> int:
        return len(self._refs)

    @property
    def free(self) -> int:
        """Pages on the free list."""
        with self._lock:
            return len(self._free)

    @property
    def used(self) -> int:
        """Pages held by some history."""
        return self.pages - self.free

    @property
    def device(self) -> torch.device:
        return self.keys[0].device if self.keys else torch.device("cpu")

    def store(self, keys: Sequence[Tensor], values: Sequence[Tensor]) -> Optional["PagedKV"]:
        """A history's K/V (per layer [H, C, Da] and [H, C, Dl]) written into new pages; None when the
        pool cannot hold it (even after ``on_full``) or the tensors are not of its dtype."""
        if not self._fits(keys, values):
            return None
        length = int(keys[0].shape[1]) if keys else 0
        pages = self._take(-(-length // self.page_size))
        if pages is None:
            return None
        self._write(pages, 0, keys, values)
        return self._table(pages, length)

    def append(self, base: "PagedKV", keys: Sequence[Tensor], values: Sequence[Tensor]) -> Optional["PagedKV"]:
        """``base`` followed by n new tokens (per layer [H, n, Da] and [H, n, Dl]), writing only them:
        into the free slots of base's last page when no other extension has claimed them, else into a
        copy of that page; None when the pool cannot hold them. ``base`` stays valid."""
        if base.pool is not self:
            raise ValueError("PagePool.append: the history's pages are in another pool")
        if not self._fits(keys, values):
            return None
        n, size, length = int(keys[0].shape[1]) if keys else 0, self.page_size, base.length
        offset = length % size
        last = base.pages[-1] if offset else None
        with self._lock:
            claimed = last is not None and self._fill[last] == offset
            if claimed:
                assert last is not None
                self._fill[last] = min(size, offset + n)
        kept = list(base.pages) if offset == 0 or claimed else list(base.pages[:-1])
        start = length if offset == 0 or claimed else length - offset  # the first row written anew
        fresh = self._take(-(-(length + n) // size) - len(kept))
        if fresh is None:
            if claimed:
                assert last is not None
                with self._lock:
                    self._fill[last] = offset
            return None
        pages = kept + fresh
        if start < length:  # copy-on-write of the partial last page (its rows are consecutive in both pages)
            source, target = base.pages[-1] * size, pages[len(kept)] * size
            for pool in (*self.keys, *self.values):
                pool[:, target : target + offset].copy_(pool[:, source : source + offset])
        self._write(pages, length, keys, values, first_fresh=len(kept))
        return self._table(pages, length + n)

    def truncated(self, base: "PagedKV", length: int) -> "PagedKV":
        """The first ``length`` tokens of ``base`` (0 <= length <= base.length), sharing its pages: no
        copy. Appending to it later copies its partial last page (``append``), so ``base``'s tokens
        after ``length`` stay as they are."""
        if base.pool is not self:
            raise ValueError("PagePool.truncated: the history's pages are in another pool")
        if not 0 <= length <= base.length:
            raise ValueError(f"PagePool.truncated: expected 0 <= length <= {base.length}, got {length}")
        return self._table(list(base.pages[: -(-length // self.page_size)]), length)

    def _fits(self, keys: Sequence[Tensor], values: Sequence[Tensor]) -> bool:
        return len(keys) == len(self.keys) and all(t.dtype == self.dtype for t in (*keys, *values))

    def _take(self, count: int) -> Optional[List[int]]:
        """``count`` pages off the free list, calling ``on_full`` (outside the lock: it may drop
        histories, whose pages come back through ``_release``) while too few are free."""
        while True:
            with self._lock:
                if len(self._free) >= count:
                    taken = [self._free.pop() for _ in range(count)]
                    for page in taken:
                        self._fill[page] = 0
                    return taken
                if count > len(self._refs):
                    return None
            if self.on_full is None or not self.on_full():
                return None

    def _write(
        self, pages: List[int], start: int, keys: Sequence[Tensor], values: Sequence[Tensor], first_fresh: int = 0
    ) -> None:
        """Write tokens start, start + 1, ... (per layer [H, n, *]) into the rows ``pages`` give them."""
        n = int(keys[0].shape[1]) if keys else 0
        if n == 0:
            return
        size, first, last = self.page_size, start // self.page_size, (start + n - 1) // self.page_size
        if all(pages[i + 1] == pages[i] + 1 for i in range(first, last)):  # consecutive pages: one slice of rows
            row = pages[first] * size + start % size
            for pool, new in zip((*self.keys, *self.values), (*keys, *values)):
                pool[:, row : row + n].copy_(new)
        else:
            rows = self._rows(pages, start, start + n)
            for pool, new in zip((*self.keys, *self.values), (*keys, *values)):
                pool.index_copy_(1, rows, new.to(pool.device))
        with self._lock:
            end = start + n
            for i in range(max(first_fresh, first), len(pages)):
                self._fill[pages[i]] = min(self.page_size, end - i * self.page_size)

    def _rows(self, pages: List[int], start: int, end: int) -> Tensor:
        """[end - start] int64: the pool rows of tokens start .. end - 1 of a history on ``pages``."""
        size, tokens = self.page_size, torch.arange(start, end, device=self.device)
        return torch.tensor(pages, dtype=torch.long, device=self.device)[tokens // size] * size + tokens % size

    def _table(self, pages: List[int], length: int) -> "PagedKV":
        with self._lock:
            for page in pages:
                self._refs[page] += 1
        return PagedKV(self, tuple(pages), length)

    def _release(self, pages: Tuple[int, ...]) -> None:
        with self._lock:
            for page in reversed(pages):  # popped back in token order: a history's pages stay consecutive
                self._refs[page] -= 1
                if self._refs[page] == 0:
                    self._fill[page] = 0
                    self._free.append(page)


class PagedKV:
    """One history's K/V in a ``PagePool``: its page table and length (immutable). Its pages stay
    held (never reused) while this object lives; the pool gets them back when it is freed.

    pool: the pool; pages: the page ids in token order; length: tokens held
    """

    def __init__(self, pool: PagePool, pages: Tuple[int, ...], length: int) -> None:
        self.pool = pool
        self.pages = pages
        self.length = length
        self.table = torch.tensor(pages, dtype=torch.long, device=pool.device)  # [n_pages] int64
        self._tables = PageTables([self.table], pool.page_size)  # its reads, shared by every layer
        weakref.finalize(self, pool._release, pages)

    @property
    def nbytes(self) -> int:
        """Bytes of the pages it holds (shared pages counted by each holder)."""
        return len(self.pages) * self.pool.page_bytes

    def layer(self, index: int) -> Tuple[Tensor, Tensor]:
        """Layer ``index``'s (K [H, C, Da], V [H, C, Dl]) read through the page table: a view of the
        pool when the pages are consecutive, else a gather."""
        keys, values = self.pages_of(index)
        return keys.read(0, self.length), values.read(0, self.length)

    def pages_of(self, index: int) -> Tuple[PagedCache, PagedCache]:
        """Layer ``index``'s K and V as cached attention reads them where they lie: ``PagedCache``
        of the pool's layer through this history's page table (one request's)."""
        return PagedCache(self.pool.keys[index], self._tables), PagedCache(self.pool.values[index], self._tables)
