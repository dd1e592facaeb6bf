"""Embedding lookups at serving time: tables from ``sparse/*.safetensors``, plain row gathers, and
the export's item feature store (``gr.export.item_store``), when it has one."""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import numpy as np
from safetensors.numpy import load_file

from gr.export.format import SPARSE_DIR, TABLE_TENSOR
from gr.export.item_store import ItemStore, load_item_store
from gr.export.reader import ExportManifest
from gr.jagged_rows import JaggedRows
from gr.serving.errors import RequestError

# An overlay past this fraction of its table's rows is merged into a copy of the table.
MERGE_FRACTION = 0.1


class PatchedTable:
    """A table with rows replaced or appended, without copying it: ``base`` [R0, d] float32, and an
    overlay of rows ``ids`` [k] int64 ascending with ``values`` [k, d] (every row past R0 among
    them). Gathers (``table[ids]``) and ``shape`` work as on the array it stands for; ``array()``
    makes that array. The base array is shared with the table it was patched from, never written."""

    def __init__(self, base: np.ndarray, rows: int, ids: np.ndarray, values: np.ndarray) -> None:
        self.base, self.ids, self.values = base, ids, values
        self.shape: Tuple[int, int] = (rows, base.shape[1])

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows)
        out = (
            self.base[np.minimum(rows, len(self.base) - 1)]
            if len(self.base)
            else np.zeros((len(rows), self.shape[1]), np.float32)
        )
        at = np.minimum(np.searchsorted(self.ids, rows), max(len(self.ids) - 1, 0))
        hit = self.ids[at] == rows if len(self.ids) else np.zeros(rows.shape, bool)
        out[hit] = self.values[at[hit]]
        return out

    def array(self) -> np.ndarray:
        """[rows, d] float32: the table as one array (a new one)."""
        out = np.empty(self.shape, dtype=np.float32)
        out[: len(self.base)] = self.base
        out[self.ids] = self.values
        return out


Table = Union[np.ndarray, PatchedTable]


def patch_table(table: Table, rows: int, ids: np.ndarray, values: np.ndarray) -> Table:
    """``table`` grown to ``rows`` rows with ``values`` [k, d] at rows ``ids`` [k] (ascending), as a
    new table that shares ``table``'s arrays: an overlay while it holds at most MERGE_FRACTION of the
    rows, else one merged array."""
    if isinstance(table, PatchedTable):
        keep = ~np.isin(table.ids, ids)
        merged = np.concatenate([table.ids[keep], ids])
        order = np.argsort(merged, kind="stable")
        patched = PatchedTable(table.base, rows, merged[order], np.concatenate([table.values[keep], values])[order])
    else:
        patched = PatchedTable(table, rows, ids, values)
    return patched if len(patched.ids) <= MERGE_FRACTION * rows else patched.array()


class SparseStore:
    """Every table of an export in memory; ``sequence`` gathers rows, ``pooled`` sums/means a bag,
    ``bags`` each of several; ``items``: the stored item features (None: the export stores none)."""

    def __init__(self, manifest: ExportManifest) -> None:
        self.features = manifest.sparse.features
        self.tables: Dict[str, Table] = {
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
        return self.bags(feature, JaggedRows.from_lengths(np.asarray([len(ids)]), ids))

    def bags(self, feature: str, bags: JaggedRows) -> np.ndarray:
        """S bags of int64 ids -> [S, d] float32, each bag's rows summed or averaged (its feature's
        pooling, as in training); an empty bag gives zeros."""
        table = self.tables[self.features[feature].table]
        lengths = bags.lengths()
        pooled = np.zeros((len(bags), table.shape[1]), dtype=np.float32)
        np.add.at(pooled, np.repeat(np.arange(len(bags)), lengths), table[bags.values])
        if self.features[feature].pooling == "mean":
            pooled /= np.maximum(lengths, 1)[:, None]
        return pooled

    def stored(self, feature: str, items: np.ndarray) -> np.ndarray:
        """items: [n] int64 model ids -> their stored ``feature`` (the item store's): [n] int64 ids,
        [n, d] float32, or a list feature's bags pooled ([n, d] float32)."""
        assert self.items is not None, "stored features are the item store's"
        column = self.items.lookup(feature, items)
        return self.bags(feature, column) if isinstance(column, JaggedRows) else column
