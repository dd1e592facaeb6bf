"""Item popularity: how often each item occurs in the training data, the cold-start answer.

One safetensors file holds one tensor ``count`` [num_items] int64 (row i: model item i). A training
run writes it as ``popularity.safetensors`` with its other run files; ``gr export`` copies it to the
export's ``sparse/popularity.safetensors`` (``gr.export.popularity``), where serving answers an empty
history with the most popular items. Nothing is pickled.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file
from safetensors.numpy import save as safetensors_bytes

from gr.utils.atomic import write_bytes

POPULARITY_FILE = "popularity.safetensors"
COUNT = "count"


def save_popularity(path: Path, counts: np.ndarray) -> None:
    """Write ``counts`` ([num_items] non-negative integers) to ``path`` atomically."""
    write_bytes(Path(path), safetensors_bytes({COUNT: check_counts(np.asarray(counts), str(path))}))


def load_popularity(path: Path) -> np.ndarray:
    """[num_items] int64 counts from ``path``; ValueError naming the file when it is not a popularity file."""
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    if set(tensors) != {COUNT}:
        raise ValueError(f"{path}: expected one tensor {COUNT!r}, found {sorted(tensors)}")
    return check_counts(tensors[COUNT], str(path))


def check_counts(counts: np.ndarray, where: str) -> np.ndarray:
    """``counts`` as [num_items] int64, or ValueError naming ``where``: one dimension, integers >= 0."""
    if counts.ndim != 1 or counts.dtype.kind not in "iu" or (counts < 0).any():
        raise ValueError(f"{where}: expected [num_items] integer counts >= 0, got {counts.dtype} {list(counts.shape)}")
    return counts.astype(np.int64)
