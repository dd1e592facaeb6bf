"""Readers for public interaction formats: one function per format, plus a registry.

Files are parsed with pyarrow's vectorised CSV reader. When the fast parse fails (or
leaves empty values / non-finite numbers), the file is scanned line by line to name the first
bad line, so every data error reads ``file:line: what was expected``.

Exact values: ids and timestamps never pass through float64. Integer columns are parsed as
int64 (a value outside int64 is an error naming file, line and column); a text column keeps
every value as written, ``NA``, ``null``, ``nan`` and ``N/A`` included (only an empty field is
missing, and an error); timestamps are integer seconds, or decimal numbers floored exactly.
"""

from __future__ import annotations

import csv
import functools
import io
import logging
import math
import re
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal, InvalidOperation
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from gr.data.config import ColumnConfig, DataConfig
from gr.data.interactions import DataFormatError, Interactions, SideTable
from gr.data.synthetic import generate_synthetic
from gr.jagged_rows import JaggedRows
from gr.timestamps import floor_seconds

log = logging.getLogger(__name__)

ARROW_TYPES = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "time": pa.string(), "list": pa.string()}
EXPECTED = {
    "int": "an integer that fits int64",
    "float": "a number",
    "str": "a non-empty value",
    "time": "seconds: an integer, or a decimal number, that fits int64",
    "list": "values separated by the list separator (an empty cell: an empty list)",
}
INT_PATTERN = re.compile(r"-?\d+")
DATE_TEXT = re.compile(r"\d{4}-\d{1,2}-\d{1,2}")  # the start of an ISO 8601 date (2024-01-05T10:00:00Z, ...)
DECIMAL_PATTERN = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
DECIMAL_SECONDS = pa.decimal128(38, 9)
INT64_RANGE = (int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max))
CANONICAL_INT = r"^-?(0|[1-9][0-9]*)$"
ML_GENRES = "item_genres"
ML_AGE_BUCKETS = (1, 18, 25, 35, 45, 50, 56)  # MovieLens-1M age codes: under 18, 18-24, ..., 56+
RATING_KINDS = ("int", "int", "float", "int")


def _require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing file ({what})")
    return path


def read_delimited(
    path: Path,
    columns: Sequence[Tuple[str, str]],
    delimiter: str,
    header: str = "none",
    encoding: str = "utf8",
    quoted: bool = False,
) -> Dict[str, np.ndarray]:
    """Parse a delimited text file into {column: [N] array}.

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
    if table.num_rows == 0:
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
    (``1.5``, ``1.7e9``) floored; None when it is neither, falls outside int64, or has an exponent
    past what ``decimal`` holds (beyond +-999999999999999999)."""
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
        return None
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
                return line, f"column {name!r}: expected {EXPECTED[kind]}, got {value!r}{_date_hint(value, kind)}"
    return None


def _date_hint(value: str, kind: str) -> str:
    """What to do with a date given as text where seconds are expected ("" for anything else)."""
    if kind != "time" or DATE_TEXT.match(value.strip()) is None:
        return ""
    return " (a date as text: give Unix seconds, or a Parquet timestamp column, which is read as it is)"


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


# ---- MovieLens -------------------------------------------------------------------------


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


def _genres(
    labels: JaggedRows, layout: str
) -> Tuple[Dict[str, np.ndarray], Dict[str, List[str]], Dict[str, JaggedRows]]:
    """An item table's genres (M rows of names) as ``SideTable`` arguments (dense, dense_columns,
    lists): ``item_genres`` [M, V] float32 multi-hot over the V sorted names, or the names as a
    list-valued feature (``data.genres``)."""
    if layout == "list":
        return {}, {}, {ML_GENRES: labels}
    vocabulary, codes = np.unique(labels.values, return_inverse=True)
    matrix = np.zeros((len(labels), len(vocabulary)), dtype=np.float32)
    matrix[np.repeat(np.arange(len(labels)), labels.lengths()), codes] = 1.0
    return {ML_GENRES: matrix}, {ML_GENRES: vocabulary.tolist()}, {}


def _genre_lists(path: Path, labels: np.ndarray) -> JaggedRows:
    """[M] "A|B|C" genre strings of a MovieLens movies file -> M rows of genre names."""
    return split_lists(
        labels, "|", lambda row, message: DataFormatError(path, f"genres of movie row {row + 1}: {message}")
    )


@dataclass(frozen=True)
class RatingsFile:
    """A built-in source's ratings file: its name inside the source's directory ("" when
    ``data.path`` is the file itself), what it holds (for the missing-file message), and how
    ``read_delimited`` reads it: ``columns`` are (user, item, rating, timestamp) in that order."""

    name: str
    what: str
    columns: Tuple[Tuple[str, str], ...]
    delimiter: str
    header: str = "none"

    def find(self, path: str) -> Path:
        """The file under ``path`` (``data.path``); a missing one raises FileNotFoundError naming it."""
        return _require_file(Path(path) / self.name if self.name else Path(path), self.what)

    def read(self, file: Path) -> Interactions:
        columns = read_delimited(file, self.columns, self.delimiter, header=self.header)
        user, item, rating, timestamp = (columns[name] for name, _ in self.columns)
        return Interactions(user, item, timestamp, rating.astype(np.float32), source=str(file))


RATINGS_FILES = {
    "ml-100k": RatingsFile(
        "u.data",
        "MovieLens-100K ratings: user<TAB>item<TAB>rating<TAB>timestamp",
        tuple(zip(("user", "item", "rating", "timestamp"), RATING_KINDS)),
        "\t",
    ),
    "ml-1m": RatingsFile(
        "ratings.dat",
        "MovieLens-1M ratings: UserID::MovieID::Rating::Timestamp",
        tuple(zip(("user", "item", "rating", "timestamp"), RATING_KINDS)),
        "::",
    ),
    "ml-20m": RatingsFile(
        "ratings.csv",
        "MovieLens-20M ratings: userId,movieId,rating,timestamp",
        tuple(zip(("userId", "movieId", "rating", "timestamp"), RATING_KINDS)),
        ",",
        header="expect",
    ),
    "amazon": RatingsFile(
        "",
        "Amazon ratings: user,item,rating,timestamp without header",
        tuple(zip(("user", "item", "rating", "timestamp"), ("str", "str", "float", "int"))),
        ",",
    ),
}
SideTables = Tuple[Optional[SideTable], Optional[SideTable]]


def _optional(path: Path, wanted: bool, name: str) -> bool:
    if wanted and not path.is_file():
        log.info("%s: not found, no %s side features", path, name)
    return wanted and path.is_file()


def ml_100k_side_tables(root: Path, item_features: bool, user_features: bool, genres: str) -> SideTables:
    """(item side, user side) of MovieLens-100K in ``root`` (``read_ml_100k`` says which); None
    for a table not wanted or whose file is absent."""
    item_side = user_side = None
    if _optional(root / "u.item", item_features, "item"):
        names = _ml_100k_genres(root / "u.genre")
        flags = [f"genre_{i}" for i in range(len(names))]
        layout = [
            ("item", "int"),
            ("title", "skip"),
            ("release_date", "skip"),
            ("video_release_date", "skip"),
            ("imdb_url", "skip"),
            *((f, "int") for f in flags),
        ]
        items = read_delimited(root / "u.item", layout, "|", encoding="latin-1")
        flagged = np.stack([items[f] for f in flags], axis=1)  # [M, 19], every genre of u.genre in its order
        if genres == "list":
            rows, codes = np.nonzero(flagged)
            lengths = np.bincount(rows, minlength=len(flagged))
            labels = JaggedRows.from_lengths(lengths, np.asarray(names)[codes])
            item_side = SideTable(items["item"], lists={ML_GENRES: labels})
        else:
            multi_hot = {ML_GENRES: flagged.astype(np.float32)}
            item_side = SideTable(items["item"], dense=multi_hot, dense_columns={ML_GENRES: names})
    if _optional(root / "u.user", user_features, "user"):
        layout = [("user", "int"), ("age", "int"), ("gender", "str"), ("occupation", "str"), ("zip", "skip")]
        users = read_delimited(root / "u.user", layout, "|")
        buckets = np.asarray(ML_AGE_BUCKETS)[np.digitize(users["age"], ML_AGE_BUCKETS[1:])]
        user_side = SideTable(
            users["user"],
            categorical={"user_age": buckets, "user_gender": users["gender"], "user_occupation": users["occupation"]},
        )
    return item_side, user_side


def read_ml_100k(
    directory: str, item_features: bool = True, user_features: bool = True, genres: str = "multi_hot"
) -> Interactions:
    """MovieLens-100K: ``u.data`` (tab: user item rating timestamp), optional ``u.item``
    (``id|title|release|video release|url|19 genre flags``, latin-1) and ``u.user``
    (``id|age|gender|occupation|zip``). Side features: item_genres ([19] multi-hot, or the
    genre names as a list-valued feature: ``genres="list"``); user_age (bucketed like ML-1M),
    user_gender, user_occupation."""
    return _read_movielens("ml-100k", directory, item_features, user_features, genres)


def _ml_100k_genres(path: Path) -> List[str]:
    """Genre names from ``u.genre`` (``name|index``), or the 19 standard names' positions."""
    if not path.is_file():
        return [f"genre_{i}" for i in range(19)]
    columns = read_delimited(path, [("name", "str"), ("index", "int")], "|", encoding="latin-1")
    return [str(n) for n in columns["name"][np.argsort(columns["index"], kind="stable")]]


def ml_1m_side_tables(root: Path, item_features: bool, user_features: bool, genres: str) -> SideTables:
    """(item side, user side) of MovieLens-1M in ``root`` (``read_ml_1m`` says which)."""
    item_side = user_side = None
    if _optional(root / "movies.dat", item_features, "item"):
        movies = read_delimited(
            root / "movies.dat", [("item", "int"), ("title", "skip"), ("genres", "str")], "::", encoding="latin-1"
        )
        dense, dense_columns, lists = _genres(_genre_lists(root / "movies.dat", movies["genres"]), genres)
        item_side = SideTable(movies["item"], dense=dense, dense_columns=dense_columns, lists=lists)
    if _optional(root / "users.dat", user_features, "user"):
        layout = [("user", "int"), ("gender", "str"), ("age", "int"), ("occupation", "int"), ("zip", "skip")]
        users = read_delimited(root / "users.dat", layout, "::")
        user_side = SideTable(
            users["user"],
            categorical={
                "user_age": users["age"],
                "user_gender": users["gender"],
                "user_occupation": users["occupation"],
            },
        )
    return item_side, user_side


def read_ml_1m(
    directory: str, item_features: bool = True, user_features: bool = True, genres: str = "multi_hot"
) -> Interactions:
    """MovieLens-1M: ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``), optional
    ``movies.dat`` (``MovieID::Title::Genres``, genres pipe-separated, latin-1) and
    ``users.dat`` (``UserID::Gender::Age::Occupation::Zip-code``)."""
    return _read_movielens("ml-1m", directory, item_features, user_features, genres)


def ml_20m_side_tables(root: Path, item_features: bool, user_features: bool, genres: str) -> SideTables:
    """(item side, None) of MovieLens-20M in ``root`` (``read_ml_20m`` says which): it has no user file."""
    if not _optional(root / "movies.csv", item_features, "item"):
        return None, None
    movies = read_delimited(
        root / "movies.csv",
        [("movieId", "int"), ("title", "skip"), ("genres", "str")],
        ",",
        header="expect",
        quoted=True,
    )
    dense, dense_columns, lists = _genres(_genre_lists(root / "movies.csv", movies["genres"]), genres)
    return SideTable(movies["movieId"], dense=dense, dense_columns=dense_columns, lists=lists), None


def read_ml_20m(
    directory: str, item_features: bool = True, user_features: bool = True, genres: str = "multi_hot"
) -> Interactions:
    """MovieLens-20M: ``ratings.csv`` with header ``userId,movieId,rating,timestamp`` (ratings
    like 3.5), optional ``movies.csv`` (``movieId,title,genres``, quoted titles). No user file."""
    return _read_movielens("ml-20m", directory, item_features, user_features, genres)


MOVIELENS_SIDE_TABLES: Dict[str, Callable[[Path, bool, bool, str], SideTables]] = {
    "ml-100k": ml_100k_side_tables,
    "ml-1m": ml_1m_side_tables,
    "ml-20m": ml_20m_side_tables,
}


def _read_movielens(source: str, directory: str, item_features: bool, user_features: bool, genres: str) -> Interactions:
    """The ratings of MovieLens ``source`` in ``directory``, then its side tables."""
    ratings = RATINGS_FILES[source]
    data = ratings.read(ratings.find(directory))
    side_tables = MOVIELENS_SIDE_TABLES[source]
    data.item_side, data.user_side = side_tables(Path(directory), item_features, user_features, genres)
    return data


def read_amazon(path: str) -> Interactions:
    """Amazon reviews ``ratings_<Category>.csv``: no header, ``user,item,rating,timestamp``
    with string ids (e.g. ``A1B2C3``, ``0123456789``; leading zeros kept)."""
    ratings = RATINGS_FILES["amazon"]
    return ratings.read(ratings.find(path))


# ---- generic tables ----------------------------------------------------------------------


def read_table_csv(path: str, columns: ColumnConfig) -> Interactions:
    """A CSV with a header; ``columns`` names the user, item, timestamp (seconds: integers, or
    decimal numbers floored) and optional rating and declared feature columns (categorical: any
    non-empty text, ``NA`` and ``null`` included; list features: values joined by
    ``columns.list_separator``, an empty cell the empty list; dense: finite numbers). Ids that
    are all canonical integers become int64."""
    file = _require_file(
        Path(path), f"CSV with a header naming {columns.user!r}, {columns.item!r}, {columns.timestamp!r}"
    )
    categorical = columns.categorical_columns()
    values = read_delimited(file, table_csv_layout(columns), columns.delimiter, header="select", quoted=True)

    def bad_id(name: str, row: int, message: str) -> DataFormatError:
        return table_csv_error(file, columns.delimiter, name, row, message)

    ratings, rating = None, columns.rating
    if rating is not None and rating in categorical:
        ratings = _numbers_of_text(values[rating], lambda row, text: bad_id(rating, row, text))
    lists = {
        c: split_lists(values[c], columns.list_separator, functools.partial(bad_id, c)) for c in columns.list_features
    }
    return _table_interactions(file, values, lists, columns, bad_id, ratings)


def table_csv_layout(columns: ColumnConfig) -> List[Tuple[str, str]]:
    """The (column, kind) pairs ``read_table_csv`` reads (``read_delimited``'s kinds), each column once."""
    layout = {
        columns.user: "str",
        columns.item: "str",
        columns.timestamp: "time",
        **({columns.rating: "float"} if columns.rating else {}),
        **{c: "float" for c in columns.dense_columns()},
        # categorical columns as text (a rating that is also a categorical feature too; lists split below)
        **{c: "list" if c in columns.list_features else "str" for c in columns.categorical_columns()},
    }
    return list(layout.items())


def not_a_number(text: str) -> str:
    """The message of a text cell that should hold a finite number."""
    return f"expected {EXPECTED['float']}, got {text!r}"


def _numbers_of_text(text: np.ndarray, bad_value: Callable[[int, str], DataFormatError]) -> np.ndarray:
    """[N] str -> [N] finite float64; the first value that is not a finite number raises
    ``bad_value(row, message)``."""
    finite = np.array([_valid(v, "float") for v in text.tolist()])
    if not finite.all():
        row = int(np.flatnonzero(~finite)[0])
        raise bad_value(row, not_a_number(str(text[row])))
    return text.astype(np.float64)


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


def read_table_parquet(path: str, columns: ColumnConfig) -> Interactions:
    """A Parquet file with the columns ``columns`` names (timestamp: integer seconds, float seconds
    floored, or a timestamp type floored to seconds; ids: integer or string columns, read exactly;
    list features: list<string> or list<int> columns, and only they are lists). Errors name the
    row counted from 1, as CSV errors name lines and ``gr predict`` names rows."""
    file = _require_file(Path(path), "Parquet file")
    wanted, numeric = table_parquet_columns(columns)
    read_table_parquet_schema(file, columns)
    try:
        table = pq.read_table(file, columns=wanted)
    except (pa.ArrowInvalid, OSError) as error:
        raise unreadable_parquet(file, str(error)) from None
    if table.num_rows == 0:
        raise DataFormatError(file, "no data rows (empty dataset)")
    values, lists, ratings = _parquet_values(file, table, columns)

    def bad_id(name: str, row: int, message: str) -> DataFormatError:
        return table_parquet_error(file, name, row, message)

    return _table_interactions(file, values, lists, columns, bad_id, ratings)


def unreadable_parquet(file: Union[Path, str], reason: str) -> DataFormatError:
    """``file: not a readable Parquet file (reason)``: a Parquet file that Arrow or an engine (DuckDB,
    Spark) cannot read, e.g. a corrupt page; ``reason``: the reader's own words (their first line)."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    return DataFormatError(file, f"not a readable Parquet file ({lines[0] if lines else 'unknown reason'})")


def table_parquet_columns(columns: ColumnConfig) -> Tuple[List[str], List[str]]:
    """(every column ``read_table_parquet`` reads, each once; the numeric ones among them)."""
    numeric = [columns.timestamp, *([columns.rating] if columns.rating else []), *columns.dense_columns()]
    wanted = list(dict.fromkeys([columns.user, columns.item, *numeric, *columns.categorical_columns()]))
    return wanted, numeric


def read_table_parquet_schema(file: Path, columns: ColumnConfig) -> pa.Schema:
    """The schema of a table Parquet file (its footer only); an unreadable file, or one lacking a
    column ``columns`` names, raises DataFormatError."""
    wanted, _ = table_parquet_columns(columns)
    try:
        schema = pq.read_schema(file)
    except (pa.ArrowInvalid, OSError) as error:
        raise unreadable_parquet(file, str(error)) from None
    missing = [c for c in wanted if c not in schema.names]
    if missing:
        raise DataFormatError(file, f"lacks column(s) {missing}; it has {schema.names}")
    return schema


def check_table_parquet_types(file: Path, schema: pa.Schema, columns: ColumnConfig) -> None:
    """Refuse, as ``read_table_parquet`` does, a column whose type cannot hold what ``columns``
    declares it to be (checked on no rows: the values are another engine's to check)."""
    wanted, _ = table_parquet_columns(columns)
    _parquet_values(file, schema.empty_table().select(wanted), columns)


def _parquet_values(
    file: Path, table: pa.Table, columns: ColumnConfig
) -> Tuple[Dict[str, np.ndarray], Dict[str, JaggedRows], Optional[np.ndarray]]:
    """(values, lists, ratings) of ``_table_interactions`` from the columns ``table_parquet_columns`` names."""
    wanted, numeric = table_parquet_columns(columns)
    values: Dict[str, np.ndarray] = {}
    categorical = columns.categorical_columns()
    lists: Dict[str, JaggedRows] = {}
    for name in wanted:
        column = table[name]
        if column.null_count:
            row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataFormatError(file, f"row {row + 1}: column {name!r} is null")
        if name in columns.list_features or _is_list(column.type):
            lists[name] = parquet_list(file, name, column, declared=name in columns.list_features)
        elif name == columns.timestamp:
            values[name] = _parquet_seconds(file, name, column)
        else:
            values[name] = _parquet_column(file, name, column, numeric=name in numeric and name not in categorical)
    ratings = None
    if columns.rating in categorical:  # also a categorical feature: its text above, its numbers here
        ratings = _parquet_column(file, columns.rating, table[columns.rating], numeric=True)
    return values, lists, ratings


def _is_list(kind: pa.DataType) -> bool:
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
    value_type = kind.value_type if _is_list(kind) else None
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


def _parquet_column(file: Path, name: str, column: pa.ChunkedArray, numeric: bool) -> np.ndarray:
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


def _parquet_seconds(file: Path, name: str, column: pa.ChunkedArray) -> np.ndarray:
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


def id_overflow(text: str) -> str:
    """The message of an integer id outside int64."""
    return f"id {text} does not fit int64 (integer ids are read as int64)"


def _as_ids(values: np.ndarray, bad_value: Callable[[int, str], DataFormatError]) -> np.ndarray:
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


def _row_table(
    values: Mapping[str, np.ndarray],
    lists: Mapping[str, JaggedRows],
    categorical: Sequence[str],
    dense: Mapping[str, Tuple[str, ...]],
) -> SideTable:
    """Every row's declared features: categorical columns as they are (a list feature's rows from
    ``lists``), each dense feature's columns stacked into [N, d] float32 (its column names kept)."""
    return SideTable(
        np.arange(len(values[next(iter(values))]), dtype=np.int64),
        categorical={c: values[c] for c in categorical if c not in lists},
        dense={name: np.stack([values[c] for c in cs], axis=1).astype(np.float32) for name, cs in dense.items()},
        dense_columns={name: list(cs) for name, cs in dense.items()},
        lists={c: lists[c] for c in categorical if c in lists},
    )


def _last_value_table(keys: np.ndarray, rows: SideTable) -> SideTable:
    """One row per distinct key holding each feature of ``rows`` (one row per key occurrence)
    at the key's last row."""
    unique, first_in_reversed = np.unique(keys[::-1], return_index=True)
    table = rows.take(len(keys) - 1 - first_in_reversed)
    return SideTable(unique, table.categorical, table.dense, table.dense_columns, table.lists)


def _table_interactions(
    file: Path,
    values: Dict[str, np.ndarray],
    lists: Dict[str, JaggedRows],
    columns: ColumnConfig,
    bad_id: Callable[[str, int, str], DataFormatError],
    ratings: Optional[np.ndarray] = None,
) -> Interactions:
    """values: {column: [N]} with [N] int64 timestamps and [N] str ids; lists: {list feature: N rows
    of str values}; bad_id(column, row, message): the error for an id that does not fit int64;
    ratings: [N] float, when ``values`` holds the rating column as a categorical feature's text."""
    users = _as_ids(values[columns.user], lambda row, message: bad_id(columns.user, row, message))
    items = _as_ids(values[columns.item], lambda row, message: bad_id(columns.item, row, message))
    if ratings is None and columns.rating:
        ratings = values[columns.rating]
    data = Interactions(
        users,
        items,
        values[columns.timestamp],
        None if ratings is None else ratings.astype(np.float32),
        source=str(file),
    )
    if columns.user_features or columns.user_dense:
        data.user_side = _last_value_table(users, _row_table(values, lists, columns.user_features, columns.user_dense))
    if columns.item_features or columns.item_dense:
        data.item_side = _last_value_table(items, _row_table(values, lists, columns.item_features, columns.item_dense))
    if columns.token_features or columns.token_dense:
        data.row_side = _row_table(values, lists, columns.token_features, columns.token_dense)
    return data


# ---- registry ------------------------------------------------------------------------------


def _path(config: DataConfig) -> str:
    """``data.path`` of a source that reads files (``DataConfig`` requires it for those)."""
    if config.path is None:
        raise ValueError(f"data.path: required for data.source {config.source!r}")
    return config.path


READERS: Dict[str, Callable[[DataConfig], Interactions]] = {
    "synthetic": lambda c: generate_synthetic(c.synthetic, c.seed),
    "ml-100k": lambda c: read_ml_100k(_path(c), c.item_features, c.user_features, c.genres),
    "ml-1m": lambda c: read_ml_1m(_path(c), c.item_features, c.user_features, c.genres),
    "ml-20m": lambda c: read_ml_20m(_path(c), c.item_features, c.user_features, c.genres),
    "amazon": lambda c: read_amazon(_path(c)),
    "csv": lambda c: read_table_csv(_path(c), c.columns),
    "parquet": lambda c: read_table_parquet(_path(c), c.columns),
}


def find_source(config: DataConfig) -> Optional[Path]:
    """The file or directory the raw source reads (a built-in source: its ratings file), or
    FileNotFoundError naming it when missing: a check as cheap as a stat, before a run imports
    its training stack. None for the synthetic source."""
    if config.source == "synthetic":
        return None
    assert config.path is not None  # DataConfig requires it of a raw file source
    if config.source in RATINGS_FILES:
        return RATINGS_FILES[config.source].find(config.path)
    path = Path(config.path)
    if not path.exists():
        raise FileNotFoundError(f"data.path: {path}: no such file or directory (the {config.source} source)")
    return path


def read_source(config: DataConfig) -> Interactions:
    """The interactions ``config.source`` names (read from ``config.path``, or generated).

    Rows repeating an earlier row's (user, item, timestamp) are dropped and counted (a warning
    names how many) unless ``config.keep_duplicates``; ``Interactions.duplicates`` holds the count."""
    data = READERS[config.source](config).without_duplicates(drop=not config.keep_duplicates)
    log_duplicates(data.source, data.duplicates, data.duplicates_dropped)
    return data


def log_duplicates(source: object, duplicates: int, dropped: bool) -> None:
    """The log line about ``duplicates`` rows repeating an earlier row's (user, item, timestamp):
    a warning when they were ``dropped``, else (data.keep_duplicates) an info line; none without any."""
    if duplicates and dropped:
        log.warning(
            "%s: dropped %d duplicate interactions (same user, item and timestamp as an earlier row); "
            "set data.keep_duplicates: true to keep them",
            source,
            duplicates,
        )
    elif duplicates:
        log.info("%s: kept %d duplicate interactions (data.keep_duplicates)", source, duplicates)
