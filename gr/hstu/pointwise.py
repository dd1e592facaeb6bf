"""The HSTU layer's pointwise steps, each fused into one pass per row on CPU.

* ``silu_split``: ``split(SiLU(x))`` into U, V, Q, K after the layer's input projection;
* ``norm_mul_dropout``: ``dropout(LayerNorm(x) * u)``. HSTU normalises twice a layer: the
  layer's input (``input_norm``, no gate, no dropout) and the attention output (``attn_norm``,
  gated by U, then dropout).

With gr's native kernels built (``gr.native``, ``gr/hstu/csrc/pointwise.cpp``) the CPU computes them
in fp32, reading each row once forward and once backward; otherwise, and on other devices or in
other dtypes, PyTorch's ops run. Both give the same values; dropout masks come from
``gr.rng.keep_mask`` either way.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from gr.hstu.dropout import Dropout
from gr.native import native_ops
from gr.rng import keep_mask

NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # computed in fp32, as autocast runs LayerNorm


def silu_split(x: Tensor, sizes: Sequence[int]) -> Tuple[Tensor, ...]:
    """x: [T, N] -> SiLU(x) split along the last dimension into [T, sizes[i]] views (sum sizes = N)."""
    ops = native_ops("gr_cpu_pointwise") if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if ops is None or x.dim() != 2 or not x.requires_grad:
        return torch.split(F.silu(x), list(sizes), dim=-1)
    return _SiluSplit.apply(ops, x.contiguous(), tuple(sizes))


class _SiluSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, x, sizes):  # type: ignore[override]
        ctx.ops, ctx.sizes = ops, sizes
        ctx.save_for_backward(x)
        return torch.split(F.silu(x), list(sizes), dim=-1)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        parts: List[Tensor] = [
            x.new_zeros(x.shape[0], width) if grad is None else grad.float().reshape(x.shape[0], width)
            for grad, width in zip(grads, ctx.sizes)
        ]
        parts = [part if part.stride(-1) == 1 else part.contiguous() for part in parts]
        return None, ctx.ops.silu_split_backward(x, parts), None


def norm_mul_dropout(
    x: Tensor, norm: nn.LayerNorm, u: Optional[Tensor] = None, dropout: Optional[Dropout] = None
) -> Tensor:
    """x: [T, D] float, u: [T, D] or None -> ``dropout(norm(x) * u)`` [T, D].

    The result's dtype is PyTorch's for the unfused ops, CPU autocast included (which leaves
    LayerNorm in its input's dtype): x's promoted with u's. The fused path computes in fp32."""
    p = dropout.p if dropout is not None and dropout.training else 0.0
    fusable = (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype in NORM_DTYPES
        and (u is None or (u.dtype in NORM_DTYPES and u.shape == x.shape))
        and norm.weight is not None
        and norm.bias is not None
        and norm.normalized_shape == (x.shape[-1],)
    )
    ops = native_ops("gr_cpu_pointwise") if fusable else None
    if ops is None:
        y = norm(x) if u is None else norm(x) * u
        return dropout(y) if dropout is not None else y
    dtype = x.dtype if u is None else torch.promote_types(x.dtype, u.dtype)
    keep = keep_mask(x.shape, p, x.device).view(torch.uint8) if p > 0.0 else None
    y = _NormMulDropout.apply(
        ops,
        x.float().contiguous(),
        norm.weight.float(),
        norm.bias.float(),
        None if u is None else u.float(),
        keep,
        1.0 / (1.0 - p),
        norm.eps,
    )
    return y.to(dtype)


class _NormMulDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, x, weight, bias, u, keep, scale, eps):  # type: ignore[override]
        if u is not None and u.stride(-1) != 1:
            u = u.contiguous()
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
