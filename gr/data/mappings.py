"""Raw id <-> dense id mappings, saved as readable TSV files beside a run."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from gr.atomic import atomic_file, write_json

MAPPINGS_FORMAT_VERSION = 1
MANIFEST = "mappings.json"


@dataclass
class IdMap:
    """raw: [K] sorted unique raw ids (int64 or str). ``raw[k]`` has dense id ``k + offset``;
    offset 1 keeps dense id 0 for "unknown" (used by categorical side features)."""

    raw: np.ndarray
    offset: int = 0

    def __post_init__(self) -> None:
        if len(self.raw) > 1 and not bool((self.raw[1:] > self.raw[:-1]).all()):
            raise ValueError("IdMap.raw: expected sorted unique raw ids")

    @classmethod
    def of(cls, values: np.ndarray, offset: int = 0) -> "IdMap":
        """The map of the distinct values of values: [N]."""
        return cls(np.unique(values), offset)

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
            index = np.minimum(np.searchsorted(self.raw, values), len(self.raw) - 1)
            found = self.raw[index] == values
        if unknown is None and not bool(found.all()):
            raise KeyError(f"ids not in the mapping: {values[~found][:5].tolist()}")
        return np.where(found, index + self.offset, -1 if unknown is None else unknown).astype(np.int64)

    def decode(self, dense: np.ndarray) -> np.ndarray:
        """dense: [N] int64 dense ids (>= offset) -> [N] raw ids."""
        return self.raw[np.asarray(dense) - self.offset]


def save_mappings(directory: str, maps: Mapping[str, IdMap], columns: Mapping[str, List[str]]) -> None:
    """Write ``<name>.tsv`` (``dense_id<TAB>raw_id``) per map, ``<name>.columns.tsv`` per dense
    feature (its column names) and the manifest ``mappings.json``; each file via temp + rename."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    manifest: Dict[str, object] = {"format_version": MAPPINGS_FORMAT_VERSION, "maps": {}, "columns": {}}
    for name, id_map in maps.items():
        rows = zip(range(id_map.offset, id_map.cardinality), id_map.raw.tolist())
        with atomic_file(root / f"{name}.tsv") as f:
            _write_tsv(f, ("dense_id", "raw_id"), rows)
        kind = "int" if id_map.raw.dtype.kind in "iu" else "str"
        manifest["maps"][name] = {"file": f"{name}.tsv", "raw_type": kind, "offset": id_map.offset}
    for name, names in columns.items():
        with atomic_file(root / f"{name}.columns.tsv") as f:
            _write_tsv(f, ("column", "name"), enumerate(names))
        manifest["columns"][name] = f"{name}.columns.tsv"
    write_json(root / MANIFEST, manifest)


def _write_tsv(f, header: Tuple[str, str], rows) -> None:
    writer = csv.writer(f, delimiter="\t", lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)


def load_mappings(directory: str) -> Tuple[Dict[str, IdMap], Dict[str, List[str]]]:
    """Read what ``save_mappings`` wrote -> ({name: IdMap}, {dense feature: column names})."""
    root = Path(directory)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path}: missing file (written by save_mappings)")
    manifest = json.loads(manifest_path.read_text(encoding="utf8"))
    version = manifest.get("format_version")
    if version != MAPPINGS_FORMAT_VERSION:
        raise ValueError(f"{manifest_path}: format_version {version!r} is not {MAPPINGS_FORMAT_VERSION}")
    maps = {}
    for name, entry in manifest["maps"].items():
        rows = _read_tsv(root / entry["file"], ("dense_id", "raw_id"))
        raw = [r[1] for r in rows]
        dense = [int(r[0]) for r in rows]
        offset = int(entry["offset"])
        if dense != list(range(offset, offset + len(rows))):
            raise ValueError(f"{root / entry['file']}: dense ids must run from {offset} without gaps")
        maps[name] = IdMap(np.asarray(raw, dtype=np.int64 if entry["raw_type"] == "int" else str), offset)
    columns = {
        name: [r[1] for r in _read_tsv(root / file, ("column", "name"))] for name, file in manifest["columns"].items()
    }
    return maps, columns


def _read_tsv(path: Path, header: Tuple[str, str]) -> List[List[str]]:
    with open(path, newline="", encoding="utf8") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    if not rows or tuple(rows[0]) != header:
        raise ValueError(f"{path}:1: expected the header {'<TAB>'.join(header)!r}")
    return rows[1:]
