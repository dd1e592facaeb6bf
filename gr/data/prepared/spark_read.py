"""A data config's raw source as Spark DataFrames, read by the rules of ``gr.data.readers``.

``read_rows(spark, config)`` gives one row per interaction read (duplicates included) with its place
in the files as ``ORD`` (file index << ``FILE_BITS`` | line, or Parquet row), so that ties keep the
files' order. Text files are read as lines (Spark's text source) and split in SQL with the readers'
CSV rules (RFC quoting for table CSVs; plain splitting for the rest); line numbers come from each
split's byte offset (``_metadata.file_block_start``) and Spark's per-partition row ids, never from
the order Spark schedules partitions in. Checks happen in the engine too: the first bad line of a
file is then named by the readers' own line scan of that file (``_first_bad_line``).
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import unquote, urlparse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gr.data.config import ColumnConfig, DataConfig
from gr.data.interactions import DataFormatError
from gr.data.readers import (
    CANONICAL_INT,
    EXPECTED,
    RATING_KINDS,
    _as_ids,
    _check_header,
    _first_bad_line,
    _first_line,
    _numbers_of_text,
    _require_file,
    split_lists,
)

log = logging.getLogger(__name__)

ORD, FILE, USER, ITEM, TIME, RATING = "_ord", "_file", "_user", "_item", "_time", "_rating"
FILE_BITS = 40  # ORD = file index << FILE_BITS | line number (text) or row index (Parquet)
FEATURE = "f:"  # rows' column of a declared feature: "f:<feature name>"
PARTITION_BITS = 33  # monotonically_increasing_id() = partition index << 33 | row within the partition
INT_TEXT = r"^[ \t]*-?[0-9]+[ \t]*$"  # what the readers' int parse takes (spaces and tabs around)
FLOAT_TEXT = r"^[ \t]*[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?[ \t]*$"
SECONDS_TEXT = r"^([-+]?)([0-9]*)(?:\.([0-9]*))?(?:[eE]([-+]?[0-9]+))?$"  # readers.exact_seconds' forms
MAX_EXPONENT = 10**18  # exponents beyond it floor the same way (0 or -1) or leave int64
INT64_SPAN = 2**63


def feature_column(name: str) -> str:
    """The rows' column of the declared feature ``name``."""
    return f"{FEATURE}{name}"


@dataclass
class SourceRows:
    """A source read by Spark.

    rows: one row per interaction read, in no particular order: ORD (long, the files' order), USER
        and ITEM (raw ids: long, or string when not all are integers), TIME (long seconds), RATING
        (float, when ``has_ratings``), ``feature_column(F)`` per declared feature (categorical:
        string, list: array<string>, dense: array<float> of its d columns)
    source: what summaries and errors name (the file, or the directory of partition files)
    features: {feature: "categorical" | "list" | "dense"} of the declared features (table sources)
    """

    rows: object  # pyspark.sql.DataFrame (pyspark is imported lazily)
    source: str
    has_ratings: bool
    features: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TextLayout:
    """Delimited text files as ``gr.data.readers.read_delimited`` reads each of them.

    columns: (name, kind) as read_delimited takes them; roles: {"user" | "item" | "timestamp" |
    "rating": column}; integer_ids: ids that are all canonical integers become int64 (table CSVs).
    """

    files: Tuple[Path, ...]
    columns: Tuple[Tuple[str, str], ...]
    delimiter: str
    roles: Mapping[str, str]
    header: str = "none"
    quoted: bool = False
    integer_ids: bool = False


def source_files(path: Path, suffix: str) -> List[Path]:
    """The files a table source reads: ``path`` itself, or a directory's ``*<suffix>`` partition files
    (recursively, sorted by their relative path: the order ties and duplicates follow)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob(f"*{suffix}") if p.is_file() and not p.name.startswith((".", "_")))
        if not files:
            raise DataFormatError(path, f"a directory without {suffix} partition files (empty dataset)")
        return files
    return [_require_file(path, f"a {suffix} file or a directory of them")]


def read_rows(spark, config: DataConfig, cached: List) -> SourceRows:
    """The interactions ``config.source`` names as a Spark DataFrame (``SourceRows``); bad input
    raises DataFormatError naming file, line (or row) and column, as the readers do. The DataFrames
    it persists are appended to ``cached`` (the caller unpersists them)."""
    if config.path is None or config.source == "synthetic":
        raise ValueError(
            f"data.source: {config.source!r} is generated in memory; a prepared dataset reads files "
            "(csv, parquet, ml-100k, ml-1m, ml-20m, amazon)"
        )
    path = Path(config.path)
    if config.source == "parquet":
        return _parquet_rows(spark, path, config.columns, cached)
    layout = _text_layout(config.source, path, config.columns)
    source = str(path) if config.source == "csv" else str(layout.files[0])
    rows = _text_rows(spark, layout, config.columns if config.source == "csv" else ColumnConfig(), cached)
    return SourceRows(rows, source, "rating" in layout.roles, _declared(config.columns))


def _declared(columns: ColumnConfig) -> Dict[str, str]:
    kinds = {c: "list" if c in columns.list_features else "categorical" for c in columns.categorical_columns()}
    dense = {name: "dense" for group in (columns.token_dense, columns.item_dense, columns.user_dense) for name in group}
    return {**kinds, **dense}


def _text_layout(source: str, path: Path, columns: ColumnConfig) -> TextLayout:
    """How each text source's interactions file is laid out (``gr.data.readers.READERS``)."""
    ratings = ("user", "item", "rating", "timestamp")
    roles = {r: r for r in ratings}
    if source == "ml-100k":
        file = _require_file(path / "u.data", "MovieLens-100K ratings: user<TAB>item<TAB>rating<TAB>timestamp")
        return TextLayout((file,), tuple(zip(ratings, RATING_KINDS)), "\t", roles)
    if source == "ml-1m":
        file = _require_file(path / "ratings.dat", "MovieLens-1M ratings: UserID::MovieID::Rating::Timestamp")
        return TextLayout((file,), tuple(zip(ratings, RATING_KINDS)), "::", roles)
    if source == "ml-20m":
        file = _require_file(path / "ratings.csv", "MovieLens-20M ratings: userId,movieId,rating,timestamp")
        names = ("userId", "movieId", "rating", "timestamp")
        return TextLayout((file,), tuple(zip(names, RATING_KINDS)), ",", dict(zip(ratings, names)), header="expect")
    if source == "amazon":
        file = _require_file(path, "Amazon ratings: user,item,rating,timestamp without header")
        return TextLayout((file,), tuple(zip(ratings, ("str", "str", "float", "int"))), ",", roles)
    layout = {
        columns.user: "str",
        columns.item: "str",
        columns.timestamp: "time",
        **({columns.rating: "float"} if columns.rating else {}),
        **{c: "float" for c in columns.dense_columns()},
        **{c: "list" if c in columns.list_features else "str" for c in columns.categorical_columns()},
    }
    roles = {"user": columns.user, "item": columns.item, "timestamp": columns.timestamp}
    if columns.rating:
        roles["rating"] = columns.rating
    return TextLayout(
        tuple(source_files(path, ".csv")),
        tuple(layout.items()),
        columns.delimiter,
        roles,
        header="select",
        quoted=True,
        integer_ids=True,
    )


# ---- text files ----------------------------------------------------------------------------------


def _hex(text: str) -> str:
    """``text`` as a Java regex matching it literally (each character as \\x{h})."""
    return "".join(f"\\x{{{ord(c):x}}}" for c in text)


def _file_indices(uris: Sequence[str], files: Sequence[Path]) -> Dict[str, int]:
    """{URI as Spark's ``_metadata.file_path`` gives it: index in ``files``}."""
    position = {os.path.abspath(path): i for i, path in enumerate(files)}
    found = {}
    for uri in uris:
        local = os.path.abspath(unquote(urlparse(uri).path))
        if local not in position:
            raise RuntimeError(f"Spark read {uri}, not one of the source's files")
        found[uri] = position[local]
    return found


def _lines(spark, files: Sequence[Path]):
    """Every line of ``files`` (split at "\\n", as the readers count lines): FILE (index in
    ``files``), ORD (FILE << FILE_BITS | line number from 1) and TEXT (without its line break and
    trailing carriage returns)."""
    from pyspark.sql import functions as F

    text = spark.read.option("lineSep", "\n").text([str(f) for f in files])
    frame = text.select(
        F.col("value"),
        F.col("_metadata.file_path").alias("uri"),
        F.col("_metadata.file_block_start").alias("block"),
        F.monotonically_increasing_id().alias("row_id"),
    )
    # a split's lines have consecutive row ids; a split's first line number follows the earlier splits'
    splits = frame.groupBy("uri", "block").agg(F.count(F.lit(1)).alias("n"), F.min("row_id").alias("first"))
    splits = splits.collect()
    index = _file_indices(sorted({r["uri"] for r in splits}), files)
    firsts = []
    before: Dict[int, int] = defaultdict(int)
    for row in sorted(splits, key=lambda r: (index[r["uri"]], r["block"])):
        file = index[row["uri"]]
        firsts.append((row["uri"], row["block"], file, (file << FILE_BITS) + before[file] + 1 - row["first"]))
        before[file] += row["n"]
    shift = spark.createDataFrame(firsts, f"uri string, block long, {FILE} long, shift long")
    return frame.join(F.broadcast(shift), ["uri", "block"]).select(
        FILE,
        (F.col("row_id") + F.col("shift")).alias(ORD),
        F.regexp_replace("value", "\r+$", "").alias("text"),
    )


def _header_line(path: Path) -> int:
    """The number of the first non-blank line of ``path`` (its header)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                return number
    return 0


@dataclass(frozen=True)
class _FileLayout:
    """Where each wanted column lies in one file's records: header line, field count, positions."""

    header_line: int
    fields: int
    positions: Tuple[int, ...]


def _file_layouts(layout: TextLayout) -> List[_FileLayout]:
    names = [name for name, _ in layout.columns]
    found = []
    for file in layout.files:
        first = _first_line(file, "utf8")
        if first is None:
            raise DataFormatError(file, "empty file (empty dataset)")
        if layout.header == "none":
            found.append(_FileLayout(0, len(names), tuple(range(len(names)))))
            continue
        _check_header(file, first, names, layout.delimiter, layout.header, layout.quoted)
        header = _split_record(first, layout.delimiter, layout.quoted)
        positions = tuple(header.index(n) for n, kind in layout.columns if kind != "skip")
        found.append(_FileLayout(_header_line(file), len(header), positions))
    return found


def _split_record(text: str, delimiter: str, quoted: bool) -> List[str]:
    import csv

    quoting = csv.QUOTE_MINIMAL if quoted else csv.QUOTE_NONE
    return next(csv.reader([text], delimiter=delimiter, quoting=quoting))


def _per_file(layouts: Sequence[_FileLayout], value):
    """A column: ``value(layout)`` of each row's file (one literal when every file agrees)."""
    from pyspark.sql import functions as F

    groups: Dict[object, List[int]] = defaultdict(list)
    for i, layout in enumerate(layouts):
        groups[value(layout)].append(i)
    if len(groups) == 1:
        return F.lit(next(iter(groups)))
    cases = None
    for result, files in groups.items():
        condition = F.col(FILE).isin(files)
        cases = F.when(condition, result) if cases is None else cases.when(condition, result)
    return cases


def _fields(text, delimiter: str, quoted: bool):
    """(fields: array<string>, well_formed: boolean) of a record ``text``, split as Python's csv
    splits it: quoted (RFC quoting: a field that starts with a quote ends at the quote before a
    delimiter, "" inside is a quote) or plain."""
    from pyspark.sql import functions as F

    d = _hex(delimiter)
    if not quoted:
        return F.split(text, F.lit(d), -1), F.lit(True)
    field_pattern = f'"(?:[^"]++|"")*+"|(?:[^"{d}][^{d}]*+)?'
    raw = F.regexp_extract_all(F.concat(F.lit(delimiter), text), F.lit(f"{d}({field_pattern})"), 1)
    unquoted = F.transform(
        raw,
        lambda x: F.when(
            x.startswith('"'), F.regexp_replace(F.substring(x, F.lit(2), F.length(x) - 2), '""', '"')
        ).otherwise(x),
    )
    return unquoted, text.rlike(f"^(?:{field_pattern})(?:{d}(?:{field_pattern}))*$")


def _checked(value, kind: str):
    """(typed value, valid: boolean) of one field of ``kind`` (read_delimited's kinds, checked as its
    parse checks them: integers and numbers may have spaces or tabs around them, text may not be empty)."""
    from pyspark.sql import functions as F

    if kind == "int":
        number = F.trim(value, F.lit(" \t")).try_cast("long")
        return number, value.rlike(INT_TEXT) & number.isNotNull()
    if kind == "float":
        number = F.trim(value, F.lit(" \t")).try_cast("double")
        return number, value.rlike(FLOAT_TEXT) & _finite(number)
    if kind == "time":
        seconds = exact_seconds(value)
        return seconds, seconds.isNotNull()
    if kind == "list":
        return F.coalesce(value, F.lit("")), value.isNotNull()
    return value, value.isNotNull() & (value != "")


def _finite(number):
    from pyspark.sql import functions as F

    return number.isNotNull() & ~F.isnan(number) & (F.abs(number) != float("inf"))


def _list_values(cell, separator: str):
    """A list feature's cell -> array<string> (``readers.split_lists``: "" is the empty list)."""
    from pyspark.sql import functions as F

    return F.when(cell == "", F.array().cast("array<string>")).otherwise(F.split(cell, F.lit(_hex(separator)), -1))


def _text_rows(spark, layout: TextLayout, columns: ColumnConfig, cached: List):
    """The rows (``SourceRows.rows``) of delimited text files, checked: the first problem raises
    DataFormatError as ``readers.read_delimited`` and ``read_table_csv`` word it."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    layouts = _file_layouts(layout)
    lines = _lines(spark, layout.files)
    line_number = F.col(ORD).bitwiseAND((1 << FILE_BITS) - 1)
    lines = lines.filter((F.col("text") != "") & (line_number > _per_file(layouts, lambda f: f.header_line)))
    fields, well_formed = _fields(F.col("text"), layout.delimiter, layout.quoted)
    counted = F.size("fields") == _per_file(layouts, lambda f: f.fields)
    parsed = lines.select(
        FILE, ORD, fields.alias("fields"), (well_formed & ~F.col("text").contains("\ufffd")).alias("clean")
    )
    wanted = [(name, kind) for name, kind in layout.columns if kind != "skip"]
    values, valid = {}, [counted, F.col("clean")]
    for i, (name, kind) in enumerate(wanted):
        position = _per_file(layouts, lambda f, i=i: f.positions[i] + 1)
        value, ok = _checked(F.when(counted, F.try_element_at("fields", position)), kind)
        values[name], valid = value, valid + [ok]
    roles = layout.roles
    checked = {
        FILE: F.col(FILE),
        ORD: F.col(ORD),
        "valid": _all(valid),
        USER: values[roles["user"]],
        ITEM: values[roles["item"]],
        TIME: values[roles["timestamp"]],
    }
    rating = roles.get("rating")
    if rating is not None:
        number, ok = _checked(values[rating], "float") if dict(wanted)[rating] == "str" else (values[rating], None)
        checked[RATING] = number.cast("float")
        if ok is not None:
            checked["rating_valid"] = ok
    for name in columns.categorical_columns():
        text = values[name]
        checked[feature_column(name)] = _list_values(text, columns.list_separator) if name in columns.list_features else text
    for group in (columns.token_dense, columns.item_dense, columns.user_dense):
        for name, group_columns in group.items():
            checked[feature_column(name)] = F.array(*[values[c].cast("float") for c in group_columns])
    frame = parsed.select(*[column.alias(name) for name, column in checked.items()])
    cached.append(frame.persist(StorageLevel.MEMORY_AND_DISK))
    per_file = _check_text(frame, layout, columns)
    typed = _typed_ids(
        frame,
        per_file,
        layout.files,
        (layout.roles["user"], layout.roles["item"]),
        lambda file, line, name, message: DataFormatError(file, f"column {name!r}: {message}", line=line),
    )
    return typed


def _all(conditions):
    result = conditions[0]
    for condition in conditions[1:]:
        result = result & condition
    return result


def _first_where(condition):
    """The aggregate: the smallest ORD of the rows where ``condition`` holds (null: none)."""
    from pyspark.sql import functions as F

    return F.min(F.when(condition, F.col(ORD)))


def _located(files: Sequence[Path], order: int) -> Tuple[Path, int]:
    """(file, line or 0-based row) of an ORD."""
    return files[order >> FILE_BITS], order & ((1 << FILE_BITS) - 1)


def _check_text(frame, layout: TextLayout, columns: ColumnConfig) -> List[dict]:
    """Raise the first problem of the checked text rows ``frame``, file by file in the readers'
    order: a malformed line (named by the readers' line scan), then the rating's text, then the
    list features' values; return each file's aggregates (``_id_checks`` included)."""
    from pyspark.sql import functions as F

    checks = {"line": _first_where(~F.col("valid"))}
    if "rating_valid" in frame.columns:
        checks["rating"] = _first_where(F.col("valid") & ~F.col("rating_valid"))
    for name in columns.list_features:
        checks[name] = _first_where(F.col("valid") & F.array_contains(feature_column(name), ""))
    if layout.integer_ids:
        checks.update(_id_checks())
    per_file = _per_file_aggregates(frame, checks)
    if not per_file:
        where = layout.files[0] if len(layout.files) == 1 else layout.files[0].parent
        raise DataFormatError(where, "no data rows (empty dataset)")
    for row in per_file:
        if row["line"] is not None:
            file, line = _located(layout.files, row["line"])
            bad = _first_bad_line(file, layout.columns, layout.delimiter, layout.header, "utf8", layout.quoted)
            if bad is None:
                raise DataFormatError(file, "could not be read (the engine splits this line differently)", line=line)
            raise DataFormatError(file, bad[1], line=bad[0])
        if row.get("rating") is not None:
            file, line = _located(layout.files, row["rating"])
            text = _value_at(frame, row["rating"], feature_column(str(columns.rating)))
            _numbers_of_text(np.asarray([text]), _cell_error(file, line, str(columns.rating)))
        for name in columns.list_features:
            if row[name] is not None:
                file, line = _located(layout.files, row[name])
                cells = _value_at(frame, row[name], feature_column(name))
                separator = columns.list_separator
                split_lists(np.asarray([separator.join(cells)]), separator, _cell_error(file, line, name))
    return per_file


def _cell_error(file: Path, line: int, column: str):
    """bad_cell(row, message) for the readers' checks of one cell: the error naming file, line, column."""
    return lambda _, message: DataFormatError(file, f"column {column!r}: {message}", line=line)


def _per_file_aggregates(frame, checks: Mapping[str, object]) -> List[dict]:
    """[{FILE, "rows", check: value}] of each file with rows, in the files' order."""
    from pyspark.sql import functions as F

    found = frame.groupBy(FILE).agg(F.count(F.lit(1)).alias("rows"), *[c.alias(k) for k, c in checks.items()])
    return sorted((row.asDict() for row in found.collect()), key=lambda r: r[FILE])


def _value_at(frame, order: int, column: str):
    """The value of ``column`` in the row at ORD ``order``."""
    from pyspark.sql import functions as F

    return frame.filter(F.col(ORD) == order).select(column).first()[0]


def _id_checks() -> Dict[str, object]:
    """Aggregates for ``readers._as_ids`` of USER and ITEM (text): whether every id is a canonical
    integer, and the first ORD of one outside int64."""
    from pyspark.sql import functions as F

    checks = {}
    for role in (USER, ITEM):
        canonical = F.col(role).rlike(CANONICAL_INT)
        checks[f"{role}_integers"] = F.bool_and(canonical)
        checks[f"{role}_outside"] = _first_where(canonical & F.col(role).try_cast("long").isNull())
    return checks


def _typed_ids(frame, per_file: Sequence[dict], files: Sequence[Path], names: Tuple[str, str], bad_id):
    """``frame``'s interaction columns, USER and ITEM as int64 where ``per_file`` (``_id_checks``
    of every file) says that all ids of the column are canonical integers (``readers._as_ids``).

    names: the user and item columns' names; bad_id(file, line or row, column, message): the error
    for an integer id outside int64 (the readers' wording)."""
    from pyspark.sql import functions as F

    typed = {}
    for role, name in ((USER, names[0]), (ITEM, names[1])):
        typed[role] = bool(per_file) and all(row.get(f"{role}_integers") for row in per_file)
        outside = [row[f"{role}_outside"] for row in per_file if row.get(f"{role}_outside") is not None]
        if typed[role] and outside:
            file, position = _located(files, min(outside))
            value = str(_value_at(frame, min(outside), role))
            _as_ids(np.asarray([value]), lambda _, message, n=name: bad_id(file, position, n, message))
    columns = [c for c in frame.columns if c not in ("valid", "rating_valid", FILE)]
    return frame.select(*[F.col(c).cast("long").alias(c) if typed.get(c) else F.col(c) for c in columns])


def exact_seconds(text):
    """The column: ``gr.data.readers.exact_seconds`` of a string column, in SQL (null where it is
    None). The number's digits are floored as text, so no value passes through a float."""
    from pyspark.sql import functions as F

    def part(index: int):
        return F.regexp_extract(text, SECONDS_TEXT, index)

    sign, whole, fraction, exponent = part(1), part(2), part(3), part(4)
    digits = F.concat(whole, fraction)
    significant = F.regexp_replace(digits, "^0+", "")  # empty: the number is 0
    exponent_digits = F.regexp_replace(exponent, "^[-+]", "")
    magnitude = F.when(F.length(exponent_digits) > 18, F.lit(MAX_EXPONENT)).otherwise(
        F.coalesce(exponent_digits.try_cast("long"), F.lit(0))
    )
    scale = F.when(exponent.startswith("-"), -magnitude).otherwise(magnitude)
    # the decimal point lies `point` digits into `significant`, whose first digit is not 0
    point = F.length(whole) + scale - (F.length(digits) - F.length(significant))
    integral = F.when(point <= 0, F.lit("0")).otherwise(F.rpad(significant, F.least(point, F.lit(20)).cast("int"), "0"))
    rest = F.substring(significant, F.greatest(point, F.lit(0)).cast("int") + 1, F.length(significant))
    below = F.when((sign == "-") & rest.rlike("[1-9]"), 1).otherwise(0)
    floored = F.when(sign == "-", -integral.cast("decimal(21,0)") - below).otherwise(integral.cast("decimal(21,0)"))
    well_formed = text.rlike(SECONDS_TEXT) & (F.length(digits) > 0)
    return (
        F.when(~well_formed, F.lit(None).cast("long"))
        .when(F.length(significant) == 0, F.lit(0).cast("long"))
        .when(point > 19, F.lit(None).cast("long"))
        .otherwise(floored.try_cast("long"))
    )


# ---- Parquet files -------------------------------------------------------------------------------


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _parquet_types(files: Sequence[Path], wanted: Sequence[str]) -> Dict[str, pa.DataType]:
    """{column: Arrow type} of the ``wanted`` columns, the same in every file (footers only)."""
    types: Optional[Dict[str, pa.DataType]] = None
    for file in files:
        try:
            schema = pq.read_schema(file)
        except (pa.ArrowInvalid, OSError) as error:
            raise DataFormatError(file, f"not a readable Parquet file ({error})") from None
        missing = [c for c in wanted if c not in schema.names]
        if missing:
            raise DataFormatError(file, f"lacks column(s) {missing}; it has {schema.names}")
        found = {c: schema.field(c).type for c in wanted}
        if types is None:
            types = found
        differing = [c for c in wanted if types[c] != found[c]]
        if differing:
            c = differing[0]
            raise DataFormatError(file, f"column {c!r} has type {found[c]}, but {files[0]} has {types[c]}")
    assert types is not None  # source_files gives at least one file
    return types


@dataclass
class _ParquetColumn:
    """How one wanted column of a Parquet source is read: its value, the condition of a bad row
    and what to say of it, or a type error (``readers.read_table_parquet``'s checks and words)."""

    value: object = None
    bad: object = None
    bad_message: str = ""
    type_error: str = ""
    shown: object = None  # the raw value a bad_message's "{value}" shows


def _parquet_column(name: str, kind: pa.DataType, role: str, declared_list: bool) -> _ParquetColumn:
    """role: "id" | "seconds" | "number" | "categorical"."""
    from pyspark.sql import functions as F

    column = F.col(f"`{name}`")
    if declared_list or _is_list(kind):
        if not declared_list:
            return _ParquetColumn(
                type_error=f"column {name!r} holds lists (type {kind}); declare it in data.columns.list_features"
            )
        value_type = kind.value_type if _is_list(kind) else None
        if value_type is None or not (pa.types.is_integer(value_type) or _is_text(value_type)):
            return _ParquetColumn(
                type_error=f"column {name!r}: a list feature (data.columns.list_features) needs list<string> or "
                f"list<int>, got type {kind}"
            )
        values = F.transform(column, lambda x: x.cast("string"))
        empty = F.exists(values, lambda x: x.isNull() | (x == ""))
        return _ParquetColumn(values, empty, f"column {name!r}: a null or empty value inside the list")
    if role == "seconds":
        return _parquet_seconds(name, kind)
    if role == "number":
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
            return _ParquetColumn(type_error=f"column {name!r}: expected numbers, got type {kind}")
        number = column.cast("double")
        return _ParquetColumn(number, ~_finite(number), f"column {name!r} is not finite")
    if pa.types.is_integer(kind) or _is_text(kind) or (role == "categorical" and pa.types.is_boolean(kind)):
        return _ParquetColumn(column.cast("string"))
    wanted = "integer or string ids" if role == "id" else "integer, string or boolean values"
    return _ParquetColumn(type_error=f"column {name!r}: the Spark engine reads {wanted}, got type {kind}")


def _parquet_seconds(name: str, kind: pa.DataType) -> _ParquetColumn:
    """``readers._parquet_seconds``: integers as they are, floats and timestamp types floored."""
    from pyspark.sql import functions as F

    column = F.col(f"`{name}`")
    if pa.types.is_timestamp(kind):
        if kind.unit == "ns":  # read as int64 nanoseconds (spark.sql.legacy.parquet.nanosAsLong)
            whole = column.cast("decimal(20,0)") - F.pmod(column, F.lit(10**9))
            return _ParquetColumn((whole / 10**9).cast("long"))
        return _ParquetColumn(F.unix_seconds(column))
    if pa.types.is_integer(kind):
        seconds = column.try_cast("long")
        return _ParquetColumn(seconds, seconds.isNull(), f"column {name!r}: {{value}} does not fit int64", column)
    if pa.types.is_floating(kind):
        number = column.cast("double")
        inside = (number >= -float(INT64_SPAN)) & (number < float(INT64_SPAN))  # NaN is outside
        message = f"column {name!r}: {{value}} is not seconds within int64"
        return _ParquetColumn(F.when(inside, F.floor(number)), ~inside, message, number)
    return _ParquetColumn(
        type_error=f"column {name!r}: expected integer seconds or a timestamp type, got type {kind}"
    )


def _parquet_rows(spark, path: Path, columns: ColumnConfig, cached: List) -> SourceRows:
    """The rows (``SourceRows``) of a Parquet file or a directory of Parquet partition files, checked
    as ``readers.read_table_parquet`` checks one file (errors name the file and the row from 1)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    files = source_files(path, ".parquet")
    numeric = [columns.timestamp, *([columns.rating] if columns.rating else []), *columns.dense_columns()]
    categorical = columns.categorical_columns()
    wanted = list(dict.fromkeys([columns.user, columns.item, *numeric, *categorical]))
    types = _parquet_types(files, wanted)

    def role(name: str) -> str:
        if name in (columns.user, columns.item):
            return "id"
        if name == columns.timestamp:
            return "seconds"
        return "number" if name in numeric and name not in categorical else "categorical"

    read = {c: _parquet_column(c, types[c], role(c), c in columns.list_features) for c in wanted}
    rating_number = None
    if columns.rating in categorical:  # a token feature too: its text above, its numbers here
        rating_number = _parquet_column(columns.rating, types[columns.rating], "number", False)
    frame = spark.read.parquet(*[str(f) for f in files])
    uris = [r[0] for r in frame.select("_metadata.file_path").distinct().collect()]
    pairs = [F.lit(part) for uri, i in _file_indices(uris, files).items() for part in (uri, i)]
    file_index = F.element_at(F.create_map(*pairs), F.col("_metadata.file_path")).cast("long")
    order = F.shiftleft(file_index, FILE_BITS) + F.col("_metadata.row_index")
    selected = {FILE: F.shiftright(order, FILE_BITS), ORD: order}
    value_of = {columns.user: USER, columns.item: ITEM, **{n: f"v{i}" for i, n in enumerate(wanted[2:], start=2)}}
    for i, name in enumerate(wanted):
        selected[f"null{i}"] = F.col(f"`{name}`").isNull()
        if not read[name].type_error:
            selected[value_of[name]] = read[name].value
            if read[name].bad is not None:
                selected[f"bad{i}"] = read[name].bad
            if read[name].shown is not None:
                selected[f"shown{i}"] = read[name].shown
    if rating_number is not None and not rating_number.type_error:
        selected["rating_number"], selected["rating_bad"] = rating_number.value, rating_number.bad
    frame = frame.select(*[c.alias(n) for n, c in selected.items()])
    cached.append(frame.persist(StorageLevel.MEMORY_AND_DISK))
    checks = {n: _first_where(F.col(n)) for n in frame.columns if n.startswith(("null", "bad")) or n == "rating_bad"}
    if not any(read[c].type_error for c in (columns.user, columns.item)):
        checks.update(_id_checks())
    per_file = _per_file_aggregates(frame, checks)
    if not per_file:
        raise DataFormatError(path, "no data rows (empty dataset)")
    for row in per_file:
        file = files[row[FILE]]
        for i, name in enumerate(wanted):
            _raise_at_row(frame, files, row[f"null{i}"], f"column {name!r} is null")
            if read[name].type_error:
                raise DataFormatError(file, read[name].type_error)
            _raise_at_row(frame, files, row.get(f"bad{i}"), read[name].bad_message, f"shown{i}")
        if rating_number is not None:
            if rating_number.type_error:
                raise DataFormatError(file, rating_number.type_error)
            _raise_at_row(frame, files, row["rating_bad"], rating_number.bad_message)
    rows = {ORD: F.col(ORD), FILE: F.col(FILE), USER: F.col(USER), ITEM: F.col(ITEM)}
    rows[TIME] = F.col(value_of[columns.timestamp]).cast("long")
    if columns.rating:
        rows[RATING] = F.col("rating_number" if rating_number is not None else value_of[columns.rating]).cast("float")
    for name in categorical:
        rows[feature_column(name)] = F.col(value_of[name])
    for group in (columns.token_dense, columns.item_dense, columns.user_dense):
        for name, group_columns in group.items():
            rows[feature_column(name)] = F.array(*[F.col(value_of[c]).cast("float") for c in group_columns])
    typed = _typed_ids(
        frame.select(*[c.alias(n) for n, c in rows.items()]),
        per_file,
        files,
        (columns.user, columns.item),
        lambda file, row, name, message: DataFormatError(file, f"row {row + 1}: column {name!r}: {message}"),
    )
    return SourceRows(typed, str(path), columns.rating is not None, _declared(columns))


def _raise_at_row(frame, files: Sequence[Path], order: Optional[int], message: str, shown: str = "") -> None:
    """Raise DataFormatError naming the file and row (from 1) of ORD ``order`` (nothing when None);
    "{value}" in ``message`` shows the row's ``shown`` column as the readers print it (floats floored)."""
    if order is None:
        return
    file, row = _located(files, order)
    if shown:
        value = _value_at(frame, order, shown)
        message = message.format(value=np.floor(np.float64(value)) if isinstance(value, float) else value)
    raise DataFormatError(file, f"row {row + 1}: {message}")
