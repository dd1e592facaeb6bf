"""The item feature store of an export: ``sparse/item_features.safetensors``, each catalogue item's
declared item features, so that a request (and a generated or retrieved item) needs only the item id.

One safetensors file, metadata ``{"format_version": "1", "item_feature": "item_id"}``::

    item_id     [n] int64       the stored items: model ids (rows of the item table), strictly increasing
    <feature>   [n] int64       a categorical item feature: the row of its table (0: unknown)
    <feature>   [n, d] float32  a dense item feature
    <feature>   [V] int64       a list-valued item feature: the rows of its table, item after item,
    <feature>.offsets [n+1] int64   stored item i's ids at ``offsets[i]:offsets[i+1]`` (jagged)

Each ``<feature>`` is a token feature of the request schema (``[request.<feature>]`` of
slice_graph.ini) other than the item itself and the features of the interaction
(``candidates = optional``). An item that is not listed has the unknown row, id 0 and zeros
(an empty list): what training gives an item the data has no side features for. The serving runtime fills the
stored features of every history token and candidate a request sends without them; a request
that sends a stored feature overrides the store for that column. The file is covered by the
MANIFEST like every other; ``check_item_store`` is what ``gr check`` and every loader verify.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
from safetensors.numpy import save as safetensors_bytes

from gr.export.format import TIMESTAMPS, TOKEN_BAGS, TOKENS, ExportError, ExportFormatError, Problem, read_safetensors
from gr.export.slice_graph import CANDIDATES_OPTIONAL, SliceGraph
from gr.export.sparse_manifest import SparseManifest
from gr.jagged_rows import JaggedRows
from gr.utils.atomic import write_bytes

ITEM_STORE = "sparse/item_features.safetensors"
ITEM_FEATURE = "item_id"
STORE_FORMAT_VERSION = "1"
OFFSETS = ".offsets"  # suffix of a list feature's offsets tensor
Column = Union[np.ndarray, JaggedRows]  # [rows] int64 | [rows, d] float32 | rows of int64 ids


class ItemStore:
    """An export's stored item features, by model item id.

    item_feature: the token feature that holds the item; features: {feature: [rows] int64 |
    [rows, d] float32 | rows of int64 ids (a list feature)}, one row per row of the item table
    (unlisted items: the unknown row, or an empty list)."""

    def __init__(self, item_feature: str, features: Dict[str, Column]) -> None:
        self.item_feature = item_feature
        self.features = features

    def lookup(self, feature: str, items: np.ndarray) -> Column:
        """items: [n] int64 model ids (rows of the item table) -> [n] int64 | [n, d] float32 | n rows of ids."""
        column = self.features[feature]
        return column.take(items) if isinstance(column, JaggedRows) else column[items]


def write_item_store(
    root: Path,
    features: Mapping[str, Column],
    graph_features: Mapping[str, int],
    sparse: SparseManifest,
    event_features: Sequence[str],
) -> None:
    """Write ``root/sparse/item_features.safetensors`` from ``features``: {feature: [rows] int64 ids |
    [rows, d] float32 | rows of int64 ids (a list feature, ``JaggedRows``)}, row i the features of
    model item i (rows <= the item table's rows). Only items with a value other than the unknown
    row (id 0, zeros, an empty list) are stored.

    graph_features: {token feature: dim} that the prefix_dnn reads; event_features: the token
    features of the interaction (never item features). Raises ExportError naming a bad feature."""
    if ITEM_FEATURE not in sparse.features:
        raise ExportError(f"item_features: the export has no {ITEM_FEATURE!r} table feature to key them by")
    rows = sparse.tables[sparse.features[ITEM_FEATURE].table].rows
    arrays: Dict[str, np.ndarray] = {}
    lists: Dict[str, JaggedRows] = {}
    for name, values in features.items():
        where = f"item_features[{name!r}]"
        if name not in graph_features or name == ITEM_FEATURE or name in event_features:
            raise ExportError(
                f"{where}: not an item feature the prefix_dnn reads (item features: "
                f"{sorted(set(graph_features) - {ITEM_FEATURE} - set(event_features))})"
            )
        kind = sparse.features[name].kind if name in sparse.features else "dense"
        if isinstance(values, JaggedRows) or kind == "token_bag":
            if not isinstance(values, JaggedRows) or kind != "token_bag" or len(values) > rows:
                raise ExportError(
                    f"{where}: a list feature is rows of ids (JaggedRows) read through a table of kind token_bag, "
                    f"at most {rows} rows (the item table's); got {type(values).__name__} for kind {kind}"
                )
            lists[name] = JaggedRows(values.offsets, values.values.astype(np.int64))
            continue
        values = np.asarray(values)
        categorical = name in sparse.features
        shape = (len(values),) if categorical else (len(values), graph_features[name])
        if values.shape != shape or len(values) > rows or values.dtype.kind != ("i" if categorical else "f"):
            expected = "integer ids [n]" if categorical else f"floats [n, {graph_features[name]}]"
            raise ExportError(
                f"{where}: expected {expected}, row i for model item i, n <= {rows} (the rows of table "
                f"{sparse.features[ITEM_FEATURE].table!r}); got {values.dtype} {list(values.shape)}"
            )
        arrays[name] = values.astype(np.int64 if categorical else np.float32)
    known = np.zeros(rows, dtype=bool)
    for values in arrays.values():
        known[: len(values)] |= (values != 0).reshape(len(values), -1).any(1)
    for bags in lists.values():
        known[: len(bags)] |= bags.lengths() > 0
    items = np.flatnonzero(known)
    tensors = {ITEM_FEATURE: items.astype(np.int64)}
    for name, values in arrays.items():
        padded = np.zeros((rows, *values.shape[1:]), dtype=values.dtype)
        padded[: len(values)] = values
        tensors[name] = np.ascontiguousarray(padded[items])
    for name, bags in lists.items():
        stored = bags.take(np.where(items < len(bags), items, -1))
        tensors[name], tensors[name + OFFSETS] = stored.values, stored.offsets
    metadata = {"format_version": STORE_FORMAT_VERSION, "item_feature": ITEM_FEATURE}
    write_bytes(root / ITEM_STORE, safetensors_bytes(tensors, metadata=metadata))


def check_item_store(
    root: Path, graph: SliceGraph, sparse: SparseManifest, problems: List[Problem]
) -> Optional[ItemStore]:
    """Read and verify ``sparse/item_features.safetensors`` against the request schema and the
    tables -> the store (None when the export has none, or with problems added)."""
    path = root / ITEM_STORE
    if not path.is_file():
        return None
    start = len(problems)

    def problem(key: str, message: str) -> None:
        problems.append(Problem(ITEM_STORE, key, message))

    read = read_safetensors(root, ITEM_STORE, problems)
    if read is None:
        return None
    metadata, tensors = read
    version, item_feature = metadata.get("format_version"), metadata.get("item_feature")
    if version != STORE_FORMAT_VERSION:
        problem("format_version", f"unknown format version {version!r}; this reader knows {STORE_FORMAT_VERSION}")
        return None
    request = {t.name: t for t in graph.request}
    item_spec = request.get(item_feature) if isinstance(item_feature, str) else None
    if item_feature not in sparse.features or item_spec is None or tuple(item_spec.shape) != (TOKENS,):
        problem("item_feature", f"{item_feature!r} is not a token id feature of the export with a table")
        return None
    item_rows = sparse.tables[sparse.features[item_feature].table].rows
    items = tensors.get(item_feature)
    if items is None or items.dtype != np.int64 or items.ndim != 1:
        problem(item_feature, "expected an int64 [n] tensor of the stored items' model ids")
        return None
    if len(items) and (items.min() < 0 or items.max() >= item_rows or (np.diff(items) <= 0).any()):
        table = sparse.features[item_feature].table
        problem(item_feature, f"expected strictly increasing model ids in [0, {item_rows}) (rows of table {table!r})")
        return None
    features: Dict[str, Column] = {}
    for name, values in tensors.items():
        if name == item_feature or (name.endswith(OFFSETS) and name[: -len(OFFSETS)] in tensors):
            continue
        spec = request.get(name)
        if name == TIMESTAMPS or spec is None or spec.shape[0] != TOKENS:
            problem(name, "not a token feature of the request schema (default/slice_graph.ini [request.*])")
            continue
        if spec.candidates == CANDIDATES_OPTIONAL:
            problem(name, "a feature of the interaction (candidates = optional), not of the item")
            continue
        if tuple(spec.shape) == TOKEN_BAGS:
            bags = _stored_lists(name, values, tensors.get(name + OFFSETS), items, item_rows, sparse, problem)
            if bags is not None:
                features[name] = bags
            continue
        expected = (len(items), *spec.shape[1:])
        if values.dtype != np.dtype(spec.dtype) or values.shape != expected:
            problem(name, f"expected {spec.dtype} {list(expected)}, got {values.dtype} {list(values.shape)}")
            continue
        if name in sparse.features:
            table_rows = sparse.tables[sparse.features[name].table].rows
            if len(values) and (values.min() < 0 or values.max() >= table_rows):
                problem(name, f"ids out of range [0, {table_rows}) (table {sparse.features[name].table!r})")
                continue
        elif not np.isfinite(values).all():
            problem(name, "holds NaN or infinite values")
            continue
        full = np.zeros((item_rows, *values.shape[1:]), dtype=values.dtype)
        full[items] = values
        features[name] = full
    return ItemStore(item_feature, features) if len(problems) == start else None


def _stored_lists(
    name: str,
    values: np.ndarray,
    offsets: Optional[np.ndarray],
    items: np.ndarray,
    item_rows: int,
    sparse: SparseManifest,
    problem: Callable[[str, str], None],
) -> Optional[JaggedRows]:
    """A list feature's stored ``values`` [V] and ``offsets`` [n+1] -> one row of ids per row of the
    item table (unlisted items: empty), or None with a problem added."""
    n = len(items)
    if offsets is None or offsets.dtype != np.int64 or offsets.shape != (n + 1,):
        problem(
            name + OFFSETS, f"expected an int64 [{n + 1}] tensor (a list feature's offsets, one per stored item + 1)"
        )
        return None
    if values.dtype != np.int64 or values.ndim != 1:
        problem(name, f"expected int64 [V] ids (a list feature), got {values.dtype} {list(values.shape)}")
        return None
    if offsets[0] != 0 or offsets[-1] != len(values) or (np.diff(offsets) < 0).any():
        problem(name + OFFSETS, f"expected non-decreasing offsets from 0 to the {len(values)} ids of {name!r}")
        return None
    table_rows = sparse.tables[sparse.features[name].table].rows
    if len(values) and (values.min() < 0 or values.max() >= table_rows):
        problem(name, f"ids out of range [0, {table_rows}) (table {sparse.features[name].table!r})")
        return None
    stored_row = np.full(item_rows, -1, dtype=np.int64)
    stored_row[items] = np.arange(n)
    return JaggedRows(offsets, values).take(stored_row)


def load_item_store(root: Path, graph: SliceGraph, sparse: SparseManifest) -> Optional[ItemStore]:
    """``check_item_store`` for a loader: the store (None when the export has none); raises
    ExportFormatError naming every problem."""
    problems: List[Problem] = []
    store = check_item_store(root, graph, sparse, problems)
    if problems:
        raise ExportFormatError(problems)
    return store
