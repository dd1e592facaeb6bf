"""New items without retraining: ``gr items add EXPORT ITEMS --out NEW_EXPORT``.

Writes a new export (never edits one in place, nor writes inside it: the old keeps serving until
``/admin/reload`` points at the new) where the items of the file ITEMS (CSV with a header, or
Parquet) join the catalogue with their item features:

* their raw ids extend the item id map (every known item keeps its row);
* their rows of the item table: on an export of a model with an item tower (``model.item_tower``:
  ``sparse/item_encoder.safetensors``, ``gr.export.item_encoder``), the tower's encoder of their
  item features, what the model gives an item with those features and no trained id row; where the
  encoder file holds the mean served query, the direction of the trained items nearest those
  features instead, turned by its count, and lifted or lowered with the other new rows to the share
  of top 10s trained items of their counts take where it holds the served queries
  (``gr.export.new_item_rows``), so a catalogue search scores each by its features and how often it
  was seen. Otherwise (the model has
  never seen them; their item features, which the PrefixDNN reads, are what tells them apart as
  candidates) they are, on an
  export with a retrieval head, zero: a catalogue search (recommend, generation) scores an item by
  the cosine of its normalised row with the query, and a zero row normalises to zero (never NaN), so
  a new item scores 0 for every query and ranks below every trained item the query has a positive
  cosine with. The mean of the trained rows, "an average item", points where typical queries point
  and would put the new items first for nearly every user. On a ranking export (no catalogue search)
  their rows are that mean, what the PrefixDNN reads beside their features;
* their item features go to the item store (categorical values through the export's
  vocabularies: a value the model never saw takes the unknown id 0), as items the data had;
* their popularity (when the export stores it) is the file's ``item_popularity`` column, each item's
  count of events, or 0 without one. An export whose tower reads popularity
  (``model.item_tower.popularity``) encodes that count with the features; count over the span the
  training data covered (or scale to it), since the encoder learned what a training count means.

An item the export already has is refused, unless ``replace_known`` (``--replace-known``): then
its stored features become the file's (a changed brand, price, genres), while its trained row and
its popularity stay (the popularity becomes the file's ``item_popularity`` where the file gives
one); served by id, it is scored with its new features. With an item tower its row becomes its
trained id part (the row less the encoder of its old features and count) plus the encoder of its
new ones: refreshing an added item's count this way moves it as its events accumulate.

An export whose model reads no item feature is refused: every new item would score alike.
ITEMS holds one row per new item: the item column (``item_id``) and each stored item feature
by name: a categorical value, a list of them (a Parquet list, or in CSV one cell joined by
``list_separator``), or a dense feature's columns as the export's id maps name them; optionally
``item_popularity`` (integers >= 0) on an export that stores popularity; no other column. Lists
are read by the training readers' rules (an empty value inside one is refused).
"""

from __future__ import annotations

import csv
import functools
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import torch
from safetensors.numpy import load_file
from safetensors.numpy import save as safetensors_bytes

from gr.data.interactions import DataFormatError
from gr.data.mappings import load_mappings, save_mappings
from gr.data.parsing import INT_PATTERN, fits_int64, id_overflow, parquet_list, split_lists
from gr.export.format import (
    ID_MAPS_DIR,
    POSTFIX,
    POSTFIX_QUERY,
    SPARSE_DIR,
    TABLE_TENSOR,
    TIMESTAMPS,
    TOKENS,
    ExportFormatError,
    Problem,
)
from gr.export.item_encoder import MEAN_QUERY, SERVED_QUERIES, check_item_encoder
from gr.export.item_store import ITEM_FEATURE, ITEM_STORE, Column, ItemStore, load_item_store, write_item_store
from gr.export.manifest import write_manifest
from gr.export.new_item_rows import place
from gr.export.popularity import POPULARITY, read_popularity, write_popularity
from gr.export.reader import ExportManifest, check_export, open_export
from gr.export.slice_graph import CANDIDATES_OPTIONAL
from gr.export.sparse_manifest import SparseManifest
from gr.jagged_rows import JaggedRows
from gr.postfix_dnn.item_tower import POPULARITY_FEATURE, ItemEncoder, popularity_columns, reads_popularity
from gr.utils.atomic import atomic_directory
from gr.utils.outputs import checked_output

ITEMS_MAP = "items"


class ItemsFileError(ValueError):
    """A bad items file: the message names the file, the row or line, and the column."""


def add_items(
    export_dir: Path,
    items_file: Path,
    out_dir: Path,
    list_separator: str = "|",
    replace_known: bool = False,
    overwrite: bool = False,
) -> Dict[str, Any]:
    """Write ``out_dir``: the export ``export_dir`` with the items of ``items_file`` added, or with
    ``replace_known`` their features replaced where the export has them (module docstring) ->
    {"items_added", "items_replaced", "unknown_values"} (feature values the vocabularies lacked),
    on a retrieval export with items added "trained_items" (the item rows before the new ones), and
    where new rows were placed "gain_fit" {"alpha", "beta", "shift"} (``gr.export.new_item_rows``).

    ``out_dir`` must lie apart from the export and the items file (``gr.utils.outputs``); an existing
    ``out_dir`` is replaced only with ``overwrite``."""
    checked_output(out_dir, [("EXPORT", export_dir), ("ITEMS", items_file)], "--out")
    export = open_export(export_dir)
    store = load_item_store(export.root, export.graph, export.sparse)
    if store is None or not store.features:
        raise ValueError(
            f"{export_dir}: its model reads no item feature, so every new item would score alike; retrain with "
            "the new items instead"
        )
    maps, columns = load_mappings(str(export.root / ID_MAPS_DIR))
    if ITEMS_MAP not in maps:
        raise ValueError(f"{export_dir}: no raw item id map ({ID_MAPS_DIR}/{ITEMS_MAP}.tsv) to add raw ids to")
    table = export.sparse.tables[export.sparse.features[ITEM_FEATURE].table]
    popularity = read_popularity(export.root)
    encoder, mean_query, served_queries = _item_encoder(export.root, export.sparse)
    if encoder is not None and reads_popularity(encoder) and popularity is None:
        raise ExportFormatError([Problem(POPULARITY, "count", "missing: the item encoder reads the items' popularity")])
    frame = _read_items(items_file, store.features, columns, list_separator, counts=popularity is not None)
    item_column = frame.pop(ITEM_FEATURE)
    given = frame.pop(POPULARITY_FEATURE, None)  # [n] int64 each file row's count, or None
    if isinstance(item_column, JaggedRows):
        raise ItemsFileError(f"{items_file}: column {ITEM_FEATURE!r}: expected one id per row, got lists")
    file_ids = _file_ids(items_file, item_column, maps[ITEMS_MAP].raw.dtype)
    rows = maps[ITEMS_MAP].encode(file_ids, unknown=-1)  # each file row's item row, -1: a new item
    if not replace_known and (rows >= 0).any():
        row = int(np.flatnonzero(rows >= 0)[0])
        raise ItemsFileError(
            f"{items_file}: row {row + 1}: column {ITEM_FEATURE!r}: item {file_ids.tolist()[row]!r} is already in "
            "the export (--replace-known replaces its features)"
        )
    raw_ids = file_ids[rows < 0]
    added, unknown = len(raw_ids), 0
    fit = None
    # The new store's rows, taken from [stored rows, file rows]: known items' from the file, then the new ones.
    take = np.arange(table.rows, dtype=np.int64)
    take[rows[rows >= 0]] = table.rows + np.flatnonzero(rows >= 0)
    take = np.concatenate([take, table.rows + np.flatnonzero(rows < 0)])
    features: Dict[str, Column] = {}
    for name, stored in store.features.items():
        values = frame[name]
        flat, rows_of = (values.values, values.offsets) if isinstance(values, JaggedRows) else (values, None)
        if name in maps:  # categorical (one value, or a list): raw values -> ids, 0 when unknown
            ids = maps[name].encode(_typed_raw(items_file, name, flat, maps[name].raw.dtype, rows_of), unknown=0)
            unknown += int((ids == 0).sum())
            values = values.with_values(ids) if isinstance(values, JaggedRows) else ids
        elif flat.dtype.kind != "f":  # categorical without a map: its values are the ids
            kind = (stored.values if isinstance(stored, JaggedRows) else np.asarray(stored)).dtype
            ids = _typed_raw(items_file, name, flat, kind, rows_of)
            values = values.with_values(ids) if isinstance(values, JaggedRows) else ids
        combined = _appended(stored, values)
        features[name] = combined.take(take) if isinstance(combined, JaggedRows) else combined[take]
    with atomic_directory(out_dir, command="gr items add", overwrite=overwrite) as tmp:
        shutil.copytree(export.root, tmp, dirs_exist_ok=True)
        maps[ITEMS_MAP] = maps[ITEMS_MAP].extended(raw_ids)
        save_mappings(str(tmp / ID_MAPS_DIR), maps, columns)
        weights = load_file(str(export.root / SPARSE_DIR / table.file))[TABLE_TENSOR]
        searched = POSTFIX_QUERY in [t.name for t in export.graph.slice(POSTFIX).outputs]
        new_row = np.zeros_like(weights[:1]) if searched else weights.mean(0, keepdims=True)
        grown = np.concatenate([weights, np.repeat(new_row, added, axis=0)])
        counts = None
        if popularity is not None:  # known items keep their counts unless the file gives them
            counts = np.concatenate([popularity, np.zeros(added, dtype=np.int64)])
            if given is not None:  # file row r's item: its known row, or the next new row
                counts[np.where(rows >= 0, rows, table.rows + np.cumsum(rows < 0) - 1)] = given
        if encoder is not None:  # rows = trained id part + the encoder of the (new) features and counts
            replaced, fresh = rows[rows >= 0], np.arange(table.rows, table.rows + added)
            placing = mean_query is not None and popularity is not None and added > 0  # gr.export.new_item_rows
            # every trained item's feature-only vector when placing (the fit reads them), else the replaced ones'
            known = np.arange(table.rows) if placing else replaced
            trained_only = _feature_vectors(encoder, store, popularity, known)
            grown[replaced] -= trained_only[replaced] if placing else trained_only
            grown_store = ItemStore(ITEM_FEATURE, features)
            grown[replaced] += _feature_vectors(encoder, grown_store, counts, replaced)
            new = _feature_vectors(encoder, grown_store, counts, fresh)
            if placing:
                assert mean_query is not None and popularity is not None and counts is not None  # placing says so
                new, fit = place(new, counts[fresh], weights, trained_only, popularity, mean_query, served_queries)
            grown[fresh] = new
        (tmp / SPARSE_DIR / table.file).write_bytes(safetensors_bytes({TABLE_TENSOR: grown.astype(np.float32)}))
        sparse = replace(
            export.sparse, tables={**export.sparse.tables, table.name: replace(table, rows=table.rows + added)}
        )
        sparse.write(tmp)
        graph_features, event_features = _token_features(export)
        (tmp / ITEM_STORE).unlink()
        write_item_store(tmp, features, graph_features, sparse, event_features)
        if counts is not None:
            (tmp / POPULARITY).unlink()
            write_popularity(tmp, counts, sparse)
        write_manifest(tmp)
        problems = check_export(tmp)
        if problems:
            raise ExportFormatError(problems)
    summary: Dict[str, Any] = {
        "items_added": added,
        "items_replaced": int((rows >= 0).sum()),
        "unknown_values": unknown,
    }
    if fit is not None:
        summary["gain_fit"] = {"alpha": fit.alpha, "beta": fit.beta, "shift": fit.shift}
    if searched and added:
        summary["trained_items"] = table.rows
    return summary


def _feature_vectors(
    encoder: ItemEncoder, store: ItemStore, counts: Optional[np.ndarray], items: np.ndarray
) -> np.ndarray:
    """[n, d] the encoder's vectors of ``items`` [n] from their features in ``store`` and, when it
    reads them, their ``counts`` ([rows] int64)."""
    columns = {name: store.lookup(name, items) for name in store.features}
    return encoder.encode_columns(
        {**columns, **popularity_columns(encoder, None if counts is None else counts[items])}
    ).numpy()


def _item_encoder(
    root: Path, sparse: SparseManifest
) -> Tuple[Optional[ItemEncoder], Optional[np.ndarray], Optional[np.ndarray]]:
    """The export's item tower encoder (``gr.export.item_encoder``), its mean query [d] and its served
    queries [S, d]: None for each the export lacks."""
    problems: List[Problem] = []
    read = check_item_encoder(root, sparse, problems)
    if problems:
        raise ExportFormatError(problems)
    if read is None:
        return None, None, None
    metadata, weights = read
    mean_query, served_queries = weights.pop(MEAN_QUERY, None), weights.pop(SERVED_QUERIES, None)
    encoder = ItemEncoder.from_metadata(metadata)
    encoder.load_state_dict({name: torch.from_numpy(value) for name, value in weights.items()})
    return encoder.eval(), mean_query, served_queries


def _token_features(export: ExportManifest) -> Tuple[Dict[str, int], Tuple[str, ...]]:
    """({token feature: dim} of the request schema, the features of the interaction)."""
    dims: Dict[str, int] = {}
    events: List[str] = []
    for spec in export.graph.request:
        if spec.name == TIMESTAMPS or spec.shape[0] != TOKENS:
            continue
        is_table = spec.name in export.sparse.features
        dims[spec.name] = export.sparse.feature_dim(spec.name) if is_table else int(spec.shape[1])
        if spec.candidates == CANDIDATES_OPTIONAL:
            events.append(spec.name)
    return dims, tuple(events)


def _appended(stored: Column, new: Column) -> Column:
    if isinstance(stored, JaggedRows) and isinstance(new, JaggedRows):
        return JaggedRows.from_lengths(
            np.concatenate([stored.lengths(), new.lengths()]), np.concatenate([stored.values, new.values])
        )
    return np.concatenate([np.asarray(stored), np.asarray(new).astype(np.asarray(stored).dtype)])


def _typed_raw(
    path: Path, column: str, raw: np.ndarray, kind: np.dtype, offsets: Optional[np.ndarray] = None
) -> np.ndarray:
    """raw: [n] str values of ``column`` -> [n] in an id map's raw type ``kind`` (int64 for an integer
    map: a value that is not an integer names its file row; ``offsets``: [rows+1] of a list column)."""
    if kind.kind not in "iu":
        return raw.astype(kind)
    texts = raw.tolist()
    index = next((i for i, text in enumerate(texts) if not fits_int64(text)), None)
    if index is not None:
        text = texts[index]
        message = id_overflow(text) if INT_PATTERN.fullmatch(text) else f"expected an integer, got {text!r}"
        row = index if offsets is None else int(np.searchsorted(offsets, index, side="right")) - 1
        raise _row_error(path, column, row, message)
    return raw.astype(np.int64)


def _file_ids(path: Path, raw: np.ndarray, kind: np.dtype) -> np.ndarray:
    """The items file's raw ids, in the item map's raw type ``kind``, checked distinct."""
    raw = _typed_raw(path, ITEM_FEATURE, raw, kind)
    values, counts = np.unique(raw, return_counts=True)
    if (counts > 1).any():
        repeated = values[counts > 1][0]
        rows = np.flatnonzero(raw == repeated)
        raise ItemsFileError(
            f"{path}: row {rows[1] + 1}: column {ITEM_FEATURE!r}: item {repeated.item()!r} repeats row {rows[0] + 1}"
        )
    return raw


def _read_items(
    path: Path, stored: Dict[str, Column], dense_columns: Dict[str, List[str]], list_separator: str, counts: bool
) -> Dict[str, Column]:
    """{"item_id": [n] str, feature: [n] str | JaggedRows of str | [n, d] float32} from the items file;
    ``stored``: the item store's features (a JaggedRows one is list-valued); with ``counts`` the file
    may also give ``item_popularity``: [n] int64 >= 0."""
    table = _table(path)
    wanted = {ITEM_FEATURE: [ITEM_FEATURE], **{f: dense_columns.get(f, [f]) for f in stored}}
    if counts and POPULARITY_FEATURE in table.column_names:
        wanted[POPULARITY_FEATURE] = [POPULARITY_FEATURE]
    every = [c for cs in wanted.values() for c in cs]
    missing = [c for c in every if c not in table.column_names]
    if missing:
        raise ItemsFileError(f"{path}: lacks column(s) {missing}; an items file of this export has {every}")
    unknown = [c for c in table.column_names if c not in every]
    if unknown:  # a column the export has no feature for would be dropped without a word
        raise ItemsFileError(f"{path}: unknown column(s) {unknown}; an items file of this export has {every}")
    out: Dict[str, Column] = {}
    for name, names in wanted.items():
        for column_name in names:
            column = table[column_name]
            if column.null_count:
                row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
                raise ItemsFileError(f"{path}: row {row + 1}: column {column_name!r} is null")
        if name == POPULARITY_FEATURE:
            out[name] = _count_column(path, table[name])
        elif name in dense_columns:
            out[name] = np.stack([_numbers(path, c, table[c]) for c in names], axis=1).astype(np.float32)
        elif pa.types.is_list(table[name].type) or pa.types.is_large_list(table[name].type):
            try:  # list<string> or list<int>, no null or empty value inside: as training reads one
                out[name] = parquet_list(path, name, table[name], declared=True)
            except DataFormatError as error:
                raise ItemsFileError(str(error)) from None
        else:
            text = pc.cast(table[name], pa.string()).to_numpy(zero_copy_only=False).astype(str)
            if isinstance(stored.get(name), JaggedRows):  # values joined by the separator, as training splits them
                out[name] = split_lists(text, list_separator, functools.partial(_row_error, path, name))
            else:
                out[name] = text
    return out


def _row_error(path: Path, column: str, row: int, message: str) -> ItemsFileError:
    """``path: row N: column 'name': message`` for row ``row`` (0-based) of the items file."""
    return ItemsFileError(f"{path}: row {row + 1}: column {column!r}: {message}")


def _table(path: Path) -> pa.Table:
    """The items file: Parquet, or CSV with a header (every column read as text)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such items file")
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path)
        with open(path, encoding="utf8", newline="") as f:
            names = next(csv.reader(f), [])
        convert = pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=False)
        return pacsv.read_csv(path, convert_options=convert)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as error:  # OSError: a corrupt Parquet page, too
        raise ItemsFileError(
            f"{path}: not a readable CSV or Parquet items file ({str(error).splitlines()[0]})"
        ) from None


def _numbers(path: Path, name: str, column: pa.ChunkedArray) -> np.ndarray:
    """A dense feature's column -> [n] finite float64; the first bad value names its row."""
    try:
        values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        text = pc.cast(column, pa.string()).to_numpy(zero_copy_only=False).astype(str)
        row = next(i for i, v in enumerate(text.tolist()) if not _is_number(v))
        raise ItemsFileError(
            f"{path}: row {row + 1}: column {name!r}: expected a number, got {text.tolist()[row]!r}"
        ) from None
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        raise ItemsFileError(
            f"{path}: row {bad[0] + 1}: column {name!r}: expected a finite number, got {values[bad[0]]}"
        )
    return values


def _count_column(path: Path, column: pa.ChunkedArray) -> np.ndarray:
    """``item_popularity`` -> [n] int64 counts; the first value that is not an integer >= 0 names its row."""
    values = _numbers(path, POPULARITY_FEATURE, column)
    bad = np.flatnonzero((values < 0) | (values != np.round(values)))
    if len(bad):
        raise _row_error(
            path, POPULARITY_FEATURE, int(bad[0]), f"expected a count (an integer >= 0), got {values[bad[0]]}"
        )
    return values.astype(np.int64)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
