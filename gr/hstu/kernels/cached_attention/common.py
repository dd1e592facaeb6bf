"""The cached-attention problem every backend of ``hstu_cached_attention`` solves: the call they take.

New tokens (history extensions, candidates, draft-tree nodes) of B requests attend to their
request's cached history K/V and to new tokens of the same request, under the training
mask and bias (``gr.hstu.kernels.attention.common``): the result equals the rows of the one-pass
``hstu_attention`` over history + new tokens. This module holds the shared pieces: the call
(``CachedAttentionCall``), the per-request slices and the mask and bias of one request's (new,
key) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple, Union, overload

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
from gr.jagged import lengths_from_offsets, token_offsets_in_seq

NEW_TOKEN_KINDS = ("targets", "history")
# A cached tensor of B requests: one jagged tensor, or a sequence of B per-request tensors.
CacheTensor = Union[Tensor, Sequence[Tensor]]


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


@dataclass(frozen=True, eq=False)
class CachedAttentionCall:
    """One cached-attention call: what every backend of ``hstu_cached_attention`` takes, by keyword
    (``backend(call, **options)``), checked once by the dispatcher (``validate``).

    q, k: [N, H, Da] float, v: [N, H, Dl] float: the new tokens' projections
    new_offsets: [B+1] int64 over the N new tokens
    cache_k: [H, C, Da] float, cache_v: [H, C, Dl] float, head-major and jagged over C; or B
        per-request tensors [H, C_b, *]
    cache_offsets: [B+1] int64 over the C cached tokens
    new_tokens: "targets" or "history"
    positions: [N] int64 or None: explicit positions of new history tokens (draft trees)
    block_visible: [N, N] bool or None: which new history token sees which (a draft tree's branches)
    contextual_len, max_attn_len, alpha, silu_scale: as ``AttentionOptions`` documents them
    rab: ``RelativeBias`` of the new tokens ([N] timestamps / query_times) or None
    cache_timestamps: [C] int64 (or B per-request [C_b]); required with a time bias
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

    def validate(self) -> None:
        """Shapes, dtypes and devices every backend relies on; errors name the argument."""
        op = "hstu_cached_attention"
        q, k, v, new_offsets, cache_offsets = self.q, self.k, self.v, self.new_offsets, self.cache_offsets
        check_qkv(op, q, k, v, "[N, H, Da]", "[N, H, Dl]")
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
        spans = [sum(lengths)] if isinstance(self.cache_k, Tensor) else lengths
        timed = self.rab is not None and self.rab.time_weights is not None
        named = (("cache_k", self.cache_k, q.shape[2]), ("cache_v", self.cache_v, v.shape[2]))
        for name, cache, dim in named + ((("cache_timestamps", self.cache_timestamps, None),) if timed else ()):
            parts = [cache] if cache is None or isinstance(cache, Tensor) else list(cache)
            for span, part in zip(spans, parts) if len(parts) == len(spans) else [(None, None)]:
                shape = (span,) if dim is None else (q.shape[1], span, dim)
                if part is None or tuple(part.shape) != shape:
                    raise ValueError(
                        f"{op}: {name} must be {list(shape) if span is not None else 'one per request'}"
                        f" (cache_offsets say {lengths} tokens per request), got "
                        f"{None if part is None else tuple(part.shape)}"
                    )


def default_positions(new_offsets: Tensor, cache_offsets: Tensor, new_tokens: str) -> Tensor:
    """[N] int64 positions of new tokens: targets sit at their request's cache length, history
    tokens follow the cache one by one."""
    new_lengths = lengths_from_offsets(new_offsets)
    cached = torch.repeat_interleave(lengths_from_offsets(cache_offsets), new_lengths)
    if new_tokens == "targets":
        return cached
    return cached + token_offsets_in_seq(new_offsets, int(new_offsets[-1]))


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


def visibility(
    request: CachedRequest, new_tokens: str, contextual_len: int, max_attn_len: int
) -> Tuple[Tensor, Tensor]:
    """-> (cache_visible [n, C] bool, new_visible [n, n] bool) of one request."""
    pos = request.positions
    cached = request.cache.stop - request.cache.start
    length = torch.tensor(torch.iinfo(torch.int64).max, device=pos.device)
    history_len = torch.tensor(request.history_len, device=pos.device)
    cols = torch.arange(cached, device=pos.device)
    cache_visible = hstu_visibility(
        pos.view(-1, 1), cols.view(1, -1), length, history_len, contextual_len, max_attn_len
    )
    eye = torch.eye(pos.numel(), dtype=torch.bool, device=pos.device)
    if new_tokens == "targets":
        return cache_visible, eye
    new_visible = hstu_visibility(pos.view(-1, 1), pos.view(1, -1), length, history_len, contextual_len, max_attn_len)
    if request.block_visible is not None:
        new_visible = new_visible & request.block_visible.bool()
    return cache_visible, new_visible | eye


def bias_between(
    rab: RelativeBias,
    query_positions: Tensor,
    query_times: Optional[Tensor],
    key_positions: Tensor,
    key_timestamps: Optional[Tensor],
) -> Optional[Tensor]:
    """[n, K] float relative bias of n queries against K keys of one request (None when off).

    query_positions: [n] int64, query_times: [n] int64; key_positions: [K] int64,
    key_timestamps: [K] int64. When every query shares position and time (a request's
    candidates) one row is computed and returned as [1, K], broadcasting over the queries.
    """
    if rab.position_weights is None and rab.time_weights is None:
        return None
    if _all_equal(query_positions) and (query_times is None or _all_equal(query_times)):
        query_positions = query_positions[:1]
        query_times = None if query_times is None else query_times[:1]
    bias = None
    if rab.position_weights is not None:
        rel = query_positions.view(-1, 1) - key_positions.view(1, -1)
        bias = rab.position_weights[position_bucket(rel, rab.position_weights.numel())]
    if rab.time_weights is not None:
        assert query_times is not None and key_timestamps is not None  # given with a time bias
        delta = query_times.view(-1, 1) - key_timestamps.view(1, -1)
        part = rab.time_weights[time_bucket(delta, rab.time_bucketing, rab.time_weights.numel())]
        bias = part if bias is None else bias + part
    return bias


@overload
def part(cache: CacheTensor, request: CachedRequest, dim: int) -> Tensor: ...
@overload
def part(cache: None, request: CachedRequest, dim: int) -> None: ...
def part(cache: Optional[CacheTensor], request: CachedRequest, dim: int) -> Optional[Tensor]:
    """One request's cached tensor: its slice of a jagged tensor along ``dim``, or its own entry of a
    per-request list (which lets callers pass several users' caches without copying them together)."""
    if cache is None or isinstance(cache, Tensor):
        return (
            None if cache is None else cache.narrow(dim, request.cache.start, request.cache.stop - request.cache.start)
        )
    return cache[request.index]


@overload
def joined(cache: CacheTensor, dim: int) -> Tensor: ...
@overload
def joined(cache: None, dim: int) -> None: ...
def joined(cache: Optional[CacheTensor], dim: int) -> Optional[Tensor]:
    """A cached tensor as one jagged tensor (per-request lists concatenated along ``dim``)."""
    return cache if cache is None or isinstance(cache, Tensor) else torch.cat(list(cache), dim=dim)


def _all_equal(values: Tensor) -> bool:
    return values.numel() <= 1 or bool((values == values[0]).all())
