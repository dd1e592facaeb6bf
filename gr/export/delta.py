"""Delta exports: what changed between two exports of one model, checked as a chain and squashed
back into a full export (docs/export_format.md, "Delta exports").

A delta directory holds::

    delta.json                        format, the base export's identity ("base": the sha256 of its
                                      MANIFEST), the full export it makes ("manifest": {file: sha256},
                                      whose MANIFEST's sha256 is the next delta's base), its tables
                                      (rows, dim, the base's rows, rows written) and files
    sparse/<table>.delta.safetensors  "ids" [n] int64 ascending, "rows" [n, dim] float32: the rows that
                                      differ, bit for bit, from the base's, and every row past them
                                      (a grown vocabulary)
    <file>                            every other file that differs from the base's, whole
                                      ("whole": the dense slices, sparse.ini, source.json, ...), or the
                                      lines an id map adds to the base's ("append"; a map of table
                                      rows must extend the base's, another one may be rewritten whole)
    MANIFEST                          sha256 of the delta's own files (``gr.export.manifest``)

A chain is a full export followed by deltas, each naming the export before it. Imports no training
code: ``gr check`` and the serving runtime read deltas through this module.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from safetensors.numpy import load_file
from safetensors.numpy import save as safetensors_bytes

from gr.data.mappings import IdMap
from gr.export.format import (
    HSTU_CONFIG,
    HSTU_WEIGHTS,
    ID_MAPS_DIR,
    SLICE_GRAPH,
    SPARSE_DIR,
    SPARSE_INI,
    TABLE_TENSOR,
    ExportFormatError,
    Problem,
    read_ini,
    read_safetensors,
)
from gr.export.manifest import MANIFEST, inside, manifest_text, read_manifest, text_sha256, write_manifest
from gr.export.reader import check_export
from gr.export.sparse_manifest import SparseManifest
from gr.utils.atomic import atomic_directory, write_bytes, write_json
from gr.utils.checksums import file_sha256

DELTA = "delta.json"
DELTA_FORMAT, DELTA_VERSION = "gr-delta", 1
IDS, ROWS = "ids", "rows"  # the tensors of a table's delta file
WHOLE, APPEND = "whole", "append"  # how a delta carries a file: the new file, or the lines added to the base's
TABLE_SUFFIX = ".delta.safetensors"
HSTU_FILES = (HSTU_CONFIG, HSTU_WEIGHTS)  # carried together: a delta's hstu/ loads as the HSTU slice alone
PathLike = Union[str, Path]


@dataclass(frozen=True)
class TableDelta:
    """One table's entry of ``delta.json``: ``rows`` x ``dim`` after the delta, ``base_rows``
    before it, ``changed`` rows written in ``file`` (relative to the delta)."""

    name: str
    file: str
    rows: int
    dim: int
    base_rows: int
    changed: int


@dataclass(frozen=True)
class Delta:
    """A parsed delta directory (``read_delta``)."""

    root: Path
    base: str  # sha256 of the base export's MANIFEST
    manifest: Dict[str, str]  # {file: sha256} of the full export this delta makes
    tables: Dict[str, TableDelta]
    files: Dict[str, str]  # {file: WHOLE | APPEND}
    removed: Tuple[str, ...]

    @property
    def target(self) -> str:
        """The identity of the export this delta makes: the sha256 of its MANIFEST."""
        return text_sha256(manifest_text(self.manifest))

    def table_rows(self, name: str) -> Tuple[np.ndarray, np.ndarray]:
        """Table ``name``'s changed rows: (ids [n] int64 ascending, rows [n, dim] float32)."""
        tensors = load_file(str(self.root / self.tables[name].file))
        return tensors[IDS], tensors[ROWS]


def is_delta(path: PathLike) -> bool:
    """Whether ``path`` is a delta directory (it holds ``delta.json``), not a full export."""
    return (Path(path) / DELTA).is_file()


def export_identity(root: Path) -> str:
    """A full export's identity, as a delta names its base: the sha256 of its MANIFEST."""
    return file_sha256(root / MANIFEST)


# ---- writing ------------------------------------------------------------------------------
def write_delta(
    base: PathLike, full: PathLike, out: Path, touched: Optional[Mapping[str, np.ndarray]] = None
) -> Dict[str, Any]:
    """Write into the empty directory ``out`` the delta that turns export ``base`` into export
    ``full`` (both checked: ``ExportFormatError`` otherwise) -> the summary kept in ``delta.json``.

    touched: {table: [n] int64 ids}, the rows training updated since ``base`` was taken
    (``gr.sparse.touched``): only those rows of such a table are read, from both exports, and
    the ones whose bits differ are written (with the rows past the base's); the delta is the
    one comparing whole tables makes, provided no other row changed. A table it does not name
    is compared whole.

    Raises ValueError in one line naming what differs when ``full`` is not a later version of
    ``base``'s model: another table set or dim, another request schema or slices
    (``slice_graph.ini``), another HSTU configuration, a table that shrank, or an id map that does
    not extend the base's (known ids renumbered: a run not warm-started from the base's)."""
    base, full = Path(base), Path(full)
    base_files, full_files = _checked_export(base), _checked_export(full)
    base_sparse, full_sparse = read_sparse_manifest(base), read_sparse_manifest(full)
    _refuse_another_model(base, full, base_sparse, full_sparse)
    tables: Dict[str, Dict[str, Any]] = {}
    table_files = {f"{SPARSE_DIR}/{t.file}" for t in full_sparse.tables.values()}
    for name, table in full_sparse.tables.items():
        base_file, full_file = base / SPARSE_DIR / base_sparse.tables[name].file, full / SPARSE_DIR / table.file
        base_rows = base_sparse.tables[name].rows
        if touched is not None and name in touched:
            candidates = np.unique(touched[name][touched[name] < base_rows])
            old_rows, new_rows = table_rows_at(base_file, candidates), table_rows_at(full_file, candidates)
            differ = (old_rows.view(np.uint32) != new_rows.view(np.uint32)).any(axis=1)
            ids = np.concatenate([candidates[differ], np.arange(base_rows, table.rows)]).astype(np.int64)
            rows = table_rows_at(full_file, ids)
        else:
            old = load_file(str(base_file))[TABLE_TENSOR]
            new = load_file(str(full_file))[TABLE_TENSOR]
            ids = changed_rows(old, new)
            rows = np.ascontiguousarray(new[ids])
        file = f"{SPARSE_DIR}/{name}{TABLE_SUFFIX}"
        (out / SPARSE_DIR).mkdir(exist_ok=True)
        write_bytes(out / file, safetensors_bytes({IDS: ids, ROWS: rows}))
        tables[name] = {"file": file, "rows": table.rows, "dim": table.dim, "base_rows": base_rows, "changed": len(ids)}
    files: Dict[str, str] = {}
    row_maps = {f"{SPARSE_DIR}/{f.id_mapping}" for f in full_sparse.features.values() if f.id_mapping is not None}
    hstu_changed = any(base_files.get(rel) != full_files.get(rel) for rel in HSTU_FILES)
    for rel, digest in sorted(full_files.items()):
        if rel in table_files or (base_files.get(rel) == digest and not (hstu_changed and rel in HSTU_FILES)):
            continue
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        data = (full / rel).read_bytes()
        known = (base / rel).read_bytes() if rel in base_files and rel.startswith(f"{ID_MAPS_DIR}/") else None
        if known is not None and rel in row_maps and not data.startswith(known):
            raise ValueError(
                f"{full / rel}: this id map does not extend {base / rel} (known ids renumbered): the run "
                f"is not a warm start of the base export's run, so no delta of it applies to {base}"
            )
        if known is not None and rel.endswith(".tsv") and data.startswith(known):
            files[rel], data = APPEND, data[len(known) :]
        else:
            files[rel] = WHOLE
        write_bytes(out / rel, data)
    summary = {
        "format": DELTA_FORMAT,
        "version": DELTA_VERSION,
        "base": export_identity(base),
        "manifest": full_files,
        "tables": tables,
        "files": files,
        "removed": sorted(set(base_files) - set(full_files) - table_files),
    }
    write_json(out / DELTA, summary)
    write_manifest(out)
    return summary


def changed_rows(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """old: [R0, d], new: [R, d] float32 (R >= R0) -> [n] int64 ascending: the rows of ``new``
    whose bits differ from ``old``'s (-0.0 and 0.0 differ too) and every row past R0."""
    known = len(old)
    differ = np.flatnonzero((old.view(np.uint32) != new[:known].view(np.uint32)).any(axis=1))
    return np.concatenate([differ, np.arange(known, len(new))]).astype(np.int64)


def table_rows_at(path: Path, ids: np.ndarray) -> np.ndarray:
    """ids: [n] int64 -> [n, d] float32: those rows of the table an export's table file holds
    (``TABLE_TENSOR``, float32 as ``check_export`` verified), read through a map of the file:
    the other rows are never read."""
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        entry = json.loads(handle.read(size))[TABLE_TENSOR]
    start = 8 + size + int(entry["data_offsets"][0])
    table = np.memmap(path, dtype=np.float32, mode="r", offset=start, shape=tuple(entry["shape"]))
    return np.ascontiguousarray(table[ids])


def _checked_export(root: Path) -> Dict[str, str]:
    """A full export's {file: sha256} after ``check_export``; ExportFormatError otherwise."""
    if is_delta(root):
        raise ValueError(f"{root}: a delta export; give the full export it applies to (or squash the chain first)")
    problems = check_export(root)
    if problems:
        raise ExportFormatError([Problem(f"{root}/{p.file}", p.key, p.message) for p in problems])
    listed = read_manifest(root, problems)
    assert listed is not None  # check_export verified it
    return listed


def read_sparse_manifest(root: Path) -> SparseManifest:
    """An export's ``sparse/sparse.ini``, parsed; ExportFormatError naming what does not parse."""
    problems: List[Problem] = []
    parser = read_ini(root, SPARSE_INI, problems)
    sparse = None if parser is None else SparseManifest.from_ini(parser, problems)
    if sparse is None:
        raise ExportFormatError(problems)
    return sparse


def _refuse_another_model(base: Path, full: Path, old: SparseManifest, new: SparseManifest) -> None:
    """ValueError naming the first difference that makes ``full`` another model than ``base``."""
    why = ""
    if sorted(old.tables) != sorted(new.tables):
        why = f"{SPARSE_INI}: tables {sorted(new.tables)} here, {sorted(old.tables)} in the base"
    elif old.features != new.features:
        changed = sorted(n for n in set(old.features) | set(new.features) if old.features.get(n) != new.features.get(n))
        why = f"{SPARSE_INI}: features {changed} differ (table, kind, pooling or id map)"
    else:
        for name, table in new.tables.items():
            was = old.tables[name]
            if table.dim != was.dim:
                why = f"{SPARSE_INI}: table.{name}.dim {table.dim} here, {was.dim} in the base"
            elif table.rows < was.rows:
                why = (
                    f"{SPARSE_INI}: table.{name}.rows {table.rows} here, {was.rows} in the base (a table never shrinks)"
                )
            if why:
                break
    if not why:
        old_hstu, new_hstu = (json.loads((root / HSTU_CONFIG).read_text()) for root in (base, full))
        keys = sorted(k for k in set(old_hstu) | set(new_hstu) if old_hstu.get(k) != new_hstu.get(k))
        if keys:
            differ = (f"{k} {new_hstu.get(k)!r} here, {old_hstu.get(k)!r} in the base" for k in keys)
            why = f"{HSTU_CONFIG}: {', '.join(differ)}"
        elif (base / SLICE_GRAPH).read_bytes() != (full / SLICE_GRAPH).read_bytes():
            why = f"{SLICE_GRAPH} differs: another request schema or other slices"
    if why:
        raise ValueError(f"{full} is another model than the base export {base} ({why}): no delta between them")


# ---- reading and checking -----------------------------------------------------------------
def read_delta(root: Path, problems: List[Problem]) -> Optional[Delta]:
    """A delta directory, its MANIFEST, ``delta.json`` and table files checked; None (problems
    added, each naming the file and key) where any does not hold."""
    start = len(problems)
    own = read_manifest(root, problems)
    if own is None:
        return None
    try:
        values = json.loads((root / DELTA).read_text(encoding="utf8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        problems.append(Problem(DELTA, "-", f"not valid JSON: {exc}"))
        return None
    if not isinstance(values, dict) or (values.get("format"), values.get("version")) != (DELTA_FORMAT, DELTA_VERSION):
        problems.append(Problem(DELTA, "format", f"expected format {DELTA_FORMAT!r} version {DELTA_VERSION}"))
        return None
    base, manifest, files = values.get("base"), values.get("manifest"), values.get("files")
    if not _is_digest(base):
        problems.append(Problem(DELTA, "base", f"expected the base MANIFEST's sha256, got {base!r}"))
    if not isinstance(manifest, dict) or not all(_is_digest(d) for d in manifest.values()):
        problems.append(Problem(DELTA, "manifest", "expected {file: sha256} of the export it makes"))
        manifest = {}
    if not isinstance(files, dict) or any(kind not in (WHOLE, APPEND) for kind in files.values()):
        problems.append(Problem(DELTA, "files", f"expected {{file: {WHOLE!r} | {APPEND!r}}}"))
        files = {}
    for rel, kind in files.items():
        if inside(root, rel, DELTA, f"files.{rel}", problems) is None:
            continue
        if rel not in manifest:
            problems.append(Problem(DELTA, f"files.{rel}", "not a file of the export it makes (manifest)"))
        elif kind == WHOLE and own.get(rel) != manifest[rel]:
            problems.append(
                Problem(rel, "-", f"sha256 differs from {DELTA}'s manifest: not the file of the export it makes")
            )
    tables = _read_tables(root, values.get("tables"), problems)
    removed = values.get("removed", [])
    if not isinstance(removed, list) or not all(isinstance(r, str) for r in removed):
        problems.append(Problem(DELTA, "removed", "expected a list of files"))
        removed = []
    if len(problems) > start:
        return None
    return Delta(root, str(base), dict(manifest), tables, dict(files), tuple(removed))


def _read_tables(root: Path, entries: Any, problems: List[Problem]) -> Dict[str, TableDelta]:
    if not isinstance(entries, dict):
        problems.append(Problem(DELTA, "tables", "expected {table: {file, rows, dim, base_rows, changed}}"))
        return {}
    tables = {}
    for name, entry in entries.items():
        key = f"tables.{name}"
        try:
            table = TableDelta(
                name, str(entry["file"]), *(int(entry[k]) for k in ("rows", "dim", "base_rows", "changed"))
            )
        except (TypeError, KeyError, ValueError):
            problems.append(Problem(DELTA, key, "expected file, rows, dim, base_rows and changed"))
            continue
        if inside(root, table.file, DELTA, f"{key}.file", problems) is None:
            continue
        read = read_safetensors(root, table.file, problems)
        if read is None:
            continue
        ids, rows = read[1].get(IDS), read[1].get(ROWS)
        expected = (
            f"{IDS!r} [{table.changed}] int64 ascending in [0, {table.rows}) and "
            f"{ROWS!r} [{table.changed}, {table.dim}] float32"
        )
        if (
            ids is None
            or rows is None
            or ids.dtype != np.int64
            or rows.dtype != np.float32
            or ids.shape != (table.changed,)
            or rows.shape != (table.changed, table.dim)
            or (len(ids) and (ids[0] < 0 or ids[-1] >= table.rows or bool((np.diff(ids) <= 0).any())))
            or not 0 <= table.rows - table.base_rows <= len(ids)
            or not np.array_equal(
                ids[len(ids) - (table.rows - table.base_rows) :], np.arange(table.base_rows, table.rows)
            )
        ):
            problems.append(Problem(table.file, "-", f"expected {expected}, every row past base_rows included"))
        elif not np.isfinite(rows).all():
            problems.append(Problem(table.file, ROWS, "holds NaN or infinite values"))
        else:
            tables[name] = table
    return tables


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def check_chain(paths: Sequence[PathLike]) -> List[Problem]:
    """Every problem of a chain: a full export, then deltas in order, each applying to the export
    before it (its ``base`` is that export's identity). A delta of another base, one missing from
    the chain and deltas out of order are named; so is a chain that does not start with a full
    export. Problems name the directory."""
    _, problems = _read_chain([Path(p) for p in paths])
    return problems


def open_chain(paths: Sequence[PathLike]) -> Tuple[Path, List[Delta]]:
    """(the full export, its deltas in order) of a valid chain; ExportFormatError otherwise."""
    read, problems = _read_chain([Path(p) for p in paths])
    if problems or read is None:
        raise ExportFormatError(problems)
    return read


def chain_deltas(identity: str, paths: Sequence[PathLike]) -> List[Delta]:
    """Deltas that apply, in order, to the export whose identity (its MANIFEST's sha256) is
    ``identity`` (a running service's model); ExportFormatError naming the first that does not."""
    deltas: List[Delta] = []
    for path in map(Path, paths):
        problems: List[Problem] = []
        if not is_delta(path):
            problems.append(Problem(DELTA, "-", "file is missing: not a delta (a full export reloads alone)"))
        delta = read_delta(path, problems) if not problems else None
        if delta is not None:
            _link(identity, delta, f"the serving model ({identity[:12]})", problems)
        if problems:
            raise ExportFormatError([Problem(f"{path}/{p.file}", p.key, p.message) for p in problems])
        assert delta is not None  # read without problems
        deltas.append(delta)
        identity = delta.target
    return deltas


def _read_chain(paths: List[Path]) -> Tuple[Optional[Tuple[Path, List[Delta]]], List[Problem]]:
    problems: List[Problem] = []
    if not paths:
        return None, [Problem("-", "-", "an empty chain: give a full export, then its deltas")]
    for path in paths:
        if not path.is_dir():
            problems.append(Problem(str(path), "-", "no such export directory"))
    if problems:
        return None, problems
    base, *rest = paths
    if is_delta(base):
        return None, [
            Problem(
                f"{base}/{DELTA}", "base", "the chain starts with a delta: give the full export it applies to first"
            )
        ]
    problems.extend(Problem(f"{base}/{p.file}", p.key, p.message) for p in check_export(base))
    identity, before = (export_identity(base) if not problems else ""), str(base)
    deltas = []
    for path in rest:
        found: List[Problem] = []
        if not is_delta(path):
            found.append(Problem(f"{path}/{DELTA}", "-", "file is missing: a full export in the middle of a chain"))
            delta = None
        else:
            delta = read_delta(path, found)
        if delta is not None and identity:
            _link(identity, delta, f"{before} ({identity[:12]})", found)
        problems.extend(Problem(f"{path}/{p.file}", p.key, p.message) for p in found)
        if delta is None:
            identity = ""
            continue
        deltas.append(delta)
        identity, before = delta.target, str(path)
    return ((base, deltas) if not problems else None), problems


def _link(identity: str, delta: Delta, before: str, problems: List[Problem]) -> None:
    if delta.base != identity:
        problems.append(
            Problem(
                DELTA,
                "base",
                f"applies to the export {delta.base[:12]}, not to {before}: a delta missing before it, "
                "deltas out of order, or a delta of another export",
            )
        )


# ---- squashing -----------------------------------------------------------------------------
def squash(paths: Sequence[PathLike], out: PathLike, *, overwrite: bool = False) -> Path:
    """Write the full export a chain (a full export, then its deltas) makes to ``out``, atomically:
    bit for bit the full export the last delta was made from. ExportFormatError for a chain
    ``check_chain`` refuses, or a result whose files differ from what the last delta names."""
    base, deltas = open_chain(paths)
    out = Path(out)
    with atomic_directory(out, command="gr export --squash", overwrite=overwrite) as tmp:
        shutil.copytree(base, tmp, dirs_exist_ok=True)
        (tmp / MANIFEST).unlink()
        tables: Dict[str, np.ndarray] = {}
        sparse = read_sparse_manifest(tmp)
        for delta in deltas:
            for name, table in delta.tables.items():
                weight = tables.get(name)
                if weight is None:
                    weight = load_file(str(tmp / SPARSE_DIR / sparse.tables[name].file))[TABLE_TENSOR]
                tables[name] = patched(weight, table.rows, *delta.table_rows(name))
            apply_files(delta, tmp)
            sparse = read_sparse_manifest(tmp)
        for name, weight in tables.items():
            write_bytes(tmp / SPARSE_DIR / sparse.tables[name].file, safetensors_bytes({TABLE_TENSOR: weight}))
        write_manifest(tmp)
        made = export_identity(tmp)
        if deltas and made != deltas[-1].target:
            wrong = sorted(
                rel
                for rel, digest in deltas[-1].manifest.items()
                if not (tmp / rel).is_file() or file_sha256(tmp / rel) != digest
            )
            raise ExportFormatError([Problem(str(deltas[-1].root), "manifest", f"squashed files differ: {wrong}")])
    return out


def apply_files(delta: Delta, root: Path) -> None:
    """Apply ``delta``'s files (not its tables) to the export files under ``root``: whole files
    replace, id-map additions append, removed files go."""
    for rel, kind in delta.files.items():
        data = (delta.root / rel).read_bytes()
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if kind == APPEND:
            data = target.read_bytes() + data
        write_bytes(target, data)
    for rel in delta.removed:
        (root / rel).unlink(missing_ok=True)


def patched(weight: np.ndarray, rows: int, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """weight: [R0, d] -> a new [rows, d] float32 array (rows >= R0): ``weight``, grown, with
    ``values`` [n, d] at rows ``ids`` [n]. ``weight`` itself is left as it is."""
    out = np.empty((rows, weight.shape[1]), dtype=np.float32)
    out[: len(weight)] = weight
    out[ids] = values
    return out


def appended_map(id_map: IdMap, lines: bytes, where: str) -> IdMap:
    """``id_map`` with the ``dense_id<TAB>raw_id`` lines a delta adds to its TSV file
    (``gr.data.mappings``); ValueError naming ``where`` when their dense ids do not continue it."""
    rows = list(csv.reader(io.StringIO(lines.decode("utf8")), delimiter="\t"))
    dense = [row[0] for row in rows if row]
    raw = [row[1] if len(row) == 2 else "" for row in rows if row]
    if dense != [str(i) for i in range(id_map.cardinality, id_map.cardinality + len(dense))]:
        raise ValueError(f"{where}: its lines do not continue the map's dense ids from {id_map.cardinality}")
    added = np.asarray(raw, dtype=np.int64 if id_map.raw.dtype.kind in "iu" else str)
    return IdMap(np.concatenate([id_map.raw, added]), id_map.offset, id_map.source)
