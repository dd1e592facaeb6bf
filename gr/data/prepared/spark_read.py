"""A data config's raw source as a Spark DataFrame, read by the rules of ``gr.data.readers``.

``source_of(config)`` checks the source on the driver (files, first lines, Parquet footers, MovieLens
side files); ``read_rows(spark, source, cached)`` then gives one row per interaction read (duplicates
included) with its place in the files, ORD (``gr.data.prepared.spark_text``: line numbers for text,
``_metadata.row_index`` for Parquet), so that ties and duplicates follow the files' order.

Values are converted and checked in the engine by the readers' rules; the first refused value is
named as the readers name it: a malformed line by their streaming line scan (``bad_line_error``), the
later checks (a rating's text, empty list values, integer ids outside int64, Parquet nulls and
non-finite numbers) by file and line or row with their messages. A file Spark cannot read (a corrupt
Parquet page) is named in one line, as the readers name it (``read_failures``).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa

from gr.data.config import MOVIELENS_SOURCES, ColumnConfig, DataConfig
from gr.data.interactions import DataFormatError, SideTable
from gr.data.parsing import (
    CANONICAL_INT,
    bad_line_error,
    empty_list_value,
    id_overflow,
    not_a_number,
    table_csv_error,
    table_parquet_error,
    unreadable_parquet,
)
from gr.data.prepared.manifest import check_preparable
from gr.data.prepared.side_tables import CATEGORICAL, DENSE, LIST
from gr.data.prepared.spark_text import (
    FILE,
    FILE_BITS,
    ORD,
    POSITION,
    FileLayout,
    TextLayout,
    checked,
    fields,
    file_indices,
    file_layouts,
    finite,
    lines,
    per_file,
    records,
)
from gr.data.readers import (
    RATINGS_FILES,
    movielens_side_tables,
    read_side_tables,
    source_files,
    table_csv_layout,
    table_parquet_columns,
    table_parquet_types,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

USER, ITEM, TIME, RATING, REQUEST = "_user", "_item", "_time", "_rating", "_request"
FEATURE = "f:"  # the rows' column of a declared feature: "f:<name>"
INT64_SPAN = 2**63
# Spark's error for a file it cannot read (error class FAILED_READ_FILE), and the JVM causes under it
FAILED_READ = re.compile(r"Encountered error while reading file (\S+)\.\s")
CAUSED_BY = re.compile(r"^Caused by: (.*)$", re.MULTILINE)
JAVA_CLASS = re.compile(r"^(?:[A-Za-z_$][\w$]*\.)+[A-Z][\w$]*: ")  # "java.io.IOException: " before a message


def feature_column(name: str) -> str:
    """The rows' column of the declared feature ``name``."""
    return f"{FEATURE}{name}"


@dataclass
class Source:
    """A data config's source, checked on the driver before Spark reads it: files found, first lines
    (or Parquet footers) checked, MovieLens side files read.

    source: what the summary and errors name (the ratings file, or a table's file or directory)
    features: {"item" | "user" | "event": {feature: "categorical" | "list" | "dense"}} of a table
        source's declared features, in the order the shards and side tables hold them
    dense_columns: {dense feature: its column names}
    text: how text files are laid out (None: Parquet), with each file's ``FileLayout`` in ``layouts``
    parquet: {column: Arrow type} of a Parquet source's columns
    item_side / user_side: a MovieLens source's side tables, or those of ``data.items`` / ``data.users``,
        read by the readers
    """

    source: str
    has_ratings: bool
    files: Tuple[Path, ...]
    columns: ColumnConfig
    features: Dict[str, Dict[str, str]] = field(default_factory=lambda: {"item": {}, "user": {}, "event": {}})
    dense_columns: Dict[str, List[str]] = field(default_factory=dict)
    text: Optional[TextLayout] = None
    layouts: List[FileLayout] = field(default_factory=list)
    parquet: Dict[str, pa.DataType] = field(default_factory=dict)
    item_side: Optional[SideTable] = None
    user_side: Optional[SideTable] = None


def declared_features(columns: ColumnConfig) -> Dict[str, Dict[str, str]]:
    """{"item" | "user" | "event": {feature: kind}}: the categorical and list features in declared
    order, then the dense ones."""
    sides = {
        "item": (columns.item_features, columns.item_dense),
        "user": (columns.user_features, columns.user_dense),
        "event": (columns.token_features, columns.token_dense),
    }
    return {
        side: {
            **{c: LIST if c in columns.list_features else CATEGORICAL for c in categorical},
            **{name: DENSE for name in dense},
        }
        for side, (categorical, dense) in sides.items()
    }


def source_of(config: DataConfig) -> Source:
    """``config``'s source checked on the driver (``Source``): a missing file, a bad first line or
    Parquet schema raise as the readers raise them, before any Spark work."""
    check_preparable(config)
    assert config.path is not None  # check_preparable
    path, columns = Path(config.path), config.event_columns()
    if config.source in ("csv", "parquet"):
        sides = read_side_tables(config)
        groups = {**columns.token_dense, **columns.item_dense, **columns.user_dense}
        files = tuple(source_files(path, f".{config.source}"))
        found = Source(
            str(path),
            columns.rating is not None,
            files,
            columns,
            declared_features(columns),
            {name: list(group) for name, group in groups.items()},
        )
        if config.source == "parquet":
            found.parquet = _parquet_types(files, columns)
        else:
            layout = TextLayout(tuple(table_csv_layout(columns)), columns.delimiter, "select", True, columns)
            found.text, found.layouts = layout, file_layouts(files, layout)
        found.item_side, found.user_side = sides.get("items"), sides.get("users")
        return found
    ratings = RATINGS_FILES[config.source]
    file = ratings.find(config.path)
    layout = TextLayout(ratings.columns, ratings.delimiter, ratings.header)
    found = Source(str(file), True, (file,), columns, text=layout, layouts=file_layouts((file,), layout))
    if config.source in MOVIELENS_SOURCES:
        found.item_side, found.user_side = movielens_side_tables(path, config)
    return found


def read_rows(spark: SparkSession, source: Source, cached: List[DataFrame]) -> DataFrame:
    """One row per interaction of ``source``: ORD (long, the files' order), USER and ITEM (raw ids:
    long, or string when the readers keep them as text), TIME (long seconds), RATING (float, when
    the source has ratings), REQUEST (the raw request id as USER's, with ``data.columns.request``),
    ``feature_column(F)`` per declared feature (categorical: string, list:
    array<string>, dense: array<float> of its columns). A refused value raises DataFormatError as
    the readers raise it. The DataFrames persisted on the way are appended to ``cached``."""
    if source.text is None:
        return _parquet_rows(spark, source, cached)
    return _text_rows(spark, source, cached)


@contextlib.contextmanager
def read_failures(source: Source) -> Iterator[None]:
    """Spark's error for a file of ``source`` it cannot read (a corrupt Parquet page, a file gone since
    ``source_of``), a JVM trace of a hundred lines, raised as one DataFormatError naming the file
    (``read_failure``); any other error passes unchanged."""
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    try:
        yield
    except (Py4JJavaError, PySparkException) as error:
        failure = read_failure(str(error), source)
        if failure is None:
            raise
        raise failure from None


def read_failure(text: str, source: Source) -> Optional[DataFormatError]:
    """The error of a Spark error's ``text`` naming a file it failed to read (None: it names none):
    ``file: not a readable Parquet file (causes)`` as the readers word it (text files: ``could not be
    read``), the causes being the JVM's "Caused by" messages, outermost first, without class names."""
    found = FAILED_READ.search(text)
    if found is None:
        return None
    uri = found.group(1)
    try:
        file: Union[Path, str] = source.files[file_indices([uri], source.files)[uri]]
    except RuntimeError:  # not one of the source's files (a path Spark spells otherwise): named as Spark names it
        file = uri
    causes: List[str] = []
    for cause in CAUSED_BY.findall(text):
        cause = cause.strip()
        while JAVA_CLASS.match(cause):
            cause = JAVA_CLASS.sub("", cause, count=1)
        if cause and cause not in causes:  # a wrapper repeats its cause's message
            causes.append(cause)
    reason = ": ".join(causes) or text[found.start() :].splitlines()[0].strip()
    if source.text is None:
        return unreadable_parquet(file, reason)
    return DataFormatError(file, f"could not be read ({reason})")


# ---- text files ----------------------------------------------------------------------------------


def _text_rows(spark: SparkSession, source: Source, cached: List[DataFrame]) -> DataFrame:
    """``read_rows`` of delimited text files: the first refused value raises DataFormatError as
    ``read_delimited`` and ``read_table_csv`` word it."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    layout, layouts = source.text, source.layouts
    assert layout is not None  # a text source
    texts, spanning = lines(spark, source.files)
    if layout.quoted and spanning:
        texts = texts.filter(~F.col(FILE).isin(spanning))
        texts = texts.unionByName(records(spark, source.files, spanning, layout.delimiter))
    header = per_file(layouts, lambda f: f.header_line)
    texts = texts.filter((F.col("text") != "") & (F.col(ORD).bitwiseAND(POSITION) > header))
    split, well_formed = fields(F.col("text"), layout.delimiter, layout.quoted)
    record = texts.select(
        FILE, ORD, split.alias("fields"), (well_formed & ~F.col("text").contains("\ufffd")).alias("ok")
    )
    counted = F.size("fields") == per_file(layouts, lambda f: f.fields)
    table = layout.table
    separator = table.list_separator if table is not None else "|"
    values: Dict[str, Column] = {}
    valid = counted & F.col("ok")
    for i, (name, kind) in enumerate(c for c in layout.columns if c[1] != "skip"):
        position = per_file(layouts, _position(i))
        values[name], ok = checked(F.when(counted, F.try_element_at("fields", position)), kind, separator)
        valid = valid & ok
    out = {FILE: F.col(FILE), ORD: F.col(ORD), "valid": valid}
    out.update({USER: values[layout.column("user")], ITEM: values[layout.column("item")]})
    out[TIME] = values[layout.column("timestamp")]
    if table is not None and table.request is not None:
        out[REQUEST] = values[table.request]
    rating = layout.rating()
    if rating is not None:
        if table is not None and rating in table.categorical_columns():  # its text is a feature's
            number, out["rating_ok"] = checked(values[rating], "float")
            out[RATING] = number.cast("float")
        else:
            out[RATING] = values[rating].cast("float")
    if table is not None:
        out.update(_feature_values(table, values))
    frame = record.select(*[column.alias(name) for name, column in out.items()])
    cached.append(frame.persist(StorageLevel.MEMORY_AND_DISK))
    found = _text_checks(frame, source)

    def bad_id(order: int, role: str, message: str) -> DataFormatError:
        assert table is not None  # only a table's ids become int64
        return _table_csv_error(frame, source, order, _id_roles(table)[role], message)

    return _typed_ids(frame, found if table is not None else None, bad_id)


def _position(index: int) -> Callable[[FileLayout], int]:
    """A file layout -> the position (from 1) of the ``index``-th column read."""
    return lambda layout: layout.positions[index] + 1


def _feature_values(columns: ColumnConfig, values: Mapping[str, Column]) -> Dict[str, Column]:
    """{feature_column(F): its value} of a table's declared features (dense: array<float> of its
    columns' float64 values)."""
    from pyspark.sql import functions as F

    found = {feature_column(c): values[c] for c in columns.categorical_columns()}
    for group in (columns.token_dense, columns.item_dense, columns.user_dense):
        for name, group_columns in group.items():
            found[feature_column(name)] = F.array(*[values[c].cast("float") for c in group_columns])
    return found


def _first_where(condition: Column) -> Column:
    """The aggregate: the smallest ORD of the rows where ``condition`` holds (null: none)."""
    from pyspark.sql import functions as F

    return F.min(F.when(condition, F.col(ORD)))


def _located(files: Sequence[Path], order: int) -> Tuple[Path, int]:
    """(file, line from 1 or row from 0) of an ORD."""
    return files[order >> FILE_BITS], order & POSITION


def _value_at(frame: DataFrame, order: int, column: Union[str, Column]) -> Any:
    """The value of ``column`` in the row at ORD ``order``."""
    from pyspark.sql import functions as F

    row = frame.filter(F.col(ORD) == order).select(column).first()
    assert row is not None  # ``order`` came from an aggregate of ``frame``
    return row[0]


def _text_checks(frame: DataFrame, source: Source) -> Dict[str, Any]:
    """Raise the first refused value of the checked text rows ``frame``, in the readers' order: a
    malformed line (named by their line scan), a rating's text, an empty value in a list -> the
    aggregates (``_id_checks`` of a table's ids among them)."""
    from pyspark.sql import functions as F

    layout, files = source.text, source.files
    assert layout is not None  # a text source
    table = layout.table
    checks = {"rows": F.count(F.lit(1)), "line": _first_where(~F.col("valid"))}
    if "rating_ok" in frame.columns:
        checks["rating"] = _first_where(F.col("valid") & ~F.col("rating_ok"))
    lists = table.list_features if table is not None else ()
    for name in lists:
        checks[name] = _first_where(F.col("valid") & F.array_contains(F.col(f"`{feature_column(name)}`"), ""))
    if table is not None:
        checks.update(_id_checks({role: F.col(role) for role in _id_roles(table)}))
    found = _aggregates(frame, checks)
    if not found["rows"]:
        where = files[0] if len(files) == 1 else source.source
        raise DataFormatError(where, "no data rows (empty dataset)")
    if found["line"] is not None:
        file, line = _located(files, found["line"])
        reason = f"line {line}: Spark split or converted it differently"
        raise bad_line_error(file, layout.columns, layout.delimiter, layout.header, "utf8", layout.quoted, reason)
    if table is None:
        return found
    if found.get("rating") is not None:
        rating = str(table.rating)
        text = _value_at(frame, found["rating"], F.col(f"`{feature_column(rating)}`"))
        raise _table_csv_error(frame, source, found["rating"], rating, not_a_number(text))
    for name in lists:
        if found[name] is not None:
            cell = table.list_separator.join(_value_at(frame, found[name], F.col(f"`{feature_column(name)}`")))
            raise _table_csv_error(frame, source, found[name], name, empty_list_value(cell, table.list_separator))
    return found


def _aggregates(frame: DataFrame, columns: Mapping[str, Column]) -> Dict[str, Any]:
    """{name: value} of the aggregate ``columns`` over ``frame`` (one job)."""
    row = frame.agg(*[column.alias(name) for name, column in columns.items()]).first()
    assert row is not None  # an aggregate without grouping has one row
    return row.asDict()


def _table_csv_error(frame: DataFrame, source: Source, order: int, column: str, message: str) -> DataFormatError:
    """``parsing.table_csv_error`` of the row at ORD ``order`` (its data row counted in its file)."""
    from pyspark.sql import functions as F

    file = order >> FILE_BITS
    row = frame.filter((F.col(FILE) == file) & (F.col(ORD) < order)).count()
    return table_csv_error(source.files[file], source.columns.delimiter, column, row, message)


def _id_roles(columns: ColumnConfig) -> Dict[str, str]:
    """{USER | ITEM | REQUEST: the source's column} of the ids read as ``parsing.as_ids`` reads them."""
    return {USER: columns.user, ITEM: columns.item, **({REQUEST: columns.request} if columns.request else {})}


def _id_checks(ids: Mapping[str, Column]) -> Dict[str, Column]:
    """Aggregates for ``parsing.as_ids`` of the text columns ``ids`` ({USER | ITEM | REQUEST: column}):
    whether every id is a canonical integer, and the first ORD of one outside int64."""
    from pyspark.sql import functions as F

    checks = {}
    for role, column in ids.items():
        canonical = column.rlike(CANONICAL_INT)
        checks[f"{role}_integers"] = F.bool_and(canonical)
        checks[f"{role}_outside"] = _first_where(canonical & column.try_cast("long").isNull())
    return checks


def _typed_ids(
    frame: DataFrame, checks: Optional[Mapping[str, Any]], bad_id: Callable[[int, str, str], DataFormatError]
) -> DataFrame:
    """``frame``'s interaction columns, a table's USER, ITEM (and REQUEST) as int64 when ``checks``
    (``_id_checks``; None: not a table) say that all the column's ids are canonical integers
    (``parsing.as_ids``). bad_id(ORD, USER | ITEM | REQUEST, message): the error of an id outside int64."""
    from pyspark.sql import functions as F

    typed = {}
    if checks is not None:
        for role in (r for r in (USER, ITEM, REQUEST) if f"{r}_integers" in checks):
            typed[role] = bool(checks[f"{role}_integers"])
            outside = checks[f"{role}_outside"]
            if typed[role] and outside is not None:
                raise bad_id(outside, role, id_overflow(str(_value_at(frame, outside, role))))
    columns = [c for c in frame.columns if c in (ORD, USER, ITEM, TIME, RATING, REQUEST) or c.startswith(FEATURE)]
    return frame.select(*[F.col(c).cast("long").alias(c) if typed.get(c) else F.col(f"`{c}`") for c in columns])


# ---- Parquet files -------------------------------------------------------------------------------


def _parquet_types(files: Sequence[Path], columns: ColumnConfig) -> Dict[str, pa.DataType]:
    """{column: Arrow type} of the columns ``read_table_parquet`` reads, checked as it checks them,
    the same in every file (footers only)."""
    types = table_parquet_types(files, columns)
    readable = [c for c in columns.categorical_columns() if c not in columns.list_features]
    for name in [*_id_roles(columns).values(), *readable]:
        kind = types[name]
        if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            key = next(k for k, c in columns.column_roles() if c == name)
            raise ValueError(
                f"data.columns.{key}: column {name!r} has type {kind}; the spark engine reads ids and categorical "
                "Parquet columns of integer or string type"
            )
    return types


def _seconds(column: Column, kind: pa.DataType) -> Column:
    """A Parquet timestamp column's seconds (``parsing.parquet_seconds``): integers as they are,
    floats and timestamp types floored; null where they leave int64."""
    from pyspark.sql import functions as F

    if pa.types.is_timestamp(kind):
        if kind.unit == "ns":  # read as int64 nanoseconds (spark.sql.legacy.parquet.nanosAsLong)
            return ((column.cast("decimal(20,0)") - F.pmod(column, F.lit(10**9))) / 10**9).cast("long")
        return F.unix_seconds(column)
    if pa.types.is_floating(kind):
        number = column.cast("double")
        return F.when((number >= -float(INT64_SPAN)) & (number < float(INT64_SPAN)), F.floor(number))
    return column.try_cast("long")


@dataclass(frozen=True)
class _RowCheck:
    """One of ``read_table_parquet``'s value checks: the condition of a refused row of ``column``
    and what its error says (``words``; "{value}" shows the row's value as the readers print it)."""

    condition: Column
    column: str
    words: str
    detail: bool = True  # "column 'x': words" (``table_parquet_error``), else "column 'x' words"

    def error(self, file: Path, row: int, value: Any) -> DataFormatError:
        words = self.words.format(value=np.floor(np.float64(value)) if isinstance(value, float) else value)
        if self.detail:
            return table_parquet_error(file, self.column, row, words)
        return DataFormatError(file, f"row {row + 1}: column {self.column!r} {words}")


def _parquet_checks(source: Source, value: Callable[[str], Column]) -> List[_RowCheck]:
    """``read_table_parquet``'s checks of the values, in its order: per column, nulls, then empty
    list values, seconds outside int64 or non-finite numbers."""
    from pyspark.sql import functions as F

    columns, types = source.columns, source.parquet
    wanted, numeric = table_parquet_columns(columns)
    categorical = columns.categorical_columns()
    checks = []
    for name in wanted:
        kind = types[name]
        checks.append(_RowCheck(value(name).isNull(), name, "is null", detail=False))
        if name in columns.list_features:
            empty = F.exists(value(name), lambda x: x.isNull() | (x.cast("string") == ""))
            checks.append(_RowCheck(empty, name, "a null or empty value inside the list"))
        elif name == columns.timestamp and not pa.types.is_timestamp(kind):
            words = "is not seconds within int64" if pa.types.is_floating(kind) else "does not fit int64"
            checks.append(_RowCheck(_seconds(value(name), kind).isNull(), name, f"{{value}} {words}"))
        elif name in numeric and name != columns.timestamp and (name not in categorical or name == columns.rating):
            checks.append(_RowCheck(~finite(value(name).cast("double")), name, "is not finite", detail=False))
    return checks


def _parquet_rows(spark: SparkSession, source: Source, cached: List[DataFrame]) -> DataFrame:
    """``read_rows`` of a Parquet file or directory of Parquet partition files, checked as
    ``read_table_parquet`` checks a file (errors name the file and its row from 1)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    files, columns, types = source.files, source.columns, source.parquet
    wanted, _ = table_parquet_columns(columns)
    read = spark.read.parquet(*[str(f) for f in files])
    uris = [row[0] for row in read.select("_metadata.file_path").distinct().collect()]
    pairs = [F.lit(part) for uri, i in file_indices(uris, files).items() for part in (uri, i)]
    file_index = F.element_at(F.create_map(*pairs), F.col("_metadata.file_path")).cast("long")
    order = F.shiftleft(file_index, FILE_BITS) + F.col("_metadata.row_index")
    frame = read.select(order.alias(ORD), *[F.col(f"`{name}`").alias(f"raw:{name}") for name in wanted])
    cached.append(frame.persist(StorageLevel.MEMORY_AND_DISK))

    def value(name: str) -> Column:
        return F.col(f"`raw:{name}`")

    checks = _parquet_checks(source, value)
    aggregates = {"rows": F.count(F.lit(1)), **{f"check{k}": _first_where(c.condition) for k, c in enumerate(checks)}}
    ids = _id_roles(columns)
    aggregates.update(_id_checks({role: value(column).cast("string") for role, column in ids.items()}))
    found = _aggregates(frame, aggregates)
    if not found["rows"]:
        raise DataFormatError(source.source, "no data rows (empty dataset)")
    for k, check in enumerate(checks):
        order = found[f"check{k}"]
        if order is not None:
            file, row = _located(files, order)
            raise check.error(file, row, _value_at(frame, order, value(check.column)))
    features = _feature_values(columns, {name: _parquet_value(value(name), name, columns) for name in wanted})
    typed = frame.select(
        ORD,
        value(columns.user).cast("string").alias(USER),
        value(columns.item).cast("string").alias(ITEM),
        _seconds(value(columns.timestamp), types[columns.timestamp]).alias(TIME),
        *([value(columns.rating).cast("double").cast("float").alias(RATING)] if columns.rating else []),
        *([value(columns.request).cast("string").alias(REQUEST)] if columns.request else []),
        *[column.alias(name) for name, column in features.items()],
    )

    def bad_id(order: int, role: str, message: str) -> DataFormatError:
        file, row = _located(files, order)
        return table_parquet_error(file, ids[role], row, message)

    return _typed_ids(typed, found, bad_id)


def _parquet_value(column: Column, name: str, columns: ColumnConfig) -> Column:
    """A Parquet column as a table feature reads it: categorical values as text, list values as
    array<string>, a dense feature's numbers as float64."""
    from pyspark.sql import functions as F

    if name in columns.list_features:
        return F.transform(column, lambda x: x.cast("string"))
    if name in columns.categorical_columns():
        return column.cast("string")
    return column.cast("double")
