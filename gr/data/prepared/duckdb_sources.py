"""A source read into DuckDB by the rules of ``gr.data.readers``: the first stage of the DuckDB engine.

``load_source(con, config)`` leaves one table, ``typed``, of every row of the source in file order:

    fr BIGINT       the row's position over the source's files (file order; ties and duplicates keep it)
    u, i            raw user / item ids: BIGINT, or VARCHAR for string ids (the readers' choice)
    ts BIGINT       seconds (``gr.data.parsing.exact_seconds`` of a text timestamp)
    r FLOAT         the rating, when the source has ratings
    q               the raw request id (``data.columns.request``), when named: BIGINT, or VARCHAR (as u, i)
    <feature>       one column per declared feature (``SourceTable``): categorical VARCHAR (the raw
                    text), list VARCHAR[], dense FLOAT[] (its columns in order)

Values the readers refuse are refused with the readers' message. A file DuckDB cannot parse, or a value
it cannot convert, goes through the readers' own streaming line scan (``bad_line_error``), which names
the file, line and column; the checks the readers make after parsing (integer ids outside int64, empty
values inside lists, a rating column's numbers) name the file and line (CSV) or row (Parquet) of the
first offending row. MovieLens side files and the side tables ``data.users`` / ``data.items`` (catalogue-
and user-sized) are read by the readers themselves.
"""

from __future__ import annotations

import bisect
import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import duckdb
import numpy as np
import pyarrow as pa

from gr.data.config import MOVIELENS_SOURCES, ColumnConfig, DataConfig
from gr.data.interactions import DataFormatError, SideTable
from gr.data.parsing import (
    CANONICAL_INT,
    bad_line_error,
    check_first_line,
    empty_list_value,
    id_overflow,
    not_a_number,
    table_csv_error,
    table_parquet_error,
    unreadable_parquet,
)
from gr.data.prepared.side_tables import CATEGORICAL, DENSE, LIST, side_table_from_arrow
from gr.data.readers import (
    RATINGS_FILES,
    movielens_side_tables,
    read_side_tables,
    source_files,
    table_csv_layout,
    table_parquet_columns,
    table_parquet_types,
)
from gr.timestamps import ISO_TEXT_SQL

SQL_TYPES = {"int": "BIGINT", "float": "DOUBLE", "str": "VARCHAR", "time": "BIGINT", "list": "VARCHAR[]"}
INT64_LIMIT = 2**63
ISO_PATTERN = "'" + ISO_TEXT_SQL + "'"  # a SQL literal: the pattern holds no quote
# Text -> value by the readers' rules (``read_delimited``'s kinds); NULL where the readers refuse the text.
MACROS = (
    r"""CREATE TEMP MACRO gr_int(x) AS
        CASE WHEN regexp_full_match(x, '[ \t]*-?[0-9]+[ \t]*') THEN TRY_CAST(x AS BIGINT) END""",
    r"""CREATE TEMP MACRO gr_float(x) AS
        CASE WHEN regexp_full_match(x, '[ \t]*[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?[ \t]*')
             AND isfinite(TRY_CAST(x AS DOUBLE)) THEN TRY_CAST(x AS DOUBLE) END""",
    "CREATE TEMP MACRO gr_text(x) AS NULLIF(x, '')",
    "CREATE TEMP MACRO gr_list(x, separator) AS "
    "CASE WHEN x IS NULL OR x = '' THEN []::VARCHAR[] ELSE string_split(x, separator) END",
    # A decimal's floor, exactly: its significant digits d (no leading zeros) times 10^shift, with a sign.
    """CREATE TEMP MACRO gr_signed(negative, whole, fraction) AS
        TRY_CAST(CASE WHEN length(whole) > 20 THEN NULL
                      WHEN negative THEN -TRY_CAST(whole AS HUGEINT) - CASE WHEN fraction THEN 1 ELSE 0 END
                      ELSE TRY_CAST(whole AS HUGEINT) END AS BIGINT)""",
    """CREATE TEMP MACRO gr_floor_digits(negative, d, shift) AS
        CASE WHEN d = '' THEN 0::BIGINT
             WHEN shift IS NULL THEN NULL
             WHEN shift >= 0 THEN CASE WHEN length(d) + shift > 19 THEN NULL
                                       ELSE gr_signed(negative, d || repeat('0', shift), false) END
             WHEN length(d) + shift <= 0 THEN gr_signed(negative, '0', true)
             ELSE gr_signed(negative, left(d, length(d) + shift), ltrim(right(d, -shift), '0') <> '') END""",
    """CREATE TEMP MACRO gr_floor_parts(p) AS
        gr_floor_digits(p.sign = '-', ltrim(p.whole || p.fraction, '0'),
                        TRY_CAST(COALESCE(NULLIF(p.exponent, ''), '0') AS BIGINT) - length(p.fraction))""",
    # An ISO 8601 text's seconds (``gr.timestamps.iso_text_seconds``): days from the civil date (the
    # proleptic Gregorian calendar, years from 1), NULL for an impossible date, time or offset.
    """CREATE TEMP MACRO gr_days(shifted, month, day) AS
        (shifted // 400) * 146097 + (shifted % 400) * 365 + (shifted % 400) // 4 - (shifted % 400) // 100
        + (153 * ((month + 9) % 12) + 2) // 5 + day - 1 - 719468""",
    """CREATE TEMP MACRO gr_iso_seconds(year, month, day, hour, minute, second, sign, zone_hours, zone_minutes) AS
        CASE WHEN year >= 1 AND month BETWEEN 1 AND 12 AND day >= 1
                  AND day <= CASE WHEN month = 2
                                  THEN 28 + CASE WHEN year % 4 = 0 AND (year % 100 <> 0 OR year % 400 = 0)
                                                 THEN 1 ELSE 0 END
                                  ELSE 30 + (month + month // 8) % 2 END
                  AND hour <= 23 AND minute <= 59 AND second <= 59 AND zone_hours <= 23 AND zone_minutes <= 59
             THEN gr_days(year - CASE WHEN month <= 2 THEN 1 ELSE 0 END, month, day) * 86400
                  + hour * 3600 + minute * 60 + second
                  - CASE WHEN sign = '-' THEN -1 ELSE 1 END * (zone_hours * 3600 + zone_minutes * 60) END""",
    """CREATE TEMP MACRO gr_iso_parts(p) AS
        gr_iso_seconds(CAST(p.year AS BIGINT), CAST(p.month AS BIGINT), CAST(p.day AS BIGINT),
                       CAST(COALESCE(NULLIF(p.hour, ''), '0') AS BIGINT),
                       CAST(COALESCE(NULLIF(p.minute, ''), '0') AS BIGINT),
                       CAST(COALESCE(NULLIF(p.second, ''), '0') AS BIGINT), p.sign,
                       CAST(COALESCE(NULLIF(p.zone_hours, ''), '0') AS BIGINT),
                       CAST(COALESCE(NULLIF(p.zone_minutes, ''), '0') AS BIGINT))""",
    r"""CREATE TEMP MACRO gr_seconds(x) AS
        CASE WHEN regexp_full_match(x, '-?[0-9]+') THEN TRY_CAST(x AS BIGINT)
             WHEN regexp_full_match(x, '[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?')
             THEN gr_floor_parts(regexp_extract(x, '^([-+]?)([0-9]*)\.?([0-9]*)(?:[eE]([-+]?[0-9]+))?$',
                                                ['sign', 'whole', 'fraction', 'exponent']))
             WHEN regexp_full_match(x, """
    + ISO_PATTERN
    + """) THEN gr_iso_parts(regexp_extract(x, """
    + ISO_PATTERN
    + """, ['year', 'month', 'day', 'hour', 'minute', 'second', 'zone', 'sign', 'zone_hours', 'zone_minutes']))
        END""",
)
PARSE = {"int": "gr_int", "float": "gr_float", "str": "gr_text", "time": "gr_seconds"}


def scalar(con: duckdb.DuckDBPyConnection, query: str) -> Any:
    """The one value ``query`` gives (its result read to the end, as DuckDB asks before the next query)."""
    return con.execute(query).fetchall()[0][0]


def quote(name: str) -> str:
    """A SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def literal(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


@dataclass(frozen=True)
class Feature:
    """A declared feature: its name, kind (categorical | list | dense), its column in ``typed``, and
    (dense) the source columns of its d values."""

    name: str
    kind: str
    column: str
    dense_columns: Tuple[str, ...] = ()


@dataclass
class SourceTable:
    """What ``load_source`` read. source: the file (or directory) errors and the summary name;
    item_features / user_features / event_features: the declared features in ``typed`` (table sources);
    item_side / user_side: a built-in source's side tables, or those of ``data.items`` / ``data.users``,
    read by ``gr.data.readers``; has_requests: ``typed`` holds ``q``."""

    source: str
    has_ratings: bool
    has_requests: bool = False
    item_features: List[Feature] = field(default_factory=list)
    user_features: List[Feature] = field(default_factory=list)
    event_features: List[Feature] = field(default_factory=list)
    item_side: Optional[SideTable] = None
    user_side: Optional[SideTable] = None


def load_source(con: duckdb.DuckDBPyConnection, config: DataConfig) -> SourceTable:
    """Read ``config``'s source into table ``typed`` (the module docstring); refuse what the readers refuse."""
    for macro in MACROS:
        con.execute(macro)
    assert config.path is not None  # DataConfig requires it for every source read from files
    if config.source in ("csv", "parquet"):
        sides = read_side_tables(config)
        load = _load_table_csv if config.source == "csv" else _load_table_parquet
        table = load(con, Path(config.path), config.event_columns())
        table.item_side, table.user_side = sides.get("items"), sides.get("users")
        return table
    ratings = RATINGS_FILES[config.source]
    file = ratings.find(config.path)
    names = [name for name, _ in ratings.columns]
    files = _Files(con, file, [file])
    files.insert_delimited(list(ratings.columns), ratings.delimiter, ratings.header, quoted=False)
    files.check_parsed(list(ratings.columns), ratings.delimiter, ratings.header, quoted=False)
    user, item, rating, timestamp = (f"c{names.index(name)}" for name in names)
    con.execute(
        f"CREATE TABLE typed AS SELECT rowid AS fr, {user} AS u, {item} AS i, {timestamp} AS ts, "
        f"CAST({rating} AS FLOAT) AS r FROM rows"
    )
    con.execute("DROP TABLE rows")
    table = SourceTable(str(file), has_ratings=True)
    if config.source in MOVIELENS_SOURCES:
        table.item_side, table.user_side = movielens_side_tables(Path(config.path), config)
    return table


class _Files:
    """The files of one source loaded into table ``rows`` in order (columns c0, c1, ... of a layout),
    and which file and row a ``rows`` rowid comes from."""

    def __init__(self, con: duckdb.DuckDBPyConnection, source: Path, files: List[Path]) -> None:
        self.con, self.source, self.files, self.starts = con, source, files, [0]

    def locate(self, rowid: int) -> Tuple[Path, int]:
        """(file, 0-based row in it) of ``rows``' row ``rowid``."""
        index = bisect.bisect_right(self.starts, rowid) - 1
        return self.files[index], rowid - self.starts[index]

    def first(self, condition: str) -> Optional[int]:
        """The first rowid of ``rows`` meeting ``condition``, or None."""
        return scalar(self.con, f"SELECT min(rowid) FROM rows WHERE {condition}")

    def insert_delimited(
        self, layout: List[Tuple[str, str]], delimiter: str, header: str, quoted: bool, separator: str = ""
    ) -> None:
        """Each file's layout columns as c0, c1, ... (NULL where the text is refused); a file DuckDB
        cannot parse is named by the readers' line scan."""
        names = [name for name, _ in layout]
        columns = ", ".join(f"c{j} {SQL_TYPES[kind]}" for j, (_, kind) in enumerate(layout))
        self.con.execute(f"CREATE TABLE rows ({columns})")
        quote_char = literal('"' if quoted else "")
        for file in self.files:
            check_first_line(file, names, delimiter, header, "utf8", quoted)
            fields = _header(file, delimiter) if header == "select" else names
            expressions = ", ".join(_parse(name, kind, separator) for name, kind in layout)
            options = (
                f"header={str(header != 'none').lower()}, delim={literal(delimiter)}, quote={quote_char}, "
                f"escape={quote_char}, columns={{{', '.join(f'{literal(f)}: VARCHAR' for f in fields)}}}, "
                "auto_detect=false, strict_mode=true, null_padding=false, hive_partitioning=false"
            )
            try:
                self.con.execute(
                    f"INSERT INTO rows SELECT {expressions} FROM read_csv({literal(str(file))}, {options})"
                )
            except duckdb.Error as error:
                reason = str(error).splitlines()[0]
                raise bad_line_error(file, layout, delimiter, header, "utf8", quoted, reason) from None
            self.starts.append(self._count())
        if self._count() == 0:
            where = self.files[0] if len(self.files) == 1 else self.source
            raise DataFormatError(where, "no data rows (empty dataset)")

    def check_parsed(self, layout: List[Tuple[str, str]], delimiter: str, header: str, quoted: bool) -> None:
        """Refuse the first row holding a value the readers refuse (named by their line scan)."""
        refused = " OR ".join(f"c{j} IS NULL" for j, (_, kind) in enumerate(layout) if kind != "list")
        rowid = self.first(refused)
        if rowid is not None:
            file, _ = self.locate(rowid)
            raise bad_line_error(file, layout, delimiter, header, "utf8", quoted, "a value DuckDB could not convert")

    def _count(self) -> int:
        return int(scalar(self.con, "SELECT count(*) FROM rows"))


def _header(file: Path, delimiter: str) -> List[str]:
    """The field names on a CSV's first line (``check_first_line`` checked it)."""
    with open(file, encoding="utf8", newline="") as f:
        for fields in csv.reader(f, delimiter=delimiter):
            if fields:
                return fields
    return []


def _parse(name: str, kind: str, separator: str) -> str:
    """The SQL converting the text column ``name`` by the readers' ``kind``."""
    if kind == "list":
        return f"gr_list({quote(name)}, {literal(separator)})"
    return f"{PARSE[kind]}({quote(name)})"


def _features(columns: ColumnConfig, alias: Callable[[str], str]) -> Dict[str, List[Feature]]:
    """{"item" | "user" | "event": the declared features}, each reading ``alias(column)``."""
    sides = {
        "item": (columns.item_features, columns.item_dense),
        "user": (columns.user_features, columns.user_dense),
        "event": (columns.token_features, columns.token_dense),
    }
    return {
        side: [
            *(Feature(c, LIST if c in columns.list_features else CATEGORICAL, alias(c)) for c in categorical),
            *(Feature(name, DENSE, f"d_{side}_{k}", tuple(cs)) for k, (name, cs) in enumerate(dense.items())),
        ]
        for side, (categorical, dense) in sides.items()
    }


def _load_table_csv(con: duckdb.DuckDBPyConnection, path: Path, columns: ColumnConfig) -> SourceTable:
    """A CSV (or a directory of CSV partitions), as ``read_table_csv`` reads one."""
    files = _Files(con, path, source_files(path, ".csv"))
    layout = table_csv_layout(columns)
    names = [name for name, _ in layout]

    def alias(column: str) -> str:
        return f"c{names.index(column)}"

    files.insert_delimited(layout, columns.delimiter, "select", quoted=True, separator=columns.list_separator)
    files.check_parsed(layout, columns.delimiter, "select", quoted=True)

    def refuse(column: str, condition: str, message: Callable[[str], str], value: str) -> None:
        rowid = files.first(condition)
        if rowid is not None:
            text = scalar(con, f"SELECT {value} FROM rows WHERE rowid = {rowid}")
            file, row = files.locate(rowid)
            raise table_csv_error(file, columns.delimiter, column, row, message(str(text)))

    rating = columns.rating
    rating_is_text = rating is not None and rating in columns.categorical_columns()
    if rating is not None and rating_is_text:
        refuse(rating, f"gr_float({alias(rating)}) IS NULL", not_a_number, alias(rating))
    separator = literal(columns.list_separator)
    for name in columns.list_features:
        refuse(
            name,
            f"list_contains({alias(name)}, '')",
            lambda cell: empty_list_value(cell, columns.list_separator),
            f"array_to_string({alias(name)}, {separator})",
        )
    ids = []
    for key, column in _id_columns(columns):
        numeric = _all_canonical_ints(con, alias(column))
        if numeric:
            refuse(column, f"TRY_CAST({alias(column)} AS BIGINT) IS NULL", id_overflow, alias(column))
        ids.append(f"{'CAST(' + alias(column) + ' AS BIGINT)' if numeric else alias(column)} AS {key}")
    ratings = []
    if rating is not None:
        ratings = [f"CAST({'gr_float(' + alias(rating) + ')' if rating_is_text else alias(rating)} AS FLOAT) AS r"]
    features = _features(columns, alias)
    return _create_typed(
        con, str(path), features, ids, alias(columns.timestamp), ratings, alias, columns.request is not None
    )


def _id_columns(columns: ColumnConfig) -> List[Tuple[str, str]]:
    """[(``typed``'s column, the source's)] of the ids read as ``parsing.as_ids`` reads them: u, i, q."""
    return [("u", columns.user), ("i", columns.item), *([("q", columns.request)] if columns.request else [])]


def _all_canonical_ints(con: duckdb.DuckDBPyConnection, column: str) -> bool:
    """Whether every value of the text ``column`` of ``rows`` is a canonical integer (the readers then
    read the ids as int64)."""
    pattern = literal(CANONICAL_INT.strip("^$"))
    return bool(scalar(con, f"SELECT bool_and(regexp_full_match({column}, {pattern})) FROM rows"))


def _create_typed(
    con: duckdb.DuckDBPyConnection,
    source: str,
    features: Dict[str, List[Feature]],
    ids: List[str],
    timestamp: str,
    ratings: List[str],
    alias: Callable[[str], str],
    requests: bool,
) -> SourceTable:
    """Table ``typed`` from ``rows`` (then dropped): fr = rowid, the ids (with q when ``requests``),
    seconds, ratings, features."""
    feature_columns = [
        *(
            f"[{', '.join(f'CAST(CAST({alias(c)} AS DOUBLE) AS FLOAT)' for c in f.dense_columns)}] AS {f.column}"
            for group in features.values()
            for f in group
            if f.kind == DENSE
        ),
        *dict.fromkeys(
            f"CAST({f.column} AS VARCHAR{'[]' if f.kind == LIST else ''}) AS {f.column}"
            for group in features.values()
            for f in group
            if f.kind != DENSE
        ),
    ]
    select = ", ".join(["rowid AS fr", *ids, f"{timestamp} AS ts", *ratings, *feature_columns])
    con.execute(f"CREATE TABLE typed AS SELECT {select} FROM rows")
    con.execute("DROP TABLE rows")
    return SourceTable(
        source,
        has_ratings=bool(ratings),
        has_requests=requests,
        item_features=features["item"],
        user_features=features["user"],
        event_features=features["event"],
    )


def _load_table_parquet(con: duckdb.DuckDBPyConnection, path: Path, columns: ColumnConfig) -> SourceTable:
    """A Parquet file (or a directory of Parquet partitions), as ``read_table_parquet`` reads one."""
    files = _Files(con, path, source_files(path, ".parquet"))
    wanted, numeric = table_parquet_columns(columns)
    categorical = columns.categorical_columns()
    kinds = table_parquet_types(files.files, columns)
    for name in (c for c in categorical if c not in columns.list_features):
        kind = kinds[name]
        if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            key = next(k for k in ("user_features", "item_features", "token_features") if name in getattr(columns, k))
            raise ValueError(
                f"data.columns.{key}: column {name!r} has type {kind}; the duckdb engine reads categorical "
                "Parquet columns of integer or string type"
            )

    def alias(column: str) -> str:
        return f"c{wanted.index(column)}"

    select = ", ".join(f"{quote(c)} AS {alias(c)}" for c in wanted)
    for index, file in enumerate(files.files):
        statement = "CREATE TABLE rows AS" if index == 0 else "INSERT INTO rows"
        try:
            con.execute(f"{statement} SELECT {select} FROM read_parquet({literal(str(file))}, hive_partitioning=false)")
        except duckdb.Error as error:  # a page its footer promises but DuckDB cannot decode (corrupt)
            raise unreadable_parquet(file, str(error).replace(f'Failed to read file "{file}": ', "")) from None
        files.starts.append(files._count())
    if files._count() == 0:
        raise DataFormatError(path, "no data rows (empty dataset)")

    def refuse(condition: str, error: Callable[..., DataFormatError], value: str = "NULL") -> None:
        rowid = files.first(condition)
        if rowid is not None:
            found = scalar(con, f"SELECT {value} FROM rows WHERE rowid = {rowid}")
            file, row = files.locate(rowid)
            raise error(file, row, found)

    for name in wanted:
        c, kind = alias(name), kinds[name]
        refuse(
            f"{c} IS NULL", lambda file, row, _, n=name: DataFormatError(file, f"row {row + 1}: column {n!r} is null")
        )
        if name in columns.list_features:
            refuse(
                f"len(list_filter({c}, lambda x: x IS NULL OR CAST(x AS VARCHAR) = '')) > 0",
                lambda file, row, _, n=name: table_parquet_error(file, n, row, "a null or empty value inside the list"),
            )
        elif name == columns.timestamp and pa.types.is_unsigned_integer(kind):
            refuse(
                f"{c} >= {INT64_LIMIT}",
                lambda file, row, v, n=name: table_parquet_error(file, n, row, f"{v} does not fit int64"),
                c,
            )
        elif name == columns.timestamp and pa.types.is_floating(kind):
            refuse(
                f"NOT (floor({c}) >= {-INT64_LIMIT}.0 AND floor({c}) < {INT64_LIMIT}.0)",
                lambda file, row, v, n=name: table_parquet_error(
                    file, n, row, f"{np.float64(v)} is not seconds within int64"
                ),
                f"floor({c})",
            )
        elif name in numeric and name != columns.timestamp and (name not in categorical or name == columns.rating):
            refuse(
                f"NOT isfinite(CAST({c} AS DOUBLE))",
                lambda file, row, _, n=name: DataFormatError(file, f"row {row + 1}: column {n!r} is not finite"),
            )
    ids = []
    for key, column in _id_columns(columns):
        c, kind = alias(column), kinds[column]
        numeric_ids = pa.types.is_integer(kind) or _all_canonical_ints(con, c)
        if numeric_ids:
            refuse(
                f"TRY_CAST({c} AS BIGINT) IS NULL",
                lambda file, row, v, n=column: table_parquet_error(file, n, row, id_overflow(str(v))),
                c,
            )
        ids.append(f"{'CAST(' + c + ' AS BIGINT)' if numeric_ids else c} AS {key}")
    timestamp = _parquet_seconds(alias(columns.timestamp), kinds[columns.timestamp])
    ratings = [f"CAST(CAST({alias(columns.rating)} AS DOUBLE) AS FLOAT) AS r"] if columns.rating else []
    features = _features(columns, alias)
    return _create_typed(con, str(path), features, ids, timestamp, ratings, alias, columns.request is not None)


def _parquet_seconds(column: str, kind: pa.DataType) -> str:
    """The SQL of a Parquet timestamp column's seconds: integers as they are, floats and timestamp
    types floored (exactly: integer floor division of the epoch count)."""
    if pa.types.is_timestamp(kind):
        epoch, per_second = ("epoch_ns", 10**9) if kind.unit == "ns" else ("epoch_us", 10**6)
        count = f"{epoch}({column})"
        return f"(({count} - ((({count} % {per_second}) + {per_second}) % {per_second})) // {per_second})"
    if pa.types.is_floating(kind):
        return f"CAST(floor({column}) AS BIGINT)"
    return f"CAST({column} AS BIGINT)"


def side_table(con: duckdb.DuckDBPyConnection, key: str, features: Sequence[Feature]) -> Optional[SideTable]:
    """The side table of ``features`` keyed by ``key`` ("u" or "i") of ``typed``: each key's values at
    its last row in file order (as the readers take them), one row per key in raw id order."""
    if not features:
        return None
    values = ", ".join(f"arg_max({f.column}, fr) AS {quote(f.name)}" for f in features)
    table = con.sql(f"SELECT {key} AS key, {values} FROM typed GROUP BY {key} ORDER BY {key}").to_arrow_table()
    kinds = {feature.name: feature.kind for feature in features}
    return side_table_from_arrow(table, kinds, {f.name: f.dense_columns for f in features if f.kind == DENSE})
