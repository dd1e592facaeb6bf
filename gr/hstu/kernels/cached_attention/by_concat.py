"""Cached attention on a device backend by way of its training kernel (the Ascend backends; the
triton backend's draft trees and calls that need gradients): each request's cache and
new tokens are laid out as one jagged sequence (history + targets, or a longer history) and
the new tokens' rows are kept. Exact by construction; it also computes the cached rows, so it
costs O((C + n)^2) per request instead of O(n (C + n)). Draft trees (``block_visible``) and
explicit positions have no training-kernel layout and run on the pytorch reference. A paged cache
(``PagedCache``) is gathered through its page tables straight into that layout, feeding the same
kernel."""

from __future__ import annotations

import torch
from torch import Tensor

from gr.hstu.kernels.attention import AttentionOptions, RelativeBias, hstu_attention
from gr.hstu.kernels.cached_attention.common import CachedAttentionCall, joined
from gr.hstu.kernels.cached_attention.pytorch import pytorch_hstu_cached_attention
from gr.jagged import lengths_from_offsets, offsets_from_lengths, token_offsets_in_seq


def concat_hstu_cached_attention(call: CachedAttentionCall, *, backend: str) -> Tensor:
    """See ``gr.hstu.kernels.cached_attention.hstu_cached_attention``; ``backend`` names the training kernel used."""
    q, k, v, rab, new_tokens = call.q, call.k, call.v, call.rab, call.new_tokens
    if call.block_visible is not None or call.positions is not None:
        return pytorch_hstu_cached_attention(call)
    new_lengths, cache_lengths = lengths_from_offsets(call.new_offsets), lengths_from_offsets(call.cache_offsets)
    spans = cache_lengths.tolist()
    cache_k, cache_v = joined(call.cache_k, 1, spans), joined(call.cache_v, 1, spans)
    cache_timestamps = joined(call.cache_timestamps, 0, spans)
    seq_offsets = offsets_from_lengths(new_lengths + cache_lengths)
    cache_rows, new_rows = _rows(seq_offsets, cache_lengths, new_lengths)
    total = int(seq_offsets[-1])

    def interleaved(cached: Tensor, new: Tensor) -> Tensor:  # cached [C, ...], new [N, ...] -> [C + N, ...]
        out = new.new_zeros(total, *new.shape[1:])
        out[cache_rows] = cached.to(new.dtype)
        out[new_rows] = new
        return out

    full_rab = None
    if rab is not None:
        timestamps = query_times = None
        if rab.time_weights is not None:
            assert rab.timestamps is not None and rab.resolved_query_times is not None  # set with time_weights
            assert cache_timestamps is not None  # required with a time bias (validate)
            timestamps = interleaved(cache_timestamps, rab.timestamps)
            query_times = interleaved(cache_timestamps, rab.resolved_query_times)
        full_rab = RelativeBias(rab.position_weights, rab.time_weights, timestamps, rab.time_bucketing, query_times)
    out = hstu_attention(
        interleaved(torch.zeros_like(cache_k).transpose(0, 1), q),
        interleaved(cache_k.transpose(0, 1), k),
        interleaved(cache_v.transpose(0, 1), v),
        seq_offsets,
        int((new_lengths + cache_lengths).max()) if new_lengths.numel() else 0,
        num_targets=new_lengths if new_tokens == "targets" else None,
        rab=full_rab,
        backend=backend,
        **AttentionOptions.of(call).keywords(),
    )
    return out[new_rows]


def _rows(seq_offsets: Tensor, cache_lengths: Tensor, new_lengths: Tensor) -> tuple:
    """-> (rows of the cached tokens [C], rows of the new tokens [N]) in the joined layout."""
    starts = seq_offsets[:-1]
    cache_rows = torch.repeat_interleave(starts, cache_lengths) + token_offsets_in_seq(
        offsets_from_lengths(cache_lengths)
    )
    new_rows = torch.repeat_interleave(starts + cache_lengths, new_lengths) + token_offsets_in_seq(
        offsets_from_lengths(new_lengths)
    )
    return cache_rows, new_rows
