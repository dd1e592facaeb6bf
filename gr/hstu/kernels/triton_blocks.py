"""Device code shared by the GPU and NPU Triton kernels: one block of HSTU attention work.

``query_block`` computes one query block [m0, m0 + BLOCK_M) of one sequence and head: the
attention output (``GRAD`` False) or dq (``GRAD`` True); ``key_block`` computes dk, dv of one
key block [n0, n0 + BLOCK_N) and adds the bias-weight gradients. Every call passes its
arguments by keyword, so a missing or misnamed argument fails to compile instead of silently
swapping strides or pointers. The kernels (``triton_attention`` for CUDA, ``ascend_triton``
for NPUs) differ only in how programs map to blocks and in two switches:

* ``UB_TABLES``: look bias weights and time-bucket thresholds up in tables preloaded into
  on-chip memory (``tl.gather``; position weights as one contiguous window per tile) instead
  of scattered global loads: what triton-ascend recommends for NPUs.
* The bias-weight gradient is added with fp32 ``tl.atomic_add`` (a dtype both CUDA and
  Ascend A2/A3 support); q, k, v gradients need no atomics.

Block skipping: a query block visits history keys [0, ctx_hi) and [lo, hi) only; a key block
the query rows that can see it; a target's only visible target key is itself, added as a
per-row term from its own K/V row, so no target loads another target's K/V.

Time bias: query rows read their times from ``QueryTimes`` (``RelativeBias.resolved_query_times``), key
columns from ``Ts``; a target's self term uses |tq_i - t_i|. ``QUERY_TIMES`` False means both
pointers hold the same times: the self delta is then 0 and is not loaded.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gr.hstu.kernels.common import TIME_BUCKET_LOG_DIV

_LOG_DIV = tl.constexpr(TIME_BUCKET_LOG_DIV)


@triton.jit
def _sequence_of(SeqOffsets, History, b):
    """-> start (int64), length, history length of sequence b."""
    start = tl.load(SeqOffsets + b)
    length = tl.load(SeqOffsets + b + 1) - start
    return start.to(tl.int64), length, tl.load(History + b)


@triton.jit
def _key_ranges(
    m0, hist, contextual_len, max_attn_len, BLOCK_M: tl.constexpr, HAS_CONTEXT: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    """History keys query rows [m0, m0 + BLOCK_M) may see: [0, ctx_hi) and [lo, hi)."""
    hi = tl.minimum(m0 + BLOCK_M, hist)
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(tl.minimum(m0, hist) - max_attn_len, 0)
    ctx_hi = lo * 0
    if HAS_CONTEXT:
        ctx_hi = tl.minimum(tl.minimum(contextual_len, hist), lo)
    return ctx_hi, lo, hi


@triton.jit
def _query_range(
    n0,
    length,
    hist,
    contextual_len,
    max_attn_len,
    BLOCK_N: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Query rows [lo, hi) that may see a history key of [n0, n0 + BLOCK_N) (empty if none)."""
    key_hi = tl.minimum(n0 + BLOCK_N, hist)
    lo = n0
    hi = length
    if HAS_WINDOW:
        # history rows see keys at most max_attn_len back; targets (at position hist) too
        targets_see = hist - (key_hi - 1) <= max_attn_len
        hi = tl.where(targets_see, length, tl.minimum(hist, key_hi + max_attn_len))
    if HAS_CONTEXT:
        is_context = n0 < tl.minimum(contextual_len, hist)
        lo = tl.where(is_context, 0, lo)
        hi = tl.where(is_context, length, hi)
    hi = tl.where(n0 < hist, hi, lo)
    return lo, hi


@triton.jit
def _visible(
    rows, cols, length, hist, contextual_len, max_attn_len, HAS_CONTEXT: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    """[M, N] mask of ``hstu_visibility`` restricted to history keys (cols < hist)."""
    pos_r = tl.minimum(rows, hist)[:, None]
    pos_c = tl.minimum(cols, hist)[None, :]
    dist = pos_r - pos_c
    seen = dist > 0
    if HAS_WINDOW:
        seen = seen & (dist <= max_attn_len)
    if HAS_CONTEXT:
        seen = seen | ((cols < contextual_len) & (cols < hist))[None, :]
    seen = seen | (rows[:, None] == cols[None, :])
    return seen & (rows < length)[:, None] & (cols < hist)[None, :]


@triton.jit
def _row_norm(rows, hist, silu_scale, SCALE_BY_POSITION: tl.constexpr):
    """Per-query factor after SiLU: 1 / (pos + 1) or silu_scale, fp32 [M]."""
    if SCALE_BY_POSITION:
        norm = 1.0 / (tl.minimum(rows, hist).to(tl.float32) + 1.0)
    else:
        norm = tl.zeros(rows.shape, dtype=tl.float32) + silu_scale
    return norm


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
def _time_bucket(delta, Thresholds, thr_table, num_time, TIME_LOG: tl.constexpr, UB_TABLES: tl.constexpr):
    """|dt| (int32, any shape) -> bucket of ``common.time_bucket``: a log/sqrt estimate, then
    one correction step against the threshold table."""
    x = tl.maximum(tl.abs(delta).to(tl.float32), 1.0)
    if TIME_LOG:
        estimate = tl.log(x) / _LOG_DIV
    else:
        estimate = tl.sqrt(x)
    bucket = tl.minimum(estimate.to(tl.int32), num_time - 1)
    if UB_TABLES:
        bucket = bucket - (x < _lookup(thr_table, bucket)).to(tl.int32)
        bucket = bucket + (x >= _lookup(thr_table, bucket + 1)).to(tl.int32)
    else:
        bucket = bucket - (x < tl.load(Thresholds + bucket)).to(tl.int32)
        bucket = bucket + (x >= tl.load(Thresholds + bucket + 1)).to(tl.int32)
    return tl.minimum(tl.maximum(bucket, 0), num_time - 1)


@triton.jit
def _weights(idx, Weights, table, UB_TABLES: tl.constexpr):
    if UB_TABLES:
        w = _lookup(table, idx)
    else:
        w = tl.load(Weights + idx)
    return w


@triton.jit
def _tile_bias(
    rows,
    cols,
    hist,
    ts_rows,
    ts_cols,
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
):
    """-> bias [M, N] fp32 and its position / time bucket indices (zeros when a part is off).

    With UB_TABLES the position weights come from one contiguous window per tile: a tile's
    relative positions span fewer than M + N <= POS_WINDOW consecutive buckets."""
    pos_idx = rows[:, None] * 0 + cols[None, :] * 0
    time_idx = pos_idx
    bias = tl.zeros(pos_idx.shape, dtype=tl.float32)
    if HAS_POS:
        delta = tl.minimum(rows, hist)[:, None] - tl.minimum(cols, hist)[None, :]
        pos_idx = tl.minimum(tl.maximum(delta, 0), num_pos - 1)
        if UB_TABLES:
            base = tl.min(pos_idx)
            window = base + tl.arange(0, POS_WINDOW)
            bias += _lookup(tl.load(PosW + window, mask=window < num_pos, other=0.0), pos_idx - base)
        else:
            bias += tl.load(PosW + pos_idx)
    if HAS_TIME:
        time_idx = _time_bucket(
            delta=ts_rows[:, None] - ts_cols[None, :],
            Thresholds=Thresholds,
            thr_table=thr_table,
            num_time=num_time,
            TIME_LOG=TIME_LOG,
            UB_TABLES=UB_TABLES,
        )
        bias += _weights(time_idx, TimeW, time_table, UB_TABLES)
    return bias, pos_idx, time_idx


@triton.jit
def _self_time_delta(QueryTimes, Ts, start, idx, ok, QUERY_TIMES: tl.constexpr):
    """tq - t of tokens ``idx`` paired with themselves, int32 [len(idx)]: zeros (nothing loaded)
    unless queries have their own times."""
    delta = idx * 0
    if QUERY_TIMES:
        delta = tl.load(QueryTimes + start + idx, mask=ok, other=0) - tl.load(Ts + start + idx, mask=ok, other=0)
    return delta


@triton.jit
def _self_bias(
    time_delta,
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
    """Bias of tokens on themselves (relative position 0, time delta ``time_delta`` [M] int32,
    from ``_self_time_delta``) -> bias [M] fp32 and its time bucket."""
    bias = tl.zeros(time_delta.shape, dtype=tl.float32)
    zero = time_delta * 0
    time_idx = zero
    if HAS_POS:
        bias += tl.load(PosW + zero)
    if HAS_TIME:
        time_idx = _time_bucket(
            delta=time_delta,
            Thresholds=Thresholds,
            thr_table=thr_table,
            num_time=num_time,
            TIME_LOG=TIME_LOG,
            UB_TABLES=UB_TABLES,
        )
        bias += _weights(time_idx, TimeW, time_table, UB_TABLES)
    return bias, time_idx


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
def _timestamps(Ts, start, idx, ok, HAS_TIME: tl.constexpr):
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
    HAS_CONTEXT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UB_TABLES: tl.constexpr,
    POS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One [M, N] tile of query rows x history keys -> sigmoid and SiLU of the scores, weight
    (mask * norm), the mask, and the position / time bucket indices."""
    bias, pos_idx, time_idx = _tile_bias(
        rows=rows,
        cols=cols,
        hist=hist,
        ts_rows=ts_rows,
        ts_cols=ts_cols,
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
    )
    sig, silu = _silu_parts(_dot(q, tl.trans(k), PRECISION) * alpha + bias)
    mask = (
        _visible(
            rows=rows,
            cols=cols,
            length=length,
            hist=hist,
            contextual_len=contextual_len,
            max_attn_len=max_attn_len,
            HAS_CONTEXT=HAS_CONTEXT,
            HAS_WINDOW=HAS_WINDOW,
        )
        & tile_ok
    )
    weight = tl.where(mask, norm[:, None], 0.0)
    return sig, silu, weight, mask, pos_idx, time_idx


@triton.jit
def _store_rows(X, value, start, idx, ok, h, stride_t, stride_h, DIM, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    tl.store(
        X + (start + idx)[:, None] * stride_t + h * stride_h + d[None, :],
        value.to(X.dtype.element_ty),
        mask=ok[:, None] & (d < DIM)[None, :],
    )


@triton.jit
def _query_pass(
    acc,
    q,
    do,
    rows,
    norm,
    ts_rows,
    n_lo,
    n_hi,
    start,
    length,
    hist,
    h,
    K,
    V,
    Ts,
    PosW,
    TimeW,
    Thresholds,
    time_table,
    thr_table,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    alpha,
    contextual_len,
    max_attn_len,
    num_pos,
    num_time,
    DIM_QK,
    DIM_V,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    TIME_LOG: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UB_TABLES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    POS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    GRAD: tl.constexpr,
):
    """Loop over history keys [n_lo, n_hi) of a query block. GRAD False: acc [M, Dv] += SiLU(s)
    * mask * norm @ v. GRAD True: acc [M, Dqk] += dS @ k (alpha applied by the caller)."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_hi
        k = _load_rows(K, start, cols, col_ok, h, stride_t=stride_kt, stride_h=stride_kh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK)
        v = _load_rows(V, start, cols, col_ok, h, stride_t=stride_vt, stride_h=stride_vh, DIM=DIM_V, BLOCK_D=BLOCK_DV)
        ts_cols = _timestamps(Ts, start, cols, col_ok, HAS_TIME)
        sig, silu, weight, _, _, _ = _tile(
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
            HAS_CONTEXT=HAS_CONTEXT,
            HAS_WINDOW=HAS_WINDOW,
            UB_TABLES=UB_TABLES,
            POS_WINDOW=POS_WINDOW,
            PRECISION=PRECISION,
        )
        if GRAD:
            ds = _dot(do, tl.trans(v), PRECISION) * weight * _silu_grad(sig, silu)
            acc += _dot(ds.to(k.dtype), k, PRECISION)
        else:
            acc += _dot((silu * weight).to(v.dtype), v, PRECISION)
    return acc


@triton.jit
def query_block(
    b,
    h,
    m0,
    Q,
    K,
    V,
    DO,
    Out,
    SeqOffsets,
    History,
    Ts,
    QueryTimes,
    PosW,
    TimeW,
    Thresholds,
    time_table,
    thr_table,
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
    alpha,
    silu_scale,
    contextual_len,
    max_attn_len,
    num_pos,
    num_time,
    DIM_QK,
    DIM_V,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    TIME_LOG: tl.constexpr,
    QUERY_TIMES: tl.constexpr,
    SCALE_BY_POSITION: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UB_TABLES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    POS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    GRAD: tl.constexpr,
):
    """Query block [m0, m0 + BLOCK_M) of sequence b, head h. GRAD False: Out = attention output
    [T, H, Dv] (DO unused). GRAD True: Out = dq [T, H, Dqk] given DO = d output."""
    start, length, hist = _sequence_of(SeqOffsets=SeqOffsets, History=History, b=b)
    if m0 < length:
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < length
        q = _load_rows(Q, start, rows, row_ok, h, stride_t=stride_qt, stride_h=stride_qh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK)
        do = q
        if GRAD:
            do = _load_rows(
                DO, start, rows, row_ok, h, stride_t=stride_dot, stride_h=stride_doh, DIM=DIM_V, BLOCK_D=BLOCK_DV
            )
        ts_rows = _timestamps(QueryTimes, start, rows, row_ok, HAS_TIME)
        norm = _row_norm(rows, hist, silu_scale, SCALE_BY_POSITION)
        ctx_hi, lo, hi = _key_ranges(
            m0=m0,
            hist=hist,
            contextual_len=contextual_len,
            max_attn_len=max_attn_len,
            BLOCK_M=BLOCK_M,
            HAS_CONTEXT=HAS_CONTEXT,
            HAS_WINDOW=HAS_WINDOW,
        )
        if GRAD:
            acc = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        acc = _query_pass(
            acc=acc,
            q=q,
            do=do,
            rows=rows,
            norm=norm,
            ts_rows=ts_rows,
            n_lo=0,
            n_hi=ctx_hi,
            start=start,
            length=length,
            hist=hist,
            h=h,
            K=K,
            V=V,
            Ts=Ts,
            PosW=PosW,
            TimeW=TimeW,
            Thresholds=Thresholds,
            time_table=time_table,
            thr_table=thr_table,
            stride_kt=stride_kt,
            stride_kh=stride_kh,
            stride_vt=stride_vt,
            stride_vh=stride_vh,
            alpha=alpha,
            contextual_len=contextual_len,
            max_attn_len=max_attn_len,
            num_pos=num_pos,
            num_time=num_time,
            DIM_QK=DIM_QK,
            DIM_V=DIM_V,
            HAS_POS=HAS_POS,
            HAS_TIME=HAS_TIME,
            TIME_LOG=TIME_LOG,
            HAS_CONTEXT=HAS_CONTEXT,
            HAS_WINDOW=HAS_WINDOW,
            UB_TABLES=UB_TABLES,
            BLOCK_N=BLOCK_N,
            BLOCK_DQK=BLOCK_DQK,
            BLOCK_DV=BLOCK_DV,
            POS_WINDOW=POS_WINDOW,
            PRECISION=PRECISION,
            GRAD=GRAD,
        )
        acc = _query_pass(
            acc=acc,
            q=q,
            do=do,
            rows=rows,
            norm=norm,
            ts_rows=ts_rows,
            n_lo=lo,
            n_hi=hi,
            start=start,
            length=length,
            hist=hist,
            h=h,
            K=K,
            V=V,
            Ts=Ts,
            PosW=PosW,
            TimeW=TimeW,
            Thresholds=Thresholds,
            time_table=time_table,
            thr_table=thr_table,
            stride_kt=stride_kt,
            stride_kh=stride_kh,
            stride_vt=stride_vt,
            stride_vh=stride_vh,
            alpha=alpha,
            contextual_len=contextual_len,
            max_attn_len=max_attn_len,
            num_pos=num_pos,
            num_time=num_time,
            DIM_QK=DIM_QK,
            DIM_V=DIM_V,
            HAS_POS=HAS_POS,
            HAS_TIME=HAS_TIME,
            TIME_LOG=TIME_LOG,
            HAS_CONTEXT=HAS_CONTEXT,
            HAS_WINDOW=HAS_WINDOW,
            UB_TABLES=UB_TABLES,
            BLOCK_N=BLOCK_N,
            BLOCK_DQK=BLOCK_DQK,
            BLOCK_DV=BLOCK_DV,
            POS_WINDOW=POS_WINDOW,
            PRECISION=PRECISION,
            GRAD=GRAD,
        )
        # a target's only visible target key is itself: its own K/V row, nobody else's
        target = row_ok & (rows >= hist)
        k_self = _load_rows(
            K, start, rows, target, h, stride_t=stride_kt, stride_h=stride_kh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK
        ).to(tl.float32)
        v_self = _load_rows(
            V, start, rows, target, h, stride_t=stride_vt, stride_h=stride_vh, DIM=DIM_V, BLOCK_D=BLOCK_DV
        ).to(tl.float32)
        dt_self = _self_time_delta(
            QueryTimes=QueryTimes, Ts=Ts, start=start, idx=rows, ok=target, QUERY_TIMES=QUERY_TIMES
        )
        bias_self, _ = _self_bias(
            time_delta=dt_self,
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
        sig, silu = _silu_parts(tl.sum(q.to(tl.float32) * k_self, 1) * alpha + bias_self)
        weight_self = tl.where(target, norm, 0.0)
        if GRAD:
            ds_self = tl.sum(do.to(tl.float32) * v_self, 1) * weight_self * _silu_grad(sig, silu)
            acc = (acc + ds_self[:, None] * k_self) * alpha
            _store_rows(
                Out, acc, start, rows, row_ok, h, stride_t=stride_ot, stride_h=stride_oh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK
            )
        else:
            acc += (silu * weight_self)[:, None] * v_self
            _store_rows(
                Out, acc, start, rows, row_ok, h, stride_t=stride_ot, stride_h=stride_oh, DIM=DIM_V, BLOCK_D=BLOCK_DV
            )


@triton.jit
def key_block(
    b,
    h,
    n0,
    Q,
    K,
    V,
    DO,
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
    time_table,
    thr_table,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    alpha,
    silu_scale,
    contextual_len,
    max_attn_len,
    num_pos,
    num_time,
    DIM_QK,
    DIM_V,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    TIME_LOG: tl.constexpr,
    QUERY_TIMES: tl.constexpr,
    SCALE_BY_POSITION: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UB_TABLES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    POS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dk, dv of key block [n0, n0 + BLOCK_N) of sequence b, head h; adds dS into DPos / DTime."""
    start, length, hist = _sequence_of(SeqOffsets=SeqOffsets, History=History, b=b)
    if n0 < length:
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < length
        k = _load_rows(K, start, cols, col_ok, h, stride_t=stride_kt, stride_h=stride_kh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK)
        v = _load_rows(V, start, cols, col_ok, h, stride_t=stride_vt, stride_h=stride_vh, DIM=DIM_V, BLOCK_D=BLOCK_DV)
        ts_cols = _timestamps(Ts, start, cols, col_ok, HAS_TIME)
        dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        m_lo, m_hi = _query_range(
            n0=n0,
            length=length,
            hist=hist,
            contextual_len=contextual_len,
            max_attn_len=max_attn_len,
            BLOCK_N=BLOCK_N,
            HAS_CONTEXT=HAS_CONTEXT,
            HAS_WINDOW=HAS_WINDOW,
        )
        for m0 in range(m_lo, m_hi, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < m_hi
            q = _load_rows(
                Q, start, rows, row_ok, h, stride_t=stride_qt, stride_h=stride_qh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK
            )
            do = _load_rows(
                DO, start, rows, row_ok, h, stride_t=stride_dot, stride_h=stride_doh, DIM=DIM_V, BLOCK_D=BLOCK_DV
            )
            norm = _row_norm(rows, hist, silu_scale, SCALE_BY_POSITION)
            ts_rows = _timestamps(QueryTimes, start, rows, row_ok, HAS_TIME)
            sig, silu, weight, mask, pos_idx, time_idx = _tile(
                q=q,
                k=k,
                rows=rows,
                cols=cols,
                tile_ok=row_ok[:, None],
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
                HAS_CONTEXT=HAS_CONTEXT,
                HAS_WINDOW=HAS_WINDOW,
                UB_TABLES=UB_TABLES,
                POS_WINDOW=POS_WINDOW,
                PRECISION=PRECISION,
            )
            dv += _dot(tl.trans((silu * weight).to(do.dtype)), do, PRECISION)
            ds = _dot(do, tl.trans(v), PRECISION) * weight * _silu_grad(sig, silu)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION)
            if HAS_POS:
                tl.atomic_add(DPos + pos_idx, ds, mask=mask)
            if HAS_TIME:
                tl.atomic_add(DTime + time_idx, ds, mask=mask)
        # target keys: only the target itself sees them
        target = col_ok & (cols >= hist)
        q_self = _load_rows(
            Q, start, cols, target, h, stride_t=stride_qt, stride_h=stride_qh, DIM=DIM_QK, BLOCK_D=BLOCK_DQK
        ).to(tl.float32)
        do_self = _load_rows(
            DO, start, cols, target, h, stride_t=stride_dot, stride_h=stride_doh, DIM=DIM_V, BLOCK_D=BLOCK_DV
        ).to(tl.float32)
        dt_self = _self_time_delta(
            QueryTimes=QueryTimes, Ts=Ts, start=start, idx=cols, ok=target, QUERY_TIMES=QUERY_TIMES
        )
        bias_self, time_self = _self_bias(
            time_delta=dt_self,
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
        sig, silu = _silu_parts(tl.sum(q_self * k.to(tl.float32), 1) * alpha + bias_self)
        weight_self = tl.where(target, _row_norm(cols, hist, silu_scale, SCALE_BY_POSITION), 0.0)
        dv += (silu * weight_self)[:, None] * do_self
        ds_self = tl.sum(do_self * v.to(tl.float32), 1) * weight_self * _silu_grad(sig, silu)
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
            col_ok,
            h,
            stride_t=stride_dkt,
            stride_h=stride_dkh,
            DIM=DIM_QK,
            BLOCK_D=BLOCK_DQK,
        )
        _store_rows(
            DV, dv, start, cols, col_ok, h, stride_t=stride_dvt, stride_h=stride_dvh, DIM=DIM_V, BLOCK_D=BLOCK_DV
        )
