"""Fast cached HSTU attention for CPU tensors: per request, the cached part and the new block
apart (no copy of the cache), one bias row for a request's candidates, the mask multiply skipped
where everything is visible, and the candidates' self term elementwise.

On fp32 tensors a layer's call is one C++ op (``cpu_cached_attention.cpp``, ``gr_cpu_cached.cached_layer``):
every request's new-token part by the ATen ops ``_pytorch_layer`` issues, its bias gathered from the
layer's weights at the pass's buckets, the cached part by the fused kernel, the sum and the norm. The
fused kernel reads K/V where they lie, through the page tables of a ``PagedCache`` or in place in
tensors, by the same GEMMs, so a paged cache gives the unpaged answer bit for bit without a gather.
What the layers of a pass share (masks, buckets, norms, the requests' bounds, the cache's block
layout) is worked out once (``_PassSetup``). Where the kernel is not built (``gr.ops.native``), under
bf16 autocast, for other dtypes, or where autograd records the call, PyTorch ops run request by
request (``_pytorch_layer``; a paged cache's K/V read through ``PagedCache.read``: a view, or a
gather of its rows when its pages are not consecutive)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from gr.hstu.kernels.attention.common import RelativeBias, silu_norm, time_bucket
from gr.hstu.kernels.cached_attention.common import (
    BiasBuckets,
    CachedAttentionCall,
    CachedRequest,
    PagedCache,
    bias_buckets,
    cache_visibility,
    new_visibility,
    part,
    requests,
    rows_contiguous,
)
from gr.jagged import lengths_from_offsets
from gr.ops.native import cpu_bf16_math, native_ops

# Where the fused kernel reads K/V: (K pools, V pools, each request's pool [B], the first pool row of
# each block of tokens [S] int64, where each request's blocks begin in those [B+1], each request's
# tokens per block [B]); Blocks: the last three, which depend on the pass alone.
Layout = Tuple[List[Tensor], List[Tensor], List[int], Tensor, List[int], List[int]]
Blocks = Tuple[Tensor, List[int], List[int]]


@dataclass(frozen=True)
class _RequestSetup:
    """What every layer of a pass reads the same for one request.

    cache_visible: [n, C] float32 0/1, or None (all visible); new_visible: [n, n] float32 0/1
    bias: buckets of its tokens' bias against the cache ([n or 1, C], targets) or against the cache
        and themselves ([n, C + n], history), or None (no bias)
    self_bias: targets: [n] buckets of each with itself, else None
    norm: [n, 1, 1] float32, the factor after SiLU (``silu_norm``)
    """

    request: CachedRequest
    cache_visible: Optional[Tensor]
    new_visible: Tensor
    bias: Optional[BiasBuckets]
    self_bias: Optional[BiasBuckets]
    norm: Tensor


@dataclass(frozen=True)
class _PassSetup:
    """What every layer's call of one pass reads the same (kept in the call's ``CachedSetup``).

    lengths: [B] the requests' cached tokens; new_bounds: [B+1] their rows in q, k, v
    requests: [B] each request's ``_RequestSetup``
    fused: the fused op's per-request arguments, B entries each: the bias buckets' position and time
        parts (contiguous int64, or None), the targets' self buckets' (likewise), cache_visible (fp32
        [n, C] or None), new_visible (fp32 [n, n]) and norm (fp32 [n, 1, 1])
    ops: ``torch.ops.gr_cpu_cached``, or None where the fused kernels are off or not built
    blocks: where the fused kernel reads the requests' K/V (``Blocks``), by cache kind: "tensor" (a
        jagged tensor) and "requests" (per-request entries), worked out by the first layer to read them
    """

    lengths: List[int]
    new_bounds: List[int]
    requests: List[_RequestSetup]
    fused: Tuple[List[Optional[Tensor]], ...]
    ops: Optional[Any]
    blocks: Dict[str, Blocks]


def cpu_hstu_cached_attention(call: CachedAttentionCall) -> Tensor:
    """See ``gr.hstu.kernels.cached_attention.hstu_cached_attention``; returns [N, H, Dl]."""
    q, rab = call.q, call.rab
    kept = _setup(call)
    ops = kept.ops
    if ops is not None and q.dtype == torch.float32 and not cpu_bf16_math() and not _needs_grad(call):
        layout = _layout(call, kept)
        if layout is not None:  # one op for the layer: every request's own part, bias, cached part, sum, norm
            return ops.cached_layer(
                q, call.k, call.v, layout[0], layout[1], kept.new_bounds, kept.lengths, *layout[2:],
                float(call.alpha), call.new_tokens == "targets", None if rab is None else rab.position_weights,
                None if rab is None else rab.time_weights, *kept.fused,
            )  # fmt: skip
    return _pytorch_layer(call, kept.requests)


def _needs_grad(call: CachedAttentionCall) -> bool:
    """Whether autograd records the call (the fused op has no backward: the PyTorch ops run instead)."""
    if not torch.is_grad_enabled():
        return False
    rab = call.rab
    weights = () if rab is None else (rab.position_weights, rab.time_weights)
    return any(t is not None and t.requires_grad for t in (call.q, call.k, call.v, *weights))


def _pytorch_layer(call: CachedAttentionCall, setups: Sequence[_RequestSetup]) -> Tensor:
    """[N, H, Dl]: the call by PyTorch ops, request by request: ``gr_cpu_cached.cached_layer``'s new-token
    part and sums, its cached part by matmuls over each request's K/V (equal to the fused one within
    float rounding)."""
    q, k, v, rab = call.q, call.k, call.v, call.rab
    out = v.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for own in setups:
        new, cached = own.request.new, own.request.cache.stop - own.request.cache.start
        qh = q[new].transpose(0, 1) * call.alpha  # [H, n, Da]
        kh, vh = k[new].transpose(0, 1), v[new].transpose(0, 1)
        bias = None if own.bias is None or rab is None else own.bias.bias(rab)
        if call.new_tokens == "targets":  # each candidate sees itself only: an elementwise term
            self_logits = (qh * kh).sum(-1)  # [H, n]
            if own.self_bias is not None and rab is not None:
                self_logits = self_logits + own.self_bias.bias(rab).to(self_logits.dtype)
            new_part = F.silu(self_logits).unsqueeze(-1) * vh
        else:
            block = torch.matmul(qh, kh.transpose(1, 2))  # [H, n, n]
            if bias is not None:
                block = block + bias[:, cached:].to(block.dtype)
                bias = bias[:, :cached]
            new_part = torch.matmul(F.silu(block) * own.new_visible.to(block.dtype), vh)
        attn = _cached_part(call, own.request, qh, bias, own.cache_visible).transpose(0, 1) + new_part.transpose(0, 1)
        attn.mul_(own.norm.to(attn.dtype))  # [n, H, Dl]
        out[new] = attn
    return out


def _setup(call: CachedAttentionCall) -> _PassSetup:
    """The pass's ``_PassSetup``: worked out once a pass (kept in the call's ``CachedSetup``)."""
    kept = None if call.setup is None else call.setup.kept.get("cpu")
    if kept is not None:
        return cast(_PassSetup, kept)
    rab, new_tokens = call.rab, call.new_tokens
    lengths = lengths_from_offsets(call.cache_offsets).tolist()
    setups = []
    for request in requests(call):
        new, pos = request.new, request.positions
        query_ts = new_ts = cache_ts = None
        if rab is not None and rab.time_weights is not None:
            assert rab.timestamps is not None and rab.resolved_query_times is not None  # set with time_weights
            assert call.cache_timestamps is not None  # required with a time bias (validate)
            query_ts, new_ts = rab.resolved_query_times[new].long(), rab.timestamps[new].long()
            cache_ts = part(call.cache_timestamps, request, 0).long()
        cache_visible = cache_visibility(request, call.contextual_len, call.max_attn_len)
        if cache_visible is not None and bool(cache_visible.all()):
            cache_visible = None
        bias = self_bias = None
        if rab is not None:
            key_pos = torch.arange(request.cache.stop - request.cache.start, device=pos.device)
            if new_tokens == "targets":
                bias = bias_buckets(rab, pos, query_ts, key_pos, cache_ts)
                self_bias = _self_buckets(rab, pos, query_ts, new_ts)
            else:  # the cache's keys and the new tokens' in one
                key_ts = None if cache_ts is None or new_ts is None else torch.cat([cache_ts, new_ts])
                bias = bias_buckets(rab, pos, query_ts, torch.cat([key_pos, pos]), key_ts)
        setups.append(
            _RequestSetup(
                request,
                None if cache_visible is None else cache_visible.to(torch.float32),
                new_visibility(request, new_tokens, call.contextual_len, call.max_attn_len).to(torch.float32),
                bias,
                self_bias,
                silu_norm(pos, call.silu_scale).view(-1, 1, 1),
            )
        )
    found = _PassSetup(
        lengths,
        call.new_offsets.tolist(),
        setups,
        (
            [_contiguous(None if s.bias is None else s.bias.position) for s in setups],
            [_contiguous(None if s.bias is None else s.bias.time) for s in setups],
            [_contiguous(None if s.self_bias is None else s.self_bias.position) for s in setups],
            [_contiguous(None if s.self_bias is None else s.self_bias.time) for s in setups],
            [s.cache_visible for s in setups],
            [s.new_visible for s in setups],
            [s.norm for s in setups],
        ),
        native_ops("gr_cpu_cached"),
        {},
    )
    if call.setup is not None:
        call.setup.kept["cpu"] = found
    return found


def _contiguous(buckets: Optional[Tensor]) -> Optional[Tensor]:
    """Bucket indices (int64, ``bias_buckets``'s) as the fused op reads them: contiguous (None stays None)."""
    return None if buckets is None else buckets.contiguous()


def _cached_part(
    call: CachedAttentionCall, request: CachedRequest, qh: Tensor, bias: Optional[Tensor], visible: Optional[Tensor]
) -> Tensor:
    """[H, n, Dl]: the request's new tokens (qh: [H, n, Da], alpha applied) against its cached K/V by
    PyTorch matmuls; bias: [n or 1, C] or None, visible: [n, C] 0/1 float or None (all visible)."""
    logits = torch.matmul(qh, part(call.cache_k, request, 1).transpose(1, 2))  # [H, n, C]
    if bias is not None:
        logits.add_(bias.to(logits.dtype))
    scores = F.silu(logits, inplace=True)
    if visible is not None:
        scores.mul_(visible.to(scores.dtype))
    return torch.matmul(scores, part(call.cache_v, request, 1))


def _layout(call: CachedAttentionCall, kept: _PassSetup) -> Optional[Layout]:
    """Where the fused kernel reads each request's K/V (on the CPU, fp32), or None when it cannot: a
    paged cache through its page tables (K and V sharing them), a jagged tensor or per-request
    tensors in place (one block of a request's tokens from its first row), per-request pages
    through their own tables. What depends on the pass alone comes from ``kept``."""
    cache_k, cache_v, lengths = call.cache_k, call.cache_v, kept.lengths
    count = len(lengths)
    if isinstance(cache_k, PagedCache) or isinstance(cache_v, PagedCache):
        if not isinstance(cache_k, PagedCache) or not isinstance(cache_v, PagedCache):
            return None  # one of them in tensors
        if cache_k.tables is not cache_v.tables:
            return None
        starts, offsets = cache_k.tables.blocks(lengths)
        pools_k, pools_v, index = [cache_k.pool], [cache_v.pool], [0] * count
        sizes = [cache_k.tables.page_size] * count
    elif isinstance(cache_k, Tensor) and isinstance(cache_v, Tensor):
        pools_k, pools_v, index = [cache_k], [cache_v], [0] * count
        if "tensor" not in kept.blocks:  # one block a request, from its first row
            kept.blocks["tensor"] = (call.cache_offsets.cpu(), list(range(count + 1)), [max(1, n) for n in lengths])
        starts, offsets, sizes = kept.blocks["tensor"]
    else:
        assert not isinstance(cache_k, Tensor) and not isinstance(cache_v, Tensor)  # per-request lists
        pools = _request_pools(cache_k, cache_v)
        if pools is None:
            return None
        pools_k, pools_v, index = pools
        if "requests" not in kept.blocks:
            kept.blocks["requests"] = _request_blocks(cache_k, lengths)
        starts, offsets, sizes = kept.blocks["requests"]
    pools_k, pools_v = [rows_contiguous(t) for t in pools_k], [rows_contiguous(t) for t in pools_v]
    if not all(t.is_cpu and t.dtype is torch.float32 for t in (*pools_k, *pools_v)):
        return None
    return pools_k, pools_v, index, starts, offsets, sizes


def _request_pools(
    cache_k: Sequence[Union[Tensor, PagedCache]], cache_v: Sequence[Union[Tensor, PagedCache]]
) -> Optional[Tuple[List[Tensor], List[Tensor], List[int]]]:
    """Per-request entries' (K pools, V pools, each request's pool [B]): a request's pages (K and V
    through one page table) or its tensors; None when a request's K and V are not alike."""
    pools_k: List[Tensor] = []
    pools_v: List[Tensor] = []
    index = []
    where: Dict[int, int] = {}  # id of a K pool -> its place in pools_k
    for own_k, own_v in zip(cache_k, cache_v):
        if isinstance(own_k, PagedCache) and isinstance(own_v, PagedCache) and own_k.tables is own_v.tables:
            pool_k, pool_v = own_k.pool, own_v.pool
        elif isinstance(own_k, Tensor) and isinstance(own_v, Tensor):
            pool_k, pool_v = own_k, own_v
        else:
            return None
        if id(pool_k) not in where:
            where[id(pool_k)] = len(pools_k)
            pools_k.append(pool_k)
            pools_v.append(pool_v)
        index.append(where[id(pool_k)])
    return pools_k, pools_v, index


def _request_blocks(cache_k: Sequence[Union[Tensor, PagedCache]], lengths: Sequence[int]) -> Blocks:
    """``Blocks`` of per-request entries of ``lengths`` tokens: a request's pages through its page table,
    its tensor as one block from row 0 (the same for every layer of a pass: its tables are the pass's)."""
    parts, offsets, sizes = [], [0], []
    for own_k, length in zip(cache_k, lengths):
        if isinstance(own_k, PagedCache):
            part_starts, _ = own_k.tables.blocks([length])
            size = own_k.tables.page_size
        else:
            part_starts, size = torch.zeros(1, dtype=torch.long), max(1, length)
        parts.append(part_starts)
        offsets.append(offsets[-1] + int(part_starts.numel()))
        sizes.append(size)
    starts = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return starts, offsets, sizes


def _self_buckets(
    rab: RelativeBias, pos: Tensor, query_ts: Optional[Tensor], new_ts: Optional[Tensor]
) -> Optional[BiasBuckets]:
    """[n] buckets of each token's bias with itself: position distance 0, time delta query time - own time."""
    if rab.position_weights is None and rab.time_weights is None:
        return None
    time = None
    if rab.time_weights is not None:
        assert query_ts is not None and new_ts is not None  # given with a time bias
        time = time_bucket(query_ts - new_ts, rab.time_bucketing, rab.time_weights.numel())
    return BiasBuckets(None if rab.position_weights is None else torch.zeros_like(pos), time)
