"""Host side of the Triton kernels (GPU and NPU variants): argument checks, the inputs laid
out for the kernels, and the autograd wrapper. Device code: ``triton_blocks``.

The relative bias is fused from bucket weights and timestamps (``RelativeBias``): a
precomputed [B, L, L] bias would bring back the O(L^2) memory and padding the kernels avoid,
and its gradient is only needed per bucket. The time bucket is estimated with the device's
log/sqrt and corrected by one step against ``time_bucket_thresholds``, so it equals the
reference bucket exactly. Key timestamps and query times (``RelativeBias.resolved_query_times``) are
rebased to the minimum of both and passed as int32; when the queries use the tokens' own times
one tensor is passed twice and the kernels compile without the query-time path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

import torch
import triton
from torch import Tensor

from gr.hstu.kernels.common import RelativeBias, rebased_times, time_bucket_thresholds
from gr.jagged import history_lengths

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class KernelInputs:
    """One call's jagged metadata and fused-bias tables, laid out for the kernels.

    seq_offsets: [B+1] int32; history: [B] int32 (history length per sequence)
    timestamps: [T] int32 key times, rebased to the batch minimum ([1] dummy when time bias is off)
    query_times: [T] int32 query times, same base; the ``timestamps`` tensor itself when the
        queries use the tokens' own times (``RelativeBias.query_times`` None)
    pos_w: [P] fp32, time_w: [NB] fp32, thresholds: [NB+1] fp32 (each [1] dummy when off)
    """

    seq_offsets: Tensor
    history: Tensor
    timestamps: Tensor
    query_times: Tensor
    pos_w: Tensor
    time_w: Tensor
    thresholds: Tensor
    num_pos: int  # 0 = position bias off
    num_time: int  # 0 = time bias off
    time_log: bool
    max_seq_len: int
    alpha: float
    silu_scale: float  # ignored when scale_by_position
    scale_by_position: bool  # silu_scale None: norm_i = 1 / (pos_i + 1)
    contextual_len: int
    max_attn_len: int

    @property
    def batch(self) -> int:
        return self.seq_offsets.numel() - 1

    @property
    def has_query_times(self) -> bool:
        """Whether queries measure time from their own query times rather than their timestamps."""
        return self.query_times is not self.timestamps


class KernelSet(Protocol):
    """A device's forward and backward launches over ``KernelInputs``."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, inputs: KernelInputs) -> Tensor: ...

    def backward(
        self, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, inputs: KernelInputs
    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """-> dq, dk, dv, d position weights [P] fp32, d time weights [NB] fp32."""
        ...


def prepare_inputs(
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
    backend: str,
) -> KernelInputs:
    """Check what the kernels support and build their ``KernelInputs``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"hstu_attention[{backend}]: {name} is {x.dtype}; supported: fp32, bf16, fp16")
    if q.shape != k.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"hstu_attention[{backend}]: expected q, k [T, H, Dqk] and v [T, H, Dv], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    device = q.device
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    pos_w = rab.position_weights if rab is not None else None
    time_w = rab.time_weights if rab is not None else None
    timestamps = query_times = torch.zeros(1, dtype=torch.int32, device=device)
    thresholds = dummy
    time_log = True
    if time_w is not None:
        timestamps, query_times = _rebased_times(rab, device, backend)
        thresholds = time_bucket_thresholds(rab.time_bucketing, time_w.numel(), device)
        time_log = rab.time_bucketing == "log"
    return KernelInputs(
        seq_offsets=seq_offsets.to(device=device, dtype=torch.int32),
        history=history_lengths(seq_offsets, num_targets).to(device=device, dtype=torch.int32),
        timestamps=timestamps,
        query_times=query_times,
        pos_w=pos_w.detach().float().contiguous() if pos_w is not None else dummy,
        time_w=time_w.detach().float().contiguous() if time_w is not None else dummy,
        thresholds=thresholds,
        num_pos=pos_w.numel() if pos_w is not None else 0,
        num_time=time_w.numel() if time_w is not None else 0,
        time_log=time_log,
        max_seq_len=max(int(max_seq_len), 1),
        alpha=float(alpha),
        silu_scale=float(silu_scale) if silu_scale is not None else 0.0,
        scale_by_position=silu_scale is None,
        contextual_len=int(contextual_len),
        max_attn_len=int(max_attn_len),
    )


def _rebased_times(rab: RelativeBias, device: torch.device, backend: str) -> Tuple[Tensor, Tensor]:
    """-> (key timestamps, query times), each [T] int32 seconds since the earliest of both; one
    tensor twice when ``rab.query_times`` is None."""
    keys, queries = rebased_times(rab, device)
    span = max(int(keys.max()), int(queries.max())) if keys.numel() else 0
    if span >= 2**31:
        raise ValueError(
            f"hstu_attention[{backend}]: RelativeBias.timestamps (and query_times) span {span} s, more than 2^31 - 1"
        )
    keys32 = keys.to(torch.int32)
    return (keys32, keys32) if queries is keys else (keys32, queries.to(torch.int32))


class TritonAttention(torch.autograd.Function):
    """Differentiable in q, k, v and the bias weights; the kernels recompute scores in backward."""

    @staticmethod
    def forward(ctx, q, k, v, pos_w, time_w, inputs: KernelInputs, kernels: KernelSet):
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        ctx.save_for_backward(q, k, v)
        ctx.inputs, ctx.kernels = inputs, kernels
        ctx.weight_dtypes = tuple(w.dtype if w is not None else None for w in (pos_w, time_w))
        return kernels.forward(q, k, v, inputs)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        dq, dk, dv, dpos, dtime = ctx.kernels.backward(q, k, v, grad_out.contiguous(), ctx.inputs)
        pos_dtype, time_dtype = ctx.weight_dtypes
        dpos = dpos.to(pos_dtype) if pos_dtype is not None else None
        dtime = dtime.to(time_dtype) if time_dtype is not None else None
        return dq, dk, dv, dpos, dtime, None, None


def apply_kernels(
    q: Tensor, k: Tensor, v: Tensor, inputs: KernelInputs, rab: Optional[RelativeBias], kernels: KernelSet
) -> Tensor:
    """Run ``kernels`` under autograd; q, k: [T, H, Dqk], v: [T, H, Dv] -> [T, H, Dv]."""
    pos_w = rab.position_weights if rab is not None else None
    time_w = rab.time_weights if rab is not None else None
    return TritonAttention.apply(q, k, v, pos_w, time_w, inputs, kernels)


def head_block(dim: int) -> int:
    """Block size covering a head dimension (tl.dot needs >= 16)."""
    return max(16, triton.next_power_of_2(dim))


def strides(**tensors: Tensor) -> dict:
    """``stride_{name}t`` (token) and ``stride_{name}h`` (head) of each named [T, H, D] tensor,
    e.g. ``strides(q=q)`` -> {"stride_qt": .., "stride_qh": ..}."""
    out = {}
    for name, x in tensors.items():
        out[f"stride_{name}t"], out[f"stride_{name}h"] = x.stride(0), x.stride(1)
    return out


def scalar_args(inputs: KernelInputs, q: Tensor, v: Tensor) -> dict:
    """The block functions' scalar arguments, by name."""
    return dict(
        alpha=inputs.alpha,
        silu_scale=inputs.silu_scale,
        contextual_len=inputs.contextual_len,
        max_attn_len=inputs.max_attn_len,
        num_pos=inputs.num_pos,
        num_time=inputs.num_time,
        DIM_QK=q.shape[2],
        DIM_V=v.shape[2],
    )


def table_args(inputs: KernelInputs) -> dict:
    """The block functions' table pointers, by name."""
    return dict(
        SeqOffsets=inputs.seq_offsets,
        History=inputs.history,
        Ts=inputs.timestamps,
        QueryTimes=inputs.query_times,
        PosW=inputs.pos_w,
        TimeW=inputs.time_w,
        Thresholds=inputs.thresholds,
    )


def flags(inputs: KernelInputs, q: Tensor, v: Tensor, interpreted: bool) -> dict:
    """Compile-time switches of the block functions."""
    if q.dtype == torch.float32:
        precision = "ieee"
    else:
        precision = "upcast" if interpreted else "tf32"  # tf32: ignored for 16-bit operands
    return dict(
        HAS_POS=inputs.num_pos > 0,
        HAS_TIME=inputs.num_time > 0,
        TIME_LOG=inputs.time_log,
        QUERY_TIMES=inputs.has_query_times,
        SCALE_BY_POSITION=inputs.scale_by_position,
        HAS_CONTEXT=inputs.contextual_len > 0,
        HAS_WINDOW=inputs.max_attn_len > 0,
        BLOCK_DQK=head_block(q.shape[2]),
        BLOCK_DV=head_block(v.shape[2]),
        PRECISION=precision,
    )
