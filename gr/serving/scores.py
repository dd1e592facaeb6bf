"""How a ranking export's head outputs are named in served results (rank, JSON API and RankResult).

Each postfix output of a ranking export is a task's logit (training's BCE input). Served results
hold the task's probability, sigmoid(logit), under the task's name and the logit under
``<task>_logit``. A retrieval export's rank score is the cosine under ``RETRIEVAL``.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

LOGIT_SUFFIX = "_logit"
RETRIEVAL = "retrieval"


def ranking_scores(logits: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """{task: [N] logits} -> {task: [N] probabilities, f"{task}_logit": [N] logits}, tasks in order."""
    out: Dict[str, np.ndarray] = {}
    for task, logit in logits.items():
        out[task] = _sigmoid(logit)
        out[f"{task}{LOGIT_SUFFIX}"] = logit
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """Numerically stable logistic function, in x's dtype (exp never overflows)."""
    z = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + z), z / (1 + z)).astype(x.dtype, copy=False)
