"""Training losses: multi-task binary cross-entropy (ranking); the sampled softmax (retrieval) is
``gr.ops.sampled_softmax``."""

from __future__ import annotations

from typing import Dict, Mapping, cast

import torch.nn.functional as F
from torch import Tensor


def multitask_bce(
    logits: Mapping[str, Tensor], labels: Mapping[str, Tensor], weights: Mapping[str, float]
) -> Dict[str, Tensor]:
    """Weighted sum of per-task BCE. logits, labels: {task: [N]} -> {"loss": scalar, "bce/<task>": scalar}."""
    terms = {
        f"bce/{task}": F.binary_cross_entropy_with_logits(logit, labels[task].float()) for task, logit in logits.items()
    }
    total = cast(Tensor, sum(weights.get(task, 1.0) * terms[f"bce/{task}"] for task in logits))  # logits: not empty
    return {"loss": total, **terms}
