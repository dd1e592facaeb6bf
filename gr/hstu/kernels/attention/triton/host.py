"""Host side of the Triton kernels (GPU and NPU variants): argument checks, the inputs laid
out for the kernels, one argument assembly, one launcher and the autograd wrapper. Device code:
``blocks``.

The CUDA and NPU variants launch the same kernel through ``TritonKernels``; a ``Layout``
is what differs between them: the tile sizes, and the grid (one program per block) or the work
list (a fixed grid of cores looping over the batch's blocks) with on-chip bias tables.

The relative bias is fused from bucket weights and timestamps (``RelativeBias``): a
precomputed [B, L, L] bias would bring back the O(L^2) memory and padding the kernels avoid,
and its gradient is only needed per bucket. The time bucket is estimated with the device's
log/sqrt and corrected by one step against ``time_bucket_thresholds``, so it equals the
reference bucket exactly. Key timestamps and query times (``RelativeBias.resolved_query_times``) are
rebased to the minimum of both and passed as int32 (one tensor twice when the queries use the
tokens' own times).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Protocol, Tuple

import torch
import triton
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from gr.hstu.kernels.attention.common import (
    AttentionCall,
    AttentionOptions,
    RelativeBias,
    rebased_times,
    time_bucket_thresholds,
)
from gr.hstu.kernels.attention.triton.blocks import attention_kernel
from gr.hstu.kernels.attention.triton.tuning import TileConfig
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


def interpreted_on(device: torch.device, op: str, kernel: triton.runtime.KernelInterface) -> bool:
    """Whether ``kernel`` runs under Triton's interpreter (CPU tensors); an error unless it does or
    ``device`` is CUDA."""
    interpreted = isinstance(kernel, InterpretedFunction)
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(
            f"{op}: tensors are on {device.type}; the Triton kernels need CUDA, or TRITON_INTERPRET=1 set "
            "before gr.hstu.kernels.attention.triton is imported (CPU, tests only)"
        )
    return interpreted


def check_dtypes(op: str, **tensors: Tensor) -> None:
    """Each named tensor of a dtype the kernels support (``op`` names the call in the error)."""
    for name, x in tensors.items():
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{op}: {name} is {x.dtype}; supported: fp32, bf16, fp16")


@dataclass
class BiasTables:
    """The fused relative bias laid out for the kernels: ``KernelInputs``' fields of those names."""

    timestamps: Tensor
    query_times: Tensor
    pos_w: Tensor
    time_w: Tensor
    thresholds: Tensor
    num_pos: int
    num_time: int
    time_log: bool


def bias_tables(rab: Optional[RelativeBias], device: torch.device, op: str) -> BiasTables:
    """``rab``'s weights, int32 rebased times and bucket thresholds on ``device`` ([1] dummies for
    the parts that are off); ``op`` names the call in errors."""
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    pos_w = rab.position_weights if rab is not None else None
    time_w = rab.time_weights if rab is not None else None
    timestamps = query_times = torch.zeros(1, dtype=torch.int32, device=device)
    thresholds = dummy
    time_log = True
    if rab is not None and time_w is not None:
        timestamps, query_times = _rebased_times(rab, device, op)
        thresholds = time_bucket_thresholds(rab.time_bucketing, time_w.numel(), device)
        time_log = rab.time_bucketing == "log"
    return BiasTables(
        timestamps=timestamps,
        query_times=query_times,
        pos_w=pos_w.detach().float().contiguous() if pos_w is not None else dummy,
        time_w=time_w.detach().float().contiguous() if time_w is not None else dummy,
        thresholds=thresholds,
        num_pos=pos_w.numel() if pos_w is not None else 0,
        num_time=time_w.numel() if time_w is not None else 0,
        time_log=time_log,
    )


def prepare_inputs(call: AttentionCall, backend: str) -> KernelInputs:
    """Check the dtypes the kernels support and build their ``KernelInputs`` (shapes: ``call.validate``)."""
    op = f"hstu_attention[{backend}]"
    check_dtypes(op, q=call.q, k=call.k, v=call.v)
    history = history_lengths(call.seq_offsets, call.num_targets)
    return kernel_inputs(
        op, call.seq_offsets, history, call.max_seq_len, AttentionOptions.of(call), call.rab, call.q.device
    )


def kernel_inputs(
    op: str,
    seq_offsets: Tensor,
    history: Tensor,
    max_seq_len: int,
    options: AttentionOptions,
    rab: Optional[RelativeBias],
    device: torch.device,
) -> KernelInputs:
    """``KernelInputs`` of sequences ``seq_offsets`` [B+1] with ``history`` [B] history tokens each
    (``op`` names the call in errors)."""
    return KernelInputs(
        seq_offsets=seq_offsets.to(device=device, dtype=torch.int32),
        history=history.to(device=device, dtype=torch.int32),
        **vars(bias_tables(rab, device, op)),
        max_seq_len=max(int(max_seq_len), 1),
        alpha=float(options.alpha),
        silu_scale=float(options.silu_scale) if options.silu_scale is not None else 0.0,
        scale_by_position=options.silu_scale is None,
        contextual_len=int(options.contextual_len),
        max_attn_len=int(options.max_attn_len),
    )


def _rebased_times(rab: RelativeBias, device: torch.device, op: str) -> Tuple[Tensor, Tensor]:
    """-> (key timestamps, query times), each [T] int32 seconds since the earliest of both; one
    tensor twice when ``rab.query_times`` is None."""
    keys, queries = rebased_times(rab, device)
    span = max(int(keys.max()), int(queries.max())) if keys.numel() else 0
    if span >= 2**31:
        raise ValueError(f"{op}: RelativeBias.timestamps (and query_times) span {span} s, more than 2^31 - 1")
    keys32 = keys.to(torch.int32)
    return (keys32, keys32) if queries is keys else (keys32, queries.to(torch.int32))


class TritonAttention(torch.autograd.Function):
    """Differentiable in q, k, v and the bias weights; the kernels recompute scores in backward."""

    @staticmethod
    def forward(ctx, q, k, v, pos_w, time_w, inputs: KernelInputs, kernels: TritonKernels):
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


def apply_kernels(call: AttentionCall, inputs: KernelInputs, kernels: TritonKernels) -> Tensor:
    """Run ``kernels`` on ``call`` under autograd -> [T, H, Dv]."""
    pos_w = call.rab.position_weights if call.rab is not None else None
    time_w = call.rab.time_weights if call.rab is not None else None
    return TritonAttention.apply(call.q, call.k, call.v, pos_w, time_w, inputs, kernels)


@dataclass
class Launch:
    """One kernel launch before its layout: the kernel, its name (``forward``, ``backward_dq`` or
    ``backward_dkv``) and its arguments by name (all but the layout's: work list, tile sizes).

    row_block: the tile programs split their rows by ("BLOCK_M": query-major, "BLOCK_N": key-major)
    reset: tensors the kernel accumulates into, zeroed before each launch
    """

    name: str
    kernel: triton.runtime.KernelInterface
    args: Dict[str, Any]
    row_block: str
    reset: Tuple[Tensor, ...] = field(default=())


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


def common_args(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, inputs: KernelInputs, interpreted: bool) -> dict:
    """The arguments every kernel takes, by name: inputs, tables, strides, scalars, switches.
    grad_out: [T, H, Dv] d output (``q`` itself in forward, where it is not read)."""
    return dict(
        Q=q,
        K=k,
        V=v,
        DO=grad_out,
        SeqOffsets=inputs.seq_offsets,
        History=inputs.history,
        Ts=inputs.timestamps,
        QueryTimes=inputs.query_times,
        **strides(q=q, k=k, v=v, do=grad_out),
        **option_args(inputs),
        **head_args(q, v, interpreted),
    )


def option_args(inputs: KernelInputs) -> dict:
    """The kernels' bias tables, mask and norm scalars and bias switches, by name."""
    return dict(
        PosW=inputs.pos_w,
        TimeW=inputs.time_w,
        Thresholds=inputs.thresholds,
        alpha=inputs.alpha,
        silu_scale=inputs.silu_scale,
        scale_by_position=int(inputs.scale_by_position),
        contextual_len=inputs.contextual_len,
        max_attn_len=inputs.max_attn_len,
        num_pos=inputs.num_pos,
        num_time=inputs.num_time,
        HAS_POS=inputs.num_pos > 0,
        HAS_TIME=inputs.num_time > 0,
        TIME_LOG=inputs.time_log,
    )


def head_args(q: Tensor, v: Tensor, interpreted: bool) -> dict:
    """The kernels' head count, head dims and their blocks, and dot precision, from q [T, H, Dqk] and
    v [T, H, Dv]."""
    return dict(
        DIM_QK=q.shape[2],
        DIM_V=v.shape[2],
        H=q.shape[1],
        BLOCK_DQK=head_block(q.shape[2]),
        BLOCK_DV=head_block(v.shape[2]),
        PRECISION=dot_precision(q.dtype, interpreted),
    )


def dot_precision(dtype: torch.dtype, interpreted: bool) -> str:
    """The kernels' ``PRECISION`` for operands of ``dtype``."""
    if interpreted:
        return "ieee" if dtype == torch.float32 else "upcast"
    # fp32: three tf32 products on tensor cores, ~fp32 accuracy (tf32: ignored for 16-bit operands)
    return "tf32x3" if dtype == torch.float32 else "tf32"


def forward_launch(q: Tensor, k: Tensor, v: Tensor, inputs: KernelInputs, interpreted: bool) -> Launch:
    """The forward launch; its output [T, H, Dv] is ``launch.args["Out"]``."""
    out = torch.empty(*q.shape[:2], v.shape[-1], dtype=v.dtype, device=v.device)
    unused = dict(DK=out, DV=out, DPos=inputs.pos_w, DTime=inputs.time_w, **strides(dk=out, dv=out))
    args = dict(common_args(q, k, v, q, inputs, interpreted), Out=out, **strides(o=out), **unused, PASS="forward")
    return Launch("forward", attention_kernel, args, "BLOCK_M")


def backward_launches(
    q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, inputs: KernelInputs, interpreted: bool
) -> Tuple[Launch, Launch]:
    """The dq launch (``Out``: dq) and the dk/dv launch (``DK``, ``DV``, and ``DPos`` [max(P, 1)],
    ``DTime`` [max(NB, 1)] fp32 bias-weight gradients)."""
    common = common_args(q, k, v, grad_out, inputs, interpreted)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dpos = torch.zeros(max(inputs.num_pos, 1), dtype=torch.float32, device=q.device)
    dtime = torch.zeros(max(inputs.num_time, 1), dtype=torch.float32, device=q.device)
    grads = dict(DK=dk, DV=dv, DPos=dpos, DTime=dtime, **strides(dk=dk, dv=dv))
    dq_args = dict(common, Out=dq, **strides(o=dq), **grads, PASS="dq")  # dk, dv: not written by this pass
    dkv_args = dict(common, Out=dq, **strides(o=dq), **grads, PASS="dkv")  # dq: not written by this pass
    return (
        Launch("backward_dq", attention_kernel, dq_args, "BLOCK_M"),
        Launch("backward_dkv", attention_kernel, dkv_args, "BLOCK_N", reset=(dpos, dtime)),
    )


class Layout(Protocol):
    """What a device variant decides: tile sizes, and how programs map to blocks."""

    ub_tables: bool  # bias tables preloaded on chip (``blocks`` module docstring)

    def config(self, launch: Launch, inputs: KernelInputs, run: Callable[[TileConfig], None]) -> TileConfig:
        """The tile configuration of ``launch``; ``run(config)`` launches it (for autotuning)."""
        ...

    def work(self, launch: Launch, inputs: KernelInputs, block: int) -> Tuple[Tuple[int, ...], dict]:
        """-> grid, and the kernel's TileSeq, TileStart, num_work and WORK_LIST arguments."""
        ...


def layout_args(config: TileConfig, ub_tables: bool, inputs: KernelInputs) -> dict:
    """The kernel's tile-size switches under ``config`` (the on-chip table sizes only with
    ``ub_tables``, so that the GPU variant compiles once for every table size)."""
    return dict(
        UB_TABLES=ub_tables,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        POS_WINDOW=triton.next_power_of_2(config.block_m + config.block_n) if ub_tables else 1,
        TIME_TABLE=triton.next_power_of_2(max(inputs.num_time, 1)) if ub_tables else 1,
    )


def row_block(launch: Launch, config: TileConfig) -> int:
    return config.block_m if launch.row_block == "BLOCK_M" else config.block_n


class TritonKernels:
    """The one launcher of both variants: forward and backward over ``KernelInputs``."""

    def __init__(self, layout: Layout, interpreted: bool) -> None:
        self.layout, self.interpreted = layout, interpreted

    def forward(self, q: Tensor, k: Tensor, v: Tensor, inputs: KernelInputs) -> Tensor:
        launch = forward_launch(q, k, v, inputs, self.interpreted)
        self.run(launch, inputs)
        return launch.args["Out"]

    def backward(
        self, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, inputs: KernelInputs
    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """-> dq, dk, dv, d position weights [P] fp32, d time weights [NB] fp32."""
        dq_launch, dkv_launch = backward_launches(q, k, v, grad_out, inputs, self.interpreted)
        self.run(dq_launch, inputs)
        self.run(dkv_launch, inputs)
        args = dkv_launch.args
        return (
            dq_launch.args["Out"],
            args["DK"],
            args["DV"],
            args["DPos"][: inputs.num_pos],
            args["DTime"][: inputs.num_time],
        )

    def run(self, launch: Launch, inputs: KernelInputs) -> None:
        config = self.layout.config(launch, inputs, lambda c: self._launch(launch, inputs, c))
        self._launch(launch, inputs, config)

    def _launch(self, launch: Launch, inputs: KernelInputs, config: TileConfig) -> None:
        for buffer in launch.reset:
            buffer.zero_()
        grid, work = self.layout.work(launch, inputs, row_block(launch, config))
        launch.kernel[grid](
            **launch.args,
            **work,
            **layout_args(config, self.layout.ub_tables, inputs),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
