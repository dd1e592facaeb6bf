"""Sampled softmax in PyTorch, any device: row tiles against all items (``DenseSampledSoftmax``) when
there are fewer distinct items than gathered values, else a gather of each row's negatives."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from gr.ops.sampled_softmax.common import SampledSoftmaxCall

ROW_TILE_ELEMENTS = 1 << 20  # logits of one row tile in the dense path (~280 rows of ML-1M: matmuls near peak)


def sampled_softmax(call: SampledSoftmaxCall) -> Tensor:
    """``gr.ops.sampled_softmax.sampled_softmax_loss`` in PyTorch's ops; returns a scalar."""
    queries, items, temperature, rows_per_draw = call.queries, call.items, call.temperature, call.rows_per_draw
    positive_index, negative_index = call.positive_index, call.negative_index
    if negative_index.dim() == 2 and rows_per_draw > 1:
        rows = torch.arange(positive_index.shape[0], device=negative_index.device)
        negative_index = negative_index[rows % negative_index.shape[0]]
    if negative_index.dim() == 2 and items.shape[0] <= negative_index.shape[1] * items.shape[1]:
        # Fewer distinct items than gathered values: score rows against all items, tile by tile.
        device = queries.device.type
        autocast = torch.is_autocast_enabled(device)
        compute = torch.get_autocast_dtype(device) if autocast else torch.promote_types(queries.dtype, items.dtype)
        with torch.autocast(device, enabled=False):
            return DenseSampledSoftmax.apply(queries, items, positive_index, negative_index, temperature, compute)
    positive_logits = (queries * items[positive_index]).sum(-1, keepdim=True)  # [N, 1]
    if negative_index.dim() == 1:
        negative_logits = queries @ items[negative_index].T
        negative_index = negative_index.unsqueeze(0)
    else:
        negative_logits = torch.einsum("nd,nkd->nk", queries, items[negative_index])
    negative_logits = negative_logits.masked_fill(negative_index == positive_index.unsqueeze(1), float("-inf"))
    logits = torch.cat([positive_logits, negative_logits], dim=1) / temperature
    return -F.log_softmax(logits, dim=1)[:, 0].mean()


class DenseSampledSoftmax(torch.autograd.Function):
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
