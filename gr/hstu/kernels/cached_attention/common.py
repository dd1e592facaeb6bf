"""The cached-attention problem every backend of ``hstu_cached_attention`` solves: the call they take.

New tokens (history extensions, candidates, draft-tree nodes) of B requests attend to their
request's cached history K/V and to new tokens of the same request, under the training
mask and bias (``gr.hstu.kernels.attention.common``): the result equals the rows of the one-pass
``hstu_attention`` over history + new tokens. This module holds the shared pieces: the call
(``CachedAttentionCall``), the per-request slices and the mask and bias of one request's (new,
key) pairs, and the paged form of a cache (``PagedCache``: K or V read through page tables).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union, overload

import torch
from torch import Tensor

from gr.hstu.kernels.attention.common import (
    RelativeBias,
    check_qkv,
    check_tensors,
    hstu_visibility,
    position_bucket,
    time_bucket,
)
from gr.jagged import lengths_from_offsets

NEW_TOKEN_KINDS = ("targets", "history")
LAYOUTS_KEPT = 64  # read and block layouts a PageTables keeps, each kind (past it, it starts afresh)


class PageTables:
    """B requests' page tables into one page pool, shared by every layer's ``PagedCache``.

    tables: B [n_b] int64 page ids, the request's tokens in order (token j in page
    tables[b][j // page_size], slot j % page_size); page_size: tokens per page.
    The pool rows of a request's tokens are computed once and reused by every layer; at most
    ``LAYOUTS_KEPT`` reads and as many block layouts are kept (a history's tables live as long as
    its cache entry, read at whatever lengths its requests ask).
    """

    def __init__(self, tables: Sequence[Tensor], page_size: int) -> None:
        self.tables = list(tables)
        self.page_size = int(page_size)
        self._reads: dict = {}  # (request, length) -> ("run", first row) | ("rows", [length] int64)
        self._extremes: Optional[list] = None  # per table (smallest, largest page id), for the checks
        self._blocks: dict = {}  # lengths -> (first pool row of each page read [S] int64, offsets [B+1])

    def extremes(self) -> list:
        """Per table (smallest page id, largest page id), or None for an empty table (computed once)."""
        if self._extremes is None:
            self._extremes = [(int(t.min()), int(t.max())) if t.numel() else None for t in self.tables]
        return self._extremes

    def __len__(self) -> int:
        return len(self.tables)

    def blocks(self, lengths: Sequence[int]) -> Tuple[Tensor, List[int]]:
        """-> (starts [S] int64: the first pool row of each page holding the requests' first ``lengths``
        tokens, request after request, on the CPU; offsets [B+1]: where each request's pages begin in
        starts), computed once per lengths: token j of request b is in row starts[offsets[b] + j //
        page_size] + j % page_size."""
        key = tuple(lengths)
        found = self._blocks.get(key)
        if found is None:
            used = [table[: -(-length // self.page_size)].cpu() for table, length in zip(self.tables, key)]
            starts = torch.cat(used).long() * self.page_size if used else torch.zeros(0, dtype=torch.long)
            found = (starts, [0, *itertools.accumulate(t.numel() for t in used)])
            _keep(self._blocks, key, found)
        return found

    def read(self, index: int, length: int) -> Tuple[str, Union[int, Tensor]]:
        """How request ``index``'s first ``length`` tokens are read: ("run", first pool row) when
        its pages are consecutive in the pool (a view), else ("rows", [length] int64 pool rows)."""
        key = (index, length)
        found = self._reads.get(key)
        if found is None:
            table, size = self.tables[index], self.page_size
            pages = table[: -(-length // size)]
            if pages.numel() <= 1 or bool((pages[1:] - pages[:-1] == 1).all()):
                found = ("run", int(pages[0]) * size if pages.numel() else 0)
            else:
                slots = torch.arange(size, device=table.device)
                found = ("rows", (pages.view(-1, 1) * size + slots).flatten()[:length])
            _keep(self._reads, key, found)
        return found

    @property
    def layouts(self) -> int:
        """Reads and block layouts kept (each kind at most ``LAYOUTS_KEPT``)."""
        return len(self._reads) + len(self._blocks)


def _keep(layouts: dict, key: object, layout: object) -> None:
    """Keep ``layout`` under ``key``, emptying ``layouts`` first when it holds ``LAYOUTS_KEPT`` (one
    step, safe beside other threads reading or keeping: no iteration)."""
    if len(layouts) >= LAYOUTS_KEPT:
        layouts.clear()
    layouts[key] = layout


@dataclass(frozen=True, eq=False)
class PagedCache:
    """One layer's cached K (or V) of B requests, kept in a page pool and read through page tables.

    pool: [H, P * page_size, D] float, head-major: the pool's P pages of this layer, page p's
    slots in rows p * page_size ...; tables: the requests' ``PageTables`` (request b's length
    comes from the call's cache_offsets). A request's K/V is read as [H, C_b, D]: a view of the
    pool when its pages are consecutive, else one gather of its rows; the values are the
    pool's, so results equal those of the same K/V given as tensors, bit for bit.
    """

    pool: Tensor
    tables: PageTables

    def read(self, index: int, length: int) -> Tensor:
        """[H, length, D]: request ``index``'s first ``length`` cached tokens."""
        kind, where = self.tables.read(index, length)
        if kind == "run":
            return self.pool.narrow(1, int(where), length)
        return self.pool.index_select(1, where)  # type: ignore[arg-type]

    def rows(self, lengths: Sequence[int]) -> Tensor:
        """[sum lengths] int64: the pool rows of every request's tokens, back to back."""
        out = []
        for index, length in enumerate(lengths):
            kind, where = self.tables.read(index, length)
            if kind == "run":
                out.append(torch.arange(int(where), int(where) + length, device=self.pool.device))
            else:
                out.append(where)  # type: ignore[arg-type]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=self.pool.device)


# A cached tensor of B requests: one jagged tensor, a sequence of B per-request ones (each a tensor, or
# that request's pages: a PagedCache of one page table), or all of them in pages.
CacheEntry = Union[Tensor, PagedCache]  # one request's entry of a per-request sequence
CacheTensor = Union[Tensor, Sequence[CacheEntry], PagedCache]


@dataclass(frozen=True)
class CachedRequest:
    """One request's slice of a cached-attention call.

    index: which request of the call; new: its rows in q/k/v ([start, end)); cache: its
    columns in jagged cache tensors (see ``part``)
    positions: [n] int64 each new token's position; history_len: the request's history
    length (cached + new history tokens; targets excluded); block_visible: [n, n] bool or None
    """

    index: int
    new: slice
    cache: slice
    positions: Tensor
    history_len: int
    block_visible: Optional[Tensor]


class CachedSetup:
    """What the cached-attention calls of one pass through the layers share, worked out by the first
    call and reused by the others: the call's checks, and what a backend derives from the requests'
    offsets, positions, masks and times (kept under the backend's name in ``kept``).

    One setup serves one pass: every call given it has the same new_offsets, cache_offsets,
    positions, block_visible, options, timestamps, query times and cache timestamps, and caches of
    the same lengths and page tables; q, k, v, the caches' pools and the bias weights may differ
    (each layer's)."""

    def __init__(self) -> None:
        self.validated = False
        self.kept: Dict[str, object] = {}


@dataclass(frozen=True, eq=False)
class CachedAttentionCall:
    """One cached-attention call: what every backend of ``hstu_cached_attention`` takes, by keyword
    (``backend(call, **options)``), checked once by the dispatcher (``validate``).

    q, k: [N, H, Da] float, v: [N, H, Dl] float: the new tokens' projections
    new_offsets: [B+1] int64 over the N new tokens
    cache_k: [H, C, Da] float, cache_v: [H, C, Dl] float, head-major and jagged over C; or B
        per-request tensors [H, C_b, *] (or that request's ``PagedCache``); or a ``PagedCache``
    cache_offsets: [B+1] int64 over the C cached tokens
    new_tokens: "targets" or "history"
    positions: [N] int64 or None: explicit positions of new history tokens (draft trees)
    block_visible: [N, N] bool or None: which new history token sees which (a draft tree's branches)
    contextual_len, max_attn_len, alpha, silu_scale: as ``AttentionOptions`` documents them
    rab: ``RelativeBias`` of the new tokens ([N] timestamps / query_times) or None
    cache_timestamps: [C] int64 (or B per-request [C_b]); required with a time bias
    setup: the pass's ``CachedSetup`` (None: this call alone)
    """

    q: Tensor
    k: Tensor
    v: Tensor
    new_offsets: Tensor
    cache_k: CacheTensor
    cache_v: CacheTensor
    cache_offsets: Tensor
    new_tokens: str = "targets"
    positions: Optional[Tensor] = None
    block_visible: Optional[Tensor] = None
    contextual_len: int = 0
    max_attn_len: int = 0
    alpha: float = 1.0
    silu_scale: Optional[float] = None
    rab: Optional[RelativeBias] = None
    cache_timestamps: Optional[CacheTensor] = None
    setup: Optional[CachedSetup] = None

    def validate(self) -> None:
        """Shapes, dtypes and devices every backend relies on; errors name the argument. Within a
        pass (``setup``) what the calls share is checked by the first one only."""
        op = "hstu_cached_attention"
        q, k, v, new_offsets, cache_offsets = self.q, self.k, self.v, self.new_offsets, self.cache_offsets
        check_qkv(op, q, k, v, "[N, H, Da]", "[N, H, Dl]")
        if self.setup is not None and self.setup.validated:
            return
        if self.new_tokens not in NEW_TOKEN_KINDS:
            raise ValueError(f"{op}: new_tokens must be one of {list(NEW_TOKEN_KINDS)}, got {self.new_tokens!r}")
        if new_offsets.shape != cache_offsets.shape or new_offsets.dim() != 1:
            raise ValueError(f"{op}: new_offsets and cache_offsets must both be [B+1]")
        check_tensors(op, q, (("new_offsets", new_offsets), ("cache_offsets", cache_offsets)), floating=False)
        if self.block_visible is not None and self.new_tokens != "history":
            raise ValueError(f"{op}: block_visible is for new history tokens (draft trees) only")
        if int(new_offsets[-1]) != q.shape[0]:
            raise ValueError(f"{op}: new_offsets[-1] must be N, the number of new tokens")
        lengths = lengths_from_offsets(cache_offsets).tolist()
        timed = self.rab is not None and self.rab.time_weights is not None
        named = (("cache_k", self.cache_k, q.shape[2]), ("cache_v", self.cache_v, v.shape[2]))
        for name, cache, dim in named + ((("cache_timestamps", self.cache_timestamps, None),) if timed else ()):
            if isinstance(cache, PagedCache):
                _check_paged(op, name, cache, lengths, q.shape[1], dim)
                continue
            parts = [cache] if cache is None or isinstance(cache, Tensor) else list(cache)
            spans = [sum(lengths)] if isinstance(cache, Tensor) else lengths
            for span, part in zip(spans, parts) if len(parts) == len(spans) else [(None, None)]:
                if isinstance(part, PagedCache):  # one request's pages
                    _check_paged(op, name, part, [span or 0], q.shape[1], dim)
                    continue
                shape = (span,) if dim is None else (q.shape[1], span, dim)
                if part is None or tuple(part.shape) != shape:
                    raise ValueError(
                        f"{op}: {name} must be {list(shape) if span is not None else 'one per request'}"
                        f" (cache_offsets say {lengths} tokens per request), got "
                        f"{None if part is None else tuple(part.shape)}"
                    )
        if self.setup is not None:
            self.setup.validated = True


def _check_paged(op: str, name: str, cache: PagedCache, lengths: Sequence[int], heads: int, dim: Optional[int]) -> None:
    """A paged cache holds B page tables, each with room for its request's tokens, in a [H, rows, D]
    pool (dim None: timestamps, which are never paged)."""
    if dim is None:
        raise ValueError(f"{op}: {name} must be tensors, not pages")
    pool, tables = cache.pool, cache.tables
    if pool.dim() != 3 or pool.shape[0] != heads or pool.shape[2] != dim or pool.shape[1] % tables.page_size:
        raise ValueError(
            f"{op}: {name}: the page pool must be [{heads}, pages * {tables.page_size}, {dim}], got {tuple(pool.shape)}"
        )
    if len(tables) != len(lengths):
        raise ValueError(f"{op}: {name}: {len(tables)} page tables for {len(lengths)} requests")
    pages = pool.shape[1] // tables.page_size
    for b, (table, length, extremes) in enumerate(zip(tables.tables, lengths, tables.extremes())):
        if table.numel() * tables.page_size < length or (extremes and not 0 <= extremes[0] <= extremes[1] < pages):
            raise ValueError(
                f"{op}: {name}: request {b}'s page table {table.tolist()} does not hold its {length} tokens "
                f"in a pool of {pages} pages of {tables.page_size}"
            )


def default_positions(new_offsets: Tensor, cache_offsets: Tensor, new_tokens: str) -> Tensor:
    """[N] int64 positions of new tokens: targets sit at their request's cache length, history
    tokens follow the cache one by one."""
    news, cached = new_offsets.tolist(), cache_offsets.tolist()
    starts = [c1 - c0 for c0, c1 in zip(cached, cached[1:])]
    spans = zip(starts, (n1 - n0 for n0, n1 in zip(news, news[1:])))
    if new_tokens == "targets":
        positions = [p for start, n in spans for p in itertools.repeat(start, n)]
    else:
        positions = [p for start, n in spans for p in range(start, start + n)]
    return torch.tensor(positions, dtype=torch.long, device=new_offsets.device)


def requests(call: CachedAttentionCall) -> Iterator[CachedRequest]:
    """Split a (validated) call into its requests. positions default to each kind's: targets sit at
    the cache length, history tokens follow the cache one by one."""
    new_offsets, cache_offsets, new_tokens = call.new_offsets, call.cache_offsets, call.new_tokens
    new_bounds, cache_bounds = new_offsets.tolist(), cache_offsets.tolist()
    positions = call.positions
    all_positions = default_positions(new_offsets, cache_offsets, new_tokens) if positions is None else positions
    for b in range(len(new_bounds) - 1):
        ns, ne, cs, ce = new_bounds[b], new_bounds[b + 1], cache_bounds[b], cache_bounds[b + 1]
        n, cached = ne - ns, ce - cs
        pos = all_positions[ns:ne].long()
        block = None if call.block_visible is None else call.block_visible[ns:ne, ns:ne]
        yield CachedRequest(b, slice(ns, ne), slice(cs, ce), pos, cached + (n if new_tokens == "history" else 0), block)


def cache_visibility(request: CachedRequest, contextual_len: int, max_attn_len: int) -> Optional[Tensor]:
    """[n, C] bool: which cached token each new token of one request sees; None when it sees them all
    (every new token stands after the cache, so only a bounded look-back hides cached tokens)."""
    if max_attn_len <= 0:
        return None
    cols = torch.arange(request.cache.stop - request.cache.start, device=request.positions.device)
    return _sees(request, cols, contextual_len, max_attn_len)


def new_visibility(request: CachedRequest, new_tokens: str, contextual_len: int, max_attn_len: int) -> Tensor:
    """[n, n] bool: which new token of one request sees which (targets: each itself only)."""
    pos = request.positions
    eye = torch.eye(pos.numel(), dtype=torch.bool, device=pos.device)
    if new_tokens == "targets":
        return eye
    if max_attn_len <= 0 and request.cache.stop - request.cache.start >= contextual_len:
        new_visible = pos.view(-1, 1) > pos.view(1, -1)  # causal: no new token is contextual
    else:
        new_visible = _sees(request, pos, contextual_len, max_attn_len)
    if request.block_visible is not None:
        new_visible = new_visible & request.block_visible.bool()
    return new_visible | eye


def _sees(request: CachedRequest, keys: Tensor, contextual_len: int, max_attn_len: int) -> Tensor:
    """[n, K] bool: whether each new token of one request sees each key at positions ``keys`` [K]
    (``hstu_visibility`` within the request's history)."""
    pos = request.positions
    length = torch.tensor(torch.iinfo(torch.int64).max, device=pos.device)
    history_len = torch.tensor(request.history_len, device=pos.device)
    return hstu_visibility(pos.view(-1, 1), keys.view(1, -1), length, history_len, contextual_len, max_attn_len)


@dataclass(frozen=True)
class BiasBuckets:
    """Where a relative bias between queries and keys of one request reads its weights, worked out
    once and read against each layer's ``RelativeBias`` (``bias``): position, time: int64 bucket
    indices of one shape (e.g. [n, K]), or None where that part is off (not both)."""

    position: Optional[Tensor]
    time: Optional[Tensor]

    def bias(self, rab: RelativeBias) -> Tensor:
        """The bias at these buckets, float, of their shape: position part + time part."""
        bias = None
        if self.position is not None:
            assert rab.position_weights is not None  # buckets made for a position bias
            bias = rab.position_weights[self.position]
        if self.time is not None:
            assert rab.time_weights is not None  # buckets made for a time bias
            part = rab.time_weights[self.time]
            bias = part if bias is None else bias + part
        assert bias is not None  # bias_buckets makes none without a part
        return bias


def bias_buckets(
    rab: RelativeBias,
    query_positions: Tensor,
    query_times: Optional[Tensor],
    key_positions: Tensor,
    key_timestamps: Optional[Tensor],
) -> Optional[BiasBuckets]:
    """[n, K] buckets of the relative bias of n queries against K keys of one request (None when off).

    query_positions: [n] int64, query_times: [n] int64; key_positions: [K] int64,
    key_timestamps: [K] int64. When every query shares position and time (a request's
    candidates) one row is worked out, [1, K], broadcasting over the queries.
    """
    if rab.position_weights is None and rab.time_weights is None:
        return None
    if _all_equal(query_positions) and (query_times is None or _all_equal(query_times)):
        query_positions = query_positions[:1]
        query_times = None if query_times is None else query_times[:1]
    position = time = None
    if rab.position_weights is not None:
        position = position_bucket(
            query_positions.view(-1, 1) - key_positions.view(1, -1), rab.position_weights.numel()
        )
    if rab.time_weights is not None:
        assert query_times is not None and key_timestamps is not None  # given with a time bias
        delta = query_times.view(-1, 1) - key_timestamps.view(1, -1)
        time = time_bucket(delta, rab.time_bucketing, rab.time_weights.numel())
    return BiasBuckets(position, time)


def bias_between(
    rab: RelativeBias,
    query_positions: Tensor,
    query_times: Optional[Tensor],
    key_positions: Tensor,
    key_timestamps: Optional[Tensor],
) -> Optional[Tensor]:
    """[n, K] float relative bias of n queries against K keys of one request (None when off): the
    weights at ``bias_buckets`` (which takes the same arguments; [1, K] for candidates)."""
    buckets = bias_buckets(rab, query_positions, query_times, key_positions, key_timestamps)
    return None if buckets is None else buckets.bias(rab)


@overload
def part(cache: CacheTensor, request: CachedRequest, dim: int) -> Tensor: ...
@overload
def part(cache: None, request: CachedRequest, dim: int) -> None: ...
def part(cache: Optional[CacheTensor], request: CachedRequest, dim: int) -> Optional[Tensor]:
    """One request's cached tensor: its slice of a jagged tensor along ``dim``, its own entry of a
    per-request list (which lets callers pass several users' caches without copying them together),
    or its tokens read through its page table."""
    if isinstance(cache, PagedCache):
        return cache.read(request.index, request.cache.stop - request.cache.start)
    if cache is None or isinstance(cache, Tensor):
        return (
            None if cache is None else cache.narrow(dim, request.cache.start, request.cache.stop - request.cache.start)
        )
    own = cache[request.index]
    return own.read(0, request.cache.stop - request.cache.start) if isinstance(own, PagedCache) else own


@overload
def joined(cache: CacheTensor, dim: int, lengths: Sequence[int] = ()) -> Tensor: ...
@overload
def joined(cache: None, dim: int, lengths: Sequence[int] = ()) -> None: ...
def joined(cache: Optional[CacheTensor], dim: int, lengths: Sequence[int] = ()) -> Optional[Tensor]:
    """A cached tensor as one jagged tensor (per-request lists concatenated along ``dim``; a paged
    cache's requests, of ``lengths`` tokens, gathered through their page tables in one read)."""
    if isinstance(cache, PagedCache):
        return cache.pool.index_select(1, cache.rows(lengths))
    if cache is None or isinstance(cache, Tensor):
        return cache
    return torch.cat([c.read(0, lengths[i]) if isinstance(c, PagedCache) else c for i, c in enumerate(cache)], dim=dim)


def rows_contiguous(t: Tensor) -> Tensor:
    """``t`` [H, rows, D], with each row's D values adjacent (a copy only when they are not)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _all_equal(values: Tensor) -> bool:
    return values.numel() <= 1 or bool((values == values[0]).all())
