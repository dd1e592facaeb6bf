"""Fast HSTU attention for CPU tensors: work proportional to sum(L_i^2), bounded memory.

Sequences are grouped by their length rounded up to 1/8 of its power of two (so padding
wastes at most ~12% per side), each group is cut into query chunks that only meet the keys
they can see (causal / window / contextual), and each chunk is one batched matmul pair over
the group. Targets are computed against history keys only; their one visible target key
(themselves) is a per-token term. Forward and backward run chunk by chunk and recompute the
scores in backward (no L x L tensor is kept), so memory stays bounded by ``TILE_ELEMENTS``.

torch.compile of the chunk functions was measured on bench/attention.py's batch and not kept:
the same CPU time per call as eager (once the time bucket is a log rather than a binary
search), for ~30 s of compiling per graph and recompiles on single-sequence groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

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
)
from gr.jagged import history_lengths, lengths_from_offsets, target_token_index

QUERY_CHUNK = 128  # query rows per chunk
TILE_ELEMENTS = 1 << 22  # score elements (all heads) per batched chunk, ~16 MB in fp32


@dataclass
class _Chunk:
    """Query rows [m0, m1) of a group against keys [0, ctx_hi) + [lo, hi) (padded indices).

    cols: [K] int64, those key indices
    """

    m0: int
    m1: int
    ctx_hi: int
    lo: int
    hi: int
    cols: Tensor

    @property
    def rows(self) -> slice:
        return slice(self.m0, self.m1)


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
    time_bucketing: str


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
        q.shape[0], q.shape[1], seq_offsets, num_targets, contextual_len, max_attn_len, alpha, silu_scale, rab
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
) -> _Problem:
    groups = _groups(total, heads, seq_offsets, num_targets, contextual_len, max_attn_len)
    timestamps = None
    bucketing = "log"
    if rab is not None and rab.time_weights is not None:
        timestamps = torch.cat([rab.timestamps.long(), rab.timestamps.new_zeros(1, dtype=torch.long)])
        bucketing = rab.time_bucketing
    return _Problem(groups, alpha, silu_scale, contextual_len, max_attn_len, timestamps, bucketing)


def score_elements(
    seq_offsets: Tensor, num_targets: Optional[Tensor], heads: int, contextual_len: int = 0, max_attn_len: int = 0
) -> int:
    """How many q.k scores this backend computes for a batch (all heads, padding included).

    seq_offsets: [B+1] int64; num_targets: [B] int64 or None
    """
    groups = _groups(int(seq_offsets[-1]), heads, seq_offsets, num_targets, contextual_len, max_attn_len)
    return _score_count(groups, heads)


def _score_count(groups: List[_Group], heads: int) -> int:
    return sum(g.tokens.shape[0] * heads * (c.m1 - c.m0) * c.cols.numel() for g in groups for c in g.chunks)


def _groups(
    total: int,
    heads: int,
    seq_offsets: Tensor,
    num_targets: Optional[Tensor],
    contextual_len: int,
    max_attn_len: int,
) -> List[_Group]:
    """Sequences of similar length, in batches of at most ``TILE_ELEMENTS`` scores per chunk."""
    lengths = lengths_from_offsets(seq_offsets)
    history = history_lengths(seq_offsets, num_targets)
    padded = _padded_lengths(lengths)
    groups: List[_Group] = []
    for padded_len in torch.unique(padded[lengths > 0]).tolist():
        members = torch.nonzero(padded == padded_len).flatten()
        rows = min(padded_len, QUERY_CHUNK)
        step = max(1, TILE_ELEMENTS // (heads * rows * padded_len))
        for part in torch.split(members, step):
            groups.append(
                _group(part, seq_offsets, lengths, history, total, padded_len, rows, contextual_len, max_attn_len)
            )
    return groups


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
            cols = torch.cat([torch.arange(0, ctx_hi, device=index.device), torch.arange(lo, hi, device=index.device)])
            chunks.append(_Chunk(m0, m1, ctx_hi, lo, hi, cols))
    return _Group(tokens, lens.view(-1, 1, 1), hist.view(-1, 1, 1), chunks)


class _ChunkedAttention(torch.autograd.Function):
    """Attention of every token to the history keys it sees (targets' self term excluded)."""

    @staticmethod
    def forward(ctx, q, k, v, pos_w, time_w, problem: _Problem):
        ctx.problem = problem
        ctx.save_for_backward(q, k, v, pos_w, time_w)
        total, heads, dim_v = v.shape
        out = v.new_zeros(total + 1, heads, dim_v)
        padded = [_pad_rows(x) for x in (q, k, v)]
        for group in problem.groups:
            qg, kg, vg = (x[group.tokens].transpose(1, 2) for x in padded)  # [G, H, Lp, D]
            og = vg.new_zeros(vg.shape[:2] + (group.tokens.shape[1], dim_v))
            for chunk in group.chunks:
                context = _tile_context(problem, group, chunk, pos_w, time_w)
                og[:, :, chunk.rows] = _forward_tile(qg[:, :, chunk.rows], *_key_part(chunk, kg, vg), context)
            out[group.tokens] = og.transpose(1, 2)
        return out[:total]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, pos_w, time_w = ctx.saved_tensors
        problem: _Problem = ctx.problem
        grads = [x.new_zeros(x.shape[0] + 1, *x.shape[1:]) for x in (q, k, v)]
        dpos = torch.zeros_like(pos_w) if ctx.needs_input_grad[3] else None
        dtime = torch.zeros_like(time_w) if ctx.needs_input_grad[4] else None
        padded = [_pad_rows(x) for x in (q, k, v, grad_out.contiguous())]
        for group in problem.groups:
            qg, kg, vg, dog = (x[group.tokens].transpose(1, 2) for x in padded)
            dqg, dkg, dvg = (torch.zeros_like(x) for x in (qg, kg, vg))
            for chunk in group.chunks:
                context = _tile_context(problem, group, chunk, pos_w, time_w)
                dq, dk, dv, dbias_pos, dbias_time = _backward_tile(
                    qg[:, :, chunk.rows], *_key_part(chunk, kg, vg), dog[:, :, chunk.rows], context
                )
                dqg[:, :, chunk.rows] += dq
                _add_keys(dkg, dk, chunk)
                _add_keys(dvg, dv, chunk)
                if dpos is not None:
                    dpos += dbias_pos
                if dtime is not None:
                    dtime += dbias_time
            for grad, part in zip(grads, (dqg, dkg, dvg)):
                grad.index_add_(0, group.tokens.flatten(), part.transpose(1, 2).flatten(0, 1))
        dq, dk, dv = (g[:-1] for g in grads)
        return dq, dk, dv, dpos, dtime, None


def _pad_rows(x: Tensor) -> Tensor:
    """[T, ...] -> [T + 1, ...] with a zero row last (the padding token)."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def _key_part(chunk: _Chunk, *xs: Tensor) -> Tuple[Tensor, ...]:
    """The chunk's keys of each [G, H, Lp, D] tensor."""
    return tuple(x[:, :, chunk.lo : chunk.hi] if chunk.ctx_hi == 0 else x[:, :, chunk.cols] for x in xs)


def _add_keys(acc: Tensor, part: Tensor, chunk: _Chunk) -> None:
    if chunk.ctx_hi == 0:
        acc[:, :, chunk.lo : chunk.hi] += part
    else:
        acc.index_add_(2, chunk.cols, part)


class _TileContext(NamedTuple):
    """What one tile needs besides q, k, v (and grad_out).

    rows: [C], cols: [K] int64 indices in the padded sequences; lengths, history: [G, 1, 1];
    row_ts: [G, C], col_ts: [G, K] int64 (None without time bias).
    """

    rows: Tensor
    cols: Tensor
    lengths: Tensor
    history: Tensor
    row_ts: Optional[Tensor]
    col_ts: Optional[Tensor]
    pos_w: Optional[Tensor]
    time_w: Optional[Tensor]
    time_bucketing: str
    alpha: float
    silu_scale: Optional[float]
    contextual_len: int
    max_attn_len: int


def _tile_context(
    problem: _Problem, group: _Group, chunk: _Chunk, pos_w: Optional[Tensor], time_w: Optional[Tensor]
) -> _TileContext:
    row_ts = col_ts = None
    if time_w is not None:
        ts = problem.timestamps[group.tokens]
        row_ts, col_ts = ts[:, chunk.rows], ts[:, chunk.cols]
    rows = torch.arange(chunk.m0, chunk.m1, device=chunk.cols.device)
    return _TileContext(
        rows, chunk.cols, group.lengths, group.history, row_ts, col_ts, pos_w, time_w, problem.time_bucketing,
        problem.alpha, problem.silu_scale, problem.contextual_len, problem.max_attn_len,
    )


def _tile_scores(q: Tensor, k: Tensor, c: _TileContext) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """One tile's pre-activation scores and what multiplies SiLU of them.

    q: [G, H, C, Dqk], k: [G, H, K, Dqk] -> scores [G, H, C, K] = alpha q.k + bias, weight
    [G, 1, C, K] = visible * norm over history keys, and the position / time bucket indices
    [G, C, K] (None when off).
    """
    rows, cols, hist = c.rows.view(1, -1, 1), c.cols.view(1, 1, -1), c.history
    visible = hstu_visibility(rows, cols, c.lengths, hist, c.contextual_len, c.max_attn_len) & (cols < hist)
    row_pos = torch.minimum(rows, hist)
    weight = visible.to(q.dtype) * silu_norm(row_pos, c.silu_scale).to(q.dtype)
    scores = torch.matmul(q * c.alpha, k.transpose(-1, -2))
    pos_idx = time_idx = None
    if c.pos_w is not None:
        pos_idx = position_bucket(row_pos - torch.minimum(cols, hist), c.pos_w.numel())
        scores = scores + c.pos_w[pos_idx].unsqueeze(1)
    if c.time_w is not None:
        time_idx = time_bucket(c.row_ts[:, :, None] - c.col_ts[:, None, :], c.time_bucketing, c.time_w.numel())
        scores = scores + c.time_w[time_idx].unsqueeze(1)
    return scores, weight.unsqueeze(1), pos_idx, time_idx


def _forward_tile(q: Tensor, k: Tensor, v: Tensor, c: _TileContext) -> Tensor:
    """v: [G, H, K, Dv] -> [G, H, C, Dv]."""
    scores, weight, _, _ = _tile_scores(q, k, c)
    return torch.matmul(F.silu(scores) * weight, v)


def _backward_tile(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, c: _TileContext) -> tuple:
    """grad_out: [G, H, C, Dv] -> dq, dk, dv of the tile and the bias weights' gradients (or None)."""
    scores, weight, pos_idx, time_idx = _tile_scores(q, k, c)
    sig = torch.sigmoid(scores)
    silu = scores * sig
    dv = torch.matmul((silu * weight).transpose(-1, -2), grad_out)
    dscores = torch.matmul(grad_out, v.transpose(-1, -2)) * weight * (sig + silu * (1 - sig))  # SiLU'
    dq = torch.matmul(dscores, k) * c.alpha
    dk = torch.matmul(dscores.transpose(-1, -2), q) * c.alpha
    dbias = dscores.sum(1).flatten()
    dpos = dtime = None
    if pos_idx is not None:
        dpos = dscores.new_zeros(c.pos_w.numel()).index_add_(0, pos_idx.flatten(), dbias)
    if time_idx is not None:
        dtime = dscores.new_zeros(c.time_w.numel()).index_add_(0, time_idx.flatten(), dbias)
    return dq, dk, dv, dpos, dtime


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
