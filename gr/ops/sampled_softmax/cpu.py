"""The fused CPU sampled softmax (``sampled_softmax.cpp``) under autograd."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from gr.ops.sampled_softmax.common import SampledSoftmaxCall

# Largest item table [U, d] the fused CPU kernel takes: backward keeps one fp32 copy per thread.
MAX_TABLE_ELEMENTS = 1 << 22


def sampled_softmax(call: SampledSoftmaxCall, *, ops: object, bf16: bool) -> Tensor:
    """``gr.ops.sampled_softmax.sampled_softmax_loss`` of per-row negatives ([B, K]) by the fused
    kernel ``ops`` (GEMMs in bf16 math when ``bf16``); run with CPU autocast off."""
    return FusedSampledSoftmax.apply(
        call.queries, call.items, call.positive_index, call.negative_index, call.rows_per_draw, call.temperature,
        ops, bf16,
    )  # fmt: skip


class FusedSampledSoftmax(torch.autograd.Function):
    """Per-row negatives on CPU by gr's fused kernel (``gr.ops.native``, ``gr_cpu_loss``): each row's K + 1
    dot products read the item rows in place (rows sharing negatives: one GEMM against them), in
    fp32 (bf16 inputs are widened once; under bf16 autocast those GEMMs run in bf16 math,
    ``gr.ops.native.cpu_bf16_math``); the loss is the mean of the rows' ``lse - logit_positive``."""

    @staticmethod
    def forward(ctx, queries, items, positive_index, negative_index, rows_per_draw, temperature, ops, bf16):
        q, it = queries.float().contiguous(), items.float().contiguous()
        positive, negative = positive_index.contiguous(), negative_index.contiguous()
        probs, row_loss = ops.sampled_softmax_forward(q, it, positive, negative, rows_per_draw, temperature, bf16)
        ctx.save_for_backward(q, it, positive, negative, probs)
        ctx.rows_per_draw, ctx.temperature, ctx.ops, ctx.bf16 = rows_per_draw, temperature, ops, bf16
        ctx.dtypes = (queries.dtype, items.dtype)
        return row_loss.mean()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, it, positive, negative, probs = ctx.saved_tensors
        scale = float(grad) / (positive.shape[0] * ctx.temperature)
        dq, ditems = ctx.ops.sampled_softmax_backward(
            q, it, positive, negative, ctx.rows_per_draw, probs, scale, ctx.bf16
        )
        return dq.to(ctx.dtypes[0]), ditems.to(ctx.dtypes[1]), None, None, None, None, None, None
