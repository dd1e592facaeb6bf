"""Raw id <-> dense id mappings, saved as readable TSV files beside a run."""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from gr.utils.atomic import atomic_file, write_json

MAPPINGS_FORMAT_VERSION = 1
MANIFEST = "mappings.json"
RAW_TYPES = ("int", "str")
INT_ID = re.compile(r"-?\d+")
INT64_MIN, INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


@dataclass
class IdMap:
    """raw: [K] unique raw ids (int64 or str), in dense id order: ``raw[k]`` has dense id
    ``k + offset``; offset 1 keeps dense id 0 for "unknown" (used by categorical side features).
    A map built from data has its raw ids sorted; one ``extended`` by later data keeps its rows
    and appends the new ids (sorted among themselves). source: the file it was read from ("" for
    a map built in memory), for messages."""

    raw: np.ndarray
    offset: int = 0
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        self._order: Optional[np.ndarray] = None  # argsort of raw when it is not sorted
        self._sorted = self.raw
        if len(self.raw) > 1 and not bool((self.raw[1:] > self.raw[:-1]).all()):
            self._order = np.argsort(self.raw, kind="stable")
            self._sorted = self.raw[self._order]
            if not bool((self._sorted[1:] > self._sorted[:-1]).all()):
                raise ValueError("IdMap.raw: expected unique raw ids")

    @classmethod
    def of(cls, values: np.ndarray, offset: int = 0) -> "IdMap":
        """The map of the distinct values of values: [N]."""
        return cls(np.unique(values), offset)

    def extended(self, values: np.ndarray, column: str = "the new ids") -> "IdMap":
        """This map with the distinct ``values`` it lacks appended (sorted), so every known raw id
        keeps its dense id. column: where ``values`` come from (e.g. "FILE: column 'item_id'"),
        named when they are not of the map's kind (integers, strings): ValueError in one line."""
        values = np.unique(np.asarray(values))
        self.check_kind(values, column, "; new ids extend a map only when they are of its kind")
        new = values[self.encode(values, unknown=-1) < 0]
        if not len(new):
            return self
        return IdMap(np.concatenate([self.raw, new.astype(self.raw.dtype)]) if len(self.raw) else new, self.offset)

    def check_kind(self, values: np.ndarray, column: str, why: str = "") -> None:
        """ValueError in one line naming ``column`` (where ``values``, [N] raw ids, come from) when
        they are not of this map's kind (integers, strings); ``why`` ends the message."""
        if len(values) and len(self.raw) and id_kind(values) != id_kind(self.raw):
            raise ValueError(
                f"{column}: the data's ids are {id_kind(values)}, those of {self.source or 'the map'} (the "
                f"model's) are {id_kind(self.raw)}{why}"
            )

    @property
    def cardinality(self) -> int:
        """Number of dense ids (unknown included)."""
        return len(self.raw) + self.offset

    def encode(self, values: np.ndarray, unknown: Optional[int] = None) -> np.ndarray:
        """values: [N] raw ids -> [N] int64 dense ids. Ids not in the map become ``unknown``,
        or raise KeyError when ``unknown`` is None."""
        values = np.asarray(values)
        if len(self.raw) == 0:
            found = np.zeros(len(values), dtype=bool)
            index = np.zeros(len(values), dtype=np.int64)
        else:
            if self.raw.dtype.kind != values.dtype.kind:
                values = values.astype(self.raw.dtype)
            index = np.minimum(np.searchsorted(self._sorted, values), len(self.raw) - 1)
            found = self._sorted[index] == values
            if self._order is not None:
                index = self._order[index]
        if unknown is None and not bool(found.all()):
            raise KeyError(f"ids not in the mapping: {values[~found][:5].tolist()}")
        return np.where(found, index + self.offset, -1 if unknown is None else unknown).astype(np.int64)

    def decode(self, dense: np.ndarray) -> np.ndarray:
        """dense: [N] int64 dense ids (>= offset) -> [N] raw ids."""
        return self.raw[np.asarray(dense) - self.offset]


def id_kind(raw: np.ndarray) -> str:
    """The kind of raw ids ``raw`` ([N]) in words: "integers", "strings" (else its dtype)."""
    return {"i": "integers", "u": "integers", "U": "strings"}.get(raw.dtype.kind, str(raw.dtype))


def save_mappings(directory: str, maps: Mapping[str, IdMap], columns: Mapping[str, List[str]]) -> None:
    """Write ``<name>.tsv`` (``dense_id<TAB>raw_id``) per map, ``<name>.columns.tsv`` per dense
    feature (its column names) and the manifest ``mappings.json``; each file via temp + rename."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    map_entries: Dict[str, Dict[str, object]] = {}
    column_files: Dict[str, str] = {}
    manifest = {"format_version": MAPPINGS_FORMAT_VERSION, "maps": map_entries, "columns": column_files}
    for name, id_map in maps.items():
        rows = zip(range(id_map.offset, id_map.cardinality), id_map.raw.tolist())
        returns = id_map.raw.dtype.kind == "U" and bool((np.char.find(id_map.raw, "\r") >= 0).any())
        with atomic_file(root / f"{name}.tsv") as f:
            _write_tsv(f, ("dense_id", "raw_id"), rows, returns)
        kind = "int" if id_map.raw.dtype.kind in "iu" else "str"
        map_entries[name] = {"file": f"{name}.tsv", "raw_type": kind, "offset": id_map.offset}
    for name, names in columns.items():
        with atomic_file(root / f"{name}.columns.tsv") as f:
            _write_tsv(f, ("column", "name"), enumerate(names), any("\r" in n for n in names))
        column_files[name] = f"{name}.columns.tsv"
    write_json(root / MANIFEST, manifest)


def _write_tsv(f, header: Tuple[str, str], rows, carriage_returns: bool) -> None:
    """carriage_returns: whether a field holds "\\r"; every field is then quoted (the writer quotes
    only the line terminator's characters, and a reader ends a line at a bare "\\r")."""
    if carriage_returns:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n", quoting=csv.QUOTE_ALL)
    else:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)


def load_mappings(directory: str) -> Tuple[Dict[str, IdMap], Dict[str, List[str]]]:
    """Read what ``save_mappings`` wrote -> ({name: IdMap}, {dense feature: column names}).

    Every loader of id maps (training's, an export's) goes through here, so each refuses the same
    files: ValueError naming the file and line (or manifest key) of the first problem: an unknown
    format, dense ids that do not run from the offset without gaps, an int raw id that is not an
    int64, a raw id that repeats an earlier one. Raw ids need not be sorted (``IdMap.extended``)."""
    root = Path(directory)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path}: missing file (written by save_mappings)")
    manifest = json.loads(manifest_path.read_text(encoding="utf8"))
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != MAPPINGS_FORMAT_VERSION:
        raise ValueError(f"{manifest_path}: format_version {version!r} is not {MAPPINGS_FORMAT_VERSION}")
    maps = {}
    for name, entry in _entries(manifest_path, manifest, "maps").items():
        file, kind, offset = (_field(manifest_path, f"maps.{name}", entry, k) for k in ("file", "raw_type", "offset"))
        if kind not in RAW_TYPES or not isinstance(offset, int) or offset < 0:
            raise ValueError(
                f"{manifest_path}: maps.{name}: expected raw_type one of {list(RAW_TYPES)} and an offset >= 0, "
                f"got {kind!r} and {offset!r}"
            )
        if not isinstance(file, str):
            raise ValueError(f"{manifest_path}: maps.{name}: expected a file name, got {file!r}")
        maps[name] = _read_map(root / file, kind, offset)
    columns = {
        name: [r[1] for _, r in _read_tsv(root / file, ("column", "name"))]
        for name, file in _entries(manifest_path, manifest, "columns").items()
    }
    return maps, columns


def model_maps(directory: str) -> Dict[str, IdMap]:
    """The maps of ``load_mappings`` that name a model's rows ({"items"|feature: IdMap}): all but
    "users", whose ids have no rows (each dataset's own map)."""
    maps, _ = load_mappings(directory)
    maps.pop("users", None)
    return maps


def _entries(path: Path, manifest: dict, key: str) -> dict:
    entries = manifest.get(key, {})
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: {key}: expected an object, got {type(entries).__name__}")
    return entries


def _field(path: Path, where: str, entry: object, key: str) -> object:
    if not isinstance(entry, dict) or key not in entry:
        raise ValueError(f"{path}: {where}.{key}: missing")
    return entry[key]


def _read_map(path: Path, kind: str, offset: int) -> IdMap:
    """One ``<name>.tsv`` -> IdMap, refusing what ``load_mappings`` lists (the file and line named).
    A file with nothing to refuse and no quoted field is read in bulk; any other goes line by line."""
    values = _bulk_map_values(path, kind, offset)
    if values is not None:
        try:
            return IdMap(values, offset, str(path))
        except ValueError:  # a repeated raw id: the line-by-line reader names both lines
            pass
    return _read_map_by_line(path, kind, offset)


def _bulk_map_values(path: Path, kind: str, offset: int) -> Optional[np.ndarray]:
    """The raw ids of a ``<name>.tsv`` read at once (pyarrow), or None when the file quotes a field
    or anything is amiss (the line-by-line reader then names it): the same ids as that reader's.
    Repeated raw ids are left to ``IdMap`` to find."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from pyarrow import csv as pa_csv

    data = path.read_bytes()
    if b'"' in data or b"\r" in data:
        return None
    try:
        table = pa_csv.read_csv(
            pa.BufferReader(data),
            read_options=pa_csv.ReadOptions(column_names=["dense_id", "raw_id"]),
            parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False),
            convert_options=pa_csv.ConvertOptions(
                column_types={"dense_id": pa.string(), "raw_id": pa.string()}, strings_can_be_null=False
            ),
        )
    except (pa.ArrowInvalid, UnicodeDecodeError):
        return None
    dense, raw = table.column("dense_id"), table.column("raw_id")
    if len(dense) == 0 or (dense[0].as_py(), raw[0].as_py()) != ("dense_id", "raw_id"):
        return None
    dense, raw = dense.slice(1), raw.slice(1)
    expected = np.arange(offset, offset + len(dense), dtype=np.int64)
    digits = np.searchsorted(10 ** np.arange(1, 19, dtype=np.int64), expected, side="right") + 1
    try:
        if not (
            np.array_equal(pc.cast(dense, pa.int64()).to_numpy(), expected)
            and np.array_equal(pc.utf8_length(dense).to_numpy(), digits)  # canonical: no sign, no leading 0
        ):
            return None
        if kind == "int":
            if not pc.all(pc.match_substring_regex(raw, f"^(?:{INT_ID.pattern})$")).as_py():
                return None
            values = pc.cast(raw, pa.int64()).to_numpy()
        else:
            values = np.asarray(raw.to_numpy(zero_copy_only=False), dtype=str)
    except pa.ArrowInvalid:  # an int raw id past int64
        return None
    return values


def _read_map_by_line(path: Path, kind: str, offset: int) -> IdMap:
    rows = _read_tsv(path, ("dense_id", "raw_id"))
    raw: List[object] = []
    for i, (line, fields) in enumerate(rows):
        if len(fields) != 2 or fields[0] != str(offset + i):
            raise ValueError(
                f"{path}:{line}: expected dense_id {offset + i}<TAB>raw_id (dense ids run from {offset} "
                f"without gaps), got {fields!r}"
            )
        if kind == "int" and not (INT_ID.fullmatch(fields[1]) and INT64_MIN <= int(fields[1]) <= INT64_MAX):
            raise ValueError(f"{path}:{line}: raw_id: expected an int64 (raw_type int), got {fields[1]!r}")
        raw.append(int(fields[1]) if kind == "int" else fields[1])
    values = np.asarray(raw, dtype=np.int64 if kind == "int" else str)
    if len(values) > 1:
        _, first, counts = np.unique(values, return_index=True, return_counts=True)
        if (counts > 1).any():
            repeat = int(np.flatnonzero(values == values[first[counts > 1][0]])[1])
            original = int(first[counts > 1][0])
            raise ValueError(
                f"{path}:{rows[repeat][0]}: raw_id {raw[repeat]!r} repeats line {rows[original][0]} "
                "(each raw id maps to one dense id)"
            )
    return IdMap(values, offset, str(path))


def _read_tsv(path: Path, header: Tuple[str, str]) -> List[Tuple[int, List[str]]]:
    """[(line number, fields), ...] of the rows below ``header``."""
    with open(path, newline="", encoding="utf8") as f:
        reader = csv.reader(f, delimiter="\t")
        rows, line = [], 1
        for fields in reader:
            rows.append((line, fields))
            line = reader.line_num + 1
    if not rows or tuple(rows[0][1]) != header:
        raise ValueError(f"{path}:1: expected the header {'<TAB>'.join(header)!r}")
    return rows[1:]
