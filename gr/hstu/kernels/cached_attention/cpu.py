"""Fast cached HSTU attention for CPU tensors: per request, the cached part and the new block
as separate matmuls (no copy of the cache), one bias row for a request's candidates, the
mask multiply skipped where everything is visible, and the candidates' self term elementwise."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from gr.hstu.kernels.attention.common import RelativeBias, silu_norm, time_bucket
from gr.hstu.kernels.cached_attention.common import CachedAttentionCall, bias_between, part, requests, visibility


def cpu_hstu_cached_attention(call: CachedAttentionCall) -> Tensor:
    """See ``gr.hstu.kernels.cached_attention.hstu_cached_attention``; returns [N, H, Dl]."""
    q, k, v, rab, new_tokens = call.q, call.k, call.v, call.rab, call.new_tokens
    out = v.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for request in requests(call):
        new, pos = request.new, request.positions
        cached = request.cache.stop - request.cache.start
        qh = q[new].transpose(0, 1) * call.alpha  # [H, n, Da]
        kh, vh = k[new].transpose(0, 1), v[new].transpose(0, 1)
        query_ts = new_ts = cache_ts = None
        if rab is not None and rab.time_weights is not None:
            assert rab.timestamps is not None and rab.resolved_query_times is not None  # set with time_weights
            assert call.cache_timestamps is not None  # required with a time bias (validate)
            query_ts, new_ts = rab.resolved_query_times[new].long(), rab.timestamps[new].long()
            cache_ts = part(call.cache_timestamps, request, 0).long()
        cache_visible, new_visible = visibility(request, new_tokens, call.contextual_len, call.max_attn_len)

        logits = torch.matmul(qh, part(call.cache_k, request, 1).transpose(1, 2))  # [H, n, C]
        if rab is not None:
            bias = bias_between(
                rab,
                pos,
                query_ts,
                torch.arange(cached, device=q.device),
                cache_ts,
            )
            if bias is not None:
                logits.add_(bias.to(logits.dtype))
        scores = F.silu(logits, inplace=True)
        if not bool(cache_visible.all()):
            scores.mul_(cache_visible.to(scores.dtype))
        attn = torch.matmul(scores, part(call.cache_v, request, 1))  # [H, n, Dl]

        if new_tokens == "targets":  # each candidate sees itself only: an elementwise term
            self_logits = (qh * kh).sum(-1)  # [H, n]
            if rab is not None:
                self_bias = _self_bias(rab, pos, query_ts, new_ts)
                if self_bias is not None:
                    self_logits = self_logits + self_bias.to(self_logits.dtype)
            attn.add_(F.silu(self_logits).unsqueeze(-1) * vh)
        else:
            block = torch.matmul(qh, kh.transpose(1, 2))  # [H, n, n]
            if rab is not None:
                bias = bias_between(rab, pos, query_ts, pos, new_ts)
                if bias is not None:
                    block = block + bias.to(block.dtype)
            attn.add_(torch.matmul(F.silu(block) * new_visible.to(block.dtype), vh))
        attn.mul_(silu_norm(pos, call.silu_scale).to(attn.dtype).view(1, -1, 1))
        out[new] = attn.transpose(0, 1)
    return out


def _self_bias(
    rab: RelativeBias, pos: Tensor, query_ts: Optional[Tensor], new_ts: Optional[Tensor]
) -> Optional[Tensor]:
    """[n] bias of each token with itself: position distance 0, time delta query time - own time."""
    bias = None
    if rab.position_weights is not None:
        bias = rab.position_weights[0].expand(pos.numel())
    if rab.time_weights is not None:
        assert query_ts is not None and new_ts is not None  # given with a time bias
        delta = query_ts - new_ts
        part = rab.time_weights[time_bucket(delta, rab.time_bucketing, rab.time_weights.numel())]
        bias = part if bias is None else bias + part
    return bias
