"""Training losses: sampled softmax (retrieval) and multi-task binary cross-entropy (ranking)."""
from __future__ import annotations

from typing import Dict, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor


def sampled_softmax_loss(
    queries: Tensor,
    positives: Tensor,
    negatives: Tensor,
    positive_ids: Tensor,
    negative_ids: Tensor,
    temperature: float,
) -> Tensor:
    """Mean over rows of -log softmax of the positive among itself and the negatives.

    queries: [N, d] float; positives: [N, d] float (the true next items' embeddings)
    negatives: [N, K, d] float (per-row samples) or [K, d] float (shared by all rows)
    positive_ids: [N] int64; negative_ids: [N, K] or [K] int64, matching ``negatives``
    Logits are dot products / temperature (cosines when both sides are unit vectors); a
    negative that is the row's own positive is masked out, so it is never pushed down.
    returns: scalar
    """
    positive_logits = (queries * positives).sum(-1, keepdim=True)  # [N, 1]
    if negatives.dim() == 3:
        negative_logits = torch.einsum("nd,nkd->nk", queries, negatives)
    else:
        negative_logits = queries @ negatives.T
        negative_ids = negative_ids.unsqueeze(0)
    negative_logits = negative_logits.masked_fill(negative_ids == positive_ids.unsqueeze(1), float("-inf"))
    logits = torch.cat([positive_logits, negative_logits], dim=1) / temperature
    return -F.log_softmax(logits, dim=1)[:, 0].mean()


def multitask_bce(logits: Mapping[str, Tensor], labels: Mapping[str, Tensor], weights: Mapping[str, float]) -> Dict[str, Tensor]:
    """Weighted sum of per-task BCE. logits, labels: {task: [N]} -> {"loss": scalar, "bce/<task>": scalar}."""
    terms = {f"bce/{task}": F.binary_cross_entropy_with_logits(logit, labels[task].float())
             for task, logit in logits.items()}
    total = sum(weights.get(task, 1.0) * terms[f"bce/{task}"] for task in logits)
    return {"loss": total, **terms}
