"""Reference cached HSTU attention in plain PyTorch: one request at a time, dense masks. Any device."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gr.hstu.kernels.attention.common import silu_norm
from gr.hstu.kernels.cached_attention.common import (
    CachedAttentionCall,
    bias_between,
    cache_visibility,
    new_visibility,
    part,
    requests,
)


def pytorch_hstu_cached_attention(call: CachedAttentionCall) -> Tensor:
    """See ``gr.hstu.kernels.cached_attention.hstu_cached_attention``; returns [N, H, Dl]."""
    q, k, v, rab, new_tokens = call.q, call.k, call.v, call.rab, call.new_tokens
    out = v.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    for request in requests(call):
        new, pos = request.new, request.positions
        keys = torch.cat([part(call.cache_k, request, 1), k[new].transpose(0, 1)], dim=1)  # [H, C + n, Da]
        values = torch.cat([part(call.cache_v, request, 1), v[new].transpose(0, 1)], dim=1)
        cache_visible = cache_visibility(request, call.contextual_len, call.max_attn_len)
        if cache_visible is None:
            cached = request.cache.stop - request.cache.start
            cache_visible = torch.ones(pos.numel(), cached, dtype=torch.bool, device=q.device)
        new_visible = new_visibility(request, new_tokens, call.contextual_len, call.max_attn_len)
        visible = torch.cat([cache_visible, new_visible], dim=1)  # [n, C + n]
        logits = torch.matmul(q[new].transpose(0, 1) * call.alpha, keys.transpose(1, 2))  # [H, n, C + n]
        if rab is not None:
            cached = request.cache.stop - request.cache.start
            key_pos = torch.cat([torch.arange(cached, device=q.device), pos])
            key_ts = query_ts = None
            if rab.time_weights is not None:
                assert rab.timestamps is not None and rab.resolved_query_times is not None  # set with time_weights
                assert call.cache_timestamps is not None  # required with a time bias (validate)
                key_ts = torch.cat([part(call.cache_timestamps, request, 0), rab.timestamps[new]]).long()
                query_ts = rab.resolved_query_times[new].long()
            bias = bias_between(rab, pos, query_ts, key_pos, key_ts)
            if bias is not None:
                logits = logits + bias.to(logits.dtype)
        norm = silu_norm(pos, call.silu_scale).to(logits.dtype).view(1, -1, 1)
        scores = F.silu(logits) * visible.to(logits.dtype) * norm
        out[new] = torch.matmul(scores, values).transpose(0, 1)
    return out
