"""What the GPU and NPU Triton kernels share: host-side preparation, the autograd wrapper,
and the per-element contract math as ``@triton.jit`` helpers.

The relative bias is fused from bucket weights and timestamps (``RelativeBias``): a
precomputed [B, L, L] bias would bring back the O(L^2) memory and padding the kernels avoid,
and its gradient is only needed per bucket. The time bucket is estimated with the device's
log/sqrt and corrected by one step against ``time_bucket_thresholds``, so it equals the
reference bucket exactly; timestamps are rebased to the batch minimum and passed as int32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from gr.hstu.kernels.common import TIME_BUCKET_LOG_DIV, RelativeBias, time_bucket_thresholds
from gr.jagged import history_lengths

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG_DIV = tl.constexpr(TIME_BUCKET_LOG_DIV)


@dataclass
class KernelInputs:
    """One call's jagged metadata and fused-bias tables, laid out for the kernels.

    seq_offsets: [B+1] int32; history: [B] int32 (history length per sequence)
    timestamps: [T] int32 rebased to the batch minimum ([1] dummy when time bias is off)
    pos_w: [P] fp32, time_w: [NB] fp32, thresholds: [NB+1] fp32 (each [1] dummy when off)
    """

    seq_offsets: Tensor
    history: Tensor
    timestamps: Tensor
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


class KernelSet(Protocol):
    """A device's forward and backward launches over ``KernelInputs``."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, inputs: KernelInputs) -> Tensor:
        ...

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
    timestamps = torch.zeros(1, dtype=torch.int32, device=device)
    thresholds = dummy
    time_log = True
    if time_w is not None:
        ts = rab.timestamps.to(device=device, dtype=torch.int64)
        ts = ts - ts.min() if ts.numel() else ts
        if ts.numel() and int(ts.max()) >= 2**31:
            raise ValueError(f"hstu_attention[{backend}]: timestamps span {int(ts.max())} s; at most 2^31 - 1 supported")
        timestamps = ts.to(torch.int32)
        thresholds = time_bucket_thresholds(rab.time_bucketing, time_w.numel(), device)
        time_log = rab.time_bucketing == "log"
    return KernelInputs(
        seq_offsets=seq_offsets.to(device=device, dtype=torch.int32),
        history=history_lengths(seq_offsets, num_targets).to(device=device, dtype=torch.int32),
        timestamps=timestamps,
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


class TritonAttention(torch.autograd.Function):
    """Differentiable in q, k, v and the bias weights; the kernels recompute scores in backward."""

    @staticmethod
    def forward(ctx, q, k, v, pos_w, time_w, inputs: KernelInputs, kernels: KernelSet):  # noqa: D401
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


def apply_kernels(q: Tensor, k: Tensor, v: Tensor, inputs: KernelInputs, rab: Optional[RelativeBias], kernels: KernelSet) -> Tensor:
    pos_w = rab.position_weights if rab is not None else None
    time_w = rab.time_weights if rab is not None else None
    return TritonAttention.apply(q, k, v, pos_w, time_w, inputs, kernels)


def head_block(dim: int) -> int:
    """Block size covering a head dimension (tl.dot needs >= 16)."""
    return max(16, triton.next_power_of_2(dim))


@triton.jit
def sequence_of(SeqOffsets, History, b):
    """-> start (int64), length, history length of sequence b."""
    start = tl.load(SeqOffsets + b)
    length = tl.load(SeqOffsets + b + 1) - start
    return start.to(tl.int64), length, tl.load(History + b)


@triton.jit
def key_ranges(m0, hist, contextual_len, max_attn_len, BLOCK_M: tl.constexpr, HAS_CONTEXT: tl.constexpr,
               HAS_WINDOW: tl.constexpr):
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
def query_range(n0, length, hist, contextual_len, max_attn_len, BLOCK_N: tl.constexpr, HAS_CONTEXT: tl.constexpr,
                HAS_WINDOW: tl.constexpr):
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
def visible(rows, cols, length, hist, contextual_len, max_attn_len, HAS_CONTEXT: tl.constexpr,
            HAS_WINDOW: tl.constexpr):
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
def row_norm(rows, hist, silu_scale, SCALE_BY_POSITION: tl.constexpr):
    """Per-query factor after SiLU: 1 / (pos + 1) or silu_scale, fp32 [M]."""
    if SCALE_BY_POSITION:
        norm = 1.0 / (tl.minimum(rows, hist).to(tl.float32) + 1.0)
    else:
        norm = tl.zeros(rows.shape, dtype=tl.float32) + silu_scale
    return norm


@triton.jit
def position_bucket(pos_delta, num_pos):
    return tl.minimum(tl.maximum(pos_delta, 0), num_pos - 1)


@triton.jit
def time_bucket(delta, Thresholds, num_time, TIME_LOG: tl.constexpr):
    """|dt| (int32, any shape) -> bucket of ``common.time_bucket``: a log/sqrt estimate, then
    one correction step against the threshold table."""
    x = tl.maximum(tl.abs(delta).to(tl.float32), 1.0)
    if TIME_LOG:
        estimate = tl.log(x) / _LOG_DIV
    else:
        estimate = tl.sqrt(x)
    bucket = tl.minimum(estimate.to(tl.int32), num_time - 1)
    bucket = bucket - (x < tl.load(Thresholds + bucket)).to(tl.int32)
    bucket = bucket + (x >= tl.load(Thresholds + bucket + 1)).to(tl.int32)
    return tl.minimum(tl.maximum(bucket, 0), num_time - 1)


@triton.jit
def silu_parts(s):
    """-> sigmoid(s), silu(s) (fp32)."""
    sig = 1.0 / (1.0 + tl.exp(-s))
    return sig, s * sig


@triton.jit
def self_bias(like, PosW, TimeW, Thresholds, num_time, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
              TIME_LOG: tl.constexpr):
    """Bias of a token on itself (relative position 0, time delta 0), shaped like ``like`` [M]."""
    bias = tl.zeros(like.shape, dtype=tl.float32)
    zero = like.to(tl.int32) * 0
    if HAS_POS:
        bias += tl.load(PosW + zero)
    if HAS_TIME:
        bias += tl.load(TimeW + time_bucket(zero, Thresholds, num_time, TIME_LOG))
    return bias

