"""A prepared dataset's side tables (items.parquet, users.parquet) as every engine writes them.

An engine computes a side table (each key's features at its last row, or a MovieLens side file read
by the readers), brings it to the driver as Arrow (``side_table_from_arrow``: catalogue- and
user-sized) and ``write_side_table`` writes it with the vocabularies ``SideFeatures.align`` makes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gr.data.features import SideFeatures
from gr.data.interactions import SideTable
from gr.data.mappings import IdMap
from gr.data.prepared.manifest import SIDE_KEY
from gr.jagged_rows import JaggedRows

CATEGORICAL, LIST, DENSE = "categorical", "list", "dense"


def raw_values(array: pa.Array) -> np.ndarray:
    """An Arrow column of ids or raw values -> numpy: integers as int64, text as str."""
    if pa.types.is_integer(array.type):
        return array.to_numpy().astype(np.int64)
    return array.to_numpy(zero_copy_only=False).astype(str)


def side_table_from_arrow(
    table: pa.Table, kinds: Mapping[str, str], dense_columns: Mapping[str, Sequence[str]]
) -> SideTable:
    """A side table from Arrow: ``SIDE_KEY`` (raw ids) and one column per feature of ``kinds``
    ({feature: "categorical" | "list" | "dense"}): categorical raw values, list<raw value>,
    list<float> of the d values named by ``dense_columns[feature]``."""
    categorical, dense, lists = {}, {}, {}
    for name, kind in kinds.items():
        column = table[name].combine_chunks()
        if kind == CATEGORICAL:
            categorical[name] = raw_values(column)
        elif kind == LIST:
            offsets = column.offsets.to_numpy().astype(np.int64)
            lists[name] = JaggedRows(offsets - offsets[0], raw_values(column.flatten()))
        else:
            width = len(dense_columns[name])
            dense[name] = column.flatten().to_numpy().astype(np.float32).reshape(len(column), width)
    names = {name: list(dense_columns[name]) for name in dense}
    return SideTable(raw_values(table[SIDE_KEY].combine_chunks()), categorical, dense, names, lists)


def side_table_arrow(table: SideTable) -> pa.Table:
    """A side table as items.parquet / users.parquet hold it: ``SIDE_KEY``, then each categorical
    feature's raw values, each list feature's list<raw value>, each dense feature's list<float32>."""
    columns: Dict[str, pa.Array] = {SIDE_KEY: pa.array(table.keys)}
    columns.update({name: pa.array(values) for name, values in table.categorical.items()})
    for name, rows in table.lists.items():
        columns[name] = pa.ListArray.from_arrays(pa.array(rows.offsets, pa.int32()), pa.array(rows.values))
    for name, matrix in table.dense.items():
        width = matrix.shape[1]
        offsets = pa.array(np.arange(len(matrix) + 1, dtype=np.int64) * width, pa.int32())
        columns[name] = pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1), pa.float32()))
    return pa.table(columns)


def write_side_table(table: SideTable, ids: IdMap, path: Path) -> Tuple[Dict[str, IdMap], Dict[str, List[str]]]:
    """Write ``table`` to ``path`` -> (its features' vocabularies, its dense features' column names),
    as ``SideFeatures.align(table, ids)`` makes them."""
    aligned = SideFeatures.align(table, ids)
    pq.write_table(side_table_arrow(table), path)
    return aligned.vocabularies, aligned.dense_columns
