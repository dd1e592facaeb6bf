"""Reference HSTU attention in plain PyTorch: pads to [B, L, L]. Runs on any device."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from gr.hstu.kernels.attention.common import (
    AttentionCall,
    RelativeBias,
    hstu_visibility,
    position_bucket,
    silu_norm,
    time_bucket,
)
from gr.jagged import history_lengths, lengths_from_offsets, token_offsets_in_seq, token_seq_ids


def pytorch_hstu_attention(call: AttentionCall) -> Tensor:
    """See ``gr.hstu.kernels.attention.hstu_attention``; returns [T, H, Dv]."""
    q, k, v, seq_offsets, num_targets, rab = call.q, call.k, call.v, call.seq_offsets, call.num_targets, call.rab
    total, heads, _ = q.shape
    batch = seq_offsets.numel() - 1
    seq_len = max(int(call.max_seq_len), 1)
    seq_ids = token_seq_ids(seq_offsets, total)
    idx = token_offsets_in_seq(seq_offsets, total)

    def pad(x: Tensor) -> Tensor:  # [T, H, D] -> [B, H, L, D]
        out = x.new_zeros(batch, seq_len, heads, x.shape[-1])
        out[seq_ids, idx] = x
        return out.transpose(1, 2)

    qp, kp, vp = pad(q), pad(k), pad(v)
    lengths = lengths_from_offsets(seq_offsets).view(batch, 1, 1)
    hist = history_lengths(seq_offsets, num_targets).view(batch, 1, 1)
    ar = torch.arange(seq_len, device=q.device)
    row, col = ar.view(1, -1, 1), ar.view(1, 1, -1)
    visible = hstu_visibility(row, col, lengths, hist, call.contextual_len, call.max_attn_len)  # [B, L, L]

    logits = torch.matmul(qp, kp.transpose(-1, -2)) * call.alpha  # [B, H, L, L]
    if rab is not None:
        logits = logits + dense_relative_bias(rab, seq_offsets, num_targets, seq_len).unsqueeze(1).to(logits.dtype)
    norm = silu_norm(torch.minimum(row, hist), call.silu_scale).to(logits.dtype)  # [B or 1, L, 1]
    scores = F.silu(logits) * norm.unsqueeze(1) * visible.unsqueeze(1).to(logits.dtype)
    out = torch.matmul(scores, vp)  # [B, H, L, Dv]
    return out.transpose(1, 2)[seq_ids, idx]


def dense_relative_bias(
    rab: RelativeBias, seq_offsets: Tensor, num_targets: Optional[Tensor], max_seq_len: int
) -> Tensor:
    """[B, L, L] bias (L = max_seq_len) of each padded (query, key) pair, zero where both parts are off."""
    batch = seq_offsets.numel() - 1
    total = int(seq_offsets[-1])
    seq_ids = token_seq_ids(seq_offsets, total)
    idx = token_offsets_in_seq(seq_offsets, total)
    hist = history_lengths(seq_offsets, num_targets).view(batch, 1, 1)
    ar = torch.arange(max_seq_len, device=seq_offsets.device)
    row, col = ar.view(1, -1, 1), ar.view(1, 1, -1)
    bias = torch.zeros(batch, max_seq_len, max_seq_len, device=seq_offsets.device)
    if rab.position_weights is not None:
        rel = torch.minimum(row, hist) - torch.minimum(col, hist)
        bias = bias + rab.position_weights[position_bucket(rel, rab.position_weights.numel())]
    if rab.time_weights is not None:
        assert rab.timestamps is not None and rab.resolved_query_times is not None  # set with time_weights
        ts = torch.zeros(2, batch, max_seq_len, dtype=torch.int64, device=seq_offsets.device)
        ts[0, seq_ids, idx] = rab.resolved_query_times.long()
        ts[1, seq_ids, idx] = rab.timestamps.long()
        delta = ts[0].unsqueeze(2) - ts[1].unsqueeze(1)
        bias = bias + rab.time_weights[time_bucket(delta, rab.time_bucketing, rab.time_weights.numel())]
    return bias
