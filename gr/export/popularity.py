"""An export's item popularity: ``sparse/popularity.safetensors`` (optional), the training counts of
``gr.data.popularity`` with one row per row of the item table. Serving answers a request with an empty
history from it (the most popular items, marked ``"fallback": "popularity"``); an export without it
refuses such a request. Covered by the MANIFEST like every other file; ``check_popularity`` is what
``gr check`` and every loader verify.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import numpy as np

from gr.data.popularity import load_popularity, save_popularity
from gr.export.format import ExportError, Problem
from gr.export.item_store import ITEM_FEATURE
from gr.export.sparse_manifest import SparseManifest

POPULARITY = "sparse/popularity.safetensors"


def write_popularity(root: Path, counts: np.ndarray, sparse: SparseManifest) -> None:
    """Write ``counts`` [items] to ``root/sparse/popularity.safetensors``, one per row of the item table
    (rows past the counts, items the training data never had, count 0); ExportError when the export
    has no item table or more counts than it has rows."""
    rows = _item_rows(sparse)
    if rows is None or len(counts) > rows:
        raise ExportError(f"popularity: {len(counts)} item counts, but the item table has {rows} rows")
    save_popularity(root / POPULARITY, np.pad(np.asarray(counts), (0, rows - len(counts))))


def check_popularity(root: Path, sparse: SparseManifest, problems: List[Problem]) -> None:
    """Add a problem when the export's popularity file is unreadable or does not match the item table."""
    if not (root / POPULARITY).exists():
        return
    try:
        counts = load_popularity(root / POPULARITY)
    except ValueError as exc:
        problems.append(Problem(POPULARITY, "count", str(exc).removeprefix(f"{root / POPULARITY}: ")))
        return
    rows = _item_rows(sparse)
    if len(counts) != rows:
        problems.append(Problem(POPULARITY, "count", f"{len(counts)} rows, but the item table has {rows}"))


def read_popularity(root: Path) -> Optional[np.ndarray]:
    """[item rows] int64 counts of a checked export, or None when it stores none (an older export)."""
    path = root / POPULARITY
    return load_popularity(path) if path.is_file() else None


def _item_rows(sparse: SparseManifest) -> Optional[int]:
    feature = sparse.features.get(ITEM_FEATURE)
    return None if feature is None else sparse.tables[feature.table].rows
