"""Device code of the Triton HSTU attention kernels, shared by the GPU and NPU variants.

The training kernel, ``attention_kernel``, has three passes (``PASS``): "forward" and "dq" compute query
blocks [m0, m0 + BLOCK_M) of a sequence and head (the attention output, or dq), "dkv" computes
dk, dv of key blocks [n0, n0 + BLOCK_N) and adds the bias-weight gradients; every pass runs the
same tile and self-term code. The GPU and NPU variants differ only in how programs map to
blocks (``WORK_LIST``) and where the bias tables are read from (``UB_TABLES``):

* ``WORK_LIST`` False (CUDA): a grid of (B * H, blocks along the longest sequence); a program
  past its sequence's end returns at once. True (NPU): a fixed grid of one program per core,
  each looping over a work list of (sequence, first row) blocks (``TileSeq``, ``TileStart``).
* ``UB_TABLES``: time-bias weights and bucket thresholds preloaded into on-chip memory and
  read with ``tl.gather``, position weights as one contiguous window per tile (what
  triton-ascend recommends for NPUs); else scattered global loads (cached in L1/L2 on GPUs).
* The bias-weight gradient is added with fp32 ``tl.atomic_add`` (a dtype both CUDA and
  Ascend A2/A3 support); q, k, v gradients need no atomics.

Compile-time switches are only what changes the data flow: the pass, the bias parts
(``HAS_POS``, ``HAS_TIME``, ``TIME_LOG``), tile sizes, precision and the two layout switches. The mask and
norm options (contextual prefix, look-back window, per-position norm, query times) are
runtime scalars, so one compiled kernel serves them all and each compile stays small.
Helpers take their arguments by keyword where a swap would go unnoticed (pointers, strides).

``cached_attention_kernel`` is serving's forward pass over a request's cached keys (read through a
page table) followed by its new tokens: the forward pass's tiles, key ranges and self term over
those rows, for the new tokens' query blocks only.

Block skipping: a query block visits history keys [0, ctx_hi) and [lo, hi) only, in one loop;
a key block the query rows that can see it; a target's only visible target key is itself,
added as a per-row term from its own K/V row, so no target loads another target's K/V.

Time bias: query rows read their times from ``QueryTimes`` (``RelativeBias.resolved_query_times``),
key columns from ``Ts``; a target's self term uses |tq_i - t_i| (0 when both pointers hold the
same times).
"""

from __future__ import annotations

import triton
import triton.language as tl

from gr.hstu.kernels.attention.common import TIME_BUCKET_LOG_DIV

_LOG_DIV = tl.constexpr(TIME_BUCKET_LOG_DIV)
# runtime scalars that must not become compile-time constants when they equal 1 (Triton
# specializes such integers), so that one compiled kernel serves every value
RUNTIME_SCALARS = (
    "alpha",
    "silu_scale",
    "scale_by_position",
    "contextual_len",
    "max_attn_len",
    "num_pos",
    "num_time",
    "num_work",
    "H",
)
# the cached-attention kernel's: the same but the work-list size, and its page size
CACHED_RUNTIME_SCALARS = (*(name for name in RUNTIME_SCALARS if name != "num_work"), "page_size")


@triton.jit
def _work_item(work, TileSeq, TileStart, H, BLOCK: tl.constexpr, WORK_LIST: tl.constexpr):
    """-> sequence, head and first row of program work item ``work``."""
    if WORK_LIST:
        tile = work // H
        b = tl.load(TileSeq + tile)
        row0 = tl.load(TileStart + tile)
    else:
        b = work // H
        row0 = tl.program_id(1) * BLOCK
    return b, work % H, row0


@triton.jit
def _sequence_of(SeqOffsets, History, b):
    """-> start (int64), length, history length of sequence b."""
    start = tl.load(SeqOffsets + b)
    length = tl.load(SeqOffsets + b + 1) - start
    return start.to(tl.int64), length, tl.load(History + b)


@triton.jit
def _tables(TimeW, Thresholds, num_time, HAS_TIME: tl.constexpr, UB_TABLES: tl.constexpr, TIME_TABLE: tl.constexpr):
    """Time-bias weights [TIME_TABLE] and bucket thresholds [2 * TIME_TABLE], loaded once per
    program into on-chip memory (UB_TABLES), else one-element placeholders."""
    if UB_TABLES and HAS_TIME:
        idx = tl.arange(0, TIME_TABLE)
        time_table = tl.load(TimeW + idx, mask=idx < num_time, other=0.0)
        idx = tl.arange(0, 2 * TIME_TABLE)
        thr_table = tl.load(Thresholds + idx, mask=idx <= num_time, other=float("inf"))
    else:
        time_table = tl.zeros([1], dtype=tl.float32)
        thr_table = tl.zeros([1], dtype=tl.float32)
    return time_table, thr_table


@triton.jit
def _row_norm(rows, hist, silu_scale, scale_by_position):
    """Per-query factor after SiLU: 1 / (pos + 1) when ``scale_by_position``, else silu_scale; fp32 [M]."""
    by_position = 1.0 / (tl.minimum(rows, hist).to(tl.float32) + 1.0)
    return tl.where(scale_by_position != 0, by_position, silu_scale)


@triton.jit
def _silu_parts(s):
    """-> sigmoid(s), silu(s) (fp32)."""
    sig = 1.0 / (1.0 + tl.exp(-s))
    return sig, s * sig


@triton.jit
def _silu_grad(sig, silu):
    """SiLU'(s) from sigmoid(s) and silu(s)."""
    return sig + silu * (1.0 - sig)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """tl.dot with fp32 accumulation. PRECISION "upcast" multiplies 16-bit operands in fp32
    (the same products and fp32 sums; for Triton's interpreter, whose bf16 dot is wrong)."""
    if PRECISION == "upcast":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _lookup(table, idx):
    """table[idx] for an on-chip 1-D table and an index tensor of any shape."""
    flat = tl.gather(table, tl.reshape(idx, [idx.numel]), 0)
    return tl.reshape(flat, idx.shape)


@triton.jit
def _table(idx, Table, table, UB_TABLES: tl.constexpr):
    """Table[idx]: from the on-chip copy ``table`` (UB_TABLES) or global memory."""
    if UB_TABLES:
        w = _lookup(table, idx)
    else:
        w = tl.load(Table + idx)
    return w


@triton.jit
def _time_bucket(delta, Thresholds, thr_table, num_time, TIME_LOG: tl.constexpr, UB_TABLES: tl.constexpr):
    """|dt| (int32, any shape) -> bucket of ``common.time_bucket``: a log/sqrt estimate, then
    one correction step against the threshold table."""
    x = tl.maximum(tl.abs(delta).to(tl.float32), 1.0)
    if TIME_LOG:
        estimate = tl.log(x) / _LOG_DIV
    else:
        estimate = tl.sqrt(x)
    bucket = tl.minimum(estimate.to(tl.int32), num_time - 1)
    bucket = bucket - (x < _table(bucket, Thresholds, thr_table, UB_TABLES)).to(tl.int32)
    bucket = bucket + (x >= _table(bucket + 1, Thresholds, thr_table, UB_TABLES)).to(tl.int32)
    return tl.minimum(tl.maximum(bucket, 0), num_time - 1)


@triton.jit
def _time_bias(delta, TimeW, Thresholds, time_table, thr_table, num_time, TIME_LOG, UB_TABLES):
    """-> time bias (fp32) and bucket of time deltas ``delta`` (int32, any shape)."""
    bucket = _time_bucket(delta, Thresholds, thr_table, num_time, TIME_LOG, UB_TABLES)
    return _table(bucket, TimeW, time_table, UB_TABLES), bucket


@triton.jit
def _load_rows(X, start, idx, ok, h, stride_t, stride_h, DIM, BLOCK_D: tl.constexpr):
    """Rows ``idx`` of head h of a [T, H, D] tensor -> [len(idx), BLOCK_D] (zeros where not ok)."""
    d = tl.arange(0, BLOCK_D)
    return tl.load(
        X + (start + idx)[:, None] * stride_t + h * stride_h + d[None, :],
        mask=ok[:, None] & (d < DIM)[None, :],
        other=0.0,
    )


@triton.jit
def _store_rows(X, value, start, idx, ok, h, stride_t, stride_h, DIM, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    tl.store(
        X + (start + idx)[:, None] * stride_t + h * stride_h + d[None, :],
        value.to(X.dtype.element_ty),
        mask=ok[:, None] & (d < DIM)[None, :],
    )


@triton.jit
def _times(Ts, start, idx, ok, HAS_TIME: tl.constexpr):
    """Timestamps of tokens ``idx`` (the indices themselves, unused, without time bias)."""
    ts = idx
    if HAS_TIME:
        ts = tl.load(Ts + start + idx, mask=ok, other=0)
    return ts


@triton.jit
def _tile(
    q,
    k,
    rows,
    cols,
    tile_ok,
    norm,
    length,
    hist,
    ts_rows,
    ts_cols,
    alpha,
    contextual_len,
    max_attn_len,
    PosW,
    TimeW,
    Thresholds,
    time_table,
    thr_table,
    num_pos,
    num_time,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    TIME_LOG: tl.constexpr,
    UB_TABLES: tl.constexpr,
    POS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One [M, N] tile of query rows x history keys -> sigmoid and SiLU of the scores, weight
    (mask * norm), and the position / time bucket indices (zeros when a part is off).

    Mask: ``hstu_visibility`` restricted to history keys; without a window (max_attn_len 0)
    every earlier position is seen, without a context (contextual_len 0) no key is seen by all.
    With UB_TABLES the position weights come from one contiguous window per tile: a tile's
    relative positions span fewer than M + N <= POS_WINDOW consecutive buckets."""
    pos_r = tl.minimum(rows, hist)[:, None]
    pos_c = tl.minimum(cols, hist)[None, :]
    dist = pos_r - pos_c
    window = tl.where(max_attn_len > 0, max_attn_len, hist)
    context = (cols < tl.minimum(contextual_len, hist))[None, :]
    mask = ((dist > 0) & (dist <= window)) | context | (rows[:, None] == cols[None, :])
    mask = mask & (rows < length)[:, None] & (cols < hist)[None, :] & tile_ok
    pos_idx = dist * 0
    time_idx = pos_idx
    s = _dot(q, tl.trans(k), PRECISION) * alpha
    if HAS_POS:
        pos_idx = tl.minimum(tl.maximum(dist, 0), num_pos - 1)
        if UB_TABLES:
            base = tl.min(pos_idx)
            span = base + tl.arange(0, POS_WINDOW)
            s += _lookup(tl.load(PosW + span, mask=span < num_pos, other=0.0), pos_idx - base)
        else:
            s += tl.load(PosW + pos_idx)
    if HAS_TIME:
        time_bias, time_idx = _time_bias(
            ts_rows[:, None] - ts_cols[None, :], TimeW, Thresholds, time_table, thr_table, num_time, TIME_LOG, UB_TABLES
        )
        s += time_bias
    sig, silu = _silu_parts(s)
    weight = tl.where(mask, norm[:, None], 0.0)
    return sig, silu, weight, pos_idx, time_idx


@triton.jit
def _self_term(
    a,
    b,
    idx,
    ok,
    start,
    alpha,
    Ts,
    QueryTimes,
    PosW,
    TimeW,
    Thresholds,
    time_table,
    thr_table,
    num_time,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    TIME_LOG: tl.constexpr,
    UB_TABLES: tl.constexpr,
):
    """Score of target tokens ``idx`` on themselves (a: their q rows, b: their k rows, fp32
    [M, Dqk]; relative position 0, time delta tq_i - t_i) -> sigmoid, SiLU and time bucket [M]."""
    s = tl.sum(a * b, 1) * alpha
    time_idx = idx * 0
    if HAS_POS:
        s += tl.load(PosW + time_idx)
    if HAS_TIME:
        delta = tl.load(QueryTimes + start + idx, mask=ok, other=0) - tl.load(Ts + start + idx, mask=ok, other=0)
        time_bias, time_idx = _time_bias(delta, TimeW, Thresholds, time_table, thr_table, num_time, TIME_LOG, UB_TABLES)
        s += time_bias
    sig, silu = _silu_parts(s)
    return sig, silu, time_idx


@triton.jit
def _key_ranges(m0, hist, contextual_len, max_attn_len, BLOCK_M: tl.constexpr):
    """History keys query rows [m0, m0 + BLOCK_M) may see: [0, ctx_hi) and [lo, hi)."""
    hi = tl.minimum(m0 + BLOCK_M, hist)
    lo = tl.where(max_attn_len > 0, tl.maximum(tl.minimum(m0, hist) - max_attn_len, 0), 0)
    return tl.minimum(tl.minimum(contextual_len, hist), lo), lo, hi


@triton.jit
def _query_range(n0, length, hist, contextual_len, max_attn_len, BLOCK_N: tl.constexpr):
    """Query rows [lo, hi) that may see a history key of [n0, n0 + BLOCK_N) (empty if none)."""
    key_hi = tl.minimum(n0 + BLOCK_N, hist)
    # history rows see keys at most max_attn_len back; targets (at position hist) too
    windowed = (max_attn_len > 0) & (hist - (key_hi - 1) > max_attn_len)
    hi = tl.where(windowed, tl.minimum(hist, key_hi + max_attn_len), length)
    is_context = n0 < tl.minimum(contextual_len, hist)
    lo = tl.where(is_context, 0, n0)
    hi = tl.where(is_context, length, hi)
    return lo, tl.where(n0 < hist, hi, lo)


@triton.jit(do_not_specialize=RUNTIME_SCALARS)
def attention_kernel(
    Q,
    K,
    V,
    DO,
    Out,
    DK,
    DV,
    DPos,
    DTime,
    SeqOffsets,
    History,
    Ts,
    QueryTimes,
    PosW,
    TimeW,
    Thresholds,
    TileSeq,
    TileStart,
    num_work,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_ot,
    stride_oh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    alpha,
    silu_scale,
    scale_by_position,
    contextual_len,
    max_attn_len,
    num_pos,
    num_time,
    DIM_QK,
    DIM_V,
    H,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    TIME_LOG: tl.constexpr,
    UB_TABLES: tl.constexpr,
    WORK_LIST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    POS_WINDOW: tl.constexpr,
    TIME_TABLE: tl.constexpr,
    PRECISION: tl.constexpr,
    PASS: tl.constexpr,
):
    """One pass over the blocks of a jagged batch; the passes share the tile and self-term code.

    PASS "forward": query blocks, Out = attention output [T, H, Dv] (DO, DK, DV, DPos, DTime unused).
    PASS "dq": query blocks, Out = dq [T, H, Dqk] given DO = d output [T, H, Dv].
    PASS "dkv": key blocks, DK, DV [T, H, *] given DO; adds dS into DPos [P] / DTime [NB] fp32 (Out unused).
    """
    time_table, thr_table = _tables(TimeW, Thresholds, num_time, HAS_TIME, UB_TABLES, TIME_TABLE)
    for work in range(tl.program_id(0), num_work, tl.num_programs(0)):
        if PASS == "dkv":
            b, h, first = _work_item(work, TileSeq, TileStart, H, BLOCK_N, WORK_LIST)
        else:
            b, h, first = _work_item(work, TileSeq, TileStart, H, BLOCK_M, WORK_LIST)
        start, length, hist = _sequence_of(SeqOffsets, History, b)
        if first < length:
            # the block this program owns, and the range of the other side it visits
            if PASS == "dkv":
                cols = first + tl.arange(0, BLOCK_N)
                own, own_ok = cols, cols < length
                k = _load_rows(
                    K, start, cols, own_ok, h, stride_t=stride_kt, stride_h=stride_kh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK
                )
                v = _load_rows(
                    V, start, cols, own_ok, h, stride_t=stride_vt, stride_h=stride_vh, DIM=DIM_V, BLOCK_D=BLOCK_DV
                )
                ts_cols = _times(Ts, start, cols, own_ok, HAS_TIME)
                dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
                dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
                lo, hi = _query_range(first, length, hist, contextual_len, max_attn_len, BLOCK_N)
                steps = tl.cdiv(hi - lo, BLOCK_M)
            else:
                rows = first + tl.arange(0, BLOCK_M)
                own, own_ok = rows, rows < length
                q = _load_rows(
                    Q, start, rows, own_ok, h, stride_t=stride_qt, stride_h=stride_qh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK
                )
                ts_rows = _times(QueryTimes, start, rows, own_ok, HAS_TIME)
                norm = _row_norm(rows, hist, silu_scale, scale_by_position)
                if PASS == "dq":
                    do = _load_rows(
                        DO,
                        start,
                        rows,
                        own_ok,
                        h,
                        stride_t=stride_dot,
                        stride_h=stride_doh,
                        DIM=DIM_V,
                        BLOCK_D=BLOCK_DV,
                    )
                    acc = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
                else:
                    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
                ctx_hi, lo, hi = _key_ranges(first, hist, contextual_len, max_attn_len, BLOCK_M)
                ctx_blocks = tl.cdiv(ctx_hi, BLOCK_N)
                steps = ctx_blocks + tl.cdiv(hi - lo, BLOCK_N)  # one loop over both key ranges
            for i in range(0, steps):
                if PASS == "dkv":
                    rows = lo + i * BLOCK_M + tl.arange(0, BLOCK_M)
                    row_ok = rows < hi
                    tile_ok = row_ok[:, None]
                    q = _load_rows(
                        Q, start, rows, row_ok, h, stride_t=stride_qt, stride_h=stride_qh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK
                    )
                    do = _load_rows(
                        DO,
                        start,
                        rows,
                        row_ok,
                        h,
                        stride_t=stride_dot,
                        stride_h=stride_doh,
                        DIM=DIM_V,
                        BLOCK_D=BLOCK_DV,
                    )
                    ts_rows = _times(QueryTimes, start, rows, row_ok, HAS_TIME)
                    norm = _row_norm(rows, hist, silu_scale, scale_by_position)
                else:
                    in_ctx = i < ctx_blocks
                    cols = tl.where(in_ctx, i * BLOCK_N, lo + (i - ctx_blocks) * BLOCK_N) + tl.arange(0, BLOCK_N)
                    col_ok = cols < tl.where(in_ctx, ctx_hi, hi)
                    tile_ok = col_ok[None, :]
                    k = _load_rows(
                        K, start, cols, col_ok, h, stride_t=stride_kt, stride_h=stride_kh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK
                    )
                    v = _load_rows(
                        V, start, cols, col_ok, h, stride_t=stride_vt, stride_h=stride_vh, DIM=DIM_V, BLOCK_D=BLOCK_DV
                    )
                    ts_cols = _times(Ts, start, cols, col_ok, HAS_TIME)
                sig, silu, weight, pos_idx, time_idx = _tile(
                    q=q,
                    k=k,
                    rows=rows,
                    cols=cols,
                    tile_ok=tile_ok,
                    norm=norm,
                    length=length,
                    hist=hist,
                    ts_rows=ts_rows,
                    ts_cols=ts_cols,
                    alpha=alpha,
                    contextual_len=contextual_len,
                    max_attn_len=max_attn_len,
                    PosW=PosW,
                    TimeW=TimeW,
                    Thresholds=Thresholds,
                    time_table=time_table,
                    thr_table=thr_table,
                    num_pos=num_pos,
                    num_time=num_time,
                    HAS_POS=HAS_POS,
                    HAS_TIME=HAS_TIME,
                    TIME_LOG=TIME_LOG,
                    UB_TABLES=UB_TABLES,
                    POS_WINDOW=POS_WINDOW,
                    PRECISION=PRECISION,
                )
                if PASS == "dkv":
                    dv += _dot(tl.trans((silu * weight).to(do.dtype)), do, PRECISION)
                    ds = _dot(do, tl.trans(v), PRECISION) * weight * _silu_grad(sig, silu)
                    dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION)
                    # no mask: ds is 0 where the mask hides a pair, and both indices are in range
                    if HAS_POS:
                        tl.atomic_add(DPos + pos_idx, ds)
                    if HAS_TIME:
                        tl.atomic_add(DTime + time_idx, ds)
                elif PASS == "dq":
                    ds = _dot(do, tl.trans(v), PRECISION) * weight * _silu_grad(sig, silu)
                    acc += _dot(ds.to(k.dtype), k, PRECISION)
                else:
                    acc += _dot((silu * weight).to(v.dtype), v, PRECISION)
            # a target's only visible target key is itself: its own row of the other side, nobody else's
            target = own_ok & (own >= hist)
            if PASS == "dkv":
                q_self = _load_rows(
                    Q, start, cols, target, h, stride_t=stride_qt, stride_h=stride_qh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK
                ).to(tl.float32)
                k_self = k.to(tl.float32)
                do_self = _load_rows(
                    DO, start, cols, target, h, stride_t=stride_dot, stride_h=stride_doh, DIM=DIM_V, BLOCK_D=BLOCK_DV
                ).to(tl.float32)
                v_self = v.to(tl.float32)
            else:
                q_self = q.to(tl.float32)
                k_self = _load_rows(
                    K, start, rows, target, h, stride_t=stride_kt, stride_h=stride_kh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK
                ).to(tl.float32)
                v_self = _load_rows(
                    V, start, rows, target, h, stride_t=stride_vt, stride_h=stride_vh, DIM=DIM_V, BLOCK_D=BLOCK_DV
                ).to(tl.float32)
            sig, silu, time_self = _self_term(
                a=q_self,
                b=k_self,
                idx=own,
                ok=target,
                start=start,
                alpha=alpha,
                Ts=Ts,
                QueryTimes=QueryTimes,
                PosW=PosW,
                TimeW=TimeW,
                Thresholds=Thresholds,
                time_table=time_table,
                thr_table=thr_table,
                num_time=num_time,
                HAS_POS=HAS_POS,
                HAS_TIME=HAS_TIME,
                TIME_LOG=TIME_LOG,
                UB_TABLES=UB_TABLES,
            )
            weight_self = tl.where(target, _row_norm(own, hist, silu_scale, scale_by_position), 0.0)
            if PASS == "dkv":
                dv += (silu * weight_self)[:, None] * do_self
                ds_self = tl.sum(do_self * v_self, 1) * weight_self * _silu_grad(sig, silu)
                dk += ds_self[:, None] * q_self
                if HAS_POS:
                    tl.atomic_add(DPos + cols * 0, ds_self, mask=target)
                if HAS_TIME:
                    tl.atomic_add(DTime + time_self, ds_self, mask=target)
                _store_rows(
                    DK,
                    dk * alpha,
                    start,
                    cols,
                    own_ok,
                    h,
                    stride_t=stride_dkt,
                    stride_h=stride_dkh,
                    DIM=DIM_QK,
                    BLOCK_D=BLOCK_DQK,
                )
                _store_rows(
                    DV,
                    dv,
                    start,
                    cols,
                    own_ok,
                    h,
                    stride_t=stride_dvt,
                    stride_h=stride_dvh,
                    DIM=DIM_V,
                    BLOCK_D=BLOCK_DV,
                )
            else:
                if PASS == "dq":
                    ds_self = tl.sum(do.to(tl.float32) * v_self, 1) * weight_self * _silu_grad(sig, silu)
                    acc = (acc + ds_self[:, None] * k_self) * alpha
                else:
                    acc += (silu * weight_self)[:, None] * v_self
                _store_rows(
                    Out,
                    acc,
                    start,
                    rows,
                    own_ok,
                    h,
                    stride_t=stride_ot,
                    stride_h=stride_oh,
                    DIM=DIM_QK if PASS == "dq" else DIM_V,
                    BLOCK_D=BLOCK_DQK if PASS == "dq" else BLOCK_DV,
                )


@triton.jit
def _request_rows(
    Cached, New, PageStarts, page_base, page_size, cached, new_start, cols, ok, h, stride_ch, stride_cr,
    stride_nt, stride_nh, DIM, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows ``cols`` of head h of one request's keys (or values) in one-pass order -> [len(cols),
    BLOCK_D] in ``New``'s dtype, zeros where not ok: cached token j < ``cached`` from its page of the
    [H, rows, D] pool ``Cached`` (row PageStarts[page_base + j // page_size] + j % page_size), new
    token j from row new_start + j - cached of the [N, H, D] tensor ``New``."""
    d = tl.arange(0, BLOCK_D)
    d_ok = (d < DIM)[None, :]
    in_cache = ok & (cols < cached)
    j = tl.where(in_cache, cols, 0)
    row = tl.load(PageStarts + page_base + j // page_size, mask=in_cache, other=0) + j % page_size
    old = tl.load(
        Cached + h * stride_ch + row[:, None] * stride_cr + d[None, :], mask=in_cache[:, None] & d_ok, other=0.0
    )
    in_new = ok & (cols >= cached)
    new = tl.load(
        New + (new_start + cols - cached)[:, None] * stride_nt + h * stride_nh + d[None, :],
        mask=in_new[:, None] & d_ok,
        other=0.0,
    )
    return tl.where(in_cache[:, None], old.to(New.dtype.element_ty), new)


@triton.jit
def _request_times(CacheTs, Ts, cache_start, cached, new_start, cols, ok, HAS_TIME: tl.constexpr):
    """Timestamps of one request's keys ``cols`` in one-pass order: cached ones from ``CacheTs``, new
    ones from ``Ts`` (the indices themselves, unused, without time bias)."""
    ts = cols
    if HAS_TIME:
        in_cache = ok & (cols < cached)
        old = tl.load(CacheTs + cache_start + cols, mask=in_cache, other=0)
        new = tl.load(Ts + new_start + cols - cached, mask=ok & (cols >= cached), other=0)
        ts = tl.where(in_cache, old, new)
    return ts


@triton.jit(do_not_specialize=CACHED_RUNTIME_SCALARS)
def cached_attention_kernel(
    Q,
    K,
    V,
    Out,
    CacheK,
    CacheV,
    PageStarts,
    PageOffsets,
    SeqOffsets,
    History,
    CacheOffsets,
    CacheTs,
    Ts,
    QueryTimes,
    PosW,
    TimeW,
    Thresholds,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_ckh,
    stride_ckr,
    stride_cvh,
    stride_cvr,
    page_size,
    alpha,
    silu_scale,
    scale_by_position,
    contextual_len,
    max_attn_len,
    num_pos,
    num_time,
    DIM_QK,
    DIM_V,
    H,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    TIME_LOG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Cached attention (serving, forward): new tokens [BLOCK_M block of request b] of head h attend
    over their request's cached K/V, read through its page table, then over its new tokens, as the
    forward pass over the request's one-pass sequence (cache, then new tokens) computes their rows.

    Program (b * H + h, query block). Q, K, V, Out: [N, H, D] new tokens, jagged by SeqOffsets [B+1];
    CacheK / CacheV: [H, rows, D] pools; request b's cached token j lies in row
    PageStarts[PageOffsets[b] + j // page_size] + j % page_size (a tensor cache: one page a request);
    CacheOffsets [B+1]: cached tokens per request (and where its CacheTs [C] begin); Ts, QueryTimes:
    [N] key and query times of the new tokens; History [B]: the request's history length, C_b when its
    new tokens are candidates at position C_b (each sees the history and itself), C_b + n_b when they
    go on with the history (causal). The loop visits the same key ranges, tiles and self term as the
    training forward pass, in one-pass key order."""
    time_table, thr_table = _tables(TimeW, Thresholds, num_time, HAS_TIME, False, 1)
    b = tl.program_id(0) // H
    h = (tl.program_id(0) % H).to(tl.int64)
    first = tl.program_id(1) * BLOCK_M
    new_start = tl.load(SeqOffsets + b).to(tl.int64)
    count = tl.load(SeqOffsets + b + 1) - new_start
    if first < count:
        cache_start = tl.load(CacheOffsets + b).to(tl.int64)
        cached = (tl.load(CacheOffsets + b + 1) - cache_start).to(tl.int32)
        page_base = tl.load(PageOffsets + b)
        length = cached + count.to(tl.int32)
        hist = tl.load(History + b)
        own = first + tl.arange(0, BLOCK_M)
        own_ok = own < count
        rows = cached + own  # one-pass indices of the new tokens
        q = _load_rows(
            Q, new_start, own, own_ok, h, stride_t=stride_qt, stride_h=stride_qh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK
        )
        ts_rows = _times(QueryTimes, new_start, own, own_ok, HAS_TIME)
        norm = _row_norm(rows, hist, silu_scale, scale_by_position)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        ctx_hi, lo, hi = _key_ranges(cached + first, hist, contextual_len, max_attn_len, BLOCK_M)
        ctx_blocks = tl.cdiv(ctx_hi, BLOCK_N)
        for i in range(0, ctx_blocks + tl.cdiv(hi - lo, BLOCK_N)):
            in_ctx = i < ctx_blocks
            cols = tl.where(in_ctx, i * BLOCK_N, lo + (i - ctx_blocks) * BLOCK_N) + tl.arange(0, BLOCK_N)
            col_ok = cols < tl.where(in_ctx, ctx_hi, hi)
            k = _request_rows(
                CacheK, K, PageStarts, page_base, page_size, cached, new_start, cols, col_ok, h,
                stride_ch=stride_ckh, stride_cr=stride_ckr, stride_nt=stride_kt, stride_nh=stride_kh,
                DIM=DIM_QK, BLOCK_D=BLOCK_DQK,
            )  # fmt: skip
            v = _request_rows(
                CacheV, V, PageStarts, page_base, page_size, cached, new_start, cols, col_ok, h,
                stride_ch=stride_cvh, stride_cr=stride_cvr, stride_nt=stride_vt, stride_nh=stride_vh,
                DIM=DIM_V, BLOCK_D=BLOCK_DV,
            )  # fmt: skip
            ts_cols = _request_times(CacheTs, Ts, cache_start, cached, new_start, cols, col_ok, HAS_TIME)
            _, silu, weight, _, _ = _tile(
                q=q,
                k=k,
                rows=rows,
                cols=cols,
                tile_ok=col_ok[None, :],
                norm=norm,
                length=length,
                hist=hist,
                ts_rows=ts_rows,
                ts_cols=ts_cols,
                alpha=alpha,
                contextual_len=contextual_len,
                max_attn_len=max_attn_len,
                PosW=PosW,
                TimeW=TimeW,
                Thresholds=Thresholds,
                time_table=time_table,
                thr_table=thr_table,
                num_pos=num_pos,
                num_time=num_time,
                HAS_POS=HAS_POS,
                HAS_TIME=HAS_TIME,
                TIME_LOG=TIME_LOG,
                UB_TABLES=False,
                POS_WINDOW=1,
                PRECISION=PRECISION,
            )
            acc += _dot((silu * weight).to(v.dtype), v, PRECISION)
        # a candidate's only visible new key is itself
        target = own_ok & (rows >= hist)
        k_self = _load_rows(
            K, new_start, own, target, h, stride_t=stride_kt, stride_h=stride_kh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK
        ).to(tl.float32)
        v_self = _load_rows(
            V, new_start, own, target, h, stride_t=stride_vt, stride_h=stride_vh, DIM=DIM_V, BLOCK_D=BLOCK_DV
        ).to(tl.float32)
        _, silu, _ = _self_term(
            a=q.to(tl.float32),
            b=k_self,
            idx=own,
            ok=target,
            start=new_start,
            alpha=alpha,
            Ts=Ts,
            QueryTimes=QueryTimes,
            PosW=PosW,
            TimeW=TimeW,
            Thresholds=Thresholds,
            time_table=time_table,
            thr_table=thr_table,
            num_time=num_time,
            HAS_POS=HAS_POS,
            HAS_TIME=HAS_TIME,
            TIME_LOG=TIME_LOG,
            UB_TABLES=False,
        )
        acc += (silu * tl.where(target, _row_norm(rows, hist, silu_scale, scale_by_position), 0.0))[:, None] * v_self
        _store_rows(
            Out, acc, new_start, own, own_ok, h, stride_t=stride_ot, stride_h=stride_oh, DIM=DIM_V, BLOCK_D=BLOCK_DV
        )
