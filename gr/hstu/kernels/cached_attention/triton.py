"""Cached attention on the ``triton`` backend: one Triton kernel
(``gr.hstu.kernels.attention.triton.blocks.cached_attention_kernel``) takes each request's new tokens
over its cached K/V, read where they lie, and over its new tokens, with the training forward pass's
mask, bias, SiLU and norm code.

A paged cache (``PagedCache``) is read through its page tables (row = the page's first pool row +
position % page size); a jagged tensor cache is the same kernel with one page a request, so a paged
cache gives the answer of the same K/V as tensors bit for bit, and neither is copied. Routed to
``by_concat`` (the training kernel over cache + new tokens, or the reference): draft trees
(``positions`` / ``block_visible``: positions and masks the kernel does not take) and calls whose
tensors require grad (the kernel has no backward; serving runs without grad). Per-request caches
whose K and V are pages of one pool are read through their tables together; a batch mixing pages
and tensors, or per-request tensors, is joined into one tensor first (a copy: the kernel reads one
pool).

Tiles: the architecture's table (``tuning``, kernel ``cached_forward``; not autotuned), or
``INTERPRETER_BLOCKS`` under Triton's interpreter (CPU tensors, tests).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import triton
from torch import Tensor

from gr.hstu.kernels.attention.common import AttentionOptions, RelativeBias
from gr.hstu.kernels.attention.triton import tuning
from gr.hstu.kernels.attention.triton.blocks import cached_attention_kernel
from gr.hstu.kernels.attention.triton.host import (
    Launch,
    check_dtypes,
    head_args,
    interpreted_on,
    kernel_inputs,
    option_args,
    strides,
)
from gr.hstu.kernels.attention.triton.tuning import TileConfig
from gr.hstu.kernels.cached_attention.by_concat import concat_hstu_cached_attention
from gr.hstu.kernels.cached_attention.common import (
    CachedAttentionCall,
    CacheEntry,
    CacheTensor,
    PagedCache,
    PageTables,
    joined,
    rows_contiguous,
)
from gr.jagged import lengths_from_offsets

OP = "hstu_cached_attention[triton]"
KERNEL = "cached_forward"  # its name in the tile table
INTERPRETER_BLOCKS = (16, 64)  # (BLOCK_M, BLOCK_N) when interpreted on CPU

# Where the kernel reads the cache: K pool [H, rows, Da], V pool [H, rows, Dl], the first pool row of
# each page [S] int64, where each request's pages begin [B+1], tokens per page.
Pages = Tuple[Tensor, Tensor, Tensor, List[int], int]


def triton_hstu_cached_attention(call: CachedAttentionCall, *, blocks: Optional[Tuple[int, int]] = None) -> Tensor:
    """See ``gr.hstu.kernels.cached_attention.hstu_cached_attention``; returns [N, H, Dl].

    blocks: (BLOCK_M new tokens, BLOCK_N keys), multiples of 16; None: the tile table's on CUDA,
    ``INTERPRETER_BLOCKS`` under the interpreter.
    """
    interpreted = interpreted_on(call.q.device, OP, cached_attention_kernel)
    if blocks is not None and any(b % 16 or b <= 0 for b in blocks):
        raise ValueError(f"{OP}: blocks must be positive multiples of 16, got {blocks}")
    if call.block_visible is not None or call.positions is not None or _needs_grad(call):
        return concat_hstu_cached_attention(call, backend="triton")
    launch, max_new = cached_launch(call, interpreted)
    out = launch.args["Out"]
    if out.numel() == 0:
        return out
    if blocks is not None:
        config = TileConfig(*blocks)
    elif interpreted:
        config = TileConfig(*INTERPRETER_BLOCKS)
    else:
        q, v = launch.args["Q"], launch.args["V"]
        major = torch.cuda.get_device_capability(q.device)[0]
        dtype = str(q.dtype).removeprefix("torch.")
        config = tuning.default_config(major, KERNEL, dtype, q.shape[2], v.shape[2])
    grid = (call.new_offsets.numel() - 1) * launch.args["H"], triton.cdiv(max_new, config.block_m)
    launch.kernel[grid](**launch.args, **tile_args(config))
    return out


def cached_launch(call: CachedAttentionCall, interpreted: bool) -> Tuple[Launch, int]:
    """The kernel's arguments for ``call`` (all but the tiles: ``tile_args``; its output [N, H, Dl] is
    ``launch.args["Out"]``) and the most new tokens of a request (the grid's second axis, in tiles)."""
    q, k, v, device = call.q, call.k, call.v, call.q.device
    check_dtypes(OP, q=q, k=k, v=v)
    q, k, v = (x if x.dtype == q.dtype and x.stride(-1) == 1 else x.to(q.dtype).contiguous() for x in (q, k, v))
    cache_lengths, new_lengths = lengths_from_offsets(call.cache_offsets), lengths_from_offsets(call.new_offsets)
    lengths = cache_lengths.tolist()
    pool_k, pool_v, starts, page_offsets, page_size = _pages(call, lengths)
    check_dtypes(OP, cache_k=pool_k, cache_v=pool_v)
    cached = sum(lengths)
    if cached == 0:  # no cached token in the batch: no empty tensor (no address) for the kernel
        pool_k, pool_v = (
            pool_k.new_zeros(pool_k.shape[0], 1, pool_k.shape[2]),
            pool_v.new_zeros(pool_v.shape[0], 1, pool_v.shape[2]),
        )
        starts = torch.zeros(1, dtype=torch.long)
    history = cache_lengths + (new_lengths if call.new_tokens == "history" else 0)
    max_new = int(new_lengths.max()) if len(lengths) else 0
    options, one_pass = AttentionOptions.of(call), _one_pass_bias(call, lengths)
    inputs = kernel_inputs(OP, call.new_offsets, history, max_new, options, one_pass, device)
    timed = inputs.num_time > 0  # times of the cached keys, then the new ones
    out = torch.empty(*q.shape[:2], v.shape[2], dtype=v.dtype, device=device)
    args: Dict[str, Any] = dict(
        Q=q,
        K=k,
        V=v,
        Out=out,
        CacheK=pool_k,
        CacheV=pool_v,
        PageStarts=starts.to(device),
        PageOffsets=torch.tensor(page_offsets, dtype=torch.int32, device=device),
        SeqOffsets=inputs.seq_offsets,
        History=inputs.history,
        CacheOffsets=call.cache_offsets.to(device=device, dtype=torch.int32),
        CacheTs=inputs.timestamps[:cached] if timed else inputs.timestamps,
        Ts=inputs.timestamps[cached:] if timed else inputs.timestamps,
        QueryTimes=inputs.query_times[cached:] if timed else inputs.query_times,
        **strides(q=q, k=k, v=v, o=out),
        stride_ckh=pool_k.stride(0),
        stride_ckr=pool_k.stride(1),
        stride_cvh=pool_v.stride(0),
        stride_cvr=pool_v.stride(1),
        page_size=page_size,
        **option_args(inputs),
        **head_args(q, v, interpreted),
    )
    return Launch(KERNEL, cached_attention_kernel, args, "BLOCK_M"), max_new


def tile_args(config: TileConfig) -> Dict[str, int]:
    """The kernel's tile sizes and launch options under ``config``."""
    return dict(
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages
    )


def _needs_grad(call: CachedAttentionCall) -> bool:
    rab = call.rab
    weights = () if rab is None else (rab.position_weights, rab.time_weights)
    tensors = (call.q, call.k, call.v, *(w for w in weights if w is not None))
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _pages(call: CachedAttentionCall, lengths: Sequence[int]) -> Pages:
    """Where the kernel reads each request's cached K/V: a paged cache through its page tables (K and
    V sharing them), per-request pages of one K and one V pool through their tables together, a
    jagged tensor as one page a request from its first row; anything else joined into one tensor."""
    cache_k, cache_v = call.cache_k, call.cache_v
    if not isinstance(cache_k, (Tensor, PagedCache)) and not isinstance(cache_v, (Tensor, PagedCache)):
        cache_k, cache_v = _one_pool(cache_k, cache_v)
    if isinstance(cache_k, PagedCache) and isinstance(cache_v, PagedCache) and cache_k.tables is cache_v.tables:
        starts, offsets = cache_k.tables.blocks(lengths)
        return rows_contiguous(cache_k.pool), rows_contiguous(cache_v.pool), starts, offsets, cache_k.tables.page_size
    keys, values = rows_contiguous(joined(cache_k, 1, lengths)), rows_contiguous(joined(cache_v, 1, lengths))
    starts = call.cache_offsets[:-1].to(device=torch.device("cpu"), dtype=torch.long)
    return keys, values, starts, list(range(len(lengths) + 1)), max([1, *lengths])


def _one_pool(cache_k: Sequence[CacheEntry], cache_v: Sequence[CacheEntry]) -> Tuple[CacheTensor, CacheTensor]:
    """Per-request entries as one ``PagedCache`` each for K and V when every request's K and V are
    pages of one K and one V pool (page size alike) through one page table; else as given."""
    pairs = list(zip(cache_k, cache_v))
    first_k, first_v = pairs[0] if pairs else (None, None)
    if not isinstance(first_k, PagedCache) or not isinstance(first_v, PagedCache):
        return cache_k, cache_v
    tables = []
    for k, v in pairs:
        if not (isinstance(k, PagedCache) and isinstance(v, PagedCache) and k.tables is v.tables):
            return cache_k, cache_v
        if k.pool is not first_k.pool or v.pool is not first_v.pool or k.tables.page_size != first_k.tables.page_size:
            return cache_k, cache_v
        tables.append(k.tables.tables[0])
    shared = PageTables(tables, first_k.tables.page_size)
    return PagedCache(first_k.pool, shared), PagedCache(first_v.pool, shared)


def _one_pass_bias(call: CachedAttentionCall, lengths: Sequence[int]) -> Optional[RelativeBias]:
    """``call.rab`` with the key times of every cached token, then of every new token, and the query
    times likewise (the cached tokens' own, unread), so that all are rebased together."""
    rab = call.rab
    if rab is None or rab.time_weights is None:
        return rab
    assert rab.timestamps is not None and rab.resolved_query_times is not None  # set with time_weights
    cache_ts = joined(call.cache_timestamps, 0, lengths)
    assert cache_ts is not None  # required with a time bias (validate)
    cache_ts = cache_ts.to(device=rab.timestamps.device, dtype=torch.long)
    keys = torch.cat([cache_ts, rab.timestamps.long()])
    queries = torch.cat([cache_ts, rab.resolved_query_times.long()])
    return RelativeBias(rab.position_weights, rab.time_weights, keys, rab.time_bucketing, queries)
