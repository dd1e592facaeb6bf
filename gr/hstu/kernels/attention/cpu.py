"""Fast HSTU attention for CPU tensors: work proportional to sum(L_i^2), bounded memory.

Sequences are grouped by their length rounded up to 1/8 of its power of two, at least 32 (so
padding wastes at most ~12% per side beyond 256 tokens; shorter sequences trade some padding
for fewer, larger chunk calls, whose fixed cost dominates there), each group is cut into query
chunks that only meet the keys they can see (causal / window / contextual), and each chunk is
one batched matmul pair over the group. Targets are computed against history keys only; their one visible target key
(themselves) is a per-token term. Forward and backward run chunk by chunk and recompute the
scores in backward (no L x L tensor is kept), so memory stays bounded by ``TILE_ELEMENTS``.

Per score the work is the two matmuls plus a few elementwise passes, kept few on purpose:
padding needs no mask (its q, k, v and output-gradient rows are zeros, so it adds nothing
and what it receives is dropped); the visibility mask is applied only to the key columns of
a chunk that some query may not see (the diagonal block when causal); the SiLU normaliser is
per query, so it scales the chunk's output (and output gradient) rows, not the scores; the
bias is added by the q.k matmul itself (``baddbmm``); bias and mask of groups without targets
are computed once for all their sequences.

What depends only on the batch (groups, chunks, masks, normalisers, bias bucket indices) is
built once per batch: backward reuses forward's, and with an ``AttentionWorkspace`` (which
``HSTU.forward`` passes to every layer) the other layers reuse the first layer's, so only the
bias weights are read per layer.

Where they build (x86-64 with a C++ compiler; ``gr.ops.native``), fused tiles run the chunks
instead: one C++ call for all of a batch's chunks (its threads get equal work, not equal counts of
sequences) reads the jagged q, k, v rows in place (no padded copies), makes each (sequence, head)'s
scores 32 query rows at a time with only the keys those rows see, and does bias, SiLU, mask,
normaliser, the SiLU gradient and the bias-gradient scatter while the tile is in cache, between
GEMMs (gr/ops/csrc/gr_gemm.h). They compute in fp32 (bf16 inputs are widened once), their GEMMs in bf16
math under CPU autocast to bf16 (``gr.ops.native.cpu_bf16_math``: bf16-rounded operands, fp32 sums). Chunks whose keys
are the contextual prefix plus a window (``contextual_len`` and ``max_attn_len`` both set) run
unfused.

Time deltas are taken in int32 (timestamps relative to the batch's earliest, int64 when they
span 2^31 s or more) and bias weights are read with ``index_select``, several times cheaper
here than int64 deltas and advanced indexing.

Unfused, bf16 inputs are multiplied in bf16 (oneDNN accumulates in fp32); bias lookups and gradients and
the k/v gradients summed over query chunks stay fp32.

torch.compile is not used: the chunks' shapes vary with every batch (recompiles, or dynamic
kernels) and a compile costs tens of seconds on the first call, which small serving calls must
not pay. Compiling the layer's projections and output (``dynamic=True``) around this kernel was
measured slower than eager on the ML-1M recipe (74 vs 62 ms per HSTU forward + backward,
docs/training_performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from gr.hstu.kernels.attention.common import (
    AttentionCall,
    AttentionWorkspace,
    RelativeBias,
    hstu_visibility,
    position_bucket,
    rebased_times,
    silu_norm,
    time_bucket,
    time_bucket_thresholds,
)
from gr.jagged import history_lengths, lengths_from_offsets, target_token_index
from gr.ops.native import cpu_bf16_math, native_ops

QUERY_CHUNK = 128  # query rows per chunk
ROW_BLOCK = 32  # query rows per block of the fused tiles (ROW_BLOCK of cpu_fused_attention.cpp)
TILE_ELEMENTS = 1 << 22  # score elements (all heads) per batched chunk, ~16 MB in fp32
MIN_GRANULE = 32  # lengths are padded to a multiple of at least this
# Index and mask elements of a batch's layouts kept for reuse (~128 MB): past it (very long
# histories) a chunk's layout is rebuilt on every use, so memory stays bounded as before.
LAYOUT_CACHE_ELEMENTS = 1 << 24
# Floats of a layer's attention tiles (weights and SiLU' per score element) that the fused forward
# keeps for backward (32 MiB), which then does not compute the scores again; past it they are made again.
SAVED_TILE_FLOATS = 1 << 23
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # computed in fp32; float64 runs unfused


@dataclass
class _Chunk:
    """Query rows [m0, m1) of a group against the keys ``cols`` (padded indices).

    cols: [K] int64, keys [0, ctx_hi) then [lo, hi)
    mask_from: first of the K key columns that some query of the chunk may not see (K: none)
    """

    m0: int
    m1: int
    ctx_hi: int
    lo: int
    hi: int
    cols: Tensor
    mask_from: int

    @property
    def rows(self) -> slice:
        return slice(self.m0, self.m1)


@dataclass
class _Group:
    """Sequences padded to one length ``tokens.shape[1]``.

    tokens: [G, Lp] int64 flat token index, T (a zero row) for padding
    lengths, history: [G, 1, 1] int64 when some sequence of the group has targets, else
    [1, 1, 1] = Lp, so that masks and position buckets are computed once for the group
    starts, sizes: [G] int64 each sequence's first token and its length (the fused tiles read
    the jagged rows in place)
    """

    tokens: Tensor
    lengths: Tensor
    history: Tensor
    chunks: List[_Chunk]
    starts: Tensor
    sizes: Tensor

    @property
    def without_targets(self) -> bool:
        """No sequence of the group has targets: lengths and history are one shared [1, 1, 1] = Lp."""
        return self.history is self.lengths


@dataclass
class _Problem:
    """Everything the chunks need besides q, k, v and the bias weights."""

    groups: List[_Group]
    alpha: float
    silu_scale: Optional[float]
    contextual_len: int
    max_attn_len: int
    timestamps: Optional[Tensor]  # [T + 1] int32 (int64 if they span >= 2^31 s), padding row last
    query_times: Optional[Tensor]  # [T + 1] like timestamps: when each query is asked
    time_bucketing: str
    layouts: Dict[Tuple[int, int, int, int, torch.dtype, bool], "_Layout"] = field(default_factory=dict)
    cached_elements: int = 0
    fused_calls: Dict[Tuple[int, int], List[tuple]] = field(default_factory=dict)  # see _fused_calls

    @property
    def fusable(self) -> bool:
        """Whether the fused tiles can run it: each chunk's keys are one range (not the contextual
        keys plus a window's)."""
        return all(chunk.ctx_hi == 0 for group in self.groups for chunk in group.chunks)

    def layout(
        self,
        group_index: int,
        chunk_index: int,
        pos_buckets: int,
        time_buckets: int,
        dtype: torch.dtype,
        fused: Optional[Any] = None,
    ) -> "_Layout":
        """The layout of one chunk of one group (0 buckets: that bias part is off), built on first
        use and kept while the kept layouts hold at most ``LAYOUT_CACHE_ELEMENTS`` elements.
        fused: the fused tiles' ops, for a layout in their form (int32 indices)."""
        key = _layout_key(group_index, chunk_index, pos_buckets, time_buckets, dtype, fused is not None)
        if key in self.layouts:
            return self.layouts[key]
        group = self.groups[group_index]
        layout = _Layout(self, group, group.chunks[chunk_index], pos_buckets, time_buckets, dtype, fused)
        if self.cached_elements + layout.elements <= LAYOUT_CACHE_ELEMENTS:
            self.layouts[key] = layout
            self.cached_elements += layout.elements
        return layout


def _layout_key(
    group_index: int, chunk_index: int, pos_buckets: int, time_buckets: int, dtype: torch.dtype, fused: bool
) -> Tuple[int, int, int, int, torch.dtype, bool]:
    """A layout's key in ``_Problem.layouts``."""
    return group_index, chunk_index, pos_buckets, time_buckets, dtype, fused


def cpu_hstu_attention(call: AttentionCall, *, workspace: Optional[AttentionWorkspace] = None) -> Tensor:
    """See ``gr.hstu.kernels.attention.hstu_attention``; returns [T, H, Dv]. Differentiable in q, k, v
    and the bias weights. fp16 inputs are computed in fp32. Fused, bf16 inputs are widened to fp32
    and the GEMMs run in bf16 math under bf16 autocast; unfused, bf16 inputs stay bf16 through the
    matmuls (which accumulate in fp32); the bias weights' lookups and gradients, the gradients
    of k and v summed over query chunks, and the normaliser's reciprocal stay fp32.

    workspace: the batch's ``AttentionWorkspace``: the groups, chunks, masks and bias bucket
    indices are then computed by the first layer and reused by the others and by backward."""
    q, k, v, seq_offsets, num_targets, rab = call.q, call.k, call.v, call.seq_offsets, call.num_targets, call.rab
    pos_w = rab.position_weights if rab is not None else None
    time_w = rab.time_weights if rab is not None else None

    def build() -> _Problem:
        return _build_problem(q.shape[0], q.shape[1], call)

    problem = build() if workspace is None else workspace.get("cpu", seq_offsets, build)
    fused = native_ops("gr_cpu_fused") if problem.fusable and q.dtype in FUSED_DTYPES else None
    if fused is not None:
        weights = [w.float().contiguous() if w is not None else None for w in (pos_w, time_w)]
        # Tiles are kept only for a backward to come (not in evaluation or serving, under no_grad).
        keep_tiles = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, *weights))
        out = _FusedAttention.apply(q, k, v, weights[0], weights[1], problem, fused, keep_tiles, cpu_bf16_math())
    else:
        compute = torch.float32 if q.dtype == torch.float16 else q.dtype
        qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
        bias_dtype = torch.float32 if compute == torch.bfloat16 else compute
        weights = [w.to(bias_dtype) if w is not None else None for w in (pos_w, time_w)]
        out = _ChunkedAttention.apply(qc, kc, vc, weights[0], weights[1], problem)
    if num_targets is not None:
        if fused is not None:
            qc, kc, vc = q.float(), k.float(), v.float()  # as the fused tiles compute (no copy when fp32)
        out = _add_target_self_terms(out, qc, kc, vc, seq_offsets, num_targets, problem, weights[0], weights[1])
    return out.to(q.dtype)


def _build_problem(total: int, heads: int, call: AttentionCall) -> _Problem:
    contextual_len, max_attn_len, rab = call.contextual_len, call.max_attn_len, call.rab
    groups = sequence_groups(total, heads, call.seq_offsets, call.num_targets, contextual_len, max_attn_len)
    timestamps = query_times = None
    bucketing = "log"
    if rab is not None and rab.time_weights is not None:
        timestamps, query_times = _relative_timestamps(rab)
        bucketing = rab.time_bucketing
    alpha, silu_scale = call.alpha, call.silu_scale
    return _Problem(groups, alpha, silu_scale, contextual_len, max_attn_len, timestamps, query_times, bucketing)


def _relative_timestamps(rab: RelativeBias) -> Tuple[Tensor, Tensor]:
    """-> (key timestamps, query times), each [T + 1] seconds since the earliest of both, zero row
    last; int32 when they fit, which halves the memory traffic of the per-pair time deltas
    (differences stay exact). One tensor twice when the queries use the tokens' own times."""
    assert rab.timestamps is not None  # RelativeBias: set with time_weights
    keys, queries = rebased_times(rab, rab.timestamps.device)
    span = max(int(keys.max()), int(queries.max())) if keys.numel() else 0
    dtype = torch.int32 if span < 2**31 else torch.int64

    def padded(times: Tensor) -> Tensor:
        return torch.cat([times, times.new_zeros(1)]).to(dtype)

    key_times = padded(keys)
    return key_times, key_times if queries is keys else padded(queries)


def sequence_groups(
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
    padded = padded_lengths(lengths)
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


def padded_lengths(lengths: Tensor) -> Tensor:
    """Round each length up to a multiple of max(MIN_GRANULE, 2^floor(log2 L) / 8)."""
    top = torch.floor(torch.log2(lengths.clamp(min=1).double())).long()
    granule = torch.clamp(torch.pow(2, top) // 8, min=MIN_GRANULE)
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
    with_targets = bool((hist < lens).any())
    # Without targets a sequence's rows and keys past its length are padding (zero rows, which the
    # fused tiles skip), so the chunks are cut as if every sequence had the padded length: then
    # they depend on no batch data and batches share their layouts (``_shared_positions``).
    h_min, h_max = (int(hist.min()), int(hist.max())) if with_targets else (padded_len, padded_len)
    chunks = []
    for m0 in range(0, padded_len, rows):
        m1 = min(m0 + rows, padded_len)
        hi = min(m1, h_max)
        lo = max(min(m0, h_min) - max_attn_len, 0) if max_attn_len > 0 else 0
        ctx_hi = min(contextual_len, h_max, lo)
        if hi > lo or ctx_hi > 0:
            # without a window, every query row >= m0 sees all history keys < min(m0, h_min)
            mask_from = min(m0, h_min, hi) if max_attn_len == 0 else 0
            chunks.append(_Chunk(m0, m1, ctx_hi, lo, hi, _key_columns(ctx_hi, lo, hi, index.device), mask_from))
    starts = seq_offsets[members].contiguous()
    if with_targets:
        return _Group(tokens, lens.view(-1, 1, 1), hist.view(-1, 1, 1), chunks, starts, lens.contiguous())
    shared = _one_length(padded_len, index.device)
    return _Group(tokens, shared, shared, chunks, starts, lens.contiguous())


def _key_columns(ctx_hi: int, lo: int, hi: int, device: torch.device) -> Tensor:
    """A chunk's keys: [K] int64, [0, ctx_hi) then [lo, hi)."""
    return torch.cat([torch.arange(0, ctx_hi, device=device), torch.arange(lo, hi, device=device)])


def _one_length(padded_len: int, device: torch.device) -> Tensor:
    """The lengths and history of a group without targets: one [1, 1, 1] = its padded length."""
    return torch.full((1, 1, 1), padded_len, device=device)


class _Layout:
    """What one chunk of one group needs besides the weights: the same for every layer on a batch.

    norm: [G or 1, 1, C, 1]; mask: [G or 1, 1, C, K - mask_from] or None (both in the compute
    dtype); pos_idx: [G or 1, C, K], time_idx: [G, C, K] bucket indices (int64 for ``scatter_add_``) or None;
    for the fused tiles instead row_pos: [G or 1, C] int32 query positions (a key's position bucket
    is the difference), time_idx in uint8 (int32 past 256 buckets), bucketed by their ops in one
    pass (pairs no query sees: bucket 0), and with a mask row_end: [G or 1, C] int64, 1 + the last
    key column each query sees.
    """

    def __init__(
        self,
        problem: _Problem,
        group: _Group,
        chunk: _Chunk,
        pos_buckets: int,
        time_buckets: int,
        dtype: torch.dtype,
        fused: Optional[Any] = None,
    ) -> None:
        fusing = fused is not None
        numbers = (problem.contextual_len, problem.max_attn_len, problem.silu_scale, pos_buckets, dtype, fusing)
        if group.without_targets and chunk.cols.device.type == "cpu":  # batches share it
            c, padded_len = chunk, group.tokens.shape[1]
            positions = _shared_positions(padded_len, c.m0, c.m1, c.ctx_hi, c.lo, c.hi, c.mask_from, *numbers)
        else:
            positions = _positions(chunk, group.lengths, group.history, *numbers)
        self.norm, self.mask, self.row_end, self.row_pos, self.pos_idx = positions
        self.time_idx = None
        if time_buckets and fused is not None:  # a fusable chunk's keys are the range [lo, hi)
            query_ts, key_ts = (t.long().contiguous() for t in _group_times(problem, group))
            thresholds = time_bucket_thresholds(problem.time_bucketing, time_buckets, query_ts.device)
            self.time_idx = fused.time_buckets(
                query_ts, key_ts, group.sizes, chunk.m0, chunk.m1, chunk.lo, chunk.hi, problem.contextual_len,
                thresholds, problem.time_bucketing == "sqrt",
            )  # fmt: skip
        elif time_buckets:
            query_ts, key_ts = _group_times(problem, group)
            delta = query_ts[:, chunk.rows, None] - key_ts[:, None, chunk.cols]
            self.time_idx = time_bucket(delta, problem.time_bucketing, time_buckets)
        parts = (self.norm, self.mask, self.row_end, self.row_pos, self.pos_idx, self.time_idx)
        self.elements = sum(t.numel() for t in parts if t is not None)


_Positions = Tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]


def _positions(
    chunk: _Chunk,
    lengths: Tensor,
    history: Tensor,
    contextual_len: int,
    max_attn_len: int,
    silu_scale: Optional[float],
    pos_buckets: int,
    dtype: torch.dtype,
    fused: bool,
) -> _Positions:
    """The parts of a chunk's ``_Layout`` that depend on positions only: (norm, mask, row_end,
    row_pos, pos_idx); lengths, history: the group's (``_Group``)."""
    rows = torch.arange(chunk.m0, chunk.m1, device=chunk.cols.device).view(1, -1, 1)
    cols = chunk.cols.view(1, 1, -1)
    row_pos = torch.minimum(rows, history)
    norm = silu_norm(row_pos, silu_scale).to(dtype).unsqueeze(1)
    mask = row_end = pos_idx = query_positions = None
    if chunk.mask_from < cols.shape[-1]:
        part = cols[..., chunk.mask_from :]
        visible = hstu_visibility(rows, part, lengths, history, contextual_len, max_attn_len) & (part < history)
        mask = visible.to(dtype).unsqueeze(1)
        if fused:
            last_seen = torch.where(visible, torch.arange(1, part.shape[-1] + 1, device=part.device), 0).amax(-1)
            row_end = (chunk.mask_from + last_seen).view(-1, rows.shape[1])
    if pos_buckets and fused:  # the tiles take each key's bucket from the query's position
        query_positions = row_pos.view(-1, row_pos.shape[1]).to(torch.int32)
    elif pos_buckets:
        pos_idx = position_bucket(row_pos - torch.minimum(cols, history), pos_buckets)
    return norm, mask, row_end, query_positions, pos_idx


@lru_cache(maxsize=256)
def _shared_positions(
    padded_len: int,
    m0: int,
    m1: int,
    ctx_hi: int,
    lo: int,
    hi: int,
    mask_from: int,
    contextual_len: int,
    max_attn_len: int,
    silu_scale: Optional[float],
    pos_buckets: int,
    dtype: torch.dtype,
    fused: bool,
) -> _Positions:
    """``_positions`` of a chunk of a group without targets (on CPU), which depend on the batch only
    through these numbers: batches of the ML-1M recipe meet ~10 such chunks, so they are made once
    instead of on every batch (~0.6 ms a step). Callers must not modify them."""
    cpu = torch.device("cpu")
    shared = _one_length(padded_len, cpu)
    chunk = _Chunk(m0, m1, ctx_hi, lo, hi, _key_columns(ctx_hi, lo, hi, cpu), mask_from)
    return _positions(chunk, shared, shared, contextual_len, max_attn_len, silu_scale, pos_buckets, dtype, fused)


class _Tile:
    """One chunk of one group in one layer: its layout and that layer's bias [G or 1, 1, C, K] or None."""

    def __init__(
        self,
        problem: _Problem,
        group_index: int,
        chunk_index: int,
        pos_w: Optional[Tensor],
        time_w: Optional[Tensor],
        dtype: torch.dtype,
    ) -> None:
        self.chunk = problem.groups[group_index].chunks[chunk_index]
        sizes = (pos_w.numel() if pos_w is not None else 0, time_w.numel() if time_w is not None else 0)
        layout = problem.layout(group_index, chunk_index, *sizes, dtype)
        self.norm, self.mask, self.pos_idx, self.time_idx = layout.norm, layout.mask, layout.pos_idx, layout.time_idx
        bias = None
        if pos_w is not None:
            assert self.pos_idx is not None  # the layout has the indices of each bias part that is on
            bias = _lookup(pos_w, self.pos_idx)
        if time_w is not None:
            assert self.time_idx is not None
            time_bias = _lookup(time_w, self.time_idx)
            bias = time_bias if bias is None else time_bias.add_(bias)
        self.bias = bias.to(dtype).unsqueeze(1) if bias is not None else None

    def keys(self, *xs: Tensor) -> Tuple[Tensor, ...]:
        """The chunk's keys of each [G, H, Lp, D] tensor."""
        c = self.chunk
        return tuple(x[:, :, c.lo : c.hi] if c.ctx_hi == 0 else x[:, :, c.cols] for x in xs)

    def add_keys(self, acc: Tensor, part: Tensor) -> None:
        """acc[:, :, keys] += part, for acc [G, H, Lp, D] and part [G, H, K, D]."""
        c = self.chunk
        if c.ctx_hi == 0:
            acc[:, :, c.lo : c.hi] += part
        else:
            acc.index_add_(2, c.cols, part)

    def scores(self, q: Tensor, k: Tensor) -> Tensor:
        """q: [G, H, C, D] (alpha applied), k: [G, H, K, D] -> q.k + bias: [G, H, C, K]."""
        if self.bias is None:
            return torch.matmul(q, k.transpose(-1, -2))
        g, h, c, d = q.shape
        out = self.bias.expand(g, h, c, k.shape[2]).contiguous()
        out.view(g * h, c, -1).baddbmm_(q.reshape(g * h, c, d), k.reshape(g * h, -1, d).transpose(1, 2))
        return out

    def apply_mask(self, x: Tensor) -> Tensor:
        """Zero, in place, the entries of x [G, H, C, K] whose query does not see the key."""
        if self.mask is not None:
            x[..., self.chunk.mask_from :].mul_(self.mask)
        return x


class _ChunkedAttention(torch.autograd.Function):
    """Attention of every token to the history keys it sees (targets' self term excluded)."""

    @staticmethod
    def forward(ctx, q, k, v, pos_w, time_w, problem: _Problem):
        ctx.problem = problem
        ctx.save_for_backward(q, k, v, pos_w, time_w)
        total, heads, dim_v = v.shape
        out = v.new_zeros(total + 1, heads, dim_v)
        padded = [_pad_rows(x) for x in (q * problem.alpha, k, v)]
        for gi, group in enumerate(problem.groups):
            qg, kg, vg = (_gather_group(x, group) for x in padded)  # [G, H, Lp, D]
            og = vg.new_zeros(vg.shape[:2] + (group.tokens.shape[1], dim_v))
            for ci, chunk in enumerate(group.chunks):
                tile = _Tile(problem, gi, ci, pos_w, time_w, q.dtype)
                kk, vv = tile.keys(kg, vg)
                weights = tile.apply_mask(F.silu(tile.scores(qg[:, :, chunk.rows], kk), inplace=True))
                og[:, :, chunk.rows] = torch.matmul(weights, vv).mul_(tile.norm)
            out[group.tokens] = og.transpose(1, 2)
        return out[:total]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        q, k, v, pos_w, time_w = ctx.saved_tensors
        problem: _Problem = ctx.problem
        alpha = problem.alpha
        grads = [x.new_zeros(x.shape[0] + 1, *x.shape[1:]) for x in (q, k, v)]
        dpos = torch.zeros_like(pos_w) if ctx.needs_input_grad[3] else None
        dtime = torch.zeros_like(time_w) if ctx.needs_input_grad[4] else None
        padded = [_pad_rows(x) for x in (q * alpha, k, v, grad_out)]
        for gi, group in enumerate(problem.groups):
            qg, kg, vg, dog = (_gather_group(x, group) for x in padded)
            dqg = torch.zeros_like(qg)
            dkg, dvg = (torch.zeros_like(x, dtype=_accumulation(x.dtype)) for x in (kg, vg))  # summed over chunks
            for ci, chunk in enumerate(group.chunks):
                tile = _Tile(problem, gi, ci, pos_w, time_w, q.dtype)
                kk, vv = tile.keys(kg, vg)
                qq, g = qg[:, :, chunk.rows], dog[:, :, chunk.rows] * tile.norm
                scores = tile.scores(qq, kk)
                tile.add_keys(dvg, torch.matmul(tile.apply_mask(F.silu(scores)).transpose(-1, -2), g).to(dvg.dtype))
                dweights = tile.apply_mask(torch.matmul(g, vv.transpose(-1, -2)))
                dscores = torch.ops.aten.silu_backward(dweights, scores)
                dqg[:, :, chunk.rows] = torch.matmul(dscores, kk).mul_(alpha)
                tile.add_keys(dkg, torch.matmul(dscores.transpose(-1, -2), qq).to(dkg.dtype))
                bias_grad = dpos if dpos is not None else dtime
                if bias_grad is not None:  # its dtype: fp32 for bf16 inputs
                    _add_bias_grads(tile, dscores.sum(1, dtype=bias_grad.dtype), dpos, dtime)
            for grad, part in zip(grads, (dqg, dkg, dvg)):
                grad[group.tokens] = part.transpose(1, 2).to(grad.dtype)  # each token is in one group; padding -> row T
        dq, dk, dv = (g[:-1] for g in grads)
        return dq, dk, dv, dpos, dtime, None


class _FusedAttention(torch.autograd.Function):
    """``_ChunkedAttention`` in fp32 by the fused tiles (``gr.ops.native``): each chunk is one
    call that reads the jagged q, k, v rows in place (no padded copies) and writes out, dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v, pos_w, time_w, problem: _Problem, ops, keep_tiles: bool, bf16: bool):
        """q, k: [T, H, Da], v: [T, H, Dv] fp32, bf16 or fp16 (strided, e.g. split from one projection:
        kept as they are for backward) -> [T, H, Dv] fp32. keep_tiles: keep the tiles for backward
        (up to ``SAVED_TILE_FLOATS``) instead of computing them again there. bf16: the GEMMs in bf16
        math (``gr.ops.native.cpu_bf16_math``), forward and backward."""
        ctx.problem, ctx.ops, ctx.bf16 = problem, ops, bf16
        qf, kf, vf = (_fp32_rows(x) for x in (q, k, v))
        calls = _fused_calls(problem, pos_w, time_w, ops)
        written = _writes_every_row(problem, calls)
        out = _new_rows(vf.shape, written)
        # One call's tiles are kept for backward when they fit SAVED_TILE_FLOATS (an empty tensor if not;
        # a batch whose queries see no key has no call at all).
        save_limit = SAVED_TILE_FLOATS if keep_tiles and len(calls) == 1 else 0
        tiles = [
            ops.forward_chunks(qf, kf, vf, out, pos_w, time_w, problem.alpha, written, save_limit, *chunks, bf16=bf16)
            for chunks in calls
        ]
        ctx.save_for_backward(q, k, v, pos_w, time_w, tiles[0] if save_limit and tiles[0].numel() else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        q, k, v, pos_w, time_w, tiles = ctx.saved_tensors
        problem: _Problem = ctx.problem
        qf, kf, vf = (_fp32_rows(x) for x in (q, k, v))
        calls = _fused_calls(problem, pos_w, time_w, ctx.ops)
        written = _writes_every_row(problem, calls)
        dq, dk, dv = (_new_rows(x.shape, written) for x in (q, k, v))
        dpos = torch.zeros_like(pos_w) if ctx.needs_input_grad[3] else None
        dtime = torch.zeros_like(time_w) if ctx.needs_input_grad[4] else None
        grad_out = _fp32_rows(grad_out)
        grads = (dq, dk, dv, pos_w, time_w, dpos, dtime, tiles)
        for chunks in calls:
            ctx.ops.backward_chunks(qf, kf, vf, grad_out, *grads, problem.alpha, written, *chunks, bf16=ctx.bf16)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dpos, dtime, None, None, None, None


def _fp32_rows(x: Tensor) -> Tensor:
    """x [T, H, D] as fp32 with a contiguous last dimension: x itself when it already is one."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def _fused_calls(problem: _Problem, pos_w: Optional[Tensor], time_w: Optional[Tensor], ops) -> List[tuple]:
    """The chunk lists of each ``forward_chunks`` / ``backward_chunks`` call (their arguments after
    alpha): one call for the batch's chunks while their layouts hold at most ``LAYOUT_CACHE_ELEMENTS``
    elements (the call spreads all the batch's sequences over the threads by their work), else
    several calls of at most that many (long histories: memory stays bounded as before). Kept in
    the problem for the other layers and backward when every layout is."""
    sizes = (pos_w.numel() if pos_w is not None else 0, time_w.numel() if time_w is not None else 0)
    if sizes in problem.fused_calls:
        return problem.fused_calls[sizes]
    batch: List[Tuple[int, _Chunk, _Layout]]
    calls, batch, elements, all_kept = [], [], 0, True
    for gi, group in enumerate(problem.groups):
        for ci, chunk in enumerate(group.chunks):
            layout = problem.layout(gi, ci, *sizes, torch.float32, ops)
            all_kept = all_kept and problem.layouts.get(_layout_key(gi, ci, *sizes, torch.float32, True)) is layout
            if batch and elements + layout.elements > LAYOUT_CACHE_ELEMENTS:
                calls.append(_chunk_lists(problem, batch, pos_w is not None, time_w is not None))
                batch, elements = [], 0
            batch.append((gi, chunk, layout))
            elements += layout.elements
    if batch:
        calls.append(_chunk_lists(problem, batch, pos_w is not None, time_w is not None))
    if all_kept:
        problem.fused_calls[sizes] = calls
    return calls


def _writes_every_row(problem: _Problem, calls: List[tuple]) -> bool:
    """Whether the fused ops can write every row of out, dq, dk and dv themselves (zeros where no
    key is seen), so that those start uninitialised: one call, and the chunks of every group hold
    all its query rows (a chunk whose queries see no key is not made)."""
    return len(calls) == 1 and all(
        sum(c.m1 - c.m0 for c in group.chunks) == group.tokens.shape[1] for group in problem.groups
    )


def _new_rows(shape: torch.Size, written: bool) -> Tensor:
    """fp32 for the fused ops' out, dq, dk or dv: uninitialised when the ops write every row
    (``_writes_every_row``), else zeros."""
    return torch.empty(shape, dtype=torch.float32) if written else torch.zeros(shape, dtype=torch.float32)


def _chunk_lists(problem: _Problem, batch: List[Tuple[int, _Chunk, _Layout]], positions: bool, times: bool) -> tuple:
    """(starts, lengths) per group and (group, rows, m0, lo, hi, row_pos, time_idx, mask, mask_from,
    row_end, norm) per chunk of ``batch`` [(group index, chunk, layout)], in the fused ops' order."""
    group_ids = list(dict.fromkeys(gi for gi, _, _ in batch))
    slot = {gi: i for i, gi in enumerate(group_ids)}
    chunks = [chunk for _, chunk, _ in batch]
    layouts = [layout for _, _, layout in batch]
    return (
        [problem.groups[gi].starts for gi in group_ids], [problem.groups[gi].sizes for gi in group_ids],
        [slot[gi] for gi, _, _ in batch], [c.m1 - c.m0 for c in chunks], [c.m0 for c in chunks],
        [c.lo for c in chunks], [c.hi for c in chunks],
        [layout.row_pos if positions else None for layout in layouts],
        [layout.time_idx if times else None for layout in layouts],
        [layout.mask for layout in layouts], [c.mask_from for c in chunks],
        [layout.row_end for layout in layouts], [layout.norm for layout in layouts],
    )  # fmt: skip


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums over chunks are kept in: fp32 for bf16 inputs, else the inputs'."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _group_times(problem: _Problem, group: _Group) -> Tuple[Tensor, Tensor]:
    """The group's (query times, key timestamps), each [G, Lp] (one tensor twice when equal)."""
    assert problem.timestamps is not None and problem.query_times is not None  # set with a time bias
    keys = problem.timestamps[group.tokens]
    if problem.query_times is problem.timestamps:
        return keys, keys
    return problem.query_times[group.tokens], keys


def _lookup(weights: Tensor, index: Tensor) -> Tensor:
    """weights[index] for 1-d weights (index_select: several times faster than indexing)."""
    return weights.index_select(0, index.flatten()).view(index.shape)


def _pad_rows(x: Tensor) -> Tensor:
    """[T, ...] -> [T + 1, ...] with a zero row last (the padding token)."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def _gather_group(x: Tensor, group: _Group) -> Tensor:
    """x: [T + 1, H, D] -> the group's rows [G, H, Lp, D], contiguous."""
    rows = x.index_select(0, group.tokens.flatten()).view(*group.tokens.shape, *x.shape[1:])
    return rows.permute(0, 2, 1, 3).contiguous()


def _add_bias_grads(tile: _Tile, dbias: Tensor, dpos: Optional[Tensor], dtime: Optional[Tensor]) -> None:
    """dbias: [G, C, K], the scores' gradient summed over heads -> into dpos [P], dtime [NB]."""
    if dpos is not None:
        assert tile.pos_idx is not None  # the layout has the indices of each bias part that is on
        shared = dbias.sum(0, keepdim=True) if tile.pos_idx.shape[0] == 1 else dbias
        dpos.scatter_add_(0, tile.pos_idx.flatten(), shared.flatten())  # ~2x index_add_ on CPU
    if dtime is not None:
        assert tile.time_idx is not None
        dtime.scatter_add_(0, tile.time_idx.flatten(), dbias.flatten())


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
        assert problem.timestamps is not None and problem.query_times is not None  # set with a time bias
        delta = problem.query_times[idx] - problem.timestamps[idx]
        logits = logits + time_w[time_bucket(delta, problem.time_bucketing, time_w.numel())].unsqueeze(-1)
    owner_hist = history_lengths(seq_offsets, num_targets).repeat_interleave(num_targets.long())
    norm = silu_norm(owner_hist, problem.silu_scale).to(q.dtype)
    return out.index_add(0, idx, (F.silu(logits).mul(norm[:, None]).unsqueeze(-1) * v[idx]).to(out.dtype))
