"""The HSTU layer's steps around attention, fused per block of rows on CPU.

* ``project``: ``U, V, Q, K = split(SiLU(linear(LayerNorm(x))))``, the layer's input projection;
* ``combine``: ``x + linear(dropout(LayerNorm(attention) * U))``, the layer's output;
* ``norm_mul_dropout``: ``dropout(LayerNorm(x) * u)`` alone (or LayerNorm alone), for the two
  above where they cannot run fused.
* ``stack_input``: ``dropout(x * scale + table[rows])``, the stack's first-layer input.

``dropout`` arguments are ``gr.hstu.dropout.Dropout`` modules (any module with ``p`` and ``training``
that drops with ``gr.ops.random.keep_mask``). The fused CPU ops' autograd functions are in ``cpu``,
their C++ beside it (``layer_ops.cpp``); the PyTorch code each function falls back to is inline.
``cost`` holds what each keeps for backward, which ``gr.train.memory`` sums.

With gr's native kernels built (``gr.ops.native``, ``gr/hstu/kernels/layer_ops/layer_ops.cpp``) the CPU computes them
in fp32 a block of rows at a time while the block is in cache (backward recomputes the LayerNorm
outputs from their statistics instead of keeping them), their GEMMs in bf16 math under CPU autocast
to bf16 (``gr.ops.native.cpu_bf16_math``); otherwise, on other devices and in other dtypes, PyTorch's
ops run. Both give the same values to fp32 rounding (outside autocast); dropout masks come from
``gr.ops.random.keep_mask`` either way.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gr.hstu.kernels.layer_ops import cpu
from gr.ops.native import cpu_bf16_math, native_ops
from gr.ops.random import keep_mask

NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # computed in fp32


def _affine(norm: nn.LayerNorm, width: int) -> bool:
    return norm.weight is not None and norm.bias is not None and norm.normalized_shape == (width,)


def _mask_and_gate(
    shape: torch.Size, device: torch.device, dropout: Optional[nn.Module], u: Optional[Tensor]
) -> Tuple[Optional[Tensor], float, Optional[Tensor]]:
    """The native norm's dropout and gate arguments: (keep mask [shape] uint8 or None, the kept
    elements' scale 1 / (1 - p), u with a unit column stride or None)."""
    # cast: torch's stubs type a module's attributes (Module.__getattr__) as Tensor | Module
    p = cast(float, dropout.p) if dropout is not None and dropout.training else 0.0
    keep = keep_mask(shape, p, device).view(torch.uint8) if p > 0.0 else None
    if u is not None and u.stride(-1) != 1:
        u = u.contiguous()
    return keep, 1.0 / (1.0 - p), u


def _recorded(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records an op on ``tensors`` (grad on and one of them requires it)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _fused_fp32(norm: nn.LayerNorm, linear: nn.Linear, *rows: Tensor) -> Optional[Any]:
    """The native ops when ``rows`` are fp32 [T, n] CPU tensors outside autocast or under its bf16
    (the GEMMs then in bf16 math) and the layers have their affine weights and bias, else None."""
    fusable = (
        all(r.is_cpu and r.dim() == 2 and r.dtype == torch.float32 for r in rows)
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
    keep_grad = _recorded(x, norm.weight, norm.bias, linear.weight, linear.bias)
    args = (x.contiguous(), norm.weight, norm.bias, norm.eps, linear.weight.contiguous(), linear.bias)
    if not keep_grad:  # nothing to differentiate: the op alone, without autograd's bookkeeping
        return tuple(ops.projection_forward(*args, list(sizes), False, cpu_bf16_math())[0])
    return cpu.Projection.apply(ops, *args, tuple(sizes), keep_grad, cpu_bf16_math())


def combine(
    x: Tensor, attention: Tensor, u: Tensor, norm: nn.LayerNorm, dropout: nn.Module, linear: nn.Linear
) -> Tensor:
    """x: [T, D] (the residual), attention, u: [T, A] -> ``x + linear(dropout(norm(attention) * u))``."""
    ops = _fused_fp32(norm, linear, attention, u, x) if u.shape == attention.shape else None
    if ops is None:
        return x + linear(norm_mul_dropout(attention, norm, u, dropout))
    keep, scale, gate = _mask_and_gate(attention.shape, attention.device, dropout, u)
    args = (
        attention.contiguous(), gate, keep, scale, norm.weight, norm.bias, norm.eps,
        linear.weight.contiguous(), linear.bias, x.contiguous(), cpu_bf16_math(),
    )  # fmt: skip
    if not _recorded(attention, u, x, norm.weight, norm.bias, linear.weight, linear.bias):
        return ops.output_forward(*args)[0]  # nothing to differentiate: the op alone
    return cpu.Output.apply(ops, *args)


def norm_mul_dropout(
    x: Tensor, norm: nn.LayerNorm, u: Optional[Tensor] = None, dropout: Optional[nn.Module] = None
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
    y = cpu.NormMulDropout.apply(
        ops, x.float().contiguous(), norm.weight.float(), norm.bias.float(), u, keep, scale, norm.eps
    )
    return y.to(dtype)


def stack_input(x: Tensor, scale: float, table: Tensor, rows: Tensor, dropout: nn.Module) -> Tensor:
    """x: [T, D], table: [P, D], rows: [T] int64 in [0, P) -> ``dropout(x * scale + table[rows])``
    [T, D]; fused for fp32 on CPU, autocast or not (it leaves these ops in fp32): bitwise PyTorch's
    ops' result, one pass each way."""
    fusable = x.device.type == "cpu" and x.dim() == 2 and x.dtype == table.dtype == torch.float32
    ops = native_ops("gr_cpu_layer") if fusable else None
    if ops is None:  # index_select: its backward (index_add_) is several times cheaper on CPU than embedding's
        return dropout(x * scale + table.index_select(0, rows))
    keep, keep_scale, _ = _mask_and_gate(x.shape, x.device, dropout, None)
    args = (x.contiguous(), scale, table.contiguous(), rows.contiguous(), keep, keep_scale)
    if not _recorded(x, table):
        return ops.input_forward(*args)  # nothing to differentiate: the op alone
    return cpu.StackInput.apply(ops, *args)
