"""Fast HSTU attention for CPU tensors: work proportional to sum(L_i^2), bounded memory.

Sequences are grouped by their length rounded up to 1/8 of its power of two (so padding
wastes at most ~12% per side), each group is cut into query chunks that only meet the keys
they can see (causal / window / contextual), and each chunk is one batched matmul pair over
the group. Targets are computed against history keys only; their one visible target key
(themselves) is a per-token term. Forward and backward run chunk by chunk and recompute the
scores in backward (no L x L tensor is kept), so memory stays bounded by ``tile_elements``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from gr.hstu.kernels.common import (
    RelativeBias,
    hstu_visibility,
    position_bucket,
    silu_norm,
    time_bucket,
    time_bucket_thresholds,
)
from gr.jagged import history_lengths, lengths_from_offsets, target_token_index

QUERY_CHUNK = 256  # query rows per chunk
TILE_ELEMENTS = 1 << 22  # score elements (all heads) per batched chunk, ~16 MB in fp32


@dataclass
class _Chunk:
    """Query rows [m0, m1) of a group against keys [0, ctx_hi) + [lo, hi) (padded indices)."""

    m0: int
    m1: int
    ctx_hi: int
    lo: int
    hi: int

    def keys(self, device: torch.device) -> Optional[Tensor]:
        """Key indices when the set is not one slice, else None (use ``self.lo:self.hi``)."""
        if self.ctx_hi == 0:
            return None
        return torch.cat([torch.arange(0, self.ctx_hi, device=device), torch.arange(self.lo, self.hi, device=device)])


@dataclass
class _Group:
    """Sequences padded to one length ``tokens.shape[1]``.

    tokens: [G, Lp] int64 flat token index, T (a zero row) for padding
    lengths, history: [G, 1, 1] int64
    """

    tokens: Tensor
    lengths: Tensor
    history: Tensor
    chunks: List[_Chunk]


@dataclass
class _Problem:
    """Everything the chunks need besides q, k, v and the bias weights."""

    groups: List[_Group]
    alpha: float
    silu_scale: Optional[float]
    contextual_len: int
    max_attn_len: int
    timestamps: Optional[Tensor]  # [T + 1] int64, padding row last
    time_thresholds: Optional[Tensor]  # [NB - 1] float32 bucket edges
    time_bucketing: str
    dtype: torch.dtype  # compute dtype of the chunk weights


def cpu_hstu_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    num_targets: Optional[Tensor],
    contextual_len: int,
    max_attn_len: int,
    alpha: float,
    silu_scale: Optional[float],
    rab: Optional[RelativeBias],
) -> Tensor:
    """See ``gr.hstu.kernels.hstu_attention``; returns [T, H, Dv]. Differentiable in q, k, v
    and the bias weights. bf16/fp16 inputs are computed in fp32."""
    compute = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    pos_w = rab.position_weights if rab is not None else None
    time_w = rab.time_weights if rab is not None else None
    problem = _build_problem(
        q.shape[0], q.shape[1], seq_offsets, num_targets, contextual_len, max_attn_len, alpha, silu_scale, rab, compute
    )
    weights = [w.to(compute) if w is not None else None for w in (pos_w, time_w)]
    out = _ChunkedAttention.apply(qc, kc, vc, weights[0], weights[1], problem)
    if num_targets is not None:
        out = _add_target_self_terms(out, qc, kc, vc, seq_offsets, num_targets, problem, weights[0], weights[1])
    return out.to(q.dtype)


def _build_problem(
    total: int,
    heads: int,
    seq_offsets: Tensor,
    num_targets: Optional[Tensor],
    contextual_len: int,
    max_attn_len: int,
    alpha: float,
    silu_scale: Optional[float],
    rab: Optional[RelativeBias],
    dtype: torch.dtype,
) -> _Problem:
    device = seq_offsets.device
    lengths = lengths_from_offsets(seq_offsets)
    history = history_lengths(seq_offsets, num_targets)
    padded = _padded_lengths(lengths)
    groups: List[_Group] = []
    for padded_len in torch.unique(padded[lengths > 0]).tolist():
        members = torch.nonzero(padded == padded_len).flatten()
        rows = min(padded_len, QUERY_CHUNK)
        per_seq = max(heads * rows * padded_len, 1)
        step = max(1, TILE_ELEMENTS // per_seq)
        for part in torch.split(members, step):
            groups.append(
                _group(part, seq_offsets, lengths, history, total, padded_len, rows, contextual_len, max_attn_len)
            )
    timestamps = thresholds = None
    bucketing = "log"
    if rab is not None and rab.time_weights is not None:
        ts = rab.timestamps.long()
        ts = ts - ts.min() if ts.numel() else ts
        timestamps = torch.cat([ts, ts.new_zeros(1)])
        bucketing = rab.time_bucketing
        thresholds = time_bucket_thresholds(bucketing, rab.time_weights.numel(), device)[1:-1]
    return _Problem(groups, alpha, silu_scale, contextual_len, max_attn_len, timestamps, thresholds, bucketing, dtype)


def _padded_lengths(lengths: Tensor) -> Tensor:
    """Round each length up to a multiple of max(8, 2^floor(log2 L) / 8)."""
    top = torch.floor(torch.log2(lengths.clamp(min=1).double())).long()
    granule = torch.clamp(torch.pow(2, top) // 8, min=8)
    return (lengths + granule - 1) // granule * granule


def _group(
    members: Tensor,
    seq_offsets: Tensor,
    lengths: Tensor,
    history: Tensor,
    total: int,
    padded_len: int,
    rows: int,
    contextual_len: int,
    max_attn_len: int,
) -> _Group:
    index = torch.arange(padded_len, device=seq_offsets.device)
    lens = lengths[members]
    hist = history[members]
    tokens = torch.where(index < lens[:, None], seq_offsets[members][:, None] + index, total)
    h_min, h_max = int(hist.min()), int(hist.max())
    chunks = []
    for m0 in range(0, padded_len, rows):
        m1 = min(m0 + rows, padded_len)
        hi = min(m1, h_max)
        lo = max(min(m0, h_min) - max_attn_len, 0) if max_attn_len > 0 else 0
        ctx_hi = min(contextual_len, h_max, lo)
        if hi > lo or ctx_hi > 0:
            chunks.append(_Chunk(m0, m1, ctx_hi, lo, hi))
    return _Group(tokens, lens.view(-1, 1, 1), hist.view(-1, 1, 1), chunks)


class _ChunkedAttention(torch.autograd.Function):
    """Attention of every token to the history keys it sees (targets' self term excluded)."""

    @staticmethod
    def forward(ctx, q, k, v, pos_w, time_w, problem: _Problem):  # noqa: D401
        ctx.problem = problem
        ctx.save_for_backward(q, k, v, pos_w, time_w)
        total, heads, dv = v.shape
        out = v.new_zeros(total + 1, heads, dv)
        padded = [_pad_rows(x) for x in (q, k, v)]
        for group in problem.groups:
            qg, kg, vg = (x[group.tokens].transpose(1, 2) for x in padded)  # [G, H, Lp, D]
            og = vg.new_zeros(vg.shape[:2] + (group.tokens.shape[1], dv))
            for chunk in group.chunks:
                keys = chunk.keys(q.device)
                kc, vc = (_key_slice(x, chunk, keys) for x in (kg, vg))
                weight, bias, _, _ = _tile_terms(problem, group, chunk, keys, pos_w, time_w)
                scores = torch.matmul(qg[:, :, chunk.m0 : chunk.m1] * problem.alpha, kc.transpose(-1, -2))
                if bias is not None:
                    scores += bias
                attn = F.silu(scores, inplace=True).mul_(weight)
                og[:, :, chunk.m0 : chunk.m1] = torch.matmul(attn, vc)
            out[group.tokens] = og.transpose(1, 2)
        return out[:total]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, pos_w, time_w = ctx.saved_tensors
        problem: _Problem = ctx.problem
        alpha = problem.alpha
        grads = [torch.zeros(x.shape[0] + 1, *x.shape[1:], dtype=x.dtype) for x in (q, k, v)]
        dpos = torch.zeros_like(pos_w) if ctx.needs_input_grad[3] else None
        dtime = torch.zeros_like(time_w) if ctx.needs_input_grad[4] else None
        padded = [_pad_rows(x) for x in (q, k, v, grad_out.contiguous())]
        for group in problem.groups:
            qg, kg, vg, dog = (x[group.tokens].transpose(1, 2) for x in padded)
            dqg, dkg, dvg = (torch.zeros_like(x) for x in (qg, kg, vg))
            for chunk in group.chunks:
                keys = chunk.keys(q.device)
                rows = slice(chunk.m0, chunk.m1)
                kc, vc = (_key_slice(x, chunk, keys) for x in (kg, vg))
                weight, bias, pos_idx, time_idx = _tile_terms(problem, group, chunk, keys, pos_w, time_w)
                scores = torch.matmul(qg[:, :, rows] * alpha, kc.transpose(-1, -2))
                if bias is not None:
                    scores += bias
                sig = torch.sigmoid(scores)
                silu = scores.mul_(sig)
                attn = silu * weight
                dvc = torch.matmul(attn.transpose(-1, -2), dog[:, :, rows])
                dscore = torch.matmul(dog[:, :, rows], vc.transpose(-1, -2)).mul_(weight)
                dscore.mul_(torch.addcmul(sig, silu, torch.rsub(sig, 1.0)))  # SiLU'(s) = sig + silu * (1 - sig)
                dqg[:, :, rows] += torch.matmul(dscore, kc) * alpha
                dkc = torch.matmul(dscore.transpose(-1, -2), qg[:, :, rows]) * alpha
                _add_keys(dkg, dkc, chunk, keys)
                _add_keys(dvg, dvc, chunk, keys)
                if dpos is not None or dtime is not None:
                    dbias = dscore.sum(1).flatten()
                    if dpos is not None:
                        dpos.index_add_(0, pos_idx.flatten(), dbias)
                    if dtime is not None:
                        dtime.index_add_(0, time_idx.flatten(), dbias)
            for grad, part in zip(grads, (dqg, dkg, dvg)):
                grad.index_add_(0, group.tokens.flatten(), part.transpose(1, 2).flatten(0, 1))
        dq, dk, dv = (g[:-1] for g in grads)
        return dq, dk, dv, dpos, dtime, None


def _pad_rows(x: Tensor) -> Tensor:
    """[T, ...] -> [T + 1, ...] with a zero row last (the padding token)."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def _key_slice(x: Tensor, chunk: _Chunk, keys: Optional[Tensor]) -> Tensor:
    return x[:, :, chunk.lo : chunk.hi] if keys is None else x[:, :, keys]


def _add_keys(acc: Tensor, part: Tensor, chunk: _Chunk, keys: Optional[Tensor]) -> None:
    if keys is None:
        acc[:, :, chunk.lo : chunk.hi] += part
    else:
        acc.index_add_(2, keys, part)


def _tile_terms(
    problem: _Problem,
    group: _Group,
    chunk: _Chunk,
    keys: Optional[Tensor],
    pos_w: Optional[Tensor],
    time_w: Optional[Tensor],
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Per-chunk terms shared by all heads, each [G, 1, C, K]: weight = visible * norm (history
    keys only), bias (or None), and the position / time bucket indices [G, C, K] (or None)."""
    device = group.tokens.device
    rows = torch.arange(chunk.m0, chunk.m1, device=device).view(1, -1, 1)
    cols = torch.arange(chunk.lo, chunk.hi, device=device) if keys is None else keys
    cols = cols.view(1, 1, -1)
    hist = group.history
    visible = hstu_visibility(rows, cols, group.lengths, hist, problem.contextual_len, problem.max_attn_len)
    visible &= cols < hist
    row_pos = torch.minimum(rows, hist)
    weight = visible.to(problem.dtype).mul_(silu_norm(row_pos, problem.silu_scale).to(problem.dtype))
    bias = pos_idx = time_idx = None
    if pos_w is not None:
        pos_idx = position_bucket(row_pos - torch.minimum(cols, hist), pos_w.numel())
        bias = pos_w[pos_idx]
    if time_w is not None:
        ts = problem.timestamps[group.tokens]
        col_ts = ts[:, chunk.lo : chunk.hi] if keys is None else ts[:, keys]
        delta = (ts[:, chunk.m0 : chunk.m1, None] - col_ts[:, None, :]).abs_().clamp_(min=1)
        time_idx = torch.bucketize(delta.to(torch.float32), problem.time_thresholds, right=True)
        bias = time_w[time_idx] if bias is None else bias.add_(time_w[time_idx])
    weight = weight.unsqueeze(1)
    return weight, bias.unsqueeze(1) if bias is not None else None, pos_idx, time_idx


def _add_target_self_terms(
    out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    num_targets: Tensor,
    problem: _Problem,
    pos_w: Optional[Tensor],
    time_w: Optional[Tensor],
) -> Tensor:
    """Add each target's attention to itself (its only visible target key); plain autograd."""
    idx = target_token_index(seq_offsets, num_targets)
    if idx.numel() == 0:
        return out
    logits = (q[idx] * k[idx]).sum(-1) * problem.alpha  # [N, H]
    if pos_w is not None:
        logits = logits + pos_w[0]  # same position: bucket 0
    if time_w is not None:
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        logits = logits + time_w[time_bucket(zero, problem.time_bucketing, time_w.numel())]
    owner_hist = history_lengths(seq_offsets, num_targets).repeat_interleave(num_targets.long())
    norm = silu_norm(owner_hist, problem.silu_scale).to(q.dtype)
    return out.index_add(0, idx, F.silu(logits).mul(norm[:, None]).unsqueeze(-1) * v[idx])
