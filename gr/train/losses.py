"""Training losses: sampled softmax (retrieval) and multi-task binary cross-entropy (ranking)."""
from __future__ import annotations

from typing import Dict, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor


def sampled_softmax_loss(
    queries: Tensor,
    items: Tensor,
    positive_index: Tensor,
    negative_index: Tensor,
    temperature: float,
) -> Tensor:
    """Mean over rows of -log softmax of the positive among itself and the row's negatives.

    queries: [N, d] float; items: [U, d] float, the distinct sampled items' vectors
    positive_index: [N] int64, each row's true next item (a row of ``items``)
    negative_index: [N, K] int64 (negatives per row) or [K] int64 (shared by all rows)
    Logits are dot products / temperature (cosines when both sides are unit vectors). A
    negative that is the row's own positive is masked out, so it is never pushed down.
    returns: scalar
    """
    positive_logits = (queries * items[positive_index]).sum(-1, keepdim=True)  # [N, 1]
    if negative_index.dim() == 1:
        negative_logits = queries @ items[negative_index].T
        negative_index = negative_index.unsqueeze(0)
    elif items.shape[0] <= negative_index.shape[1] * items.shape[1]:
        # Fewer distinct items than gathered values: score every row against all of them once.
        negative_logits = (queries @ items.T).gather(1, negative_index)
    else:
        negative_logits = torch.einsum("nd,nkd->nk", queries, items[negative_index])
    negative_logits = negative_logits.masked_fill(negative_index == positive_index.unsqueeze(1), float("-inf"))
    logits = torch.cat([positive_logits, negative_logits], dim=1) / temperature
    return -F.log_softmax(logits, dim=1)[:, 0].mean()


def multitask_bce(logits: Mapping[str, Tensor], labels: Mapping[str, Tensor], weights: Mapping[str, float]) -> Dict[str, Tensor]:
    """Weighted sum of per-task BCE. logits, labels: {task: [N]} -> {"loss": scalar, "bce/<task>": scalar}."""
    terms = {f"bce/{task}": F.binary_cross_entropy_with_logits(logit, labels[task].float())
             for task, logit in logits.items()}
    total = sum(weights.get(task, 1.0) * terms[f"bce/{task}"] for task in logits)
    return {"loss": total, **terms}
