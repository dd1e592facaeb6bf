"""Training losses: sampled softmax (retrieval) and multi-task binary cross-entropy (ranking)."""

from __future__ import annotations

from typing import Dict, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from gr.native import cpu_bf16_math, native_ops

ROW_TILE_ELEMENTS = 1 << 20  # logits of one row tile in the dense path (~280 rows of ML-1M: matmuls near peak)
# Largest item table [U, d] the fused CPU kernel takes: backward keeps one fp32 copy per thread.
MAX_TABLE_ELEMENTS = 1 << 22


def negative_rows(rows: int, rows_per_draw: int) -> int:
    """Rows of ``negative_index`` for ``rows`` scored rows that share draws ``rows_per_draw`` at a time."""
    return -(-rows // rows_per_draw)


def sampled_softmax_loss(
    queries: Tensor,
    items: Tensor,
    positive_index: Tensor,
    negative_index: Tensor,
    temperature: float,
    rows_per_draw: int = 1,
) -> Tensor:
    """Mean over rows of -log softmax of the positive among itself and the row's negatives.

    queries: [N, d] float; items: [U, d] float, the distinct sampled items' vectors
    positive_index: [N] int64, each row's true next item (a row of ``items``)
    negative_index: [B, K] int64 with B = ceil(N / rows_per_draw): row n's negatives are row
        n mod B (rows_per_draw = 1: one per row; more: the rows are dealt to B blocks in turn,
        so neighbouring rows never share) or [K] int64 (shared by all rows)
    Logits are dot products / temperature (cosines when both sides are unit vectors). A
    negative that is the row's own positive is masked out, so it is never pushed down.
    Under CPU/CUDA autocast the dot products run in the autocast dtype (bf16: fp32
    accumulation, bf16 logits), the softmax in fp32.
    returns: scalar
    """
    if negative_index.dim() == 2 and negative_index.shape[0] != negative_rows(positive_index.shape[0], rows_per_draw):
        raise ValueError(
            f"sampled_softmax_loss: negative_index has {negative_index.shape[0]} rows, expected ceil("
            f"{positive_index.shape[0]} / {rows_per_draw}) for rows_per_draw={rows_per_draw}"
        )
    if negative_index.dim() == 2 and queries.device.type == "cpu" and items.numel() <= MAX_TABLE_ELEMENTS:
        ops = native_ops("gr_cpu_loss")
        if ops is not None:
            bf16 = cpu_bf16_math()
            with torch.autocast("cpu", enabled=False):
                return _FusedSampledSoftmax.apply(
                    queries, items, positive_index, negative_index, rows_per_draw, temperature, ops, bf16
                )
    if negative_index.dim() == 2 and rows_per_draw > 1:
        rows = torch.arange(positive_index.shape[0], device=negative_index.device)
        negative_index = negative_index[rows % negative_index.shape[0]]
    if negative_index.dim() == 2 and items.shape[0] <= negative_index.shape[1] * items.shape[1]:
        # Fewer distinct items than gathered values: score rows against all items, tile by tile.
        device = queries.device.type
        autocast = torch.is_autocast_enabled(device)
        compute = torch.get_autocast_dtype(device) if autocast else torch.promote_types(queries.dtype, items.dtype)
        with torch.autocast(device, enabled=False):
            return _DenseSampledSoftmax.apply(queries, items, positive_index, negative_index, temperature, compute)
    positive_logits = (queries * items[positive_index]).sum(-1, keepdim=True)  # [N, 1]
    if negative_index.dim() == 1:
        negative_logits = queries @ items[negative_index].T
        negative_index = negative_index.unsqueeze(0)
    else:
        negative_logits = torch.einsum("nd,nkd->nk", queries, items[negative_index])
    negative_logits = negative_logits.masked_fill(negative_index == positive_index.unsqueeze(1), float("-inf"))
    logits = torch.cat([positive_logits, negative_logits], dim=1) / temperature
    return -F.log_softmax(logits, dim=1)[:, 0].mean()


class _FusedSampledSoftmax(torch.autograd.Function):
    """Per-row negatives on CPU by gr's fused kernel (``gr.native``, ``gr_cpu_loss``): each row's K + 1
    dot products read the item rows in place (rows sharing negatives: one GEMM against them), in
    fp32 (bf16 inputs are widened once; under bf16 autocast those GEMMs run in bf16 math,
    ``gr.native.cpu_bf16_math``); the loss is the mean of the rows' ``lse - logit_positive``."""

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


class _DenseSampledSoftmax(torch.autograd.Function):
    """Per-row negatives scored through row tiles ``queries[rows] @ items.T`` ([n, U], never
    [N, U] at once): the forward logits at full matmul speed, no [N, K, d] gather. Forward keeps
    the softmax [N, K + 1] (fp32). Backward: the queries' gradient is a weighted bag of item rows
    (``embedding_bag`` with per-sample weights: only the K + 1 useful rows per query), the items'
    gradient ``G^T @ queries`` over the same dense tiles, G scattered into them in the compute dtype."""

    @staticmethod
    def forward(ctx, queries, items, positive_index, negative_index, temperature, compute):
        q, it = queries.to(compute), items.to(compute)
        index = torch.cat([positive_index[:, None], negative_index], 1)  # [N, K + 1], the positive first
        rows = max(1, ROW_TILE_ELEMENTS // max(items.shape[0], 1))
        logits = torch.empty(index.shape, dtype=torch.float32, device=q.device)
        for s in range(0, index.shape[0], rows):
            logits[s : s + rows] = (q[s : s + rows] @ it.T).gather(1, index[s : s + rows])
        logits[:, 1:].masked_fill_(negative_index == positive_index[:, None], float("-inf")).div_(temperature)
        logits[:, :1].div_(temperature)
        lse = torch.logsumexp(logits, 1, keepdim=True)
        loss = (lse - logits[:, :1]).mean()
        probs = logits.sub_(lse).exp_()
        ctx.save_for_backward(q, it, index, probs)
        ctx.temperature, ctx.dtypes = temperature, (queries.dtype, items.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, it, index, probs = ctx.saved_tensors
        total = probs.shape[0]
        probs[:, 0] -= 1.0  # d(-log p_positive) / d logit_j = p_j - [j is the positive]
        weights = probs.mul_(grad.float() / (total * ctx.temperature))
        dq = F.embedding_bag(index, it, mode="sum", per_sample_weights=weights.to(it.dtype))
        rows = max(1, ROW_TILE_ELEMENTS // max(it.shape[0], 1))
        ditems = torch.zeros(it.shape, dtype=torch.float32, device=it.device)
        for s in range(0, total, rows):
            # scattered in fp32 and rounded once: CPU scatter_add_ into bf16 accumulates through an
            # fp32 copy of the whole tile, 1.6x slower than this
            tile = torch.zeros(min(rows, total - s), it.shape[0], dtype=torch.float32, device=q.device)
            tile = tile.scatter_add_(1, index[s : s + rows], weights[s : s + rows]).to(q.dtype)
            ditems += (tile.T @ q[s : s + rows]).float()
        return dq.to(ctx.dtypes[0]), ditems.to(ctx.dtypes[1]), None, None, None, None


def multitask_bce(
    logits: Mapping[str, Tensor], labels: Mapping[str, Tensor], weights: Mapping[str, float]
) -> Dict[str, Tensor]:
    """Weighted sum of per-task BCE. logits, labels: {task: [N]} -> {"loss": scalar, "bce/<task>": scalar}."""
    terms = {
        f"bce/{task}": F.binary_cross_entropy_with_logits(logit, labels[task].float()) for task, logit in logits.items()
    }
    total = sum(weights.get(task, 1.0) * terms[f"bce/{task}"] for task in logits)
    return {"loss": total, **terms}
