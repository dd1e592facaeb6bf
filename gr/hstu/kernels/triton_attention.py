"""Fused jagged HSTU attention in Triton for CUDA (forward, backward, bias-weight gradients).

One program per (query or key block, sequence, head); no padding: rows past a sequence's end
are never loaded. Block skipping follows the mask: a query block visits only the history keys
it can see ([0, contextual) and the causal / windowed range), a key block only the queries
that can see it, and a target never loads another target's K/V: its one visible target key is
itself, added as a per-row term. Cost O(L^2 + N*L) per sequence, not O((L+N)^2).
Backward: dq in a query-major pass (no atomics), dk/dv in a key-major pass that also adds
dS into the position/time bucket gradients with fp32 atomics.

On CPU tensors it runs under ``TRITON_INTERPRET=1`` (set before this module is imported).
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from gr.hstu.kernels.common import RelativeBias
from gr.hstu.kernels.triton_common import (
    KernelInputs,
    apply_kernels,
    head_block,
    key_ranges,
    position_bucket,
    prepare_inputs,
    query_range,
    row_norm,
    self_bias,
    sequence_of,
    silu_parts,
    time_bucket,
    visible,
)

INTERPRETER_BLOCKS = (32, 32)  # (BLOCK_M, BLOCK_N) when interpreted on CPU


def triton_hstu_attention(
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
    blocks: Optional[Tuple[int, int]] = None,
) -> Tensor:
    """See ``gr.hstu.kernels.hstu_attention``; returns [T, H, Dv].

    blocks: (BLOCK_M, BLOCK_N), multiples of 16; None autotunes on CUDA (Ampere/Hopper
    configs) and uses ``INTERPRETER_BLOCKS`` under the interpreter.
    """
    interpreted = _interpreted()
    if q.device.type != "cuda" and not interpreted:
        raise RuntimeError(
            f"hstu_attention[triton]: tensors are on {q.device.type}; the Triton kernels need CUDA, or "
            "TRITON_INTERPRET=1 set before gr.hstu.kernels.triton_attention is imported (CPU, tests only)"
        )
    inputs = prepare_inputs(
        q, k, v, seq_offsets, max_seq_len, num_targets, contextual_len, max_attn_len, alpha, silu_scale, rab, "triton"
    )
    if blocks is None and interpreted:
        blocks = INTERPRETER_BLOCKS
    return apply_kernels(q, k, v, inputs, rab, CudaKernels(blocks))


def _interpreted() -> bool:
    return isinstance(_forward_kernel, InterpretedFunction)


def _autotune_configs() -> List[triton.Config]:
    """(BLOCK_M, BLOCK_N, warps, stages) candidates: Hopper (sm90) gets larger tiles and more
    pipeline stages than Ampere (sm80)."""
    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 8
    if major >= 9:
        shapes = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4)]
    else:
        shapes = [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (32, 64, 4, 2), (32, 32, 4, 2)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
        for m, n, warps, stages in shapes
    ]


class CudaKernels:
    """Launches the three kernels with fixed blocks, or autotuned ones when ``blocks`` is None."""

    def __init__(self, blocks: Optional[Tuple[int, int]]) -> None:
        if blocks is not None and any(b % 16 or b <= 0 for b in blocks):
            raise ValueError(f"hstu_attention[triton]: blocks must be positive multiples of 16, got {blocks}")
        self.blocks = blocks

    def _launch(self, kernel, grid_blocks: str, args: tuple, flags: dict, inputs: KernelInputs, heads: int) -> None:
        if self.blocks is not None:
            meta = {"BLOCK_M": self.blocks[0], "BLOCK_N": self.blocks[1]}
            grid = (triton.cdiv(inputs.max_seq_len, meta[grid_blocks]), inputs.batch * heads)
            kernel[grid](*args, **flags, **meta)
        else:
            tuned = _tuned(kernel)
            tuned[lambda meta: (triton.cdiv(inputs.max_seq_len, meta[grid_blocks]), inputs.batch * heads)](*args, **flags)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, inputs: KernelInputs) -> Tensor:
        total, heads, _ = q.shape
        out = torch.empty(total, heads, v.shape[-1], dtype=v.dtype, device=v.device)
        args = (q, k, v, out, *_table_args(inputs), *_strides(q, k, v, out), *_scalar_args(inputs, q, v))
        self._launch(_forward_kernel, "BLOCK_M", args, _flags(inputs, q, v), inputs, heads)
        return out

    def backward(self, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, inputs: KernelInputs):
        total, heads, _ = q.shape
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dpos = torch.zeros(max(inputs.num_pos, 1), dtype=torch.float32, device=q.device)
        dtime = torch.zeros(max(inputs.num_time, 1), dtype=torch.float32, device=q.device)
        flags = _flags(inputs, q, v)
        tables, scalars = _table_args(inputs), _scalar_args(inputs, q, v)
        dq_args = (q, k, v, grad_out, dq, *tables, *_strides(q, k, v, grad_out, dq), *scalars)
        self._launch(_backward_dq_kernel, "BLOCK_M", dq_args, flags, inputs, heads)
        dkv_args = (q, k, v, grad_out, dk, dv, dpos, dtime, *tables, *_strides(q, k, v, grad_out, dk, dv), *scalars)
        self._launch(_backward_dkv_kernel, "BLOCK_N", dkv_args, flags, inputs, heads)
        return dq, dk, dv, dpos[: inputs.num_pos], dtime[: inputs.num_time]


@functools.lru_cache(maxsize=None)
def _tuned(kernel):
    """The kernel wrapped in triton.autotune (built on first CUDA use; dbias buffers reset
    between trials since the key-major pass accumulates into them)."""
    reset = ["DPos", "DTime"] if kernel is _backward_dkv_kernel else None
    return triton.autotune(configs=_autotune_configs(), key=["AUTOTUNE_MAX_LEN", "DIM_QK", "DIM_V"], reset_to_zero=reset)(
        kernel
    )


def _table_args(inputs: KernelInputs) -> tuple:
    return (inputs.seq_offsets, inputs.history, inputs.timestamps, inputs.pos_w, inputs.time_w, inputs.thresholds)


def _strides(*tensors: Tensor) -> tuple:
    return tuple(s for x in tensors for s in (x.stride(0), x.stride(1)))


def _scalar_args(inputs: KernelInputs, q: Tensor, v: Tensor) -> tuple:
    return (
        inputs.alpha,
        inputs.silu_scale,
        inputs.contextual_len,
        inputs.max_attn_len,
        inputs.num_pos,
        inputs.num_time,
        q.shape[1],
        q.shape[2],
        v.shape[2],
        triton.next_power_of_2(inputs.max_seq_len),
    )


def _flags(inputs: KernelInputs, q: Tensor, v: Tensor) -> dict:
    return dict(
        HAS_POS=inputs.num_pos > 0,
        HAS_TIME=inputs.num_time > 0,
        TIME_LOG=inputs.time_log,
        SCALE_BY_POSITION=inputs.scale_by_position,
        HAS_CONTEXT=inputs.contextual_len > 0,
        HAS_WINDOW=inputs.max_attn_len > 0,
        BLOCK_DQK=head_block(q.shape[2]),
        BLOCK_DV=head_block(v.shape[2]),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


@triton.jit
def _scores(q, k, rows, cols, hist, ts_rows, ts_cols, alpha, PosW, TimeW, Thresholds, num_pos, num_time,
            HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, TIME_LOG: tl.constexpr, PRECISION: tl.constexpr):
    """-> alpha q k^T + bias [M, N] fp32, and the position and time bucket indices."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * alpha
    pos_idx = rows[:, None] * 0 + cols[None, :] * 0
    time_idx = pos_idx
    if HAS_POS:
        pos_idx = position_bucket(tl.minimum(rows, hist)[:, None] - tl.minimum(cols, hist)[None, :], num_pos)
        s += tl.load(PosW + pos_idx)
    if HAS_TIME:
        time_idx = time_bucket(ts_rows[:, None] - ts_cols[None, :], Thresholds, num_time, TIME_LOG)
        s += tl.load(TimeW + time_idx)
    return s, pos_idx, time_idx


@triton.jit
def _attend(acc, q, rows, norm, ts_rows, n_lo, n_hi, start, length, hist, h,
            K, V, Ts, PosW, TimeW, Thresholds, stride_kt, stride_kh, stride_vt, stride_vh,
            alpha, contextual_len, max_attn_len, num_pos, num_time, DIM_QK, DIM_V,
            HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, TIME_LOG: tl.constexpr, HAS_CONTEXT: tl.constexpr,
            HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
            PRECISION: tl.constexpr):
    """acc [M, Dv] += sum over history keys [n_lo, n_hi) of SiLU(scores) * mask * norm * v."""
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_hi
        k = tl.load(K + (start + cols)[:, None] * stride_kt + h * stride_kh + dqk[None, :],
                    mask=col_ok[:, None] & (dqk < DIM_QK)[None, :], other=0.0)
        v = tl.load(V + (start + cols)[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=col_ok[:, None] & (dv < DIM_V)[None, :], other=0.0)
        ts_cols = tl.load(Ts + start + cols, mask=col_ok, other=0) if HAS_TIME else cols
        s, _, _ = _scores(q, k, rows, cols, hist, ts_rows, ts_cols, alpha, PosW, TimeW, Thresholds, num_pos,
                          num_time, HAS_POS, HAS_TIME, TIME_LOG, PRECISION)
        mask = visible(rows, cols, length, hist, contextual_len, max_attn_len, HAS_CONTEXT, HAS_WINDOW) & col_ok[None, :]
        _, silu = silu_parts(s)
        p = tl.where(mask, silu * norm[:, None], 0.0)
        acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc


@triton.jit
def _forward_kernel(Q, K, V, Out, SeqOffsets, History, Ts, PosW, TimeW, Thresholds,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    alpha, silu_scale, contextual_len, max_attn_len, num_pos, num_time, H, DIM_QK, DIM_V,
                    AUTOTUNE_MAX_LEN,
                    HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, TIME_LOG: tl.constexpr,
                    SCALE_BY_POSITION: tl.constexpr, HAS_CONTEXT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                    PRECISION: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    start, length, hist = sequence_of(SeqOffsets, History, b)
    if m0 < length:
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < length
        dqk = tl.arange(0, BLOCK_DQK)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(Q + (start + rows)[:, None] * stride_qt + h * stride_qh + dqk[None, :],
                    mask=row_ok[:, None] & (dqk < DIM_QK)[None, :], other=0.0)
        ts_rows = tl.load(Ts + start + rows, mask=row_ok, other=0) if HAS_TIME else rows
        norm = row_norm(rows, hist, silu_scale, SCALE_BY_POSITION)
        ctx_hi, lo, hi = key_ranges(m0, hist, contextual_len, max_attn_len, BLOCK_M, HAS_CONTEXT, HAS_WINDOW)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        acc = _attend(acc, q, rows, norm, ts_rows, 0, ctx_hi, start, length, hist, h, K, V, Ts, PosW, TimeW,
                      Thresholds, stride_kt, stride_kh, stride_vt, stride_vh, alpha, contextual_len, max_attn_len,
                      num_pos, num_time, DIM_QK, DIM_V, HAS_POS, HAS_TIME, TIME_LOG, HAS_CONTEXT, HAS_WINDOW,
                      BLOCK_N, BLOCK_DQK, BLOCK_DV, PRECISION)
        acc = _attend(acc, q, rows, norm, ts_rows, lo, hi, start, length, hist, h, K, V, Ts, PosW, TimeW,
                      Thresholds, stride_kt, stride_kh, stride_vt, stride_vh, alpha, contextual_len, max_attn_len,
                      num_pos, num_time, DIM_QK, DIM_V, HAS_POS, HAS_TIME, TIME_LOG, HAS_CONTEXT, HAS_WINDOW,
                      BLOCK_N, BLOCK_DQK, BLOCK_DV, PRECISION)
        # a target's only visible target key is itself: load its own K/V row, nobody else's
        target = row_ok & (rows >= hist)
        k_self = tl.load(K + (start + rows)[:, None] * stride_kt + h * stride_kh + dqk[None, :],
                         mask=target[:, None] & (dqk < DIM_QK)[None, :], other=0.0)
        v_self = tl.load(V + (start + rows)[:, None] * stride_vt + h * stride_vh + dv[None, :],
                         mask=target[:, None] & (dv < DIM_V)[None, :], other=0.0)
        s_self = tl.sum(q.to(tl.float32) * k_self.to(tl.float32), 1) * alpha
        s_self += self_bias(rows, PosW, TimeW, Thresholds, num_time, HAS_POS, HAS_TIME, TIME_LOG)
        _, silu_self = silu_parts(s_self)
        acc += tl.where(target, silu_self * norm, 0.0)[:, None] * v_self.to(tl.float32)
        tl.store(Out + (start + rows)[:, None] * stride_ot + h * stride_oh + dv[None, :], acc.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & (dv < DIM_V)[None, :])


@triton.jit
def _dq_range(dq, q, do, rows, norm, ts_rows, n_lo, n_hi, start, length, hist, h,
              K, V, Ts, PosW, TimeW, Thresholds, stride_kt, stride_kh, stride_vt, stride_vh,
              alpha, contextual_len, max_attn_len, num_pos, num_time, DIM_QK, DIM_V,
              HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, TIME_LOG: tl.constexpr, HAS_CONTEXT: tl.constexpr,
              HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
              PRECISION: tl.constexpr):
    """dq [M, Dqk] += dS k over history keys [n_lo, n_hi) (alpha applied by the caller)."""
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_hi
        k = tl.load(K + (start + cols)[:, None] * stride_kt + h * stride_kh + dqk[None, :],
                    mask=col_ok[:, None] & (dqk < DIM_QK)[None, :], other=0.0)
        v = tl.load(V + (start + cols)[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=col_ok[:, None] & (dv < DIM_V)[None, :], other=0.0)
        ts_cols = tl.load(Ts + start + cols, mask=col_ok, other=0) if HAS_TIME else cols
        s, _, _ = _scores(q, k, rows, cols, hist, ts_rows, ts_cols, alpha, PosW, TimeW, Thresholds, num_pos,
                          num_time, HAS_POS, HAS_TIME, TIME_LOG, PRECISION)
        mask = visible(rows, cols, length, hist, contextual_len, max_attn_len, HAS_CONTEXT, HAS_WINDOW) & col_ok[None, :]
        sig, silu = silu_parts(s)
        d_attn = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = tl.where(mask, d_attn * norm[:, None] * (sig + silu * (1.0 - sig)), 0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _backward_dq_kernel(Q, K, V, DO, DQ, SeqOffsets, History, Ts, PosW, TimeW, Thresholds,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                        stride_dqt, stride_dqh,
                        alpha, silu_scale, contextual_len, max_attn_len, num_pos, num_time, H, DIM_QK, DIM_V,
                        AUTOTUNE_MAX_LEN,
                        HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, TIME_LOG: tl.constexpr,
                        SCALE_BY_POSITION: tl.constexpr, HAS_CONTEXT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
                        BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    start, length, hist = sequence_of(SeqOffsets, History, b)
    if m0 < length:
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < length
        dqk = tl.arange(0, BLOCK_DQK)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(Q + (start + rows)[:, None] * stride_qt + h * stride_qh + dqk[None, :],
                    mask=row_ok[:, None] & (dqk < DIM_QK)[None, :], other=0.0)
        do = tl.load(DO + (start + rows)[:, None] * stride_dot + h * stride_doh + dv[None, :],
                     mask=row_ok[:, None] & (dv < DIM_V)[None, :], other=0.0)
        ts_rows = tl.load(Ts + start + rows, mask=row_ok, other=0) if HAS_TIME else rows
        norm = row_norm(rows, hist, silu_scale, SCALE_BY_POSITION)
        ctx_hi, lo, hi = key_ranges(m0, hist, contextual_len, max_attn_len, BLOCK_M, HAS_CONTEXT, HAS_WINDOW)
        dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
        dq = _dq_range(dq, q, do, rows, norm, ts_rows, 0, ctx_hi, start, length, hist, h, K, V, Ts, PosW, TimeW,
                       Thresholds, stride_kt, stride_kh, stride_vt, stride_vh, alpha, contextual_len, max_attn_len,
                       num_pos, num_time, DIM_QK, DIM_V, HAS_POS, HAS_TIME, TIME_LOG, HAS_CONTEXT, HAS_WINDOW,
                       BLOCK_N, BLOCK_DQK, BLOCK_DV, PRECISION)
        dq = _dq_range(dq, q, do, rows, norm, ts_rows, lo, hi, start, length, hist, h, K, V, Ts, PosW, TimeW,
                       Thresholds, stride_kt, stride_kh, stride_vt, stride_vh, alpha, contextual_len, max_attn_len,
                       num_pos, num_time, DIM_QK, DIM_V, HAS_POS, HAS_TIME, TIME_LOG, HAS_CONTEXT, HAS_WINDOW,
                       BLOCK_N, BLOCK_DQK, BLOCK_DV, PRECISION)
        target = row_ok & (rows >= hist)
        k_self = tl.load(K + (start + rows)[:, None] * stride_kt + h * stride_kh + dqk[None, :],
                         mask=target[:, None] & (dqk < DIM_QK)[None, :], other=0.0).to(tl.float32)
        v_self = tl.load(V + (start + rows)[:, None] * stride_vt + h * stride_vh + dv[None, :],
                         mask=target[:, None] & (dv < DIM_V)[None, :], other=0.0).to(tl.float32)
        s_self = tl.sum(q.to(tl.float32) * k_self, 1) * alpha
        s_self += self_bias(rows, PosW, TimeW, Thresholds, num_time, HAS_POS, HAS_TIME, TIME_LOG)
        sig, silu = silu_parts(s_self)
        ds_self = tl.sum(do.to(tl.float32) * v_self, 1) * norm * (sig + silu * (1.0 - sig))
        dq += tl.where(target, ds_self, 0.0)[:, None] * k_self
        tl.store(DQ + (start + rows)[:, None] * stride_dqt + h * stride_dqh + dqk[None, :],
                 (dq * alpha).to(DQ.dtype.element_ty), mask=row_ok[:, None] & (dqk < DIM_QK)[None, :])


@triton.jit
def _backward_dkv_kernel(Q, K, V, DO, DK, DV, DPos, DTime, SeqOffsets, History, Ts, PosW, TimeW, Thresholds,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                         stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                         alpha, silu_scale, contextual_len, max_attn_len, num_pos, num_time, H, DIM_QK, DIM_V,
                         AUTOTUNE_MAX_LEN,
                         HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, TIME_LOG: tl.constexpr,
                         SCALE_BY_POSITION: tl.constexpr, HAS_CONTEXT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
                         BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    start, length, hist = sequence_of(SeqOffsets, History, b)
    if n0 < length:
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < length
        dqk = tl.arange(0, BLOCK_DQK)
        dv_idx = tl.arange(0, BLOCK_DV)
        k = tl.load(K + (start + cols)[:, None] * stride_kt + h * stride_kh + dqk[None, :],
                    mask=col_ok[:, None] & (dqk < DIM_QK)[None, :], other=0.0)
        v = tl.load(V + (start + cols)[:, None] * stride_vt + h * stride_vh + dv_idx[None, :],
                    mask=col_ok[:, None] & (dv_idx < DIM_V)[None, :], other=0.0)
        ts_cols = tl.load(Ts + start + cols, mask=col_ok, other=0) if HAS_TIME else cols
        dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        m_lo, m_hi = query_range(n0, length, hist, contextual_len, max_attn_len, BLOCK_N, HAS_CONTEXT, HAS_WINDOW)
        for m0 in range(m_lo, m_hi, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < m_hi
            q = tl.load(Q + (start + rows)[:, None] * stride_qt + h * stride_qh + dqk[None, :],
                        mask=row_ok[:, None] & (dqk < DIM_QK)[None, :], other=0.0)
            do = tl.load(DO + (start + rows)[:, None] * stride_dot + h * stride_doh + dv_idx[None, :],
                         mask=row_ok[:, None] & (dv_idx < DIM_V)[None, :], other=0.0)
            ts_rows = tl.load(Ts + start + rows, mask=row_ok, other=0) if HAS_TIME else rows
            s, pos_idx, time_idx = _scores(q, k, rows, cols, hist, ts_rows, ts_cols, alpha, PosW, TimeW, Thresholds,
                                           num_pos, num_time, HAS_POS, HAS_TIME, TIME_LOG, PRECISION)
            mask = visible(rows, cols, length, hist, contextual_len, max_attn_len, HAS_CONTEXT, HAS_WINDOW)
            mask = mask & row_ok[:, None]
            norm = row_norm(rows, hist, silu_scale, SCALE_BY_POSITION)
            sig, silu = silu_parts(s)
            weight = tl.where(mask, norm[:, None], 0.0)
            dv += tl.dot(tl.trans((silu * weight).to(do.dtype)), do, input_precision=PRECISION)
            d_attn = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = d_attn * weight * (sig + silu * (1.0 - sig))
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
            if HAS_POS:
                tl.atomic_add(DPos + pos_idx, ds, mask=mask)
            if HAS_TIME:
                tl.atomic_add(DTime + time_idx, ds, mask=mask)
        # target keys: only the target itself sees them
        target = col_ok & (cols >= hist)
        q_self = tl.load(Q + (start + cols)[:, None] * stride_qt + h * stride_qh + dqk[None, :],
                         mask=target[:, None] & (dqk < DIM_QK)[None, :], other=0.0).to(tl.float32)
        do_self = tl.load(DO + (start + cols)[:, None] * stride_dot + h * stride_doh + dv_idx[None, :],
                          mask=target[:, None] & (dv_idx < DIM_V)[None, :], other=0.0).to(tl.float32)
        s_self = tl.sum(q_self * k.to(tl.float32), 1) * alpha
        s_self += self_bias(cols, PosW, TimeW, Thresholds, num_time, HAS_POS, HAS_TIME, TIME_LOG)
        sig, silu = silu_parts(s_self)
        weight_self = tl.where(target, row_norm(cols, hist, silu_scale, SCALE_BY_POSITION), 0.0)
        dv += (silu * weight_self)[:, None] * do_self
        ds_self = tl.sum(do_self * v.to(tl.float32), 1) * weight_self * (sig + silu * (1.0 - sig))
        dk += ds_self[:, None] * q_self
        zero = cols * 0
        if HAS_POS:
            tl.atomic_add(DPos + zero, ds_self, mask=target)
        if HAS_TIME:
            tl.atomic_add(DTime + time_bucket(zero, Thresholds, num_time, TIME_LOG), ds_self, mask=target)
        tl.store(DK + (start + cols)[:, None] * stride_dkt + h * stride_dkh + dqk[None, :],
                 (dk * alpha).to(DK.dtype.element_ty), mask=col_ok[:, None] & (dqk < DIM_QK)[None, :])
        tl.store(DV + (start + cols)[:, None] * stride_dvt + h * stride_dvh + dv_idx[None, :],
                 dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & (dv_idx < DIM_V)[None, :])
