"""A data config's raw source as a Spark DataFrame, read by the rules of ``gr.data.readers``.

``read_rows(spark, config, cached)`` gives one row per interaction read (duplicates included). Each
row's place in the files is ORD = file index << ``FILE_BITS`` | line number (text) or row index
(Parquet), so ties and duplicates follow the files' order. Text files are read as lines (Spark's
text source, split at "\\n" as the readers count lines) and split into fields in SQL by Python's csv
rules (quoted fields for table CSVs, plain splitting otherwise). A line's number is its split's first
line number (the line counts of the file's earlier splits, ``_metadata.file_block_start`` ordering
them) plus its position in the split (Spark's per-partition row id): never the order in which Spark
happens to schedule partitions. Parquet rows are numbered by ``_metadata.row_index``.

Values are converted and checked in the engine by the readers' rules; the first refused value is
named as the readers name it: a malformed line by their streaming line scan (``bad_line_error``), the
later checks (a rating's text, empty list values, integer ids outside int64, Parquet nulls and
non-finite numbers) by file and line or row with their messages.
"""

from __future__ import annotations

import csv
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import unquote, urlparse

import numpy as np
import pyarrow as pa

from gr.data.config import MOVIELENS_SOURCES, ColumnConfig, DataConfig
from gr.data.interactions import DataFormatError, SideTable
from gr.data.prepared.duckdb_sources import source_files
from gr.data.readers import (
    CANONICAL_INT,
    MOVIELENS_SIDE_TABLES,
    RATINGS_FILES,
    bad_line_error,
    check_first_line,
    check_table_parquet_types,
    empty_list_value,
    id_overflow,
    not_a_number,
    read_table_parquet_schema,
    table_csv_error,
    table_csv_layout,
    table_parquet_columns,
    table_parquet_error,
)

ORD, FILE, USER, ITEM, TIME, RATING = "_ord", "_file", "_user", "_item", "_time", "_rating"
FILE_BITS = 40  # ORD = file index << FILE_BITS | line number (text, from 1) or row index (Parquet, from 0)
POSITION = (1 << FILE_BITS) - 1
PARTITION_BITS = 33  # monotonically_increasing_id() = partition index << 33 | row within the partition
CATEGORICAL, LIST, DENSE = "categorical", "list", "dense"
INT_TEXT = r"^[ \t]*-?[0-9]+[ \t]*$"  # what the readers' integer parse takes (spaces and tabs around)
FLOAT_TEXT = r"^[ \t]*[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?[ \t]*$"
SECONDS_TEXT = r"^([-+]?)([0-9]*)(?:\.([0-9]*))?(?:[eE]([-+]?[0-9]+))?$"  # readers.exact_seconds' forms
MAX_EXPONENT = 10**18  # a larger exponent leaves int64 (or floors to 0 / -1 alike)
INT64_SPAN = 2**63


def feature_column(name: str) -> str:
    """The rows' column of the declared feature ``name``."""
    return f"f:{name}"


@dataclass
class Source:
    """A data config's source, checked on the driver before Spark reads it: files found, first lines
    (or Parquet footers) checked, MovieLens side files read.

    source: what the summary and errors name (the ratings file, or a table's file or directory)
    features: {"item" | "user" | "event": {feature: "categorical" | "list" | "dense"}} of a table
        source's declared features, in the order the shards and side tables hold them
    dense_columns: {dense feature: its column names}
    text: how text files are laid out (None: Parquet), with each file's ``_FileLayout``
    parquet: {column: Arrow type} of a Parquet source's columns
    item_side / user_side: a MovieLens source's side tables, read by the readers
    """

    source: str
    has_ratings: bool
    files: Tuple[Path, ...]
    columns: ColumnConfig
    features: Dict[str, Dict[str, str]] = field(default_factory=lambda: {"item": {}, "user": {}, "event": {}})
    dense_columns: Dict[str, List[str]] = field(default_factory=dict)
    text: Optional[TextLayout] = None
    layouts: List[_FileLayout] = field(default_factory=list)
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
    if config.path is None or config.source == "synthetic":
        raise ValueError(
            "data.source: 'synthetic' is generated in memory at training time; gr data prepare reads files "
            "(csv, parquet, ml-100k, ml-1m, ml-20m, amazon)"
        )
    path, columns = Path(config.path), config.columns
    if config.source in ("csv", "parquet"):
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
            found.text, found.layouts = layout, _file_layouts(files, layout)
        return found
    ratings = RATINGS_FILES[config.source]
    file = ratings.find(config.path)
    layout = TextLayout(ratings.columns, ratings.delimiter, ratings.header)
    found = Source(str(file), True, (file,), columns, text=layout, layouts=_file_layouts((file,), layout))
    if config.source in MOVIELENS_SOURCES:
        side_tables = MOVIELENS_SIDE_TABLES[config.source]
        found.item_side, found.user_side = side_tables(path, config.item_features, config.user_features, config.genres)
    return found


def read_rows(spark, source: Source, cached: List):
    """One row per interaction of ``source``: ORD (long, the files' order), USER and ITEM (raw ids:
    long, or string when the readers keep them as text), TIME (long seconds), RATING (float, when
    the source has ratings), ``feature_column(F)`` per declared feature (categorical: string, list:
    array<string>, dense: array<float> of its columns). A refused value raises DataFormatError as
    the readers raise it. The DataFrames persisted on the way are appended to ``cached``."""
    if source.text is None:
        return _parquet_rows(spark, source, cached)
    return _text_rows(spark, source, cached)


# ---- text files ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextLayout:
    """Delimited text files read as ``readers.read_delimited`` reads each: ``columns`` are (name, kind)
    pairs, the first four the user, item, rating and timestamp for a ratings file; a table CSV names
    its roles in ``table`` (and its ids become int64 when all are canonical integers)."""

    columns: Tuple[Tuple[str, str], ...]
    delimiter: str
    header: str = "none"
    quoted: bool = False
    table: Optional[ColumnConfig] = None

    def role(self, name: str) -> Optional[str]:
        """The column holding "user" | "item" | "timestamp" | "rating" (None: no rating)."""
        if self.table is not None:
            return getattr(self.table, name)
        return self.columns[("user", "item", "rating", "timestamp").index(name)][0]


def _hex(text: str) -> str:
    """``text`` as a Java regex that matches it literally (each character as \\x{h})."""
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
    """(every line of ``files``: FILE (index in ``files``), ORD (FILE << FILE_BITS | line number
    from 1) and "text" (without its line break and trailing carriage returns); the indices of the
    files holding a line with an odd number of quotes: a quoted value may span lines there)."""
    from pyspark.sql import functions as F

    text = spark.read.text([str(f) for f in files], lineSep="\n")
    frame = text.select(
        F.col("value"),
        F.col("_metadata.file_path").alias("uri"),
        F.col("_metadata.file_block_start").alias("block"),
        F.monotonically_increasing_id().alias("row_id"),
    )
    # a split's lines have consecutive row ids; its first line follows the file's earlier splits' lines
    quotes = F.length("value") - F.length(F.regexp_replace("value", '"', ""))
    splits = frame.groupBy("uri", "block").agg(
        F.count(F.lit(1)).alias("n"), F.min("row_id").alias("first"), F.max(quotes % 2).alias("odd")
    )
    splits = splits.collect()
    index = _file_indices(sorted({r["uri"] for r in splits}), files)
    shifts = []
    before: Dict[int, int] = defaultdict(int)
    for row in sorted(splits, key=lambda r: (index[r["uri"]], r["block"])):
        file = index[row["uri"]]
        shifts.append((row["uri"], row["block"], file, (file << FILE_BITS) + before[file] + 1 - row["first"]))
        before[file] += row["n"]
    shift = spark.createDataFrame(shifts, f"uri string, block long, {FILE} long, shift long")
    lines = frame.join(F.broadcast(shift), ["uri", "block"]).select(
        FILE,
        (F.col("row_id") + F.col("shift")).alias(ORD),
        F.regexp_replace("value", "\r+$", "").alias("text"),
    )
    return lines, sorted({index[r["uri"]] for r in splits if r["odd"]})


def _records(spark, files: Sequence[Path], indices: Sequence[int], delimiter: str):
    """The records of the quoted CSV ``files[i]`` for i in ``indices``, where a quoted value may span
    lines (as Python's csv reads them), as ``_lines`` gives lines: FILE, ORD (from the record's first
    line number) and "text" (a record that runs to the end unparsed: the rest of the file). Each
    file is read whole, by one task."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    whole = spark.read.text([str(files[i]) for i in indices], wholetext=True)
    uris = _file_indices([r[0] for r in whole.select("_metadata.file_path").collect()], files)
    file = F.element_at(F.create_map(*[F.lit(v) for pair in uris.items() for v in pair]), F.col("_metadata.file_path"))
    record = _record_pattern(delimiter)
    # each record up to its line break; after the last record that parses, the rest of the file
    parts = F.regexp_extract_all("value", F.lit(f"\\G({record})\\r*(?:\\n|$)|\\G((?s:.+))"), 0)
    frame = whole.select(file.cast("long").alias(FILE), F.posexplode(parts).alias("k", "part"))
    breaks = F.length("part") - F.length(F.regexp_replace("part", "\n", ""))
    earlier = Window.partitionBy(FILE).orderBy("k").rowsBetween(Window.unboundedPreceding, -1)
    line = F.coalesce(F.sum(breaks).over(earlier), F.lit(0)) + 1
    return frame.select(
        FILE,
        (F.shiftleft(FILE, FILE_BITS) + line).alias(ORD),
        F.regexp_replace("part", "\r*\n?$", "").alias("text"),
    )


@dataclass(frozen=True)
class _FileLayout:
    """One file's header line number (0: none), fields per record, and each read column's position."""

    header_line: int
    fields: int
    positions: Tuple[int, ...]


def _file_layouts(files: Sequence[Path], layout: TextLayout) -> List[_FileLayout]:
    """Each file's ``_FileLayout``, its first line checked as ``read_delimited`` checks it."""
    names = [name for name, _ in layout.columns]
    read = [i for i, (_, kind) in enumerate(layout.columns) if kind != "skip"]
    found = []
    for file in files:
        check_first_line(file, names, layout.delimiter, layout.header, "utf8", layout.quoted)
        if layout.header == "none":
            found.append(_FileLayout(0, len(names), tuple(read)))
            continue
        line, header = _header(file, layout.delimiter, layout.quoted)
        found.append(_FileLayout(line, len(header), tuple(header.index(names[i]) for i in read)))
    return found


def _header(file: Path, delimiter: str, quoted: bool) -> Tuple[int, List[str]]:
    """(line number, fields) of the first non-blank line of ``file``."""
    quoting = csv.QUOTE_MINIMAL if quoted else csv.QUOTE_NONE
    with open(file, "rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                text = line.decode("utf8").rstrip("\r\n")
                return number, next(csv.reader([text], delimiter=delimiter, quoting=quoting))
    raise DataFormatError(file, "empty file (empty dataset)")


def _per_file(layouts: Sequence[_FileLayout], value: Callable[[_FileLayout], int]):
    """The column: ``value`` of each row's file's layout (a literal when every file agrees)."""
    from pyspark.sql import functions as F

    groups: Dict[int, List[int]] = defaultdict(list)
    for i, layout in enumerate(layouts):
        groups[value(layout)].append(i)
    if len(groups) == 1:
        return F.lit(next(iter(groups)))
    cases = None
    for result, files in groups.items():
        condition = F.col(FILE).isin(files)
        cases = F.when(condition, result) if cases is None else cases.when(condition, result)
    return cases


def _field_pattern(delimiter: str) -> str:
    """A Java regex of one quoted CSV field as Python's csv reads it: a field that starts with a
    quote runs to the closing quote ("" inside it is a quote, a line break may be too); any other
    field holds no delimiter and no line break."""
    d = _hex(delimiter)
    return f'"(?:[^"]++|"")*+"|(?:[^"{d}\\n][^{d}\\n]*+)?'


def _record_pattern(delimiter: str) -> str:
    """A Java regex of one record of quoted fields (``_field_pattern``)."""
    field = _field_pattern(delimiter)
    return f"(?:{field})(?:{_hex(delimiter)}(?:{field}))*"


def _fields(text, delimiter: str, quoted: bool):
    """(fields: array<string>, well_formed: boolean) of a record's ``text``, split as Python's csv
    splits it (``_field_pattern`` when ``quoted``; else at each delimiter)."""
    from pyspark.sql import functions as F

    d = _hex(delimiter)
    if not quoted:
        return F.split(text, F.lit(d), -1), F.lit(True)
    raw = F.regexp_extract_all(F.concat(F.lit(delimiter), text), F.lit(f"{d}({_field_pattern(delimiter)})"), 1)
    unquoted = F.transform(
        raw,
        lambda x: F.when(
            x.startswith('"'), F.regexp_replace(F.substring(x, F.lit(2), F.length(x) - 2), '""', '"')
        ).otherwise(x),
    )
    return unquoted, text.rlike(f"^{_record_pattern(delimiter)}\\z")


def _finite(number):
    from pyspark.sql import functions as F

    return number.isNotNull() & ~F.isnan(number) & (F.abs(number) != float("inf"))


def _checked(value, kind: str, separator: str = "|"):
    """(typed value, valid: boolean) of a text field of ``kind`` (``read_delimited``'s kinds, checked
    as it checks them: numbers may have spaces or tabs around them, text may not be empty, a list
    cell splits at ``separator``)."""
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
        values = F.when(value == "", F.array().cast("array<string>")).otherwise(F.split(value, F.lit(_hex(separator)), -1))
        return values, value.isNotNull()
    return value, value.isNotNull() & (value != "")


def exact_seconds(text):
    """The column: ``gr.data.readers.exact_seconds`` of a string column (null where it gives None).
    The number's digits are floored as text: no value passes through a float."""
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
    # the decimal point lies `point` digits into `significant` (whose first digit is not 0)
    point = F.length(whole) + scale - (F.length(digits) - F.length(significant))
    integral = F.when(point <= 0, F.lit("0")).otherwise(F.rpad(significant, F.least(point, F.lit(20)).cast("int"), "0"))
    rest = F.substring(significant, F.greatest(point, F.lit(0)).cast("int") + 1, F.length(significant))
    below = F.when((sign == "-") & rest.rlike("[1-9]"), 1).otherwise(0)
    whole_part = integral.cast("decimal(21,0)")
    floored = F.when(sign == "-", -whole_part - below).otherwise(whole_part)
    well_formed = text.rlike(SECONDS_TEXT) & (F.length(digits) > 0)
    return (
        F.when(~well_formed, F.lit(None).cast("long"))
        .when(F.length(significant) == 0, F.lit(0).cast("long"))
        .when(point > 19, F.lit(None).cast("long"))
        .otherwise(floored.try_cast("long"))
    )


def _text_rows(spark, source: Source, cached: List):
    """``read_rows`` of delimited text files: the first refused value raises DataFormatError as
    ``read_delimited`` and ``read_table_csv`` word it."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    layout, layouts = source.text, source.layouts
    assert layout is not None  # a text source
    lines, spanning = _lines(spark, source.files)
    if layout.quoted and spanning:
        lines = lines.filter(~F.col(FILE).isin(spanning))
        lines = lines.unionByName(_records(spark, source.files, spanning, layout.delimiter))
    header = _per_file(layouts, lambda f: f.header_line)
    lines = lines.filter((F.col("text") != "") & (F.col(ORD).bitwiseAND(POSITION) > header))
    fields, well_formed = _fields(F.col("text"), layout.delimiter, layout.quoted)
    record = lines.select(FILE, ORD, fields.alias("fields"), (well_formed & ~F.col("text").contains("\ufffd")).alias("ok"))
    counted = F.size("fields") == _per_file(layouts, lambda f: f.fields)
    table = layout.table
    separator = table.list_separator if table is not None else "|"
    values, valid = {}, [counted, F.col("ok")]
    for i, (name, kind) in enumerate(c for c in layout.columns if c[1] != "skip"):
        position = _per_file(layouts, lambda f, i=i: f.positions[i] + 1)
        value, ok = _checked(F.when(counted, F.try_element_at("fields", position)), kind, separator)
        values[name], valid = value, [*valid, ok]
    checked = {FILE: F.col(FILE), ORD: F.col(ORD), "valid": _all(valid)}
    checked.update({USER: values[layout.role("user")], ITEM: values[layout.role("item")]})
    checked[TIME] = values[layout.role("timestamp")]
    rating = layout.role("rating")
    if rating is not None:
        text_rating = table is not None and rating in table.categorical_columns()
        number, ok = _checked(values[rating], "float") if text_rating else (values[rating], None)
        checked[RATING] = number.cast("float")
        if ok is not None:
            checked["rating_ok"] = ok
    if table is not None:
        checked.update(_feature_values(table, values))
    frame = record.select(*[column.alias(name) for name, column in checked.items()])
    cached.append(frame.persist(StorageLevel.MEMORY_AND_DISK))
    checks = _text_checks(frame, source)
    return _typed_ids(frame, checks, table is not None, _text_id_error(frame, source))


def _feature_values(columns: ColumnConfig, values: Mapping[str, object]) -> Dict[str, object]:
    """{feature_column(F): its value} of a table's declared features (dense: array<float>)."""
    from pyspark.sql import functions as F

    found = {feature_column(c): values[c] for c in columns.categorical_columns()}
    for group in (columns.token_dense, columns.item_dense, columns.user_dense):
        for name, group_columns in group.items():
            found[feature_column(name)] = F.array(*[values[c].cast("float") for c in group_columns])
    return found


def _all(conditions: Sequence):
    result = conditions[0]
    for condition in conditions[1:]:
        result = result & condition
    return result


def _first_where(condition):
    """The aggregate: the smallest ORD of the rows where ``condition`` holds (null: none)."""
    from pyspark.sql import functions as F

    return F.min(F.when(condition, F.col(ORD)))


def _located(files: Sequence[Path], order: int) -> Tuple[Path, int]:
    """(file, line from 1 or row from 0) of an ORD."""
    return files[order >> FILE_BITS], order & POSITION


def _value_at(frame, order: int, column):
    """The value of ``column`` (a name or a Column) in the row at ORD ``order``."""
    from pyspark.sql import functions as F

    return frame.filter(F.col(ORD) == order).select(column).first()[0]


def _text_checks(frame, source: Source) -> Dict[str, object]:
    """Raise the first refused value of the checked text rows ``frame``, in the readers' order: a
    malformed line (named by their line scan), a rating's text, an empty value in a list; return
    the aggregates (``_id_checks`` of a table's ids included)."""
    from pyspark.sql import functions as F

    layout, files = source.text, source.files
    assert layout is not None  # a text source
    table = layout.table
    checks = {"rows": F.count(F.lit(1)), "line": _first_where(~F.col("valid"))}
    if "rating_ok" in frame.columns:
        checks["rating"] = _first_where(F.col("valid") & ~F.col("rating_ok"))
    lists = table.list_features if table is not None else ()
    for name in lists:
        checks[name] = _first_where(F.col("valid") & F.array_contains(feature_column(name), ""))
    if table is not None:
        checks.update(_id_checks(F.col(USER), F.col(ITEM)))
    found = frame.agg(*[c.alias(k) for k, c in checks.items()]).first().asDict()
    if not found["rows"]:
        where = files[0] if len(files) == 1 else files[0].parent
        raise DataFormatError(where, "no data rows (empty dataset)")
    if found["line"] is not None:
        file, line = _located(files, found["line"])
        reason = f"line {line}: Spark split or converted it differently"
        raise bad_line_error(file, layout.columns, layout.delimiter, layout.header, "utf8", layout.quoted, reason)
    assert table is not None or len(checks) == 2  # the later checks are a table CSV's
    if found.get("rating") is not None:
        text = _value_at(frame, found["rating"], feature_column(str(table.rating)))
        raise _table_csv_error(frame, source, found["rating"], str(table.rating), not_a_number(text))
    for name in lists:
        if found[name] is not None:
            cell = table.list_separator.join(_value_at(frame, found[name], feature_column(name)))
            raise _table_csv_error(frame, source, found[name], name, empty_list_value(cell, table.list_separator))
    return found


def _table_csv_error(frame, source: Source, order: int, column: str, message: str) -> DataFormatError:
    """``readers.table_csv_error`` of the row at ORD ``order`` (its data row counted in its file)."""
    from pyspark.sql import functions as F

    file = order >> FILE_BITS
    row = frame.filter((F.col(FILE) == file) & (F.col(ORD) < order)).count()
    return table_csv_error(source.files[file], source.columns.delimiter, column, row, message)


def _text_id_error(frame, source: Source) -> Callable[[int, str, str], DataFormatError]:
    """bad_id(ORD, role, message) of ``_typed_ids`` for a table CSV."""

    def error(order: int, role: str, message: str) -> DataFormatError:
        column = source.columns.user if role == USER else source.columns.item
        return _table_csv_error(frame, source, order, column, message)

    return error


def _id_checks(user, item) -> Dict[str, object]:
    """Aggregates for ``readers._as_ids`` of the text columns ``user`` and ``item``: whether every
    id is a canonical integer, and the first ORD of one outside int64."""
    from pyspark.sql import functions as F

    checks = {}
    for role, column in ((USER, user), (ITEM, item)):
        canonical = column.rlike(CANONICAL_INT)
        checks[f"{role}_integers"] = F.bool_and(canonical)
        checks[f"{role}_outside"] = _first_where(canonical & column.try_cast("long").isNull())
    return checks


def _typed_ids(frame, checks: Mapping[str, object], table: bool, bad_id):
    """``frame``'s interaction columns, USER and ITEM as int64 when ``checks`` (``_id_checks``) say
    that every id of a table's column is a canonical integer (``readers._as_ids``). bad_id(ORD,
    column role, message): the readers' error for an integer id outside int64."""
    from pyspark.sql import functions as F

    typed = {}
    if table:
        for role in (USER, ITEM):
            typed[role] = bool(checks[f"{role}_integers"])
            outside = checks[f"{role}_outside"]
            if typed[role] and outside is not None:
                raise bad_id(outside, role, id_overflow(str(_value_at(frame, outside, role))))
    columns = [c for c in frame.columns if c in (ORD, USER, ITEM, TIME, RATING) or c.startswith("f:")]
    return frame.select(*[F.col(c).cast("long").alias(c) if typed.get(c) else F.col(f"`{c}`") for c in columns])


# ---- Parquet files -------------------------------------------------------------------------------


def _parquet_types(files: Sequence[Path], columns: ColumnConfig) -> Dict[str, pa.DataType]:
    """{column: Arrow type} of the columns ``read_table_parquet`` reads, checked as it checks them,
    the same in every file (footers only)."""
    wanted, _ = table_parquet_columns(columns)
    first: Optional[pa.Schema] = None
    for file in files:
        schema = read_table_parquet_schema(file, columns)
        check_table_parquet_types(file, schema, columns)
        first = schema if first is None else first
        differing = [c for c in wanted if schema.field(c).type != first.field(c).type]
        if differing:
            c = differing[0]
            raise DataFormatError(
                file, f"column {c!r} has type {schema.field(c).type}, but {files[0]} has {first.field(c).type}"
            )
    assert first is not None  # source_files gives at least one file
    types = {c: first.field(c).type for c in wanted}
    for name in (c for c in columns.categorical_columns() if c not in columns.list_features):
        kind = types[name]
        if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            key = next(k for k in ("user_features", "item_features", "token_features") if name in getattr(columns, k))
            raise ValueError(
                f"data.columns.{key}: column {name!r} has type {kind}; the spark engine reads categorical "
                "Parquet columns of integer or string type"
            )
    for name in (columns.user, columns.item):
        kind = types[name]
        if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ValueError(
                f"data.columns: column {name!r} has type {kind}; the spark engine reads ids of integer or string type"
            )
    return types


def _seconds(column, kind: pa.DataType):
    """A Parquet timestamp column's seconds (``readers._parquet_seconds``): integers as they are,
    floats and timestamp types floored."""
    from pyspark.sql import functions as F

    if pa.types.is_timestamp(kind):
        if kind.unit == "ns":  # read as int64 nanoseconds (spark.sql.legacy.parquet.nanosAsLong)
            return ((column.cast("decimal(20,0)") - F.pmod(column, F.lit(10**9))) / 10**9).cast("long")
        return F.unix_seconds(column)
    if pa.types.is_floating(kind):
        number = column.cast("double")
        return F.when((number >= -float(INT64_SPAN)) & (number < float(INT64_SPAN)), F.floor(number))
    return column.try_cast("long")


def _parquet_rows(spark, source: Source, cached: List):
    """``read_rows`` of a Parquet file or directory of Parquet partition files, checked as
    ``read_table_parquet`` checks a file (errors name the file and its row from 1)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    files, columns, types = source.files, source.columns, source.parquet
    wanted, numeric = table_parquet_columns(columns)
    categorical = columns.categorical_columns()
    frame = spark.read.parquet(*[str(f) for f in files])
    uris = [r[0] for r in frame.select("_metadata.file_path").distinct().collect()]
    pairs = [F.lit(part) for uri, i in _file_indices(uris, files).items() for part in (uri, i)]
    file_index = F.element_at(F.create_map(*pairs), F.col("_metadata.file_path")).cast("long")
    order = F.shiftleft(file_index, FILE_BITS) + F.col("_metadata.row_index")
    raw = {name: F.col(f"`{name}`") for name in wanted}
    selected = {ORD: order, **{f"raw:{name}": column for name, column in raw.items()}}
    frame = frame.select(*[c.alias(n) for n, c in selected.items()])
    cached.append(frame.persist(StorageLevel.MEMORY_AND_DISK))

    def value(name: str):
        return F.col(f"`raw:{name}`")

    checks: Dict[str, Tuple[object, Callable[[Path, int, object], DataFormatError]]] = {}
    for name in wanted:
        kind = types[name]
        checks[f"null:{name}"] = (
            value(name).isNull(),
            lambda file, row, _, n=name: DataFormatError(file, f"row {row + 1}: column {n!r} is null"),
        )
        if name in columns.list_features:
            empty = F.exists(value(name), lambda x: x.isNull() | (x.cast("string") == ""))
            checks[f"list:{name}"] = (
                empty,
                lambda file, row, _, n=name: table_parquet_error(file, n, row, "a null or empty value inside the list"),
            )
        elif name == columns.timestamp and not pa.types.is_timestamp(kind):
            message = "is not seconds within int64" if pa.types.is_floating(kind) else "does not fit int64"
            checks[f"seconds:{name}"] = (
                _seconds(value(name), kind).isNull(),
                lambda file, row, v, n=name, m=message: table_parquet_error(
                    file, n, row, f"{np.floor(np.float64(v)) if isinstance(v, float) else v} {m}"
                ),
            )
        elif name in numeric and name != columns.timestamp and (name not in categorical or name == columns.rating):
            checks[f"finite:{name}"] = (
                ~_finite(value(name).cast("double")),
                lambda file, row, _, n=name: DataFormatError(file, f"row {row + 1}: column {n!r} is not finite"),
            )
    typed = frame.select(
        ORD,
        value(columns.user).cast("string").alias(USER),
        value(columns.item).cast("string").alias(ITEM),
        _seconds(value(columns.timestamp), types[columns.timestamp]).alias(TIME),
        *([value(columns.rating).cast("double").cast("float").alias(RATING)] if columns.rating else []),
        *[c.alias(n) for n, c in _feature_values(columns, {n: _parquet_value(value(n), n, columns) for n in wanted}).items()],
    )
    aggregates = [_first_where(condition).alias(key) for key, (condition, _) in checks.items()]
    ids = _id_checks(value(columns.user).cast("string"), value(columns.item).cast("string"))
    aggregates += [c.alias(k) for k, c in ids.items()]
    found = frame.agg(F.count(F.lit(1)).alias("rows"), *aggregates).first().asDict()
    if not found["rows"]:
        raise DataFormatError(source.source, "no data rows (empty dataset)")
    for key, (_, error) in checks.items():
        if found[key] is not None:
            file, row = _located(files, found[key])
            raise error(file, row, _value_at(frame, found[key], value(key.split(":", 1)[1])))
    def bad_id(order: int, role: str, message: str) -> DataFormatError:
        file, row = _located(files, order)
        return table_parquet_error(file, columns.user if role == USER else columns.item, row, message)

    return _typed_ids(typed, found, True, bad_id)


def _parquet_value(column, name: str, columns: ColumnConfig):
    """A Parquet column as a table feature reads it: categorical values as text, list values as
    array<string>, numbers as they are."""
    from pyspark.sql import functions as F

    if name in columns.list_features:
        return F.transform(column, lambda x: x.cast("string"))
    if name in columns.categorical_columns():
        return column.cast("string")
    return column.cast("double")  # a dense feature's column: float64, then float32 (as the readers)
