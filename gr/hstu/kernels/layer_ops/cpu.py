"""The fused CPU layer ops (``layer_ops.cpp``, namespace ``gr_cpu_layer`` of ``gr.ops.native``) under
autograd; ``gr.hstu.kernels.layer_ops`` decides when they run and prepares their arguments."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


class Projection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, x, norm_weight, norm_bias, eps, weight, bias, sizes, keep_grad, bf16):
        parts, silu_grads, mean, rstd = ops.projection_forward(
            x, norm_weight, norm_bias, eps, weight, bias, list(sizes), keep_grad, bf16
        )
        ctx.ops, ctx.sizes, ctx.bf16 = ops, sizes, bf16
        ctx.save_for_backward(x, norm_weight, norm_bias, weight, mean, rstd, *silu_grads)
        return tuple(parts)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        x, norm_weight, norm_bias, weight, mean, rstd, *silu_grads = ctx.saved_tensors
        parts: List[Tensor] = []
        for grad, width in zip(grads, ctx.sizes):
            part = x.new_zeros(x.shape[0], width) if grad is None else grad.float().reshape(x.shape[0], width)
            parts.append(part if part.stride(-1) == 1 else part.contiguous())
        dx, dnorm_weight, dnorm_bias, dweight, dbias = ctx.ops.projection_backward(
            parts, x, norm_weight, norm_bias, weight, silu_grads, mean, rstd, ctx.bf16
        )
        return None, dx, dnorm_weight, dnorm_bias, None, dweight, dbias, None, None, None


class Output(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, a, u, keep, scale, norm_weight, norm_bias, eps, weight, bias, x, bf16):
        out, mean, rstd = ops.output_forward(a, u, keep, scale, norm_weight, norm_bias, eps, weight, bias, x, bf16)
        ctx.ops, ctx.scale, ctx.bf16 = ops, scale, bf16
        ctx.save_for_backward(a, u, keep, norm_weight, norm_bias, weight, mean, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor) -> Tuple[Optional[Tensor], ...]:
        a, u, keep, norm_weight, norm_bias, weight, mean, rstd = ctx.saved_tensors
        dout = dout.contiguous()
        da, du, dnorm_weight, dnorm_bias, dweight, dbias = ctx.ops.output_backward(
            dout, a, u, keep, ctx.scale, norm_weight, norm_bias, weight, mean, rstd, ctx.bf16
        )
        return None, da, du, None, None, dnorm_weight, dnorm_bias, None, dweight, dbias, dout, None


class NormMulDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, x, weight, bias, u, keep, scale, eps):
        y, mean, rstd = ops.norm_forward(x, weight, bias, u, keep, scale, eps)
        ctx.ops, ctx.scale = ops, scale
        ctx.save_for_backward(x, weight, bias, u, keep, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> Tuple[Optional[Tensor], ...]:
        x, weight, bias, u, keep, mean, rstd = ctx.saved_tensors
        dy = dy.float().contiguous()
        dx, dweight, dbias, du = ctx.ops.norm_backward(dy, x, weight, bias, u, keep, mean, rstd, ctx.scale)
        return None, dx, dweight, dbias, du if u is not None else None, None, None, None


class StackInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, x, scale, table, rows, keep, keep_scale):
        ctx.ops, ctx.scale, ctx.keep_scale, ctx.table_rows = ops, scale, keep_scale, table.shape[0]
        ctx.save_for_backward(rows, keep)
        return ops.input_forward(x, scale, table, rows, keep, keep_scale)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> Tuple[Optional[Tensor], ...]:
        rows, keep = ctx.saved_tensors
        dx, dtable = ctx.ops.input_backward(dy.contiguous(), ctx.scale, rows, ctx.table_rows, keep, ctx.keep_scale)
        return None, dx, None, dtable, None, None, None
