"""``gr predict EXPORT --input users.parquet --output scores.parquet``: batch scoring or top-K
through the serving runtime (``gr.serving.Ranker``), one input row per user.

Input: a Parquet file whose columns are a serving request (``gr.serving.request``) flattened,
nested keys joined by ``.`` (a struct column ``history`` with a field ``item_id`` reads the same
as a column ``history.item_id``)::

    user_id                    int or string                        required
    history.<feature>          list per token feature of the export  required (item_id, ...); optional
                                                                     for the item features the export
                                                                     stores (taken by item id)
    history.timestamps         list<int> seconds, oldest first       required (``gr.timestamps``; a
                                                                     list<timestamp> or a list<string> of
                                                                     ISO 8601 texts is read as seconds,
                                                                     floored, as training reads one)
    candidates.<feature>       list per token feature                optional: scores per candidate
    candidates.timestamps      as history.timestamps                 optional (default: request_time)
    common_features.<feature>  id, list of ids, or list<float>       required when the export reads it,
                                                                     but for an id feature whose map has
                                                                     an unknown id (then that id)
    request_time               int (null: the request's default)     optional

With ``--history-store`` (the store of ``gr serve --history-store``: an SQLite file or a Redis URL),
the input may hold no ``history.*`` column: each row is then answered from its user's stored history
(raw ids), as a served request without a history is (``gr.serving.history_store``; a user the store
does not know has an empty history).

A token feature's column holds a value per token: list<id> for an id feature, list<list<float>>
for a dense one, list<list<id>> for a list-valued one (a bag of ids per token). The candidates
leave out what a served request may: the stored item features and the features of the interaction.

Integers (ids, timestamps, request_time) must fit int64: unsigned values past it are refused, never
wrapped. Ids are raw ids (the dataset's, through the export's id maps) unless ``--ids model``. With
``candidates.*`` columns every row is ranked (``Ranker.prepare`` and ``Ranker.run``: users' candidates packed
into shared HSTU passes, ``--batch-size`` rows at a time); without them each row gets the top
``--k`` catalogue items (``Ranker.prepare`` and ``Ranker.run``: ``--batch-size`` users' queries from shared
passes and one catalogue search; retrieval exports).

Output: a Parquet file written atomically, one row per input row in input order: ``user_id``,
the input's ``candidates.*`` columns and ``scores.<name>`` (list<float32>, one per candidate:
``retrieval``, or each task's probability and ``<task>_logit``), or ``items`` and ``scores``
(the top k); then ``history_length``, ``truncated`` (oldest history tokens dropped), ``left_out``
(history tokens of items the export has no row for, with ``--unknown-ids oov``) and ``fallback``
(null, or how a row with an empty history was answered: ``user_features``, ``popularity``; see
``gr.serving.fallback``). A row with an empty history answers as a served request does: from the
user's features with an export that stores the new-user state, else from item popularity.

Parquet only: the history and candidates are lists, which Parquet stores as typed list
columns; CSV has no list type, and a list encoding inside CSV cells would be a second format
to document and validate. Bad input stops before the output appears, with one error naming the
file, the row (counted from 1, as training's Parquet errors count them) and the column. An
``--output`` that is the input file (under any spelling or link) or a directory is refused first.

``--events LOG --config RECIPE [--users IDS]`` builds that input from the event log instead
(``predict_events``): a row per user with ``history.item_id`` and ``history.timestamps`` from their
events, read as training reads ``data.path`` with the recipe's ``data`` format and columns, each
row answered with its top ``--k`` items (retrieval exports). ``--events DIR`` of a prepared
dataset (``gr data prepare``, appends included) reads its users' sequences instead, ``--config``
optional (when given, its prepared keys must be the dataset's).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gr.export.format import TIMESTAMPS
from gr.export.item_store import ITEM_FEATURE
from gr.jagged_rows import concat_ranges, evicted_prefix
from gr.serving.errors import RequestError, ScoringError
from gr.serving.options import DEFAULT_MICRO_BATCH, ID_SPACES, UNKNOWN_IDS
from gr.serving.scores import LOGIT_SUFFIX, RETRIEVAL
from gr.timestamps import INT64_MAX, floor_seconds
from gr.utils.atomic import atomic_file
from gr.utils.cli_errors import one_line, run_cli
from gr.utils.devices import DEVICES

if TYPE_CHECKING:
    from gr.data.interactions import Interactions
    from gr.serving import Ranker, RankRequest, RankResult, RecommendResult, ServingModel
    from gr.serving.recommend import PreparedRecommend
    from gr.serving.request import IdOptions

USER = "user_id"
REQUEST_TIME = "request_time"
HISTORY = "history"
CANDIDATES = "candidates"
COMMON = "common_features"
SCORES = "scores"
ITEMS = "items"
DEFAULT_BATCH_SIZE = 64
PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True)
class Layout:
    """The input's columns for one export: the history / candidate token features it holds and the
    common features (names without their prefix); ``rank`` when the input holds candidates."""

    tokens: Tuple[str, ...]
    candidates: Tuple[str, ...]
    common: Tuple[str, ...]
    stored: bool = False  # no history columns: each row's history is its user's stored one

    @property
    def rank(self) -> bool:
        return bool(self.candidates)


def predict(
    export_dir: str | Path,
    input_path: str | Path,
    output_path: str | Path,
    *,
    k: int = 10,
    batch_size: int = DEFAULT_BATCH_SIZE,
    ids: str = "raw",
    unknown_ids: str = "error",
    exclude_seen: bool = True,
    micro_batch: int = DEFAULT_MICRO_BATCH,
    device: str = "cpu",
    progress: bool = True,
    history_store: Optional[str] = None,
) -> Dict[str, Any]:
    """Score every row of ``input_path`` with the export on ``device`` (cpu|cuda|npu, as
    ``gr serve --device``); returns {"rows", "mode", "seconds"}. history_store: where rows without
    history columns read their users' histories (``gr serve --history-store``'s value)."""
    input_path, output_path = Path(input_path), Path(output_path)
    ranker = _load(export_dir, input_path, output_path, k, batch_size, micro_batch, device)
    source = _open(input_path)
    schema = _flatten(source.schema_arrow.empty_table()).schema
    layout = input_layout(schema, ranker.model, input_path, stored=history_store is not None)
    if layout.stored:
        _open_history_store(ranker, str(history_store), ids)
    batches = (_flatten(pa.Table.from_batches([batch])) for batch in _batches(source, input_path, batch_size))
    scoring = _Scoring(ranker, export_dir, k, batch_size, ids, unknown_ids, exclude_seen, progress)
    try:
        return scoring.run(layout, schema, batches, source.metadata.num_rows, input_path, output_path)
    finally:
        if ranker.history_store is not None:
            ranker.history_store.close()


def predict_events(
    export_dir: str | Path,
    events: str | Path,
    output_path: str | Path,
    config: Optional[str | Path],
    *,
    users: Optional[Sequence[str]] = None,
    k: int = 10,
    batch_size: int = DEFAULT_BATCH_SIZE,
    ids: str = "raw",
    unknown_ids: str = "error",
    exclude_seen: bool = True,
    micro_batch: int = DEFAULT_MICRO_BATCH,
    device: str = "cpu",
    progress: bool = True,
) -> Dict[str, Any]:
    """Each user's top ``k`` items (a retrieval export) from their latest history in the event log
    ``events`` (a CSV or Parquet file, a directory of partitions or a glob, read as training reads
    ``data.path``: the format and columns of ``data`` in the recipe ``config``), or in the prepared
    dataset directory ``events`` (its users' sequences: the users and items its filters kept; ``config``
    may be None).

    A user's events are taken in timestamp order (equal timestamps in the order they are read, as
    training orders them; duplicates dropped unless ``data.keep_duplicates``), the oldest cut as
    serving cuts a history longer than the model's window (counted in ``truncated``). users: the
    raw user ids to score, in that order (default: every user of the log, in id order); one the
    log has no event of is a ValueError naming ``--users``. Output rows as ``predict``'s."""
    from gr.data.prepared.manifest import MANIFEST

    events, output_path = Path(events), Path(output_path)
    if config is None and not (events / MANIFEST).is_file():
        raise ValueError("--events: give --config, the recipe whose data section names the event columns")
    ranker = _load(export_dir, events, output_path, k, batch_size, micro_batch, device)
    if not ranker.model.is_retrieval:
        raise ValueError(
            f"--events: {export_dir} is a ranking export, which scores candidates: give them with --input "
            f"(a Parquet file with {CANDIDATES}.* columns per user)"
        )
    data = _read_events(events, None if config is None else Path(config))
    config_ = ranker.model.config
    table, truncated = events_table(data, users, config_.max_seq_len, config_.eviction_block)
    batches = (table.slice(start, batch_size) for start in range(0, table.num_rows, batch_size))
    scoring = _Scoring(ranker, export_dir, k, batch_size, ids, unknown_ids, exclude_seen, progress)
    layout = input_layout(table.schema, ranker.model, events)
    return scoring.run(layout, table.schema, batches, table.num_rows, events, output_path, truncated)


def _load(
    export_dir: str | Path, input_path: Path, output_path: Path, k: int, batch_size: int, micro_batch: int, device: str
) -> Ranker:
    """The export's ranker on ``device``, after the arguments are checked (ValueError naming them)."""
    # The serving runtime (torch, ONNX Runtime): imported to score, never to parse gr predict's arguments.
    from gr.serving.model import check_device
    from gr.serving.runtime import Ranker

    if batch_size < 1 or k < 1:
        raise ValueError(f"--batch-size and --k: expected >= 1, got {batch_size} and {k}")
    _check_output(input_path, output_path)
    try:
        check_device(device)
    except RuntimeError as exc:  # the host cannot serve there: bad input, one line
        raise ValueError(str(exc)) from None
    return Ranker.load(export_dir, micro_batch=micro_batch, device=device)


def _open_history_store(ranker: Ranker, spec: str, ids: str) -> None:
    """Give ``ranker`` the history store ``spec`` (``gr serve --history-store``'s value), which
    rows without history columns read (ValueError / FileNotFoundError naming the flag)."""
    from gr.serving.history_store import HistoryStoreError
    from gr.serving.history_store_spec import REDIS_SCHEMES, open_history_store

    if ids != "raw":
        raise ValueError(f"--ids {ids}: the rows read their users' stored histories, which hold raw ids")
    if not spec.startswith(REDIS_SCHEMES) and not Path(spec).is_file():
        raise FileNotFoundError(f"--history-store {spec}: no such file (gr serve's history store)")
    try:
        ranker.history_store = open_history_store(spec, ranker.model.config.max_seq_len)
    except HistoryStoreError as exc:
        raise ValueError(f"--history-store {spec}: {exc}") from None


def _read_events(events: Path, config: Optional[Path]) -> Interactions:
    """The event log ``events`` read as the ``data`` section of the recipe ``config`` reads its
    ``data.path`` (a csv or parquet source), duplicates dropped as training drops them; or the
    prepared dataset ``events`` (``_read_prepared``)."""
    from gr.data.config import DataConfig
    from gr.data.prepared.manifest import MANIFEST
    from gr.data.readers import READERS
    from gr.train.config import read_recipe

    if (events / MANIFEST).is_file():
        return _read_prepared(events, config)
    assert config is not None  # predict_events asks for it
    section = read_recipe(config, f"--config {config}").get("data")
    if not isinstance(section, dict):
        raise ValueError(f"--config {config}: expected a data: section naming the event columns (data.columns)")
    try:
        data = DataConfig.from_dict({**section, "path": str(events)})
    except ValueError as exc:
        raise ValueError(f"--config {config}: {exc}") from None
    if data.source not in ("csv", "parquet"):
        raise ValueError(
            f"--config {config}: data.source {data.source!r}: --events reads an event table, data.source csv or parquet"
        )
    return READERS[data.source](data).without_duplicates(drop=not data.keep_duplicates)


def _read_prepared(directory: Path, config: Optional[Path]) -> Interactions:
    """The events of the prepared dataset ``directory``: each user's current sequence (a later append's
    row superseding an earlier one), in time order, as raw ids; checked against the data section of
    the recipe ``config`` when given (its prepared keys must be the dataset's)."""
    from gr.data.config import DataConfig
    from gr.data.interactions import Interactions
    from gr.data.prepared.manifest import read_manifest
    from gr.data.prepared.reader import PreparedData
    from gr.train.config import read_recipe

    data = read_manifest(directory).data_config()
    if config is not None:
        section = read_recipe(config, f"--config {config}").get("data")
        try:
            data = DataConfig.from_dict({**(section if isinstance(section, dict) else {}), "prepared": str(directory)})
        except ValueError as exc:
            raise ValueError(f"--config {config}: {one_line(exc)}") from None
    prepared = PreparedData(directory, dataclasses.replace(data, since_append=None), {})
    parts = [rows for _, rows in prepared.scan(prepared.row_groups)]
    users = np.concatenate([np.repeat(rows.users, np.diff(rows.offsets)) for rows in parts])
    return Interactions(
        prepared.user_map.decode(users),
        prepared.item_map.decode(np.concatenate([rows.items for rows in parts])),
        np.concatenate([rows.timestamps for rows in parts]),
        source=str(directory),
    )


def events_table(
    data: Interactions, users: Optional[Sequence[str]], max_seq_len: int, eviction_block: int = 1
) -> Tuple[pa.Table, np.ndarray]:
    """``predict``'s input from an event log: one row per user (``users``' raw ids in their order,
    else every user in id order) with ``user_id``, ``history.item_id`` and ``history.timestamps``
    in timestamp order (ties: the log's order), each history cut as serving cuts one longer than
    ``max_seq_len`` (whole ``eviction_block``s) -> (the table, [rows] int64 tokens cut per row)."""
    order = np.lexsort((np.arange(len(data.users)), data.timestamps, data.users))
    user_ids, starts, counts = np.unique(data.users[order], return_index=True, return_counts=True)
    if users is not None:
        wanted = _as_user_ids(users, user_ids)
        rows = np.minimum(np.searchsorted(user_ids, wanted), len(user_ids) - 1)
        known = user_ids[rows] == wanted
        if not known.all():
            missing = [u for u, ok in zip(users, known) if not ok]
            raise ValueError(
                f"--users: user(s) {missing[:5]} have no event in {data.source} ({len(user_ids)} users there)"
            )
        user_ids, starts, counts = user_ids[rows], starts[rows], counts[rows]
    cut = np.minimum(evicted_prefix(counts, max_seq_len, eviction_block), counts)
    offsets = np.concatenate([[0], np.cumsum(counts - cut)])
    taken = order[concat_ranges(starts + cut, counts - cut)]
    table = pa.table(
        {
            USER: pa.array(user_ids),
            f"{HISTORY}.{ITEM_FEATURE}": pa.ListArray.from_arrays(offsets, pa.array(data.items[taken])),
            f"{HISTORY}.{TIMESTAMPS}": pa.ListArray.from_arrays(offsets, pa.array(data.timestamps[taken], pa.int64())),
        }
    )
    return table, cut.astype(np.int64)


def _as_user_ids(users: Sequence[str], like: np.ndarray) -> np.ndarray:
    """``--users``' texts as ids of the log's kind: int64 when the log's ids are integers (a text
    that is not one is a ValueError naming it), else strings."""
    if like.dtype.kind != "i":
        return np.asarray(users, dtype=str)
    bad = [u for u in users if not re.fullmatch(r"-?\d+", u.strip())]
    if bad:
        raise ValueError(f"--users: {bad[:5]}: expected integers, as the log's user ids are")
    return np.asarray([int(u) for u in users], dtype=np.int64)


def read_users(text: str) -> List[str]:
    """``--users``: a file of one user id a line (blank lines skipped), else ids separated by commas."""
    path = Path(text)
    values = path.read_text().splitlines() if path.is_file() else text.split(",")
    users = [v.strip() for v in values if v.strip()]
    if not users:
        raise ValueError(f"--users {text}: no user id given")
    return users


class _Scoring:
    """Rows of ``predict``'s input layout through the export, into the output file."""

    def __init__(
        self,
        ranker: Ranker,
        export_dir: str | Path,
        k: int,
        batch_size: int,
        ids: str,
        unknown_ids: str,
        exclude_seen: bool,
        progress: bool,
    ) -> None:
        from gr.serving.request import IdOptions

        self.ranker, self.export_dir, self.k, self.batch_size = ranker, export_dir, k, batch_size
        self.options, self.exclude_seen, self.progress = IdOptions(ids, unknown_ids), exclude_seen, progress

    def run(
        self,
        layout: Layout,
        schema: pa.Schema,
        batches: Iterable[pa.Table],
        total: int,
        input_path: Path,
        output_path: Path,
        truncated: Optional[np.ndarray] = None,
    ) -> Dict[str, Any]:
        """Score the flattened ``batches`` (``schema``'s columns as ``layout`` reads them, ``total`` rows,
        read from ``input_path``) into ``output_path``; truncated: [rows] tokens already cut from each
        row's history, added to the output's ``truncated``. Returns {"rows", "mode", "seconds"}."""
        ranker, k = self.ranker, self.k
        if not layout.rank and not ranker.model.is_retrieval:
            raise ValueError(
                f"{input_path}: no {CANDIDATES}.* columns, so each row asks for its top {k} items, which needs a "
                f"retrieval export; {self.export_dir} is a ranking export: give {CANDIDATES}.{ITEM_FEATURE} (and its "
                "other token features) to score"
            )
        out_schema = output_schema(schema, ranker.model, layout)
        started = time.perf_counter()
        shown = _Progress(total, self.batch_size, self.progress)
        with atomic_file(output_path, binary=True) as handle, pq.ParquetWriter(handle, out_schema) as writer:
            first = 0
            for table in batches:
                rows = _Rows(table, input_path, first)
                requests = [_request(rows, i, layout, self.options) for i in range(table.num_rows)]
                results: List[Any]  # RankResult or RecommendResult
                if layout.rank:
                    results = _rank(ranker, requests, rows)
                else:
                    results = _recommend(ranker, requests, rows, k, self.exclude_seen)
                cut = None if truncated is None else truncated[first : first + table.num_rows]
                writer.write_table(_output_table(table, results, out_schema, cut))
                first += table.num_rows
                shown.update(first)
        shown.close()
        return {"rows": total, "mode": "rank" if layout.rank else f"top-{k}", "seconds": time.perf_counter() - started}


def input_layout(schema: pa.Schema, model: ServingModel, path: Path, stored: bool = False) -> Layout:
    """Check the (flattened) input columns against what ``model`` reads, as a served request is
    checked (``RequestSchema.tokens``): ValueError naming the file and the columns missing (the
    required and the optional ones apart), unknown or of the wrong type. stored: a history store is
    given, so the history columns may all be left out (the rows then read it)."""
    request = model.schema
    features = request.token_features
    common = (*request.common_ids, *request.common_dense)
    names = set(schema.names)
    from_store = stored and not any(name.startswith(f"{HISTORY}.") for name in names)
    candidates = tuple(f for f in (*features, TIMESTAMPS) if f"{CANDIDATES}.{f}" in names)
    required = [
        USER,
        *(f"{HISTORY}.{f}" for f in (*features, TIMESTAMPS) if f not in request.stored and not from_store),
        *(f"{COMMON}.{f}" for f in common if f not in request.omittable),
    ]
    if candidates:
        left_out = (*request.stored, *request.candidate_optional)
        required += [f"{CANDIDATES}.{f}" for f in features if f not in left_out]
    optional = [
        *(f"{HISTORY}.{f}" for f in request.stored),
        *(f"{COMMON}.{f}" for f in request.omittable),
        *(f"{CANDIDATES}.{f}" for f in (*features, TIMESTAMPS) if f"{CANDIDATES}.{f}" not in required),
        REQUEST_TIME,
    ]
    missing = [name for name in required if name not in names]
    if missing:
        raise ValueError(
            f"{path}: missing column(s) {missing}; the export requires {required} and reads the optional {optional}"
        )
    unknown = sorted(names - set(required) - set(optional))
    if unknown:
        raise ValueError(f"{path}: unknown column(s) {unknown}; expected some of {required} and optionally {optional}")
    for name in names:
        kind = schema.field(name).type
        if name == USER and not (
            pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)
        ):
            raise ValueError(f"{path}: column {USER}: expected integers or strings, got {kind}")
        if name == REQUEST_TIME and not pa.types.is_integer(kind):
            raise ValueError(f"{path}: column {REQUEST_TIME}: expected integers (seconds), got {kind}")
        if name.startswith((f"{HISTORY}.", f"{CANDIDATES}.")) and not _is_list(kind):
            raise ValueError(f"{path}: column {name}: expected a list per row (one value per token), got {kind}")
    given = tuple(f for f in common if f"{COMMON}.{f}" in names)
    return Layout(tuple(f for f in features if f"{HISTORY}.{f}" in names), candidates, given, from_store)


def output_schema(schema: pa.Schema, model: ServingModel, layout: Layout) -> pa.Schema:
    """The output columns: user_id, the input's candidates.* and scores.<name> (rank), or items
    and scores (top k; items typed as the input's history item ids, else as the item map's raw
    ids), history_length, truncated, left_out, fallback."""
    scores = pa.list_(pa.float32())
    fields = [schema.field(USER)]
    if layout.rank:
        fields += [schema.field(f"{CANDIDATES}.{f}") for f in layout.candidates]
        names = [RETRIEVAL] if model.is_retrieval else _ranking_score_names(model.postfix.output_names)
        fields += [pa.field(f"{SCORES}.{name}", scores) for name in names]
    else:
        items = (
            pa.list_(pa.array(model.id_maps.decode(ITEM_FEATURE, np.zeros(1, dtype=np.int64))).type)
            if layout.stored
            else schema.field(f"{HISTORY}.{ITEM_FEATURE}").type
        )
        fields += [pa.field(ITEMS, items), pa.field(SCORES, scores)]
    fields += [pa.field(name, pa.int32()) for name in ("history_length", "truncated", "left_out")]
    return pa.schema([*fields, pa.field("fallback", pa.string())])


def _ranking_score_names(tasks: Sequence[str]) -> List[str]:
    """gr.serving.scores' names: each task's probability, then its logit."""
    return [name for task in tasks for name in (task, f"{task}{LOGIT_SUFFIX}")]


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _check_output(input_path: Path, output_path: Path) -> None:
    """Refuse an output that would overwrite the input or cannot be a file: ValueError / OSError
    naming --output."""
    if output_path.exists() and input_path.exists() and output_path.samefile(input_path):
        raise ValueError(f"--output {output_path}: is the --input file {input_path}; write elsewhere")
    if output_path.is_dir():
        raise IsADirectoryError(f"--output {output_path}: is a directory; expected a Parquet file to write")
    if not output_path.parent.is_dir():
        raise FileNotFoundError(f"--output {output_path}: its directory {output_path.parent} does not exist")


def _open(path: Path) -> pq.ParquetFile:
    if not path.is_file():
        raise FileNotFoundError(f"--input {path}: no such file")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"--input {path}: not a readable Parquet file ({exc})") from None


def _batches(source: pq.ParquetFile, path: Path, batch_size: int) -> Iterator[pa.RecordBatch]:
    """``source``'s rows, ``batch_size`` at a time; a page that cannot be read (corrupt) is a
    ValueError naming ``--input``, as an unreadable footer is."""
    batches = source.iter_batches(batch_size)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"--input {path}: not a readable Parquet file ({exc})") from None
        yield batch


def _flatten(table: pa.Table) -> pa.Table:
    """Struct columns become dotted columns (``history {item_id}`` -> ``history.item_id``)."""
    while any(pa.types.is_struct(f.type) for f in table.schema):
        table = table.flatten()
    return table


class _Rows:
    """Cell access to one batch of the input: ids and timestamps as numpy arrays, scalars as
    Python values. A null, or a non-finite number, is a ValueError naming file, row and column."""

    def __init__(self, table: pa.Table, path: Path, first: int) -> None:
        self.path, self.first = path, first
        self.columns: Dict[str, Callable[[int], Any]] = {}
        for name in table.column_names:
            column = table.column(name).combine_chunks()
            self.columns[name] = self._cells(name, column)

    def row_error(self, row: int, error: Exception, column: Optional[str] = None) -> ValueError:
        """``FILE: row R, column C: message``, R counted from 1 (the column read from a RequestError's
        field)."""
        text = str(error)
        if column is None and isinstance(error, RequestError) and error.field in self.columns:
            column, text = error.field, text[len(error.field) + 2 :]
        where = f"{self.path}: row {self.first + row + 1}" + (f", column {column}" if column else "")
        return ValueError(f"{where}: {text}")

    def _cells(self, name: str, column: pa.Array) -> Callable[[int], Any]:
        if not _is_list(column.type):
            if column.null_count and name != REQUEST_TIME:
                raise self.row_error(int(np.flatnonzero(column.is_null())[0]), ValueError("null value"), name)
            values = column.to_pylist()
            bad: Union[np.ndarray, List[int]] = (
                np.flatnonzero(~np.isfinite(np.asarray(values, dtype=float)))
                if pa.types.is_floating(column.type)
                else []
            )
            if len(bad):
                raise self.row_error(int(bad[0]), ValueError(f"non-finite value {values[bad[0]]}"), name)
            self._check_int64(name, column.to_numpy(zero_copy_only=False), [])
            return values.__getitem__
        levels: List[np.ndarray] = []  # offsets of each list level, outermost first
        while True:
            if column.null_count:
                first = int(np.flatnonzero(column.is_null())[0])
                raise self.row_error(_row_of(levels, first), ValueError("null value"), name)
            if not _is_list(column.type):
                break
            if pa.types.is_fixed_size_list(column.type):
                column = column.cast(pa.list_(column.type.value_type))
            levels.append(np.asarray(column.offsets))
            column = column.values
        if pa.types.is_timestamp(column.type):  # seconds, floored, as training reads a TIMESTAMP column
            leaf = floor_seconds(column.cast(pa.int64()).to_numpy(), column.type.unit)
        else:
            leaf = column.to_numpy(zero_copy_only=False)
        self._check_int64(name, leaf, levels)
        if leaf.dtype.kind == "f" and not np.isfinite(leaf).all():
            first = int(np.flatnonzero(~np.isfinite(leaf))[0])
            raise self.row_error(_row_of(levels, first), ValueError(f"non-finite value {leaf[first]}"), name)
        if leaf.dtype == object:  # strings: a numpy str array, as raw-id maps take them
            leaf = leaf.astype(str)
        outer = levels[0]
        if len(levels) == 1:
            return lambda i: leaf[outer[i] : outer[i + 1]]
        inner = levels[1]
        return lambda i: [leaf[inner[j] : inner[j + 1]] for j in range(outer[i], outer[i + 1])]

    def _check_int64(self, name: str, values: np.ndarray, levels: List[np.ndarray]) -> None:
        """Refuse unsigned values past int64 (ids and timestamps are int64; never wrapped)."""
        if values.dtype == np.uint64 and len(values) and values.max() > np.uint64(INT64_MAX):
            bad = int(np.flatnonzero(values > np.uint64(INT64_MAX))[0])
            message = f"{values[bad]} does not fit int64 (at most {INT64_MAX})"
            raise self.row_error(_row_of(levels, bad), ValueError(message), name)

    def get(self, name: str, row: int, default: Any = None) -> Any:
        cell = self.columns.get(name)
        return default if cell is None else cell(row)


def _row_of(levels: List[np.ndarray], index: int) -> int:
    """The row of a value at ``index`` of the innermost level reached, through the offsets above it."""
    for offsets in reversed(levels):
        index = int(np.searchsorted(offsets, index, side="right")) - 1
    return index


def _request(rows: _Rows, i: int, layout: Layout, options: IdOptions) -> RankRequest:
    """Row i of the batch as a rank request (candidates empty in top-k mode)."""
    from gr.serving.request import RankRequest  # loaded by predict()

    history = None if layout.stored else {f: rows.get(f"{HISTORY}.{f}", i) for f in (*layout.tokens, TIMESTAMPS)}
    candidates = {f: rows.get(f"{CANDIDATES}.{f}", i) for f in layout.candidates}
    common = {f: rows.get(f"{COMMON}.{f}", i) for f in layout.common}
    request_time = rows.get(REQUEST_TIME, i)
    return RankRequest(rows.get(USER, i), history, candidates, common or None, request_time, options)


def _rank(ranker: Ranker, requests: List[RankRequest], rows: _Rows) -> List[RankResult]:
    """The batch's requests through the batched ranking path; an error names its row."""
    return _batched(ranker.prepare, ranker.run, requests, rows)


def _recommend(
    ranker: Ranker, requests: List[RankRequest], rows: _Rows, k: int, exclude_seen: bool
) -> List[RecommendResult]:
    """Each row's top k through the batched recommend path; an error names its row."""
    from gr.serving.request import RecommendRequest  # loaded by predict()

    def prepare(r: RankRequest) -> PreparedRecommend:
        return ranker.prepare(
            RecommendRequest(r.user_id, r.history, k, r.common_features, r.request_time, exclude_seen, r.id_options)
        )

    return _batched(prepare, ranker.run, requests, rows)


def _batched(
    prepare: Callable[[RankRequest], Any],
    run: Callable[[List[Any]], List[Any]],
    requests: List[RankRequest],
    rows: _Rows,
) -> List[Any]:
    """Validate each request (``prepare``), then run them as one batch; a request that fails, in
    validation or in the batch, is named by its row."""
    from gr.utils.finite import NonFiniteError  # torch's checks, loaded by predict() with the runtime

    prepared = []
    for i, request in enumerate(requests):
        try:
            prepared.append(prepare(request))
        except RequestError as exc:
            raise rows.row_error(i, exc) from None
    try:
        return run(prepared)
    except (RequestError, ScoringError):  # find the row: one by one
        for i, p in enumerate(prepared):
            try:
                run([p])
            except RequestError as exc:
                raise rows.row_error(i, exc) from None
            except ScoringError as exc:
                raise NonFiniteError(str(rows.row_error(i, exc))) from None
        raise


def _output_table(
    table: pa.Table, results: List[Any], schema: pa.Schema, truncated: Optional[np.ndarray] = None
) -> pa.Table:
    """One batch's output rows (``output_schema``'s columns) from its input and its results;
    truncated: [rows] tokens cut from each history before it was scored, added to ``truncated``."""
    columns: Dict[str, Any] = {}
    for name in schema.names:
        if name == USER or name.startswith(f"{CANDIDATES}."):
            columns[name] = table.column(name)
        elif name.startswith(f"{SCORES}."):
            columns[name] = [r.scores[name[len(SCORES) + 1 :]] for r in results]
        else:  # items, scores (top k), history_length, truncated, left_out, fallback
            columns[name] = [getattr(r, name) for r in results]
    if truncated is not None:
        columns["truncated"] = (np.asarray(columns["truncated"], dtype=np.int64) + truncated).astype(np.int32)
    return pa.table(columns, schema=schema)


class _Progress:
    """Rows scored so far on stderr: a redrawn line on a terminal, else a line every
    ``PROGRESS_EVERY_S`` seconds; nothing for an input of one batch or with progress off."""

    def __init__(self, total: int, batch_size: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled and total > batch_size
        self.terminal = sys.stderr.isatty()
        self.started = self.last = time.perf_counter()
        self.done = 0

    def update(self, done: int) -> None:
        self.done = done
        now = time.perf_counter()
        if self.enabled and (self.terminal or now - self.last >= PROGRESS_EVERY_S):
            self.last = now
            print(self._line(now), end="\r" if self.terminal else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(self._line(time.perf_counter()), file=sys.stderr, flush=True)

    def _line(self, now: float) -> str:
        rate = self.done / max(now - self.started, 1e-9)
        return (
            f"predict: {self.done}/{self.total} rows ({100 * self.done / max(self.total, 1):.0f}%, {rate:.0f} rows/s)"
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli("gr predict", lambda: _main(sys.argv[1:] if argv is None else list(argv)))


def _main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gr predict",
        description="Score a Parquet file of users with an export: with candidates.* columns each row's "
        "candidates are ranked, without them each row gets its top --k items (retrieval exports). Columns: "
        "user_id, history.<feature> lists (history.item_id, history.timestamps, ...), optional candidates.<feature> "
        "lists, common_features.<feature>, request_time (see gr/commands/predict.py). Rows count from 1 in error "
        "messages.",
    )
    parser.add_argument("export_dir", type=Path, metavar="EXPORT")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--input", type=Path, help="Parquet file, one row per user")
    given.add_argument(
        "--events",
        type=Path,
        help="event log (CSV or Parquet file, directory of partitions or glob) read as --config's data section "
        "reads data.path, or a prepared dataset directory (gr data prepare; --config optional): each user's top "
        "--k items from their latest history (retrieval exports)",
    )
    parser.add_argument("--config", type=Path, help="with --events: the recipe whose data section names the columns")
    parser.add_argument("--users", help="with --events: user ids to score, comma-separated or a file, one a line")
    parser.add_argument("--output", type=Path, required=True, help="Parquet file to write (atomically)")
    parser.add_argument("--k", type=int, default=10, help="items per user without candidates (default 10)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="users scored together")
    parser.add_argument("--micro-batch", type=int, default=DEFAULT_MICRO_BATCH, help="candidates per HSTU pass")
    parser.add_argument("--ids", choices=ID_SPACES, default="raw", help="raw ids (through sparse/id_maps) or model")
    parser.add_argument("--unknown-ids", choices=UNKNOWN_IDS, default="error", help="unknown raw ids: error or oov")
    parser.add_argument("--include-seen", action="store_true", help="top-k may return history items")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where the export runs (default cpu)")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--history-store",
        default=None,
        help="gr serve's history store (an SQLite file or redis://host:port/db): an input without history.* "
        "columns reads each user's stored history",
    )
    args = parser.parse_args(argv)
    options = dict(
        k=args.k,
        batch_size=args.batch_size,
        ids=args.ids,
        unknown_ids=args.unknown_ids,
        exclude_seen=not args.include_seen,
        micro_batch=args.micro_batch,
        device=args.device,
        progress=not args.no_progress,
    )
    if args.events is None:
        unused = [flag for flag, value in (("--config", args.config), ("--users", args.users)) if value is not None]
        if unused:
            parser.error(f"{unused[0]}: only --events reads it")
        summary = predict(args.export_dir, args.input, args.output, history_store=args.history_store, **options)
    else:
        if args.history_store is not None:
            parser.error("--history-store: --events reads the histories from the event log")
        users = None if args.users is None else read_users(args.users)
        summary = predict_events(args.export_dir, args.events, args.output, args.config, users=users, **options)
    rows = f"{summary['rows']} row{'' if summary['rows'] == 1 else 's'}"
    print(f"wrote {args.output}: {rows} ({summary['mode']}) in {summary['seconds']:.1f}s")
    return 0
