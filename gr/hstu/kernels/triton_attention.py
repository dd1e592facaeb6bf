"""Fused jagged HSTU attention in Triton for CUDA (forward, backward, bias-weight gradients).

One program per (query or key block, sequence, head) over the jagged tensors (no padding;
blocks past a sequence's end return at once). The block bodies (``triton_blocks``) skip what
the mask hides, so a sequence with L history and N target tokens costs O(L^2 + N*L).
Backward: dq in a query-major pass (no atomics), dk/dv in a key-major pass that also adds dS
into the position/time bucket gradients with fp32 atomics. Block sizes are autotuned over
Ampere / Hopper configs, keyed on the (power-of-two) max length and head dims.

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
from gr.hstu.kernels.triton_blocks import key_block, query_block
from gr.hstu.kernels.triton_common import (
    KernelInputs,
    apply_kernels,
    flags,
    prepare_inputs,
    scalar_args,
    strides,
    table_args,
)

INTERPRETER_BLOCKS = (64, 64)  # (BLOCK_M, BLOCK_N) when interpreted on CPU


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

    blocks: (BLOCK_M, BLOCK_N), multiples of 16; None autotunes on CUDA and uses
    ``INTERPRETER_BLOCKS`` under the interpreter.
    """
    interpreted = isinstance(_forward_kernel, InterpretedFunction)
    if q.device.type != "cuda" and not interpreted:
        raise RuntimeError(
            f"hstu_attention[triton]: tensors are on {q.device.type}; the Triton kernels need CUDA, or "
            "TRITON_INTERPRET=1 set before gr.hstu.kernels.triton_attention is imported (CPU, tests only)"
        )
    if blocks is not None and any(b % 16 or b <= 0 for b in blocks):
        raise ValueError(f"hstu_attention[triton]: blocks must be positive multiples of 16, got {blocks}")
    inputs = prepare_inputs(
        q, k, v, seq_offsets, max_seq_len, num_targets, contextual_len, max_attn_len, alpha, silu_scale, rab, "triton"
    )
    if blocks is None and interpreted:
        blocks = INTERPRETER_BLOCKS
    return apply_kernels(q, k, v, inputs, rab, CudaKernels(blocks, interpreted))


class CudaKernels:
    """Launches the three kernels with fixed blocks, or autotuned ones when ``blocks`` is None."""

    def __init__(self, blocks: Optional[Tuple[int, int]], interpreted: bool) -> None:
        self.blocks, self.interpreted = blocks, interpreted

    def forward(self, q: Tensor, k: Tensor, v: Tensor, inputs: KernelInputs) -> Tensor:
        out = torch.empty(*q.shape[:2], v.shape[-1], dtype=v.dtype, device=v.device)
        args = dict(
            Q=q,
            K=k,
            V=v,
            DO=q,
            Out=out,
            **table_args(inputs),
            **strides(q=q, k=k, v=v, do=q, o=out),
            **scalar_args(inputs, q, v),
        )
        self._launch(_forward_kernel, "BLOCK_M", args, inputs, q, v)
        return out

    def backward(self, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, inputs: KernelInputs):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dpos = torch.zeros(max(inputs.num_pos, 1), dtype=torch.float32, device=q.device)
        dtime = torch.zeros(max(inputs.num_time, 1), dtype=torch.float32, device=q.device)
        common = dict(Q=q, K=k, V=v, DO=grad_out, **table_args(inputs), **scalar_args(inputs, q, v))
        dq_args = dict(common, DQ=dq, **strides(q=q, k=k, v=v, do=grad_out, dq=dq))
        self._launch(_backward_dq_kernel, "BLOCK_M", dq_args, inputs, q, v)
        dkv_args = dict(
            common, DK=dk, DV=dv, DPos=dpos, DTime=dtime, **strides(q=q, k=k, v=v, do=grad_out, dk=dk, dv=dv)
        )
        self._launch(_backward_dkv_kernel, "BLOCK_N", dkv_args, inputs, q, v)
        return dq, dk, dv, dpos[: inputs.num_pos], dtime[: inputs.num_time]

    def _launch(self, kernel, block: str, args: dict, inputs: KernelInputs, q: Tensor, v: Tensor) -> None:
        """Launch ``kernel`` with its arguments by name (``args`` and the switches). Grid: (B * H,
        blocks along the longest sequence); B * H first, CUDA's axis 0 has no 65535 limit."""
        heads = q.shape[1]
        meta_args = dict(
            flags(inputs, q, v, self.interpreted), H=heads, AUTOTUNE_MAX_LEN=triton.next_power_of_2(inputs.max_seq_len)
        )
        if self.blocks is None:
            grid = lambda meta: (inputs.batch * heads, triton.cdiv(inputs.max_seq_len, meta[block]))  # noqa: E731
            _tuned(kernel)[grid](**args, **meta_args)
        else:
            sizes = {"BLOCK_M": self.blocks[0], "BLOCK_N": self.blocks[1]}
            grid = (inputs.batch * heads, triton.cdiv(inputs.max_seq_len, sizes[block]))
            kernel[grid](**args, **meta_args, **sizes)


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


@functools.lru_cache(maxsize=None)
def _tuned(kernel):
    """The kernel wrapped in triton.autotune (built on first CUDA use; the bias-gradient
    buffers are reset between trials since the key-major pass accumulates into them)."""
    reset = ["DPos", "DTime"] if kernel is _backward_dkv_kernel else None
    keys = ["AUTOTUNE_MAX_LEN", "DIM_QK", "DIM_V"]
    return triton.autotune(configs=_autotune_configs(), key=keys, reset_to_zero=reset)(kernel)


@triton.jit
def _forward_kernel(
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
    H,
    AUTOTUNE_MAX_LEN,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    TIME_LOG: tl.constexpr,
    QUERY_TIMES: tl.constexpr,
    SCALE_BY_POSITION: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    query_block(
        b=tl.program_id(0) // H,
        h=tl.program_id(0) % H,
        m0=tl.program_id(1) * BLOCK_M,
        Q=Q,
        K=K,
        V=V,
        DO=DO,
        Out=Out,
        SeqOffsets=SeqOffsets,
        History=History,
        Ts=Ts,
        QueryTimes=QueryTimes,
        PosW=PosW,
        TimeW=TimeW,
        Thresholds=Thresholds,
        time_table=0,
        thr_table=0,
        stride_qt=stride_qt,
        stride_qh=stride_qh,
        stride_kt=stride_kt,
        stride_kh=stride_kh,
        stride_vt=stride_vt,
        stride_vh=stride_vh,
        stride_dot=stride_dot,
        stride_doh=stride_doh,
        stride_ot=stride_ot,
        stride_oh=stride_oh,
        alpha=alpha,
        silu_scale=silu_scale,
        contextual_len=contextual_len,
        max_attn_len=max_attn_len,
        num_pos=num_pos,
        num_time=num_time,
        DIM_QK=DIM_QK,
        DIM_V=DIM_V,
        HAS_POS=HAS_POS,
        HAS_TIME=HAS_TIME,
        TIME_LOG=TIME_LOG,
        QUERY_TIMES=QUERY_TIMES,
        SCALE_BY_POSITION=SCALE_BY_POSITION,
        HAS_CONTEXT=HAS_CONTEXT,
        HAS_WINDOW=HAS_WINDOW,
        UB_TABLES=False,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_DQK=BLOCK_DQK,
        BLOCK_DV=BLOCK_DV,
        POS_WINDOW=1,
        PRECISION=PRECISION,
        GRAD=False,
    )


@triton.jit
def _backward_dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    SeqOffsets,
    History,
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
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    alpha,
    silu_scale,
    contextual_len,
    max_attn_len,
    num_pos,
    num_time,
    DIM_QK,
    DIM_V,
    H,
    AUTOTUNE_MAX_LEN,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    TIME_LOG: tl.constexpr,
    QUERY_TIMES: tl.constexpr,
    SCALE_BY_POSITION: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    query_block(
        b=tl.program_id(0) // H,
        h=tl.program_id(0) % H,
        m0=tl.program_id(1) * BLOCK_M,
        Q=Q,
        K=K,
        V=V,
        DO=DO,
        Out=DQ,
        SeqOffsets=SeqOffsets,
        History=History,
        Ts=Ts,
        QueryTimes=QueryTimes,
        PosW=PosW,
        TimeW=TimeW,
        Thresholds=Thresholds,
        time_table=0,
        thr_table=0,
        stride_qt=stride_qt,
        stride_qh=stride_qh,
        stride_kt=stride_kt,
        stride_kh=stride_kh,
        stride_vt=stride_vt,
        stride_vh=stride_vh,
        stride_dot=stride_dot,
        stride_doh=stride_doh,
        stride_ot=stride_dqt,
        stride_oh=stride_dqh,
        alpha=alpha,
        silu_scale=silu_scale,
        contextual_len=contextual_len,
        max_attn_len=max_attn_len,
        num_pos=num_pos,
        num_time=num_time,
        DIM_QK=DIM_QK,
        DIM_V=DIM_V,
        HAS_POS=HAS_POS,
        HAS_TIME=HAS_TIME,
        TIME_LOG=TIME_LOG,
        QUERY_TIMES=QUERY_TIMES,
        SCALE_BY_POSITION=SCALE_BY_POSITION,
        HAS_CONTEXT=HAS_CONTEXT,
        HAS_WINDOW=HAS_WINDOW,
        UB_TABLES=False,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_DQK=BLOCK_DQK,
        BLOCK_DV=BLOCK_DV,
        POS_WINDOW=1,
        PRECISION=PRECISION,
        GRAD=True,
    )


@triton.jit
def _backward_dkv_kernel(
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
    H,
    AUTOTUNE_MAX_LEN,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    TIME_LOG: tl.constexpr,
    QUERY_TIMES: tl.constexpr,
    SCALE_BY_POSITION: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    key_block(
        b=tl.program_id(0) // H,
        h=tl.program_id(0) % H,
        n0=tl.program_id(1) * BLOCK_N,
        Q=Q,
        K=K,
        V=V,
        DO=DO,
        DK=DK,
        DV=DV,
        DPos=DPos,
        DTime=DTime,
        SeqOffsets=SeqOffsets,
        History=History,
        Ts=Ts,
        QueryTimes=QueryTimes,
        PosW=PosW,
        TimeW=TimeW,
        Thresholds=Thresholds,
        time_table=0,
        thr_table=0,
        stride_qt=stride_qt,
        stride_qh=stride_qh,
        stride_kt=stride_kt,
        stride_kh=stride_kh,
        stride_vt=stride_vt,
        stride_vh=stride_vh,
        stride_dot=stride_dot,
        stride_doh=stride_doh,
        stride_dkt=stride_dkt,
        stride_dkh=stride_dkh,
        stride_dvt=stride_dvt,
        stride_dvh=stride_dvh,
        alpha=alpha,
        silu_scale=silu_scale,
        contextual_len=contextual_len,
        max_attn_len=max_attn_len,
        num_pos=num_pos,
        num_time=num_time,
        DIM_QK=DIM_QK,
        DIM_V=DIM_V,
        HAS_POS=HAS_POS,
        HAS_TIME=HAS_TIME,
        TIME_LOG=TIME_LOG,
        QUERY_TIMES=QUERY_TIMES,
        SCALE_BY_POSITION=SCALE_BY_POSITION,
        HAS_CONTEXT=HAS_CONTEXT,
        HAS_WINDOW=HAS_WINDOW,
        UB_TABLES=False,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_DQK=BLOCK_DQK,
        BLOCK_DV=BLOCK_DV,
        POS_WINDOW=1,
        PRECISION=PRECISION,
    )
