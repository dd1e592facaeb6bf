"""Delimited text files in Spark, in file order, split by the rules of Python's csv module.

A row's place in its source is ORD = file index << ``FILE_BITS`` | line number (the record's first
line, from 1); Parquet sources use the row index instead. ``lines`` reads files as lines (Spark's text
source, split at "\\n" as the readers count lines). A line's number is its split's first line number
(the line counts of the file's earlier splits, ordered by ``_metadata.file_block_start``) plus its
position in the split (Spark's per-partition row id): never the order in which Spark schedules
partitions. A quoted CSV whose values span lines is read whole instead (``records``). ``fields``
splits a record, ``checked`` converts a field by ``read_delimited``'s kinds (``exact_seconds`` for
timestamps: numbers and ISO 8601 texts): all in Spark SQL, no Python function runs on the executors.
"""

from __future__ import annotations

import csv
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple
from urllib.parse import unquote, urlparse

from gr.data.config import ColumnConfig
from gr.data.interactions import DataFormatError
from gr.data.parsing import check_first_line
from gr.timestamps import ISO_TEXT_SQL

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

ORD, FILE = "_ord", "_file"
FILE_BITS = 40  # ORD = file index << FILE_BITS | line number (text, from 1) or row index (Parquet, from 0)
POSITION = (1 << FILE_BITS) - 1
INT_TEXT = r"^[ \t]*-?[0-9]+[ \t]*$"  # what the readers' integer parse takes (spaces and tabs around)
FLOAT_TEXT = r"^[ \t]*[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?[ \t]*$"
SECONDS_TEXT = r"^([-+]?)([0-9]*)(?:\.([0-9]*))?(?:[eE]([-+]?[0-9]+))?$"  # parsing.exact_seconds' forms
INTEGER_SECONDS = r"^-?[0-9]+$"
DECIMAL_SECONDS = r"^-?[0-9]+\.[0-9]{0,18}$"  # exact in decimal(38,18)
ISO_SECONDS = f"^{ISO_TEXT_SQL}$"  # parsing.exact_seconds' ISO 8601 texts
MAX_EXPONENT = 10**18  # a larger exponent leaves int64 (or floors to 0 or -1 alike)
RATINGS_ROLES = ("user", "item", "rating", "timestamp")  # a ratings file's columns (readers.RATINGS_FILES)


@dataclass(frozen=True)
class TextLayout:
    """Delimited text files read as ``parsing.read_delimited`` reads each: ``columns`` are (name, kind)
    pairs, the first four the user, item, rating and timestamp for a ratings file; a table CSV names
    its roles in ``table`` (and its ids become int64 when all are canonical integers)."""

    columns: Tuple[Tuple[str, str], ...]
    delimiter: str
    header: str = "none"
    quoted: bool = False
    table: Optional[ColumnConfig] = None

    def column(self, role: str) -> str:
        """The column of ``role``: "user" | "item" | "timestamp"."""
        found = self.table_column(role) if self.table is not None else self.columns[RATINGS_ROLES.index(role)][0]
        assert found is not None  # only the rating is optional
        return found

    def rating(self) -> Optional[str]:
        """The rating's column (None: the source has none)."""
        return self.table_column("rating") if self.table is not None else self.columns[2][0]

    def table_column(self, role: str) -> Optional[str]:
        return getattr(self.table, role)


def java_literal(text: str) -> str:
    """``text`` as a Java regex that matches it literally (each character as \\x{h})."""
    return "".join(f"\\x{{{ord(c):x}}}" for c in text)


def file_indices(uris: Sequence[str], files: Sequence[Path]) -> Dict[str, int]:
    """{URI as Spark's ``_metadata.file_path`` gives it: index in ``files``}."""
    position = {os.path.abspath(path): i for i, path in enumerate(files)}
    found = {}
    for uri in uris:
        local = os.path.abspath(unquote(urlparse(uri).path))
        if local not in position:
            raise RuntimeError(f"Spark read {uri}, not one of the source's files")
        found[uri] = position[local]
    return found


def lines(spark: SparkSession, files: Sequence[Path]) -> Tuple[DataFrame, List[int]]:
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
    splits = (
        frame.groupBy("uri", "block")
        .agg(F.count(F.lit(1)).alias("n"), F.min("row_id").alias("first"), F.max(quotes % 2).alias("odd"))
        .collect()
    )
    index = file_indices(sorted({r["uri"] for r in splits}), files)
    shifts = []
    before: Dict[int, int] = defaultdict(int)
    for row in sorted(splits, key=lambda r: (index[r["uri"]], r["block"])):
        file = index[row["uri"]]
        shifts.append((row["uri"], row["block"], file, (file << FILE_BITS) + before[file] + 1 - row["first"]))
        before[file] += row["n"]
    shift = spark.createDataFrame(shifts, f"uri string, block long, {FILE} long, shift long")
    numbered = frame.join(F.broadcast(shift), ["uri", "block"]).select(
        FILE,
        (F.col("row_id") + F.col("shift")).alias(ORD),
        F.regexp_replace("value", "\r+$", "").alias("text"),
    )
    return numbered, sorted({index[r["uri"]] for r in splits if r["odd"]})


def records(spark: SparkSession, files: Sequence[Path], indices: Sequence[int], delimiter: str) -> DataFrame:
    """The records of the quoted CSV ``files[i]`` for i in ``indices``, where a quoted value may span
    lines (as Python's csv reads them), as ``lines`` gives lines: FILE, ORD (from the record's first
    line number) and "text" (a record that runs to the end unparsed: the rest of the file). Each
    file is read whole, by one task."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    whole = spark.read.text([str(files[i]) for i in indices], wholetext=True)
    uris = file_indices([r[0] for r in whole.select("_metadata.file_path").collect()], files)
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
class FileLayout:
    """One file's header line number (0: none), fields per record, and each read column's position."""

    header_line: int
    fields: int
    positions: Tuple[int, ...]


def file_layouts(files: Sequence[Path], layout: TextLayout) -> List[FileLayout]:
    """Each file's ``FileLayout``, its first line checked as ``read_delimited`` checks it."""
    names = [name for name, _ in layout.columns]
    read = [i for i, (_, kind) in enumerate(layout.columns) if kind != "skip"]
    found = []
    for file in files:
        check_first_line(file, names, layout.delimiter, layout.header, "utf8", layout.quoted)
        if layout.header == "none":
            found.append(FileLayout(0, len(names), tuple(read)))
            continue
        line, header = _header(file, layout.delimiter, layout.quoted)
        found.append(FileLayout(line, len(header), tuple(header.index(names[i]) for i in read)))
    return found


def _header(file: Path, delimiter: str, quoted: bool) -> Tuple[int, List[str]]:
    """(line number, fields) of the first non-blank line of ``file``."""
    with open(file, "rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                text = [line.decode("utf8", errors="replace").rstrip("\r\n")]
                if quoted:
                    return number, next(csv.reader(text, delimiter=delimiter, quoting=csv.QUOTE_MINIMAL))
                return number, next(csv.reader(text, delimiter=delimiter, quoting=csv.QUOTE_NONE))
    raise DataFormatError(file, "empty file (empty dataset)")


def per_file(layouts: Sequence[FileLayout], value: Callable[[FileLayout], int]) -> Column:
    """The column: ``value`` of each row's file's layout (a literal when every file agrees)."""
    from pyspark.sql import functions as F

    groups: Dict[int, List[int]] = defaultdict(list)
    for i, layout in enumerate(layouts):
        groups[value(layout)].append(i)
    if len(groups) == 1:
        return F.lit(next(iter(groups)))
    (first, files), *others = groups.items()
    cases = F.when(F.col(FILE).isin(files), first)
    for result, files in others:
        cases = cases.when(F.col(FILE).isin(files), result)
    return cases


def _field_pattern(delimiter: str) -> str:
    """A Java regex of one quoted CSV field as Python's csv reads it: a field that starts with a
    quote runs to the closing quote ("" inside it is a quote, a line break may be too); any other
    field holds no delimiter and no line break."""
    d = java_literal(delimiter)
    return f'"(?:[^"]++|"")*+"|(?:[^"{d}\\n][^{d}\\n]*+)?'


def _record_pattern(delimiter: str) -> str:
    """A Java regex of one record of quoted fields (``_field_pattern``)."""
    field = _field_pattern(delimiter)
    return f"(?:{field})(?:{java_literal(delimiter)}(?:{field}))*"


def fields(text: Column, delimiter: str, quoted: bool) -> Tuple[Column, Column]:
    """(fields: array<string>, well_formed: boolean) of a record's ``text``, split as Python's csv
    splits it (``_field_pattern`` when ``quoted`` and the record holds a quote; else at each
    delimiter)."""
    from pyspark.sql import functions as F

    d = java_literal(delimiter)
    plain = F.split(text, F.lit(d), -1)
    if not quoted:
        return plain, F.lit(True)
    raw = F.regexp_extract_all(F.concat(F.lit(delimiter), text), F.lit(f"{d}({_field_pattern(delimiter)})"), 1)
    unquoted = F.transform(
        raw,
        lambda x: F.when(
            x.startswith('"'), F.regexp_replace(F.substring(x, F.lit(2), F.length(x) - 2), '""', '"')
        ).otherwise(x),
    )
    has_quotes = text.contains('"')
    well_formed = ~has_quotes | text.rlike(f"^{_record_pattern(delimiter)}\\z")
    return F.when(has_quotes, unquoted).otherwise(plain), well_formed


def finite(number: Column) -> Column:
    """Whether a double column is a finite number."""
    from pyspark.sql import functions as F

    return number.isNotNull() & ~F.isnan(number) & (F.abs(number) != float("inf"))


def checked(value: Column, kind: str, separator: str = "|") -> Tuple[Column, Column]:
    """(typed value, valid: boolean) of a text field of ``kind`` (``read_delimited``'s kinds, checked
    as it checks them: numbers may have spaces or tabs around them, text may not be empty, a list
    cell splits at ``separator``)."""
    from pyspark.sql import functions as F

    if kind == "int":
        number = F.trim(value, F.lit(" \t")).try_cast("long")
        return number, value.rlike(INT_TEXT) & number.isNotNull()
    if kind == "float":
        number = F.trim(value, F.lit(" \t")).try_cast("double")
        return number, value.rlike(FLOAT_TEXT) & finite(number)
    if kind == "time":
        seconds = exact_seconds(value)
        return seconds, seconds.isNotNull()
    if kind == "list":
        values = F.when(value == "", F.array().cast("array<string>")).otherwise(
            F.split(value, F.lit(java_literal(separator)), -1)
        )
        return values, value.isNotNull()
    return value, value.isNotNull() & (value != "")


def exact_seconds(text: Column) -> Column:
    """The column: ``gr.data.parsing.exact_seconds`` of a string column (null where it gives None),
    exactly: an integer as it is, a decimal of up to 18 places floored as a decimal, any other form
    (exponents, more places) floored digit by digit as text: no value passes through a float."""
    from pyspark.sql import functions as F

    integral = text.try_cast("long")
    places = F.floor(text.try_cast("decimal(38,18)")).try_cast("long")
    return (
        F.when(text.rlike(INTEGER_SECONDS), integral)
        .when(text.rlike(DECIMAL_SECONDS), places)
        .when(text.rlike(ISO_SECONDS), _iso_seconds(text))
        .otherwise(_floored_digits(text))
    )


def _iso_seconds(text: Column) -> Column:
    """``gr.timestamps.iso_text_seconds`` of a text matching ``ISO_SECONDS``: its fields' seconds from
    the civil date (the proleptic Gregorian calendar, years from 1) in integer arithmetic, null for an
    impossible date, time or offset."""
    from pyspark.sql import functions as F

    def part(index: int) -> Column:
        return F.coalesce(F.regexp_extract(text, ISO_SECONDS, index).try_cast("long"), F.lit(0).cast("long"))

    year, month, day, hour, minute, second = (part(k) for k in range(1, 7))
    sign, zone_hours, zone_minutes = F.regexp_extract(text, ISO_SECONDS, 8), part(9), part(10)
    leap = (year % 4 == 0) & ((year % 100 != 0) | (year % 400 == 0))
    days_in_month = F.when(month == 2, F.when(leap, 29).otherwise(28)).otherwise(30 + (month + F.floor(month / 8)) % 2)
    valid = (
        (year >= 1)
        & month.between(1, 12)
        & (day >= 1)
        & (day <= days_in_month)
        & (hour <= 23)
        & (minute <= 59)
        & (second <= 59)
        & (zone_hours <= 23)
        & (zone_minutes <= 59)
    )
    shifted = year - F.when(month <= 2, 1).otherwise(0)
    of_era = shifted % 400
    days = (
        F.floor(shifted / 400) * 146097
        + of_era * 365
        + F.floor(of_era / 4)
        - F.floor(of_era / 100)
        + F.floor((153 * ((month + 9) % 12) + 2) / 5)
        + day
        - 1
        - 719468
    )
    offset = F.when(sign == "-", -1).otherwise(1) * (zone_hours * 3600 + zone_minutes * 60)
    return F.when(valid, (days * 86400 + hour * 3600 + minute * 60 + second - offset).cast("long"))


def _floored_digits(text: Column) -> Column:
    """``exact_seconds`` of any form ``parsing.exact_seconds`` takes, its digits floored as text."""
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
