"""Parsing and checking raw interaction data, and the one-line errors naming what is wrong.

The format readers (``gr.data.readers``), the prepared-dataset engines (``gr.data.prepared``) and
``gr items add`` (``gr.export.new_items``) parse and refuse values by these rules, in these words.

Delimited text is parsed with pyarrow's vectorised CSV reader (``read_delimited``). When the fast
parse fails (or leaves empty values / non-finite numbers), the file is scanned line by line to name
the first bad line, so every data error reads ``file:line: what was expected``.

Exact values: ids and timestamps never pass through float64. Integer columns are parsed as
int64 (a value outside int64 is an error naming file, line and column); a text column keeps
every value as written, ``NA``, ``null``, ``nan`` and ``N/A`` included (only an empty field is
missing, and an error); timestamps are integer seconds, decimal numbers floored exactly, or ISO 8601
dates and times (UTC unless they carry an offset) floored to the second.
"""

from __future__ import annotations

import csv
import io
import math
import re
from decimal import ROUND_FLOOR, Decimal, InvalidOperation
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from gr.data.interactions import DataFormatError
from gr.jagged_rows import JaggedRows
from gr.timestamps import floor_seconds, iso_text_seconds

ARROW_TYPES = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "time": pa.string(), "list": pa.string()}
EXPECTED = {
    "int": "an integer that fits int64",
    "float": "a number",
    "str": "a non-empty value",
    "time": "seconds (an integer, or a decimal number, that fits int64) or an ISO 8601 date or time",
    "list": "values separated by the list separator (an empty cell: an empty list)",
}
INT_PATTERN = re.compile(r"-?\d+")
DECIMAL_PATTERN = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
DECIMAL_SECONDS = pa.decimal128(38, 9)
INT64_RANGE = (int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max))
CANONICAL_INT = r"^-?(0|[1-9][0-9]*)$"


# ---- delimited text ----------------------------------------------------------------------


def read_delimited(
    path: Path,
    columns: Sequence[Tuple[str, str]],
    delimiter: str,
    header: str = "none",
    encoding: str = "utf8",
    quoted: bool = False,
    empty: bool = False,
) -> Dict[str, np.ndarray]:
    """Parse a delimited text file into {column: [N] array}; a file without data rows is refused
    unless ``empty`` (a partition of several files, whose rows are counted together).

    columns: (name, kind) with kind "int" | "float" | "str" | "time" (seconds, ``exact_seconds``) |
    "list" (text, empty allowed: ``split_lists`` splits it) | "skip". With header "none"
    they are the file's fields in order; "expect": the first line must list exactly
    these names; "select": the first line names the columns and these are picked by name.
    delimiter: one character, or "::" (MovieLens-1M).
    """
    wanted = {name: kind for name, kind in columns if kind != "skip"}
    names = [name for name, _ in columns]
    check_first_line(path, names, delimiter, header, encoding, quoted)
    source: object = str(path)
    text_delimiter = delimiter
    if delimiter == "::":
        source, text_delimiter = io.BytesIO(path.read_bytes().replace(b"::", b"\x1f")), "\x1f"
    read = pacsv.ReadOptions(
        column_names=None if header != "none" else names, encoding=encoding, autogenerate_column_names=False
    )
    parse = pacsv.ParseOptions(delimiter=text_delimiter, quote_char='"' if quoted else False)
    convert = pacsv.ConvertOptions(
        column_types={n: ARROW_TYPES[k] for n, k in wanted.items()},
        include_columns=list(wanted),
        null_values=[],  # text is kept as written ("NA" is a value); an empty number fails to parse
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
    )
    values: Optional[Dict[str, np.ndarray]] = None
    try:
        table = pacsv.read_csv(source, read, parse, convert)
        values = {n: v for n, k in wanted.items() if (v := _to_numpy(table[n], k)) is not None}
        arrow_error = "empty or non-finite values"
        if len(values) < len(wanted):
            values = None
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        arrow_error = str(error).splitlines()[0]
    if values is None:
        raise bad_line_error(path, columns, delimiter, header, encoding, quoted, arrow_error)
    if table.num_rows == 0 and not empty:
        raise DataFormatError(path, "no data rows (empty dataset)")
    return values


def bad_line_error(
    path: Path,
    columns: Sequence[Tuple[str, str]],
    delimiter: str,
    header: str = "none",
    encoding: str = "utf8",
    quoted: bool = False,
    reason: str = "",
) -> DataFormatError:
    """The error of a file ``read_delimited`` (with these arguments) cannot take: ``file:line:`` and
    what is wrong on its first malformed line (found by a streaming scan), or ``could not be parsed
    (reason)`` when every line is well formed (``reason``: the parser's own error)."""
    bad = _first_bad_line(path, columns, delimiter, header, encoding, quoted)
    if bad is None:
        return DataFormatError(path, f"could not be parsed ({reason})")
    return DataFormatError(path, bad[1], line=bad[0])


def _to_numpy(column: pa.ChunkedArray, kind: str) -> Optional[np.ndarray]:
    """The column as [N] numpy, or None when a value is invalid (empty text, a non-finite number,
    a time that ``exact_seconds`` refuses)."""
    if kind == "str":
        return None if pc.any(pc.equal(column, "")).as_py() else column.to_numpy(zero_copy_only=False).astype(str)
    if kind == "time":
        return _seconds_column(column)
    if kind == "list":
        return column.to_numpy(zero_copy_only=False).astype(str)
    array = column.to_numpy()
    return array if kind == "int" or np.isfinite(array).all() else None


def _seconds_column(column: pa.ChunkedArray) -> Optional[np.ndarray]:
    """Text timestamps -> [N] int64 seconds (``exact_seconds`` of each), or None if one is invalid.

    Vectorised and exact: as int64, else floored through decimal128 (up to 9 decimals); Python's
    Decimal for the rest (more decimals, or a value to refuse)."""
    for exact in (lambda c: c, lambda c: pc.floor(pc.cast(c, DECIMAL_SECONDS))):
        try:
            return pc.cast(exact(column), pa.int64()).to_numpy()
        except pa.ArrowInvalid:  # a decimal (first), or past what the cast holds: try the next
            pass
    seconds = [exact_seconds(text) for text in column.to_pylist()]
    return None if any(s is None for s in seconds) else np.asarray(seconds, dtype=np.int64)


def exact_seconds(text: str) -> Optional[int]:
    """A timestamp's text -> its integer seconds, exactly: an integer as it is, a decimal number
    (``1.5``, ``1.7e9``) floored, an ISO 8601 date or time (``gr.timestamps.iso_text_seconds``:
    ``2024-01-05T10:00:00Z``, UTC unless it has an offset) floored; None when it is none of them,
    falls outside int64, or has an exponent past what ``decimal`` holds (beyond +-999999999999999999)."""
    if INT_PATTERN.fullmatch(text):
        value = int(text)
    elif DECIMAL_PATTERN.fullmatch(text):
        try:
            number = Decimal(text)
            if not INT64_RANGE[0] <= number < INT64_RANGE[1] + 1:  # before flooring: 1e999999 stays cheap
                return None
            value = int(number.to_integral_value(rounding=ROUND_FLOOR))
        except InvalidOperation:
            return None
    else:
        return iso_text_seconds(text)
    return value if INT64_RANGE[0] <= value <= INT64_RANGE[1] else None


def _decoded_lines(path: Path, encoding: str, delimiter: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                text = line.decode(encoding)
            except UnicodeDecodeError as error:
                raise DataFormatError(path, f"not valid {encoding} text ({error.reason})", line=number) from None
            yield text.replace("::", "\x1f") if delimiter == "::" else text


def _records(path: Path, delimiter: str, encoding: str, quoted: bool) -> Iterator[Tuple[int, List[str]]]:
    """(line number, fields) of every non-blank record."""
    reader = csv.reader(
        _decoded_lines(path, encoding, delimiter),
        delimiter="\x1f" if delimiter == "::" else delimiter,
        quoting=csv.QUOTE_MINIMAL if quoted else csv.QUOTE_NONE,
        strict=quoted,
    )
    start = 1
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as error:
            raise DataFormatError(path, f"malformed quoting ({error})", line=reader.line_num) from None
        if fields:
            yield start, [f.rstrip("\r\n") for f in fields]
        start = reader.line_num + 1


def _first_line(path: Path, encoding: str) -> Optional[str]:
    """The first non-blank line (without its line break), or None for a blank file."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                return line.decode(encoding, errors="replace").rstrip("\r\n")
    return None


def check_first_line(
    path: Path, names: Sequence[str], delimiter: str, header: str, encoding: str = "utf8", quoted: bool = False
) -> None:
    """Refuse a blank file, and (header "expect" / "select", as ``read_delimited``) a first line
    that is not / does not hold the header of ``names``: reads the first line only."""
    first = _first_line(path, encoding)
    if first is None:
        raise DataFormatError(path, "empty file (empty dataset)")
    if header != "none":
        _check_header(path, first, names, delimiter, header, quoted)


def _check_header(path: Path, first: str, names: Sequence[str], delimiter: str, header: str, quoted: bool) -> None:
    found = next(csv.reader([first], delimiter=delimiter, quoting=csv.QUOTE_MINIMAL if quoted else csv.QUOTE_NONE))
    if header == "expect" and found != list(names):
        raise DataFormatError(path, f"expected the header {delimiter.join(names)!r}, got {first!r}", line=1)
    missing = [n for n in names if n not in found]
    if missing:
        raise DataFormatError(path, f"the header lacks column(s) {missing}; it has {found}", line=1)


def _first_bad_line(
    path: Path, columns: Sequence[Tuple[str, str]], delimiter: str, header: str, encoding: str, quoted: bool
) -> Optional[Tuple[int, str]]:
    """(line number, what is wrong) of the first malformed record, or None."""
    names = [name for name, _ in columns]
    positions = {name: i for i, name in enumerate(names)}
    expected_fields = len(names)
    shown = "::" if delimiter == "::" else repr(delimiter)
    records = _records(path, delimiter, encoding, quoted)
    if header != "none":
        _, fields = next(records)
        positions = {name: fields.index(name) for name in names}
        expected_fields = len(fields)
    for line, fields in records:
        if len(fields) != expected_fields:
            layout = delimiter.join(names) if header == "none" else f"{expected_fields} columns"
            return line, f"expected {expected_fields} fields separated by {shown} ({layout}), got {len(fields)}"
        for name, kind in columns:
            value = fields[positions[name]]
            if kind != "skip" and not _valid(value, kind):
                return line, f"column {name!r}: expected {EXPECTED[kind]}, got {value!r}"
    return None


def fits_int64(text: str) -> bool:
    """Whether ``text`` is an integer (``INT_PATTERN``) within int64."""
    return INT_PATTERN.fullmatch(text) is not None and INT64_RANGE[0] <= int(text) <= INT64_RANGE[1]


def _valid(value: str, kind: str) -> bool:
    if kind == "int":
        return fits_int64(value)
    if kind == "time":
        return exact_seconds(value) is not None
    if kind == "float":
        try:
            return math.isfinite(float(value))
        except ValueError:
            return False
    return kind == "list" or value != ""


# ---- lists, numbers and ids --------------------------------------------------------------


def empty_list_value(cell: str, separator: str) -> str:
    """The message of a list cell holding an empty value."""
    return (
        f"an empty value in the list {cell!r} (values are separated by {separator!r}; an empty cell is an empty list)"
    )


def split_lists(cells: np.ndarray, separator: str, bad_cell: Callable[[int, str], ValueError]) -> JaggedRows:
    """cells: [M] str, each a list of values joined by ``separator`` ("" is the empty list) ->
    M rows of str values. An empty value inside a list (``"a||b"``, ``"a|"``) raises
    ``bad_cell(row, message)``."""
    lists = pc.split_pattern(pa.array(cells, pa.string()), separator)
    parents = pc.list_parent_indices(lists).to_numpy()
    filled = cells != ""
    keep = filled[parents]
    values = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(str)[keep]
    empty = np.flatnonzero(values == "")
    if len(empty):
        row = int(parents[keep][empty[0]])
        raise bad_cell(row, empty_list_value(str(cells[row]), separator))
    lengths = np.where(filled, pc.list_value_length(lists).to_numpy(), 0)
    return JaggedRows.from_lengths(lengths, values)


def not_a_number(text: str) -> str:
    """The message of a text cell that should hold a finite number."""
    return f"expected {EXPECTED['float']}, got {text!r}"


def numbers_of_text(text: np.ndarray, bad_value: Callable[[int, str], DataFormatError]) -> np.ndarray:
    """[N] str -> [N] finite float64; the first value that is not a finite number raises
    ``bad_value(row, message)``."""
    finite = np.array([_valid(v, "float") for v in text.tolist()])
    if not finite.all():
        row = int(np.flatnonzero(~finite)[0])
        raise bad_value(row, not_a_number(str(text[row])))
    return text.astype(np.float64)


def id_overflow(text: str) -> str:
    """The message of an integer id outside int64."""
    return f"id {text} does not fit int64 (integer ids are read as int64)"


def as_ids(values: np.ndarray, bad_value: Callable[[int, str], DataFormatError]) -> np.ndarray:
    """[N] str ids that are all canonical integers -> [N] int64 (so they sort numerically), parsed
    exactly; one outside int64 raises ``bad_value(row, message)``. Other ids stay strings."""
    text = pa.array(values, pa.string())
    if not bool(pc.all(pc.match_substring_regex(text, CANONICAL_INT)).as_py()):
        return values
    try:
        return pc.cast(text, pa.int64()).to_numpy()
    except pa.ArrowInvalid:
        row = next(i for i, v in enumerate(values.tolist()) if not INT64_RANGE[0] <= int(v) <= INT64_RANGE[1])
        raise bad_value(row, id_overflow(str(values[row]))) from None


# ---- table errors ------------------------------------------------------------------------


def table_csv_error(file: Path, delimiter: str, column: str, row: int, message: str) -> DataFormatError:
    """``file:line: column 'name': message`` for data row ``row`` (0-based) of a table CSV."""
    return DataFormatError(file, f"column {column!r}: {message}", line=_line_of_row(file, delimiter, row))


def table_parquet_error(file: Path, column: str, row: int, message: str) -> DataFormatError:
    """``file: row N: column 'name': message`` for row ``row`` (0-based) of a table Parquet file."""
    return DataFormatError(file, f"row {row + 1}: column {column!r}: {message}")


def _line_of_row(path: Path, delimiter: str, row: int) -> int:
    """The line where data row ``row`` (0-based, after the header) of a quoted CSV starts."""
    records = _records(path, delimiter, "utf8", quoted=True)
    next(records)
    return next(line for i, (line, _) in enumerate(records) if i == row)


def unreadable_parquet(file: Union[Path, str], reason: str) -> DataFormatError:
    """``file: not a readable Parquet file (reason)``: a Parquet file that Arrow or an engine (DuckDB,
    Spark) cannot read, e.g. a corrupt page; ``reason``: the reader's own words (their first line)."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    return DataFormatError(file, f"not a readable Parquet file ({lines[0] if lines else 'unknown reason'})")


# ---- Parquet columns ---------------------------------------------------------------------


def is_list_type(kind: pa.DataType) -> bool:
    """Whether a Parquet column of type ``kind`` holds lists (list or large_list)."""
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def parquet_list(file: Path, name: str, column: pa.ChunkedArray, declared: bool) -> JaggedRows:
    """A list<string> / list<int> column declared in ``list_features`` -> N rows of str values
    (integers exactly); a list column not declared, a declared column that is not a list, a null
    or empty value inside a list raise DataFormatError naming the file, row and column."""
    kind = column.type
    if not declared:
        raise DataFormatError(
            file, f"column {name!r} holds lists (type {kind}); declare it in data.columns.list_features"
        )
    value_type = kind.value_type if is_list_type(kind) else None
    if value_type is None or not (
        pa.types.is_integer(value_type) or pa.types.is_string(value_type) or pa.types.is_large_string(value_type)
    ):
        raise DataFormatError(
            file,
            f"column {name!r}: a list feature (data.columns.list_features) needs list<string> or list<int>, "
            f"got type {kind}",
        )
    flat = pc.list_flatten(column)  # the column has no null lists (refused before)
    lengths = pc.list_value_length(column).to_numpy()
    text = pc.cast(flat, pa.string())
    bad = np.flatnonzero(pc.fill_null(pc.equal(text, ""), True).to_numpy(zero_copy_only=False))
    if len(bad):
        row = int(np.searchsorted(np.cumsum(lengths), bad[0], side="right"))
        raise DataFormatError(file, f"row {row + 1}: column {name!r}: a null or empty value inside the list")
    return JaggedRows.from_lengths(lengths, text.to_numpy(zero_copy_only=False).astype(str))


def parquet_column(file: Path, name: str, column: pa.ChunkedArray, numeric: bool) -> np.ndarray:
    """A rating or dense column -> [N] finite float64; any other -> [N] str (integers exactly)."""
    kind = column.type
    if numeric:
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
            raise DataFormatError(file, f"column {name!r}: expected numbers, got type {kind}")
        array = column.to_numpy().astype(np.float64)
        if not np.isfinite(array).all():
            row = int(np.flatnonzero(~np.isfinite(array))[0])
            raise DataFormatError(file, f"row {row + 1}: column {name!r} is not finite")
        return array
    return pc.cast(column, pa.string()).to_numpy(zero_copy_only=False).astype(str)


def parquet_seconds(file: Path, name: str, column: pa.ChunkedArray) -> np.ndarray:
    """A timestamp column -> [N] int64 seconds, exactly: integers as they are, floats and timestamp
    types floored to whole seconds; a value outside int64 (or not finite) names its row."""
    kind = column.type
    if pa.types.is_timestamp(kind):
        return floor_seconds(pc.cast(column, pa.int64()).to_numpy(), kind.unit)
    if pa.types.is_integer(kind):
        array = column.to_numpy()
        if array.dtype == np.uint64 and len(array) and array.max() > np.uint64(INT64_RANGE[1]):
            row = int(np.flatnonzero(array > np.uint64(INT64_RANGE[1]))[0])
            raise DataFormatError(file, f"row {row + 1}: column {name!r}: {array[row]} does not fit int64")
        return array.astype(np.int64)
    if pa.types.is_floating(kind):
        array = np.floor(column.to_numpy().astype(np.float64))
        outside = ~((array >= INT64_RANGE[0]) & (array < 2.0**63))  # NaN included
        if outside.any():
            row = int(np.flatnonzero(outside)[0])
            raise DataFormatError(file, f"row {row + 1}: column {name!r}: {array[row]} is not seconds within int64")
        return array.astype(np.int64)
    raise DataFormatError(file, f"column {name!r}: expected integer seconds or a timestamp type, got type {kind}")
