"""Embedding lookups at serving time: tables from ``sparse/*.safetensors``, plain row gathers, and
the export's item feature store (``gr.export.item_store``), when it has one."""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
from safetensors.numpy import load_file

from gr.export.format import SPARSE_DIR, TABLE_TENSOR
from gr.export.item_store import ItemStore, load_item_store
from gr.export.reader import ExportManifest
from gr.serving.errors import RequestError


class SparseStore:
    """Every table of an export in memory; ``sequence`` gathers rows, ``pooled`` sums/means a bag;
    ``items``: the stored item features (None: the export stores none)."""

    def __init__(self, manifest: ExportManifest) -> None:
        self.features = manifest.sparse.features
        self.tables: Dict[str, np.ndarray] = {
            name: load_file(str(manifest.path(f"{SPARSE_DIR}/{table.file}")))[TABLE_TENSOR]
            for name, table in manifest.sparse.tables.items()
        }
        self.items: Optional[ItemStore] = load_item_store(manifest.root, manifest.graph, manifest.sparse)

    def rows(self, feature: str) -> int:
        return int(self.tables[self.features[feature].table].shape[0])

    def check_ids(self, feature: str, ids: np.ndarray, where: str) -> None:
        """Raise RequestError naming ``where``/``feature`` unless every id is a row of its table."""
        rows = self.rows(feature)
        bad = ids[(ids < 0) | (ids >= rows)]
        if bad.size:
            raise RequestError(
                f"{where}.{feature}: ids {bad[:5].tolist()} out of range [0, {rows}) "
                f"(table {self.features[feature].table!r})"
            )

    def sequence(self, feature: str, ids: np.ndarray) -> np.ndarray:
        """ids: [T] int64 -> [T, d] float32, one row per token."""
        return self.tables[self.features[feature].table][ids]

    def pooled(self, feature: str, ids: np.ndarray) -> np.ndarray:
        """ids: [n] int64, one request's bag -> [1, d] float32 (sum or mean, as in training)."""
        rows = self.tables[self.features[feature].table][ids]
        pooled = rows.sum(0, keepdims=True)
        if self.features[feature].pooling == "mean" and len(ids):
            pooled = pooled / len(ids)
        return pooled.astype(np.float32)
