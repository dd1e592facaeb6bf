"""Readers for public interaction formats: one function per format, plus a registry.

Each reader knows its format's files and columns (MovieLens, Amazon, a table CSV or Parquet file)
and builds ``Interactions`` with their side tables; values are parsed and refused by
``gr.data.parsing``, so every data error names the file and line (or row) and what was expected.
"""

from __future__ import annotations

import csv
import functools
import glob
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gr.data.config import RELEASE_YEAR, SIDES, ColumnConfig, DataConfig
from gr.data.interactions import DataFormatError, Interactions, SideTable
from gr.data.mappings import IdMap, id_kind
from gr.data.parsing import (
    as_ids,
    check_first_line,
    is_list_type,
    numbers_of_text,
    parquet_column,
    parquet_list,
    parquet_seconds,
    read_delimited,
    split_lists,
    table_csv_error,
    table_parquet_error,
    unreadable_parquet,
)
from gr.data.synthetic import generate_synthetic
from gr.jagged_rows import JaggedRows

log = logging.getLogger(__name__)

ML_GENRES = "item_genres"
ML_AGE_BUCKETS = (1, 18, 25, 35, 45, 50, 56)  # MovieLens-1M age codes: under 18, 18-24, ..., 56+
YEARS_FROM = 1990  # release years from here on are their own bucket (most of ML-100K's items); earlier: decades
UNKNOWN_YEAR = "unknown"
RATING_KINDS = ("int", "int", "float", "int")
SIDE_SUMMARY = "side_tables"  # a summary's counts of data.users / data.items (``side_table_summary``)


def _require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing file ({what})")
    return path


# ---- MovieLens -------------------------------------------------------------------------


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


def ml_100k_side_tables(
    root: Path, item_features: bool, user_features: bool, genres: str, release_year: bool = False
) -> SideTables:
    """(item side, user side) of MovieLens-100K in ``root`` (``read_ml_100k`` says which); None
    for a table not wanted or whose file is absent."""
    item_side = user_side = None
    if _optional(root / "u.item", item_features, "item"):
        names = _ml_100k_genres(root / "u.genre")
        flags = [f"genre_{i}" for i in range(len(names))]
        layout = [
            ("item", "int"),
            ("title", "skip"),
            ("release_date", "list" if release_year else "skip"),  # "list": text, empty allowed
            ("video_release_date", "skip"),
            ("imdb_url", "skip"),
            *((f, "int") for f in flags),
        ]
        items = read_delimited(root / "u.item", layout, "|", encoding="latin-1")
        flagged = np.stack([items[f] for f in flags], axis=1)  # [M, 19], every genre of u.genre in its order
        years = {RELEASE_YEAR: release_year_buckets(root / "u.item", items["release_date"])} if release_year else {}
        if genres == "list":
            rows, codes = np.nonzero(flagged)
            lengths = np.bincount(rows, minlength=len(flagged))
            labels = JaggedRows.from_lengths(lengths, np.asarray(names)[codes])
            item_side = SideTable(items["item"], categorical=years, lists={ML_GENRES: labels})
        else:
            multi_hot = {ML_GENRES: flagged.astype(np.float32)}
            item_side = SideTable(items["item"], categorical=years, dense=multi_hot, dense_columns={ML_GENRES: names})
    if _optional(root / "u.user", user_features, "user"):
        layout = [("user", "int"), ("age", "int"), ("gender", "str"), ("occupation", "str"), ("zip", "skip")]
        users = read_delimited(root / "u.user", layout, "|")
        buckets = np.asarray(ML_AGE_BUCKETS)[np.digitize(users["age"], ML_AGE_BUCKETS[1:])]
        user_side = SideTable(
            users["user"],
            categorical={"user_age": buckets, "user_gender": users["gender"], "user_occupation": users["occupation"]},
        )
    return item_side, user_side


def release_year_buckets(path: Path, dates: np.ndarray) -> np.ndarray:
    """[M] release dates of ``path`` (u.item: ``01-Jan-1995``, or empty) -> [M] str buckets: the
    year from ``YEARS_FROM`` on ("1995"), its decade before ("1980s"), "unknown" for an empty date.
    Another text raises DataFormatError naming its line."""
    out = np.full(len(dates), UNKNOWN_YEAR, dtype=object)
    for row, date in enumerate(dates.tolist()):
        if not date:
            continue
        match = re.fullmatch(r"\d{1,2}-[A-Za-z]{3}-(\d{4})", date)
        if match is None:
            raise DataFormatError(path, f"release date {date!r}: expected DD-Mon-YYYY or an empty field", line=row + 1)
        year = int(match.group(1))
        out[row] = str(year) if year >= YEARS_FROM else f"{year // 10 * 10}s"
    return out.astype(str)


def read_ml_100k(
    directory: str,
    item_features: bool = True,
    user_features: bool = True,
    genres: str = "multi_hot",
    release_year: bool = False,
) -> Interactions:
    """MovieLens-100K: ``u.data`` (tab: user item rating timestamp), optional ``u.item``
    (``id|title|release|video release|url|19 genre flags``, latin-1) and ``u.user``
    (``id|age|gender|occupation|zip``). Side features: item_genres ([19] multi-hot, or the
    genre names as a list-valued feature: ``genres="list"``); with ``release_year``, item_year
    (``release_year_buckets``); user_age (bucketed like ML-1M), user_gender, user_occupation."""
    return _read_movielens(
        "ml-100k",
        directory,
        lambda root: ml_100k_side_tables(root, item_features, user_features, genres, release_year),
    )


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
    return _read_movielens(
        "ml-1m", directory, lambda root: ml_1m_side_tables(root, item_features, user_features, genres)
    )


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
    return _read_movielens(
        "ml-20m", directory, lambda root: ml_20m_side_tables(root, item_features, user_features, genres)
    )


def movielens_side_tables(root: Path, config: DataConfig) -> SideTables:
    """(item side, user side) of MovieLens source ``config.source`` in ``root``, as ``config`` asks."""
    if config.source == "ml-100k":
        return ml_100k_side_tables(root, config.item_features, config.user_features, config.genres, config.release_year)
    side_tables = ml_1m_side_tables if config.source == "ml-1m" else ml_20m_side_tables
    return side_tables(root, config.item_features, config.user_features, config.genres)


def _read_movielens(source: str, directory: str, side_tables: Callable[[Path], SideTables]) -> Interactions:
    """The ratings of MovieLens ``source`` in ``directory``, then its side tables."""
    ratings = RATINGS_FILES[source]
    data = ratings.read(ratings.find(directory))
    data.item_side, data.user_side = side_tables(Path(directory))
    return data


def read_amazon(path: str) -> Interactions:
    """Amazon reviews ``ratings_<Category>.csv``: no header, ``user,item,rating,timestamp``
    with string ids (e.g. ``A1B2C3``, ``0123456789``; leading zeros kept)."""
    ratings = RATINGS_FILES["amazon"]
    return ratings.read(ratings.find(path))


# ---- generic tables ----------------------------------------------------------------------

TABLE_SUFFIXES = (".csv", ".parquet")  # the table sources' files: one format per source
GLOB_CHARACTERS = re.compile(r"[*?\[]")


def _listed(name: str) -> bool:
    """Whether a file or folder of a source directory is data: hidden names and ``_``-prefixed
    markers (``_SUCCESS``, ``_temporary/``) are not."""
    return name[0] not in "._"


def _files_under(directory: Path) -> List[Path]:
    """Every listed file under ``directory``, in its subdirectories too (Hive-style ``key=value``
    folders), unordered."""
    found = []
    for root, folders, names in os.walk(directory):
        folders[:] = [folder for folder in folders if _listed(folder)]
        found += [Path(root) / name for name in names if _listed(name)]
    return found


def _found_files(path: Path, key: str) -> List[Path]:
    """Every listed file under the directory ``path`` or matched by the glob ``path``, unordered;
    nothing there raises FileNotFoundError naming the config ``key``."""
    if path.is_dir():
        return _files_under(path)
    if GLOB_CHARACTERS.search(str(path)):
        matched = [Path(m) for m in glob.glob(str(path), recursive=True)]
        if not matched:
            raise FileNotFoundError(f"{key}: {path}: no file or directory matches the pattern")
        return [f for m in matched for f in (_files_under(m) if m.is_dir() else [m] if _listed(m.name) else [])]
    raise FileNotFoundError(f"{key}: {path}: no such file or directory")


def source_files(path: Path, suffix: str, key: str = "data.path") -> List[Path]:
    """The files a table source reads from ``data.path`` (or the config ``key`` naming ``path``), in
    the order their rows are read (which orders the rows of equal timestamps): ``path`` itself when
    it is a file; else the ``*<suffix>`` files under the directory ``path``, subdirectories included
    (Hive-style ``month=2024-01/`` folders: their keys are not columns), or matched by the glob
    ``path`` (``**`` spans folders, a matched directory counts as its files), in path order
    (compared folder by folder, then by name), leaving out hidden and ``_``-prefixed names
    (``_SUCCESS``, ``_temporary/``).

    Nothing at ``path`` (or nothing it matches) raises FileNotFoundError; no ``*<suffix>`` file, or
    a file of the other table format among them, DataFormatError naming it."""
    if path.is_file():
        return [path]
    found = _found_files(path, key)
    for file in found:
        other = next((s for s in TABLE_SUFFIXES if s != suffix and file.name.endswith(s)), None)
        if other is not None:
            raise DataFormatError(
                file, f"a {other} file among the {suffix} files of {key} {path} (one format per source)"
            )
    files = sorted({f for f in found if f.name.endswith(suffix)}, key=lambda f: f.parts)
    if not files:
        raise DataFormatError(path, f"no *{suffix} files ({key}: a file, a directory of partition files or a glob)")
    return files


@dataclass
class _Part:
    """What ``_table_interactions`` takes of one file of a table source: values: {column: [n]} (str
    ids, int64 timestamps, float numbers or text), lists: {list feature: n rows}, ratings: [n] float
    when the rating column is also a categorical feature's text; bad(column, row, message): the
    error naming the file and row (0-based) of a refused value."""

    file: Path
    values: Dict[str, np.ndarray]
    lists: Dict[str, JaggedRows]
    ratings: Optional[np.ndarray]
    bad: Callable[[str, int, str], DataFormatError]

    def __len__(self) -> int:
        return len(next(iter(self.values.values())))


def _merged(path: Path, parts: Sequence[_Part]) -> _Part:
    """The rows of a source's files ``parts`` in their order, as one part of ``path`` whose ``bad``
    names the file and row of a merged row (one file: that part as it is)."""
    if len(parts) == 1:
        return parts[0]
    starts = np.cumsum([0, *(len(part) for part in parts)])
    if starts[-1] == 0:
        raise DataFormatError(path, "no data rows (empty dataset)")
    first = parts[0]
    values = {name: np.concatenate([part.values[name] for part in parts]) for name in first.values}
    lists = {
        name: JaggedRows.from_lengths(
            np.concatenate([part.lists[name].lengths() for part in parts]),
            np.concatenate([part.lists[name].values for part in parts]),
        )
        for name in first.lists
    }
    ratings = None if first.ratings is None else np.concatenate([part.ratings for part in parts])

    def bad(name: str, row: int, message: str) -> DataFormatError:
        index = int(np.searchsorted(starts, row, side="right")) - 1
        return parts[index].bad(name, row - int(starts[index]), message)

    return _Part(path, values, lists, ratings, bad)


def _concatenated(path: Path, parts: Sequence[_Part], columns: ColumnConfig) -> Interactions:
    """The interactions of a table source's files ``parts`` in their order (one file: as it is)."""
    part = _merged(path, parts)
    return _table_interactions(part.file, part.values, part.lists, columns, part.bad, part.ratings)


def read_table_csv(path: str, columns: ColumnConfig) -> Interactions:
    """A CSV with a header, or its partitions (``source_files``: a directory or a glob, each file
    with its own header); ``columns`` names the user, item, timestamp (seconds: integers, or
    decimal numbers floored) and optional rating and declared feature columns (categorical: any
    non-empty text, ``NA`` and ``null`` included; list features: values joined by
    ``columns.list_separator``, an empty cell the empty list; dense: finite numbers). Ids that
    are all canonical integers become int64."""
    files = source_files(Path(path), ".csv")
    return _concatenated(Path(path), [_csv_part(file, columns, len(files) > 1) for file in files], columns)


def _csv_part(file: Path, columns: ColumnConfig, partition: bool) -> _Part:
    """One CSV file of a table source (a ``partition`` of several may hold no data rows)."""
    categorical = columns.categorical_columns()
    layout = table_csv_layout(columns)
    values = read_delimited(file, layout, columns.delimiter, header="select", quoted=True, empty=partition)

    def bad_id(name: str, row: int, message: str) -> DataFormatError:
        return table_csv_error(file, columns.delimiter, name, row, message)

    ratings, rating = None, columns.rating
    if rating is not None and rating in categorical:
        ratings = numbers_of_text(values[rating], lambda row, text: bad_id(rating, row, text))
    lists = {
        c: split_lists(values[c], columns.list_separator, functools.partial(bad_id, c)) for c in columns.list_features
    }
    return _Part(file, values, lists, ratings, bad_id)


def table_csv_layout(columns: ColumnConfig) -> List[Tuple[str, str]]:
    """The (column, kind) pairs ``read_table_csv`` reads (``read_delimited``'s kinds), each column once."""
    layout = {
        columns.user: "str",
        columns.item: "str",
        columns.timestamp: "time",
        **({columns.rating: "float"} if columns.rating else {}),
        **({columns.request: "str"} if columns.request else {}),
        **{c: "float" for c in columns.dense_columns()},
        # categorical columns as text (a rating that is also a categorical feature too; lists split below)
        **{c: "list" if c in columns.list_features else "str" for c in columns.categorical_columns()},
    }
    return list(layout.items())


def read_table_parquet(path: str, columns: ColumnConfig) -> Interactions:
    """A Parquet file, or its partitions (``source_files``: a directory or a glob; each column of
    one type in every file), with the columns ``columns`` names (timestamp: integer seconds, float
    seconds floored, or a timestamp type floored to seconds; ids: integer or string columns, read
    exactly; list features: list<string> or list<int> columns, and only they are lists). Errors
    name the file and row counted from 1, as CSV errors name lines and ``gr predict`` names rows."""
    files = source_files(Path(path), ".parquet")
    table_parquet_types(files, columns)
    return _concatenated(Path(path), [_parquet_part(file, columns, len(files) > 1) for file in files], columns)


def _parquet_part(file: Path, columns: ColumnConfig, partition: bool) -> _Part:
    """One Parquet file of a table source (a ``partition`` of several may hold no rows)."""
    wanted, _ = table_parquet_columns(columns)
    try:
        table = pq.read_table(file, columns=wanted)
    except (pa.ArrowInvalid, OSError) as error:
        raise unreadable_parquet(file, str(error)) from None
    if table.num_rows == 0 and not partition:
        raise DataFormatError(file, "no data rows (empty dataset)")
    values, lists, ratings = _parquet_values(file, table, columns)

    def bad_id(name: str, row: int, message: str) -> DataFormatError:
        return table_parquet_error(file, name, row, message)

    return _Part(file, values, lists, ratings, bad_id)


def table_parquet_columns(columns: ColumnConfig) -> Tuple[List[str], List[str]]:
    """(every column ``read_table_parquet`` reads, each once; the numeric ones among them)."""
    numeric = [columns.timestamp, *([columns.rating] if columns.rating else []), *columns.dense_columns()]
    requests = [columns.request] if columns.request else []
    wanted = list(dict.fromkeys([columns.user, columns.item, *requests, *numeric, *columns.categorical_columns()]))
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


def table_parquet_types(files: Sequence[Path], columns: ColumnConfig) -> Dict[str, pa.DataType]:
    """{column: Arrow type} of the columns ``read_table_parquet`` reads, from the footers of
    ``files``: each file must hold them (``read_table_parquet_schema``), of types they may have
    (``check_table_parquet_types``) and the same in every file (else DataFormatError naming it)."""
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
    assert first is not None  # source_files gives a file at least
    return {c: first.field(c).type for c in wanted}


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
        if name in columns.list_features or is_list_type(column.type):
            lists[name] = parquet_list(file, name, column, declared=name in columns.list_features)
        elif name == columns.timestamp:
            values[name] = parquet_seconds(file, name, column)
        else:
            values[name] = parquet_column(file, name, column, numeric=name in numeric and name not in categorical)
    ratings = None
    if columns.rating in categorical:  # also a categorical feature: its text above, its numbers here
        ratings = parquet_column(file, columns.rating, table[columns.rating], numeric=True)
    return values, lists, ratings


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
    users = as_ids(values[columns.user], lambda row, message: bad_id(columns.user, row, message))
    items = as_ids(values[columns.item], lambda row, message: bad_id(columns.item, row, message))
    if ratings is None and columns.rating:
        ratings = values[columns.rating]
    request = columns.request
    data = Interactions(
        users,
        items,
        values[columns.timestamp],
        None if ratings is None else ratings.astype(np.float32),
        None if request is None else as_ids(values[request], lambda row, message: bad_id(request, row, message)),
        source=str(file),
    )
    if columns.user_features or columns.user_dense:
        data.user_side = _last_value_table(users, _row_table(values, lists, columns.user_features, columns.user_dense))
    if columns.item_features or columns.item_dense:
        data.item_side = _last_value_table(items, _row_table(values, lists, columns.item_features, columns.item_dense))
    if columns.token_features or columns.token_dense:
        data.row_side = _row_table(values, lists, columns.token_features, columns.token_dense)
    return data


# ---- side tables: data.users, data.items ---------------------------------------------------


@dataclass(frozen=True)
class SideSpec:
    """What a side table (``data.users`` / ``data.items``: ``key``) gives: the declared features of
    ``side`` ("user" | "item"), read from ``files`` (of ``suffix``) by their id column ``id_column``.

    columns: [(config key, column)] of the declared features, e.g. ``("user_dense.age", "age")``."""

    key: str
    side: str
    path: Path
    files: Tuple[Path, ...]
    suffix: str
    id_column: str
    columns: Tuple[Tuple[str, str], ...]

    def wanted(self) -> List[str]:
        """Every column read, the id first, each once."""
        return list(dict.fromkeys([self.id_column, *(c for _, c in self.columns)]))

    def declared(self, column: str) -> str:
        """The config key declaring ``column`` (``data.columns.user_features``, ...)."""
        return "data.columns." + next(k for k, c in self.columns if c == column).split(".")[0]


def side_specs(config: DataConfig) -> List[SideSpec]:
    """The side tables ``config`` names (``data.users``, ``data.items``), their files found: nothing
    there raises FileNotFoundError, no CSV or Parquet file DataFormatError (each naming the key)."""
    specs = []
    for key, side in SIDES.items():
        table = config.side_table(key)
        if table is None:
            continue
        path, where = Path(table.path), f"data.{key}"
        suffix = next((s for s in TABLE_SUFFIXES if path.name.endswith(s)), None)
        if suffix is None and not path.is_file():
            names = sorted(f.name for f in _found_files(path, where))
            suffix = next((s for name in names for s in TABLE_SUFFIXES if name.endswith(s)), ".parquet")
        if suffix is None:
            raise DataFormatError(path, f"{where}: expected a {' or '.join(TABLE_SUFFIXES)} file")
        files = tuple(source_files(path, suffix, where))
        columns = tuple(config.columns.side_columns(side))
        specs.append(SideSpec(key, side, path, files, suffix, config.side_key(key), columns))
    return specs


def _column_names(file: Path, suffix: str, delimiter: str) -> List[str]:
    """The columns of a table file: its CSV header (first line) or its Parquet schema."""
    if suffix == ".parquet":
        try:
            return list(pq.read_schema(file).names)
        except (pa.ArrowInvalid, OSError) as error:
            raise unreadable_parquet(file, str(error)) from None
    check_first_line(file, [], delimiter, "select", quoted=True)
    with open(file, encoding="utf8", newline="") as f:
        return next(row for row in csv.reader(f, delimiter=delimiter) if row)


def check_side_tables(config: DataConfig) -> List[SideSpec]:
    """Check ``data.users`` / ``data.items`` before anything is read (headers and footers only) ->
    their specs. Each file holds the id column and every declared feature of its side (Parquet: of a
    type it may have); a declared column the events hold too is refused (a feature is read from one
    place). Errors are one line naming the config key and the file."""
    specs = side_specs(config)
    if not specs:
        return specs
    assert config.path is not None  # DataConfig: a table source reads data.path
    events = source_files(Path(config.path), f".{config.source}")[0]
    event_names = set(_column_names(events, f".{config.source}", config.columns.delimiter))
    for spec in specs:
        for file in spec.files:
            names = _column_names(file, spec.suffix, config.columns.delimiter)
            if spec.id_column not in names:
                table = config.side_table(spec.key)
                key = f"data.{spec.key}.key" if table is not None and table.key else f"data.columns.{spec.side}"
                raise DataFormatError(
                    file, f"{key}: lacks the id column {spec.id_column!r} (data.{spec.key}); it has {names}"
                )
            for key, column in spec.columns:
                if column not in names:
                    raise DataFormatError(
                        file,
                        f"data.columns.{key}: lacks column {column!r}; with data.{spec.key} every declared "
                        f"{spec.side} feature is read from it (it has {names})",
                    )
            if spec.suffix == ".parquet":
                _check_side_parquet_types(file, pq.read_schema(file), spec, config.columns.list_features)
        both = [(k, c) for k, c in spec.columns if c in event_names and c != spec.id_column]
        if both:
            key, column = both[0]
            raise DataFormatError(
                spec.files[0],
                f"data.columns.{key}: column {column!r} is in this side table (data.{spec.key}) and in the events "
                f"{events} (data.path); a declared {spec.side} feature is read from one of them: drop the "
                "column from the events",
            )
    return specs


def _check_side_parquet_types(file: Path, schema: pa.Schema, spec: SideSpec, list_features: Sequence[str]) -> None:
    """Refuse a side table column of a type it may not have: ids and categorical values integer or
    string, a list feature list<string> or list<int>, a dense column numbers."""
    dense = {c for k, c in spec.columns if "_dense." in k}
    for column in spec.wanted():
        kind = schema.field(column).type
        if column in list_features and column != spec.id_column:
            ok = is_list_type(kind) and _id_type(kind.value_type)
            expected = "list<string> or list<int>"
        elif column in dense:
            ok, expected = pa.types.is_integer(kind) or pa.types.is_floating(kind), "numbers"
        else:
            ok, expected = _id_type(kind), "integer or string values"
        if not ok:
            key = f"data.{spec.key}" if column == spec.id_column else spec.declared(column)
            raise DataFormatError(file, f"{key}: column {column!r} has type {kind}; expected {expected}")


def _id_type(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _side_part(spec: SideSpec, file: Path, columns: ColumnConfig) -> _Part:
    """One file of a side table: its id column as text, its declared features' values."""
    categorical = [c for k, c in spec.columns if "_dense." not in k]
    dense = {c for k, c in spec.columns if "_dense." in k}
    partition = len(spec.files) > 1
    if spec.suffix == ".csv":
        kinds = {c: "float" if c in dense else "list" if c in columns.list_features else "str" for _, c in spec.columns}
        layout = {spec.id_column: "str", **kinds}
        values = read_delimited(
            file, list(layout.items()), columns.delimiter, header="select", quoted=True, empty=partition
        )

        def bad_csv(name: str, row: int, message: str) -> DataFormatError:
            return table_csv_error(file, columns.delimiter, name, row, message)

        lists = {
            c: split_lists(values[c], columns.list_separator, functools.partial(bad_csv, c))
            for c in categorical
            if c in columns.list_features
        }
        return _Part(file, values, lists, None, bad_csv)
    try:
        table = pq.read_table(file, columns=spec.wanted())
    except (pa.ArrowInvalid, OSError) as error:
        raise unreadable_parquet(file, str(error)) from None
    if table.num_rows == 0 and not partition:
        raise DataFormatError(file, "no data rows (empty dataset)")
    values, lists = {}, {}
    for name in spec.wanted():
        column = table[name]
        if column.null_count:
            row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataFormatError(file, f"row {row + 1}: column {name!r} is null")
        if name in columns.list_features and name != spec.id_column:
            lists[name] = parquet_list(file, name, column, declared=True)
        else:
            values[name] = parquet_column(file, name, column, numeric=name in dense)

    def bad_parquet(name: str, row: int, message: str) -> DataFormatError:
        return table_parquet_error(file, name, row, message)

    return _Part(file, values, lists, None, bad_parquet)


def read_side_table(spec: SideSpec, columns: ColumnConfig) -> SideTable:
    """The side table ``spec`` (``check_side_tables`` checked it) -> one row per id (int64 ids when
    all are canonical integers, as the events' ids), its declared features as the events would give
    them. An id on two rows raises DataFormatError naming the file, the id column and the id."""
    part = _merged(spec.path, [_side_part(spec, file, columns) for file in spec.files])
    keys = as_ids(part.values[spec.id_column], functools.partial(part.bad, spec.id_column))
    order = np.argsort(keys, kind="stable")
    repeated = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    if len(repeated):
        row = int(order[1:][repeated].min())  # the first row repeating an earlier id
        raise part.bad(
            spec.id_column, row, f"id {keys[row].item()!r} is on an earlier row too (data.{spec.key}: one row per id)"
        )
    categorical = [c for k, c in spec.columns if k.startswith(f"{spec.side}_features")]
    rows = _row_table(part.values, part.lists, categorical, getattr(columns, f"{spec.side}_dense"))
    return SideTable(keys, rows.categorical, rows.dense, rows.dense_columns, rows.lists)


def read_side_tables(config: DataConfig) -> Dict[str, SideTable]:
    """{"users" | "items": its side table} of the side tables ``config`` names, checked first."""
    return {spec.key: read_side_table(spec, config.columns) for spec in check_side_tables(config)}


def side_table_summary(
    config: DataConfig, tables: Mapping[str, Optional[SideTable]], ids: Mapping[str, IdMap]
) -> Dict[str, Any]:
    """{"side_tables": {"users" | "items": {"path", "rows", "unused_rows", "ids_without_row"}}} of
    the side tables ``config`` names (``tables``: {"users" | "items": the side read}) against the
    dataset's ids ({"users" | "items": IdMap}): rows whose id the kept events lack (unused), ids
    without a row (their features unknown), each logged; {} without side tables. Text ids against
    the events' integer ids raise DataFormatError naming the file."""
    summary = {}
    for key, table in tables.items():
        side = config.side_table(key)
        if side is None or table is None:
            continue
        path = side.path
        if ids[key].raw.dtype.kind in "iu" and table.keys.dtype.kind == "U":
            raise DataFormatError(
                path,
                f"data.{key}: the ids of column {config.side_key(key)!r} are {id_kind(table.keys)} (e.g. "
                f"{table.keys[0].item()!r}), the events' {id_kind(ids[key].raw)}: no row would match",
            )
        found = ids[key].encode(table.keys, unknown=-1) >= 0
        known = int(found.sum())
        counts = {"rows": len(table.keys), "unused_rows": len(table.keys) - known}
        counts["ids_without_row"] = ids[key].cardinality - known
        summary[key] = {"path": path, **counts}
        if counts["ids_without_row"]:
            log.warning(
                "%s (data.%s): %d of %d %s have no row: their features are the unknown value",
                path,
                key,
                counts["ids_without_row"],
                ids[key].cardinality,
                key,
            )
        if counts["unused_rows"]:
            log.info(
                "%s (data.%s): %d rows for %s absent from the events, unused", path, key, counts["unused_rows"], key
            )
    return {SIDE_SUMMARY: summary} if summary else {}


# ---- registry ------------------------------------------------------------------------------


def _path(config: DataConfig) -> str:
    """``data.path`` of a source that reads files (``DataConfig`` requires it for those)."""
    if config.path is None:
        raise ValueError(f"data.path: required for data.source {config.source!r}")
    return config.path


READERS: Dict[str, Callable[[DataConfig], Interactions]] = {
    "synthetic": lambda c: generate_synthetic(c.synthetic, c.seed),
    "ml-100k": lambda c: read_ml_100k(_path(c), c.item_features, c.user_features, c.genres, c.release_year),
    "ml-1m": lambda c: read_ml_1m(_path(c), c.item_features, c.user_features, c.genres),
    "ml-20m": lambda c: read_ml_20m(_path(c), c.item_features, c.user_features, c.genres),
    "amazon": lambda c: read_amazon(_path(c)),
    "csv": lambda c: read_table_csv(_path(c), c.event_columns()),
    "parquet": lambda c: read_table_parquet(_path(c), c.event_columns()),
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
    if config.source in ("csv", "parquet"):
        source_files(path, f".{config.source}")
        check_side_tables(config)
    elif not path.exists():
        raise FileNotFoundError(f"data.path: {path}: no such file or directory (the {config.source} source)")
    return path


def read_source(config: DataConfig) -> Interactions:
    """The interactions ``config.source`` names (read from ``config.path``, or generated).

    Rows repeating an earlier row's (user, item, timestamp) are dropped and counted (a warning
    names how many) unless ``config.keep_duplicates``; ``Interactions.duplicates`` holds the count.
    The side tables ``data.users`` / ``data.items`` give the user / item side."""
    sides = read_side_tables(config)
    data = READERS[config.source](config).without_duplicates(drop=not config.keep_duplicates)
    data.user_side = sides.get("users", data.user_side)
    data.item_side = sides.get("items", data.item_side)
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
