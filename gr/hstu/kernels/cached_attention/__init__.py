"""HSTU attention of new tokens over their request's cached K/V and themselves: the serving analogue
of ``gr.hstu.kernels.attention.hstu_attention``, with the same backend names.

* ``pytorch``: the reference, one request at a time with dense masks (``pytorch``);
* ``cpu``: the fast path for CPU tensors (``cpu``; its fused C++ kernel reads K/V where they lie,
  through page tables or in place, with no gather);
* ``triton``: its own kernel (``triton``), which reads K/V where they lie, through page tables or
  in place, with no gather (draft trees and calls that need gradients run ``by_concat``);
* ``ascend``, ``ascend_triton``: that backend's training kernel over each request's cache followed
  by its new tokens (``by_concat``; a paged cache is gathered through its page tables into that
  layout).

Every backend's entry takes one ``CachedAttentionCall`` (``common``) by keyword, checked once here.
"""

from __future__ import annotations

from typing import Dict, Optional

from torch import Tensor

from gr.hstu.kernels.attention import RelativeBias, backend_entry, resolve_backend
from gr.hstu.kernels.cached_attention.by_concat import concat_hstu_cached_attention
from gr.hstu.kernels.cached_attention.common import (
    CachedAttentionCall,
    CachedSetup,
    CacheTensor,
    PagedCache,
    PageTables,
    default_positions,
)

__all__ = [
    "CachedAttentionCall",
    "CachedSetup",
    "PageTables",
    "PagedCache",
    "default_positions",
    "hstu_cached_attention",
]

_BACKENDS: Dict[str, str] = {  # name -> "module:function"; the others run by_concat
    "pytorch": "gr.hstu.kernels.cached_attention.pytorch:pytorch_hstu_cached_attention",
    "cpu": "gr.hstu.kernels.cached_attention.cpu:cpu_hstu_cached_attention",
    "triton": "gr.hstu.kernels.cached_attention.triton:triton_hstu_cached_attention",
}


def hstu_cached_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    new_offsets: Tensor,
    cache_k: CacheTensor,
    cache_v: CacheTensor,
    cache_offsets: Tensor,
    *,
    new_tokens: str = "targets",
    positions: Optional[Tensor] = None,
    block_visible: Optional[Tensor] = None,
    contextual_len: int = 0,
    max_attn_len: int = 0,
    alpha: float = 1.0,
    silu_scale: Optional[float] = None,
    rab: Optional[RelativeBias] = None,
    cache_timestamps: Optional[CacheTensor] = None,
    setup: Optional[CachedSetup] = None,
    backend: str = "auto",
) -> Tensor:
    """HSTU attention of new tokens over their request's cached K/V and the new tokens themselves.

    The rows equal those of ``hstu_attention`` over each request's history followed by its new
    tokens (cached key j of a request sits at position j). B requests run in one call.

    q, k: [N, H, Da] float, v: [N, H, Dl] float: the new tokens' projections
    new_offsets: [B+1] int64 over the N new tokens
    cache_k: [H, C, Da] float, cache_v: [H, C, Dl] float: the requests' cached keys and values,
        head-major (the layout ``gr.hstu.cache.HistoryCache`` keeps), jagged over C; or B
        per-request tensors [H, C_b, *] (no copy of several users' caches into one), or a
        ``PagedCache``: a page pool [H, P * page_size, *] read through each request's page table
        (every backend; results equal to the same K/V given as tensors, bit for bit); a per-request
        entry may be that request's ``PagedCache`` (one page table) among tensors
    cache_offsets: [B+1] int64 over the C cached tokens
    new_tokens: "targets" (candidates at position C_b: each sees the history and itself) or
        "history" (the history goes on: causal among themselves, positions C_b, C_b + 1, ...)
    positions: [N] int64 or None: explicit positions of new history tokens (draft trees)
    block_visible: [N, N] bool or None: further restricts which new history token sees which
        (a draft tree's branches); only entries within one request are read
    contextual_len, max_attn_len, alpha, silu_scale: as in ``hstu_attention`` (``AttentionOptions``)
    rab: ``RelativeBias`` of the new tokens (``timestamps``/``query_times``: [N] int64) or None
    cache_timestamps: [C] int64 seconds of the cached tokens (or B per-request [C_b]); required
        with a time bias
    setup: a ``CachedSetup`` shared by the calls of one pass through the layers (they differ only in
        q, k, v, the caches' pools and the bias weights): what they share is checked and worked out
        once; None: this call alone
    backend: one of ``gr.hstu.kernels.attention.available_backends()`` or "auto" (by q's device)
    returns: [N, H, Dl]
    """
    call = CachedAttentionCall(
        q, k, v, new_offsets, cache_k, cache_v, cache_offsets, new_tokens, positions, block_visible,
        contextual_len, max_attn_len, alpha, silu_scale, rab, cache_timestamps, setup,
    )  # fmt: skip
    call.validate()
    name = resolve_backend(backend, q.device.type)
    if name in _BACKENDS:
        return backend_entry(name, _BACKENDS)(call)
    backend_entry(name)  # an unknown name or a missing package is the same clear error as for the training op
    return concat_hstu_cached_attention(call, backend=name)
