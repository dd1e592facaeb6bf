"""The HSTU layer's steps around attention, fused per block of rows on CPU.

* ``project``: ``U, V, Q, K = split(SiLU(linear(LayerNorm(x))))``, the layer's input projection;
* ``combine``: ``x + linear(dropout(LayerNorm(attention) * U))``, the layer's output;
* ``norm_mul_dropout``: ``dropout(LayerNorm(x) * u)`` alone (or LayerNorm alone), for the two
  above where they cannot run fused.
* ``stack_input``: ``dropout(x * scale + table[rows])``, the stack's first-layer input.

With gr's native kernels built (``gr.native``, ``gr/hstu/csrc/layer_ops.cpp``) the CPU computes them
in fp32 a block of rows at a time while the block is in cache (backward recomputes the LayerNorm
outputs from their statistics instead of keeping them), their GEMMs in bf16 math under CPU autocast
to bf16 (``gr.native.cpu_bf16_math``); otherwise, on other devices and in other dtypes, PyTorch's
ops run. Both give the same values to fp32 rounding (outside autocast); dropout masks come from
``gr.rng.keep_mask`` either way.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from gr.hstu.dropout import Dropout
from gr.native import cpu_bf16_math, native_ops
from gr.rng import keep_mask

NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # computed in fp32


def _affine(norm: nn.LayerNorm, width: int) -> bool:
    return norm.weight is not None and norm.bias is not None and norm.normalized_shape == (width,)


def _mask_and_gate(
    shape: torch.Size, device: torch.device, dropout: Optional[Dropout], u: Optional[Tensor]
) -> Tuple[Optional[Tensor], float, Optional[Tensor]]:
    """The native norm's dropout and gate arguments: (keep mask [shape] uint8 or None, the kept
    elements' scale 1 / (1 - p), u with a unit column stride or None)."""
    p = dropout.p if dropout is not None and dropout.training else 0.0
    keep = keep_mask(shape, p, device).view(torch.uint8) if p > 0.0 else None
    if u is not None and u.stride(-1) != 1:
        u = u.contiguous()
    return keep, 1.0 / (1.0 - p), u


def _fused_fp32(norm: nn.LayerNorm, linear: nn.Linear, *rows: Tensor) -> Optional[object]:
    """The native ops when ``rows`` are fp32 [T, n] CPU tensors outside autocast or under its bf16
    (the GEMMs then in bf16 math) and the layers have their affine weights and bias, else None."""
    fusable = (
        all(r.device.type == "cpu" and r.dim() == 2 and r.dtype == torch.float32 for r in rows)
        and (not torch.is_autocast_enabled("cpu") or cpu_bf16_math())
        and _affine(norm, rows[0].shape[-1])
        and linear.bias is not None
        and linear.weight.dtype == torch.float32
    )
    return native_ops("gr_cpu_layer") if fusable else None


def project(x: Tensor, norm: nn.LayerNorm, linear: nn.Linear, sizes: Sequence[int]) -> Tuple[Tensor, ...]:
    """x: [T, D] -> ``split(SiLU(linear(norm(x))), sizes)``: [T, sizes[i]] (sum sizes = the
    linear's output width); fused, each part is contiguous."""
    ops = _fused_fp32(norm, linear, x)
    if ops is None:
        return torch.split(F.silu(linear(norm_mul_dropout(x, norm))), list(sizes), dim=-1)
    # SiLU'(pre) is kept for backward only when there will be one (not in serving, under no_grad).
    keep_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, norm.weight, norm.bias, linear.weight, linear.bias)
    )
    return _Projection.apply(
        ops, x.contiguous(), norm.weight, norm.bias, norm.eps, linear.weight.contiguous(), linear.bias, tuple(sizes),
        keep_grad, cpu_bf16_math(),
    )  # fmt: skip


class _Projection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, x, norm_weight, norm_bias, eps, weight, bias, sizes, keep_grad, bf16):  # type: ignore[override]
        parts, silu_grads, mean, rstd = ops.projection_forward(
            x, norm_weight, norm_bias, eps, weight, bias, list(sizes), keep_grad, bf16
        )
        ctx.ops, ctx.sizes, ctx.bf16 = ops, sizes, bf16
        ctx.save_for_backward(x, norm_weight, norm_bias, weight, mean, rstd, *silu_grads)
        return tuple(parts)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        x, norm_weight, norm_bias, weight, mean, rstd, *silu_grads = ctx.saved_tensors
        parts: List[Tensor] = []
        for grad, width in zip(grads, ctx.sizes):
            part = x.new_zeros(x.shape[0], width) if grad is None else grad.float().reshape(x.shape[0], width)
            parts.append(part if part.stride(-1) == 1 else part.contiguous())
        dx, dnorm_weight, dnorm_bias, dweight, dbias = ctx.ops.projection_backward(
            parts, x, norm_weight, norm_bias, weight, silu_grads, mean, rstd, ctx.bf16
        )
        return None, dx, dnorm_weight, dnorm_bias, None, dweight, dbias, None, None, None


def combine(x: Tensor, attention: Tensor, u: Tensor, norm: nn.LayerNorm, dropout: Dropout, linear: nn.Linear) -> Tensor:
    """x: [T, D] (the residual), attention, u: [T, A] -> ``x + linear(dropout(norm(attention) * u))``."""
    ops = _fused_fp32(norm, linear, attention, u, x) if u.shape == attention.shape else None
    if ops is None:
        return x + linear(norm_mul_dropout(attention, norm, u, dropout))
    keep, scale, u = _mask_and_gate(attention.shape, attention.device, dropout, u)
    return _Output.apply(
        ops, attention.contiguous(), u, keep, scale, norm.weight, norm.bias, norm.eps,
        linear.weight.contiguous(), linear.bias, x.contiguous(), cpu_bf16_math(),
    )  # fmt: skip


class _Output(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, a, u, keep, scale, norm_weight, norm_bias, eps, weight, bias, x, bf16):  # type: ignore[override]
        out, mean, rstd = ops.output_forward(a, u, keep, scale, norm_weight, norm_bias, eps, weight, bias, x, bf16)
        ctx.ops, ctx.scale, ctx.bf16 = ops, scale, bf16
        ctx.save_for_backward(a, u, keep, norm_weight, norm_bias, weight, mean, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        a, u, keep, norm_weight, norm_bias, weight, mean, rstd = ctx.saved_tensors
        dout = dout.contiguous()
        da, du, dnorm_weight, dnorm_bias, dweight, dbias = ctx.ops.output_backward(
            dout, a, u, keep, ctx.scale, norm_weight, norm_bias, weight, mean, rstd, ctx.bf16
        )
        return None, da, du, None, None, dnorm_weight, dnorm_bias, None, dweight, dbias, dout, None


def norm_mul_dropout(
    x: Tensor, norm: nn.LayerNorm, u: Optional[Tensor] = None, dropout: Optional[Dropout] = None
) -> Tensor:
    """x: [T, D] float, u: [T, D] or None -> ``dropout(norm(x) * u)`` [T, D].

    The result's dtype is PyTorch's for the unfused ops, CPU autocast included (which leaves
    LayerNorm in its input's dtype): x's promoted with u's. The fused path computes in fp32."""
    fusable = (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype in NORM_DTYPES
        and (u is None or (u.dtype in NORM_DTYPES and u.shape == x.shape))
        and _affine(norm, x.shape[-1])
    )
    ops = native_ops("gr_cpu_layer") if fusable else None
    if ops is None:
        y = norm(x) if u is None else norm(x) * u
        return dropout(y) if dropout is not None else y
    dtype = x.dtype if u is None else torch.promote_types(x.dtype, u.dtype)
    keep, scale, u = _mask_and_gate(x.shape, x.device, dropout, None if u is None else u.float())
    y = _NormMulDropout.apply(
        ops, x.float().contiguous(), norm.weight.float(), norm.bias.float(), u, keep, scale, norm.eps
    )
    return y.to(dtype)


class _NormMulDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, x, weight, bias, u, keep, scale, eps):  # type: ignore[override]
        y, mean, rstd = ops.norm_forward(x, weight, bias, u, keep, scale, eps)
        ctx.ops, ctx.scale = ops, scale
        ctx.save_for_backward(x, weight, bias, u, keep, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        x, weight, bias, u, keep, mean, rstd = ctx.saved_tensors
        dy = dy.float().contiguous()
        dx, dweight, dbias, du = ctx.ops.norm_backward(dy, x, weight, bias, u, keep, mean, rstd, ctx.scale)
        return None, dx, dweight, dbias, du if u is not None else None, None, None, None


def stack_input(x: Tensor, scale: float, table: Tensor, rows: Tensor, dropout: Dropout) -> Tensor:
    """x: [T, D], table: [P, D], rows: [T] int64 in [0, P) -> ``dropout(x * scale + table[rows])``
    [T, D]; fused for fp32 on CPU, autocast or not (it leaves these ops in fp32): bitwise PyTorch's
    ops' result, one pass each way."""
    fusable = x.device.type == "cpu" and x.dim() == 2 and x.dtype == table.dtype == torch.float32
    ops = native_ops("gr_cpu_layer") if fusable else None
    if ops is None:  # index_select: its backward (index_add_) is several times cheaper on CPU than embedding's
        return dropout(x * scale + table.index_select(0, rows))
    keep, keep_scale, _ = _mask_and_gate(x.shape, x.device, dropout, None)
    return _StackInput.apply(ops, x.contiguous(), scale, table.contiguous(), rows.contiguous(), keep, keep_scale)


class _StackInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, x, scale, table, rows, keep, keep_scale):  # type: ignore[override]
        ctx.ops, ctx.scale, ctx.keep_scale, ctx.table_rows = ops, scale, keep_scale, table.shape[0]
        ctx.save_for_backward(rows, keep)
        return ops.input_forward(x, scale, table, rows, keep, keep_scale)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        rows, keep = ctx.saved_tensors
        dx, dtable = ctx.ops.input_backward(dy.contiguous(), ctx.scale, rows, ctx.table_rows, keep, ctx.keep_scale)
        return None, dx, None, dtable, None, None, None
