"""The paired statistics the quality benchmarks report: two scorers on the same units (users or
events), compared unit by unit."""

from __future__ import annotations

import math
from typing import Any, Dict

import numpy as np


def paired_difference(a: Any, b: Any, units: str = "users") -> Dict[str, Any]:
    """a, b: [N] per-unit values (arrays or CPU tensors) of two scorers -> the mean of a - b, its sample standard error,
    their ratio (in_se; 0 where the SE is 0) and how many units a scores higher and lower
    (``{units}_higher``, ``{units}_lower``)."""
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    mean = float(diff.mean()) if len(diff) else float("nan")
    se = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else float("nan")
    return {
        "mean": mean,
        "se": se,
        "in_se": mean / se if se > 0 else 0.0,
        f"{units}_higher": int((diff > 0).sum()),
        f"{units}_lower": int((diff < 0).sum()),
    }
