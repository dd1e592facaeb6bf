"""The HSTU attention kernels written to triton-ascend's NPU constraints.

Same block math as the CUDA kernels (``triton_blocks``), laid out the way triton-ascend's
programming guide asks for Ascend NPUs:

* a fixed grid of one program per AI (cube) core, each looping over a work list instead of
  one program per tile (extra programs beyond the physical cores run in further rounds and
  pay start-up each time). The list holds only real blocks of the jagged batch (no empty
  programs for short sequences), costliest first so the cores finish together;
* bias weights and time-bucket thresholds preloaded once per program into on-chip memory
  and read with ``tl.gather`` (no scattered global loads); position weights as one
  contiguous window per tile;
* block sizes multiples of 16, int32 index math, fp32 ``tl.atomic_add`` only (for the bias
  gradient: A2/A3 have no int64/fp64 atomics), no atomics for q/k/v gradients.

On CPU tensors it runs under ``TRITON_INTERPRET=1`` with PyPI triton (tests); on an NPU host it
needs triton-ascend in place of triton.
"""

from __future__ import annotations

from typing import Optional, Tuple

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
from gr.jagged import lengths_from_offsets

NPU_BLOCKS = (64, 64)  # (BLOCK_M, BLOCK_N) on an NPU
INTERPRETER_BLOCKS = (64, 64)
INTERPRETER_CORES = 3  # programs of the persistent grid when interpreted on CPU


def ascend_triton_hstu_attention(
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
    num_cores: Optional[int] = None,
) -> Tensor:
    """See ``gr.hstu.kernels.hstu_attention``; returns [T, H, Dv].

    blocks: (BLOCK_M, BLOCK_N), multiples of 16; num_cores: programs of the persistent grid
    (None: the device's AI core count, or ``INTERPRETER_CORES`` under the interpreter).
    """
    interpreted = isinstance(_forward_kernel, InterpretedFunction)
    if q.device.type != "npu" and not interpreted:
        raise RuntimeError(
            f"hstu_attention[ascend_triton]: tensors are on {q.device.type}; the kernels need an NPU with "
            "triton-ascend, or TRITON_INTERPRET=1 set before gr.hstu.kernels.ascend_triton is imported (CPU, tests)"
        )
    blocks = blocks or (INTERPRETER_BLOCKS if interpreted else NPU_BLOCKS)
    if any(b % 16 or b <= 0 for b in blocks):
        raise ValueError(f"hstu_attention[ascend_triton]: blocks must be positive multiples of 16, got {blocks}")
    if num_cores is None:
        num_cores = INTERPRETER_CORES if interpreted else _ai_cores(q.device)
    inputs = prepare_inputs(
        q,
        k,
        v,
        seq_offsets,
        max_seq_len,
        num_targets,
        contextual_len,
        max_attn_len,
        alpha,
        silu_scale,
        rab,
        "ascend_triton",
    )
    return apply_kernels(q, k, v, inputs, rab, AscendKernels(blocks, num_cores, interpreted))


def _ai_cores(device: torch.device) -> int:
    """Cube cores of the NPU (the grid size triton-ascend recommends for tl.dot kernels)."""
    properties = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return int(properties["num_aicore"])


def work_list(seq_offsets: Tensor, block: int, query_major: bool) -> Tuple[Tensor, Tensor]:
    """Blocks of the jagged batch, costliest first.

    returns (sequence, first row) of each block, both [W] int32. A query block's cost grows
    with its start (more keys before it), a key block's with the rows after it.
    """
    lengths = lengths_from_offsets(seq_offsets.long())
    counts = (lengths + block - 1) // block
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), counts)
    first_block = torch.cumsum(counts, 0) - counts
    start = (torch.arange(seq.numel(), device=lengths.device) - first_block[seq]) * block
    cost = start if query_major else lengths[seq] - start
    order = torch.argsort(cost, descending=True, stable=True)
    return seq[order].int(), start[order].int()


class AscendKernels:
    """Launches the persistent kernels: grid = (num_cores,)."""

    def __init__(self, blocks: Tuple[int, int], num_cores: int, interpreted: bool) -> None:
        self.blocks, self.num_cores, self.interpreted = blocks, num_cores, interpreted

    def _meta(self, inputs: KernelInputs, q: Tensor, v: Tensor) -> dict:
        block_m, block_n = self.blocks
        return dict(
            flags(inputs, q, v, self.interpreted),
            H=q.shape[1],
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            POS_WINDOW=triton.next_power_of_2(block_m + block_n),
            TIME_TABLE=triton.next_power_of_2(max(inputs.num_time, 1)),
            THR_TABLE=triton.next_power_of_2(inputs.num_time + 1),
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, inputs: KernelInputs) -> Tensor:
        out = torch.empty(*q.shape[:2], v.shape[-1], dtype=v.dtype, device=v.device)
        _forward_kernel[(self.num_cores,)](
            Q=q,
            K=k,
            V=v,
            DO=q,
            Out=out,
            **table_args(inputs),
            **_tile_args(work_list(inputs.seq_offsets, self.blocks[0], query_major=True)),
            **strides(q=q, k=k, v=v, do=q, o=out),
            **scalar_args(inputs, q, v),
            **self._meta(inputs, q, v),
        )
        return out

    def backward(self, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, inputs: KernelInputs):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dpos = torch.zeros(max(inputs.num_pos, 1), dtype=torch.float32, device=q.device)
        dtime = torch.zeros(max(inputs.num_time, 1), dtype=torch.float32, device=q.device)
        common = dict(
            Q=q, K=k, V=v, DO=grad_out, **table_args(inputs), **scalar_args(inputs, q, v), **self._meta(inputs, q, v)
        )
        _backward_dq_kernel[(self.num_cores,)](
            DQ=dq,
            **_tile_args(work_list(inputs.seq_offsets, self.blocks[0], query_major=True)),
            **strides(q=q, k=k, v=v, do=grad_out, dq=dq),
            **common,
        )
        _backward_dkv_kernel[(self.num_cores,)](
            DK=dk,
            DV=dv,
            DPos=dpos,
            DTime=dtime,
            **_tile_args(work_list(inputs.seq_offsets, self.blocks[1], query_major=False)),
            **strides(q=q, k=k, v=v, do=grad_out, dk=dk, dv=dv),
            **common,
        )
        return dq, dk, dv, dpos[: inputs.num_pos], dtime[: inputs.num_time]


def _tile_args(tiles: Tuple[Tensor, Tensor]) -> dict:
    """A ``work_list`` as the kernels' TileSeq, TileStart and num_tiles arguments."""
    seq, start = tiles
    return dict(TileSeq=seq, TileStart=start, num_tiles=seq.numel())


@triton.jit
def _tables(TimeW, Thresholds, num_time, HAS_TIME: tl.constexpr, TIME_TABLE: tl.constexpr, THR_TABLE: tl.constexpr):
    """Time-bias weights and bucket thresholds, loaded once per program into on-chip memory."""
    time_table = tl.zeros([TIME_TABLE], dtype=tl.float32)
    thr_table = tl.zeros([THR_TABLE], dtype=tl.float32)
    if HAS_TIME:
        idx = tl.arange(0, TIME_TABLE)
        time_table = tl.load(TimeW + idx, mask=idx < num_time, other=0.0)
        idx = tl.arange(0, THR_TABLE)
        thr_table = tl.load(Thresholds + idx, mask=idx <= num_time, other=float("inf"))
    return time_table, thr_table


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
    TileSeq,
    TileStart,
    num_tiles,
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
    H: tl.constexpr,
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
    POS_WINDOW: tl.constexpr,
    TIME_TABLE: tl.constexpr,
    THR_TABLE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    time_table, thr_table = _tables(TimeW, Thresholds, num_time, HAS_TIME, TIME_TABLE, THR_TABLE)
    for work in range(tl.program_id(0), num_tiles * H, tl.num_programs(0)):
        tile = work // H
        query_block(
            b=tl.load(TileSeq + tile),
            h=work % H,
            m0=tl.load(TileStart + tile),
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
            time_table=time_table,
            thr_table=thr_table,
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
            UB_TABLES=True,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_DQK=BLOCK_DQK,
            BLOCK_DV=BLOCK_DV,
            POS_WINDOW=POS_WINDOW,
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
    TileSeq,
    TileStart,
    num_tiles,
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
    H: tl.constexpr,
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
    POS_WINDOW: tl.constexpr,
    TIME_TABLE: tl.constexpr,
    THR_TABLE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    time_table, thr_table = _tables(TimeW, Thresholds, num_time, HAS_TIME, TIME_TABLE, THR_TABLE)
    for work in range(tl.program_id(0), num_tiles * H, tl.num_programs(0)):
        tile = work // H
        query_block(
            b=tl.load(TileSeq + tile),
            h=work % H,
            m0=tl.load(TileStart + tile),
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
            time_table=time_table,
            thr_table=thr_table,
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
            UB_TABLES=True,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_DQK=BLOCK_DQK,
            BLOCK_DV=BLOCK_DV,
            POS_WINDOW=POS_WINDOW,
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
    TileSeq,
    TileStart,
    num_tiles,
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
    H: tl.constexpr,
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
    POS_WINDOW: tl.constexpr,
    TIME_TABLE: tl.constexpr,
    THR_TABLE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    time_table, thr_table = _tables(TimeW, Thresholds, num_time, HAS_TIME, TIME_TABLE, THR_TABLE)
    for work in range(tl.program_id(0), num_tiles * H, tl.num_programs(0)):
        tile = work // H
        key_block(
            b=tl.load(TileSeq + tile),
            h=work % H,
            n0=tl.load(TileStart + tile),
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
            time_table=time_table,
            thr_table=thr_table,
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
            UB_TABLES=True,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_DQK=BLOCK_DQK,
            BLOCK_DV=BLOCK_DV,
            POS_WINDOW=POS_WINDOW,
            PRECISION=PRECISION,
        )
