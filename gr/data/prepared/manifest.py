"""The prepared dataset format (version 1): where each file lies, ``manifest.json``, and its checks.

A prepared dataset DIR (``gr data prepare`` writes it with an engine; training streams it)::

    DIR/manifest.json                written last: format, version, engine, the data config and its
                                     hash, summary counts, the shards, the sha256 of every other file
    DIR/maps/                        ``gr.data.mappings.save_mappings``: users, items, vocabularies
    DIR/items.parquet                the item side table: "key" (raw item id) + one column per feature
    DIR/users.parquet                the user side table, the same way (each absent when there is none)
    DIR/shards/part-00000.parquet    one row per user: user, items, timestamps[, ratings][, requests]
                                     [, event:<F>], sorted by dense user id; shard k holds a contiguous
                                     range of users; row groups of at most ``ROW_GROUP_USERS`` users
    DIR/appends/00001/               ``gr data prepare --append``'s first append (``AppendEntry``): the
                                     maps and side tables extended (old ids first, unchanged), and
                                     shards/ holding every user with a new event, whole sequence
                                     (history and new events), users increasing but not consecutive;
                                     a user's row in a later append supersedes its earlier rows

Shard columns: ``user`` int64 (the dense user id); per event, in time order (ties in file order),
``items`` list<int64> (dense item ids), ``timestamps`` list<int64> (seconds), ``ratings``
list<float32> (with ``has_ratings``), ``requests`` list<string> (each event's raw request id as text,
a canonical integer for an integer id: present when the data config names ``columns.request``; a
user's consecutive events of one id are one request, ``gr.data.sequences.request_starts``) and
``event:<F>`` (the raw values of row feature F, of kind ``event_features[F]``).

The dataset's current maps and side tables are those of its last append (``current``); the files of
the earlier ones stay, unused, so that no file a manifest lists is ever rewritten.

The writer calls ``describe_shard`` per shard, ``file_checksums`` for the rest and ``write_manifest``
last; the reader calls ``read_manifest``, then ``verify_file`` (or ``verify_digest`` with a digest it
computed while reading) and ``check_shard_order`` for each shard it opens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gr.data.config import DataConfig
from gr.data.interactions import DataFormatError
from gr.data.mappings import IdMap
from gr.utils.atomic import write_json
from gr.utils.checksums import file_sha256

FORMAT = "gr-prepared"
VERSION = 1
MANIFEST = "manifest.json"
MAPS = "maps"
SHARDS = "shards"
ITEMS_TABLE = "items.parquet"
USERS_TABLE = "users.parquet"
SIDE_KEY = "key"  # the raw id column of items.parquet / users.parquet
ROW_GROUP_USERS = 1024
DEFAULT_USERS_PER_SHARD = 16 * ROW_GROUP_USERS
USER, ITEMS, TIMESTAMPS, RATINGS, REQUESTS = "user", "items", "timestamps", "ratings", "requests"
EVENT_PREFIX = "event:"
EVENT_KINDS = ("categorical", "list", "dense")
ENGINES = ("duckdb", "spark")
# The data-config keys that change what is prepared (not path, splits, batching, seeds, ...).
PREPARED_KEYS = (
    "source",
    "columns",
    "min_seq_len",
    "min_item_interactions",
    "keep_duplicates",
    "genres",
    "release_year",
    "item_features",
    "user_features",
)
# data.users / data.items change what is prepared too: their id column (not their path, as data.path)
SIDE_TABLE_KEYS = ("users", "items")
# Prepared keys added since the format was first written, with their defaults: left out of a config's
# prepared keys at the default, so a directory prepared before them keeps its config hash.
LATER_PREPARED_KEYS: Dict[str, Any] = {"release_year": False}
LATER_COLUMN_KEYS: Dict[str, Any] = {"request": None}  # the same for keys of data.columns
APPENDS = "appends"
SUMMARY_KEYS = ("source", "rows_read", "duplicates_dropped", "duplicates_kept", "users", "items", "interactions")
PathLike = Union[str, Path]


@dataclass(frozen=True)
class ShardEntry:
    """One shard: ``path`` (relative to DIR) holds dense users ``first_user .. first_user+users-1``."""

    path: str
    first_user: int
    users: int
    interactions: int
    row_groups: int
    sha256: str


@dataclass(frozen=True)
class AppendEntry:
    """One ``gr data prepare --append``: ``path`` (``appends/00001``, relative to DIR) holds its files.

    partition: the events read (as given); appended_at: when (ISO 8601, UTC); rows_read /
    duplicates_dropped / events: rows of the partition, those dropped as repeats, new events kept;
    users_added / items_added: ids appended to the maps; first_timestamp / last_timestamp: of its
    new events; shards: every user with a new event (``ShardEntry.first_user``: the shard's first
    user; its users increase); files: {relative path: sha256} of its maps and side tables.
    """

    path: str
    partition: str
    appended_at: str
    rows_read: int
    duplicates_dropped: int
    events: int
    users_added: int
    items_added: int
    first_timestamp: int
    last_timestamp: int
    shards: List[ShardEntry]
    files: Dict[str, str]

    def to_dict(self) -> Dict[str, Any]:
        return {**vars(self), "shards": [vars(shard) for shard in self.shards]}


@dataclass
class PreparedManifest:
    """A prepared dataset's ``manifest.json`` (the module docstring lists its files).

    directory: DIR; data: ``DataConfig.to_dict()`` of the preparing config; summary: the
    ``SUMMARY_KEYS`` counts (as ``SequenceDataModule.summary``); event_features: {name: one of
    ``EVENT_KINDS``} of the shards' ``event:<name>`` columns; files: {relative path: sha256} of
    every file but the manifest and the shards; appends: the ``AppendEntry`` of each append, in order
    (the summary counts them in).
    """

    directory: Path
    engine: str
    engine_version: str
    config_hash: str
    data: Dict[str, Any]
    summary: Dict[str, Any]
    has_ratings: bool
    event_features: Dict[str, str] = field(default_factory=dict)
    shards: List[ShardEntry] = field(default_factory=list)
    files: Dict[str, str] = field(default_factory=dict)
    appends: List[AppendEntry] = field(default_factory=list)

    @property
    def request_column(self) -> Optional[str]:
        """The preparing config's ``data.columns.request``: the shards hold ``REQUESTS`` when it is set."""
        columns = self.data.get("columns")
        request = columns.get("request") if isinstance(columns, dict) else None
        return request if isinstance(request, str) else None

    @property
    def num_users(self) -> int:
        return sum(shard.users for shard in self.shards) + sum(entry.users_added for entry in self.appends)

    def current(self, relpath: str) -> str:
        """The relative path of the dataset's current ``relpath`` (``MAPS``, ``ITEMS_TABLE``,
        ``USERS_TABLE``): the last append's, else the preparation's."""
        return f"{self.appends[-1].path}/{relpath}" if self.appends else relpath

    def current_files(self) -> Dict[str, str]:
        """{relative path: sha256} of the current maps and side tables (the files a reader loads)."""
        return self.appends[-1].files if self.appends else self.files

    def shards_since(self, append: int = 0) -> List[ShardEntry]:
        """The shards of appends ``append`` .. (numbered from 1), or every shard (``append`` 0: the
        preparation's, then each append's), in that order: a user's last row among them is its own."""
        if not 0 <= append <= len(self.appends):
            raise ValueError(
                f"data.since_append: {self.directory / MANIFEST} records {len(self.appends)} appends, got {append}"
            )
        first = self.shards if append == 0 else []
        return first + [shard for entry in self.appends[max(append - 1, 0) :] for shard in entry.shards]

    def path(self, relpath: str) -> Path:
        """The file ``relpath`` (a path the manifest lists) inside DIR."""
        return self.directory / relpath

    def data_config(self) -> DataConfig:
        """The preparing config's ``data`` section."""
        return DataConfig.from_dict(self.data)

    def checksum(self, relpath: str) -> str:
        """The sha256 the manifest lists for ``relpath`` (a shard or another file)."""
        listed = {**self.files, **{shard.path: shard.sha256 for shard in self.shards_since()}}
        listed.update({path: digest for entry in self.appends for path, digest in entry.files.items()})
        if relpath not in listed:
            raise ValueError(f"{self.directory / MANIFEST}: lists no file {relpath!r}")
        return listed[relpath]

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object of ``manifest.json``."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "config_hash": self.config_hash,
            "data": self.data,
            "summary": self.summary,
            "has_ratings": self.has_ratings,
            "event_features": self.event_features,
            "shards": [vars(shard) for shard in self.shards],
            "files": self.files,
            **({"appends": [entry.to_dict() for entry in self.appends]} if self.appends else {}),
        }


def check_preparable(config: DataConfig) -> None:
    """ValueError for a source that is not files (synthetic: generated in memory at training time),
    or without data.path (a config that trains from a prepared dataset may leave it out)."""
    if config.source == "synthetic":
        raise ValueError(
            "data.source: 'synthetic' is generated in memory at training time; gr data prepare reads files "
            "(csv, parquet, ml-100k, ml-1m, ml-20m, amazon)"
        )
    if config.path is None:
        raise ValueError(f"data.path: required to prepare data.source {config.source!r} (the files to read)")


def prepared_summary(
    source: str, rows_read: int, duplicates: int, keep_duplicates: bool, users: int, items: int, interactions: int
) -> Dict[str, Any]:
    """The manifest's ``summary`` (``SUMMARY_KEYS``: ``SequenceDataModule.summary``'s counts)."""
    dropped = 0 if keep_duplicates else duplicates
    return {
        "source": source,
        "rows_read": rows_read,
        "duplicates_dropped": dropped,
        "duplicates_kept": duplicates - dropped,
        "users": users,
        "items": items,
        "interactions": interactions,
    }


def config_data(config: DataConfig) -> Dict[str, Any]:
    """``config.to_dict()`` as JSON reads it back (tuples as lists): the manifest's ``data``."""
    return json.loads(json.dumps(config.to_dict()))


def prepared_keys(config: DataConfig) -> Dict[str, Any]:
    """{key: JSON value} of the ``PREPARED_KEYS`` of ``config``, and of its side tables (``SIDE_TABLE_KEYS``)."""
    values = config_data(config)
    values["columns"] = _without_defaults(values["columns"], LATER_COLUMN_KEYS)
    prepared = _without_defaults({key: values[key] for key in PREPARED_KEYS}, LATER_PREPARED_KEYS)
    return {**prepared, **_side_table_keys(values)}


def _without_defaults(values: Mapping[str, Any], later: Mapping[str, Any]) -> Dict[str, Any]:
    """``values`` without the keys added later (``later``: {key: its default}) that hold their default."""
    return {key: value for key, value in values.items() if key not in later or value != later[key]}


def _side_table_keys(values: Mapping[str, Any]) -> Dict[str, Any]:
    """{"users" | "items": {"key": its id column or None}} of the side tables a data section names."""
    return {key: {"key": values[key].get("key")} for key in SIDE_TABLE_KEYS if isinstance(values.get(key), dict)}


def config_hash(config: DataConfig) -> str:
    """sha256 hex of the canonical JSON (sorted keys) of ``prepared_keys(config)``."""
    return _hash(prepared_keys(config))


def accepted_hashes(config: DataConfig) -> Tuple[str, str]:
    """The hashes a dataset prepared for ``config`` may carry: ``config_hash(config)``, and the hash of
    the same keys with each of ``LATER_COLUMN_KEYS`` present at its default (as they were hashed before
    being left out at their defaults)."""
    keys = prepared_keys(config)
    return _hash(keys), _hash({**keys, "columns": {**LATER_COLUMN_KEYS, **keys["columns"]}})


def _hash(keys: Mapping[str, Any]) -> str:
    text = json.dumps(keys, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf8")).hexdigest()


def shard_path(index: int) -> str:
    """The relative path of shard ``index``: ``shards/part-00000.parquet``."""
    return f"{SHARDS}/part-{index:05d}.parquet"


def event_column(name: str) -> str:
    """A shard's column of the row feature ``name``: ``event:<name>``."""
    return f"{EVENT_PREFIX}{name}"


def describe_shard(directory: PathLike, relpath: str, first_user: int) -> ShardEntry:
    """The manifest entry of the written shard ``directory/relpath``: users and row groups from its
    Parquet footer, interactions summed one row group at a time, sha256 of the file."""
    path = Path(directory) / relpath
    parquet = pq.ParquetFile(path)
    interactions = sum(
        int(pc.sum(pc.list_value_length(parquet.read_row_group(g, columns=[ITEMS])[ITEMS])).as_py() or 0)
        for g in range(parquet.num_row_groups)
    )
    metadata = parquet.metadata
    return ShardEntry(relpath, first_user, metadata.num_rows, interactions, metadata.num_row_groups, file_sha256(path))


def file_checksums(directory: PathLike) -> Dict[str, str]:
    """{relative path: sha256} of every file under ``directory`` but the manifest and the shards."""
    root = Path(directory)
    return {
        path.relative_to(root).as_posix(): file_sha256(path)
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.relative_to(root).parts[0] not in (MANIFEST, SHARDS)
    }


def write_manifest(directory: PathLike, manifest: PreparedManifest) -> None:
    """Write ``directory/manifest.json`` (temp + rename): the last file of a preparation."""
    write_json(Path(directory) / MANIFEST, manifest.to_dict())


def read_manifest(directory: PathLike, config: Optional[DataConfig] = None) -> PreparedManifest:
    """Read and check ``directory/manifest.json``: format and version, field types, every path
    inside DIR, shards covering dense users 0 .. users-1 in order, every listed file present, and,
    given ``config``, that it was prepared for the same ``PREPARED_KEYS`` (the first differing key
    named; request ids asked of a dataset prepared without them named first). Errors: one line
    naming the manifest (or the missing file) and the key."""
    root = Path(directory)
    path = root / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing file (not a prepared dataset, or its preparation did not finish: "
            "gr data prepare writes the manifest last)"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataFormatError(path, f"not a JSON manifest ({error})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else raw
        raise DataFormatError(path, f"format: expected {FORMAT!r}, got {found!r}")
    if raw.get("version") != VERSION:
        raise DataFormatError(
            path, f"version: expected {VERSION}, got {raw.get('version')!r} (prepared by another version of gr)"
        )
    raw.setdefault("appends", [])  # absent from a dataset never appended to
    manifest = PreparedManifest(
        directory=root,
        engine=_field(path, raw, "engine", str),
        engine_version=_field(path, raw, "engine_version", str),
        config_hash=_field(path, raw, "config_hash", str),
        data=_field(path, raw, "data", dict),
        summary=_field(path, raw, "summary", dict),
        has_ratings=_field(path, raw, "has_ratings", bool),
        event_features=_field(path, raw, "event_features", dict),
        shards=[_shard(path, raw, i) for i in range(len(_field(path, raw, "shards", list)))],
        files=_field(path, raw, "files", dict),
        appends=[_append(path, raw, i) for i in range(len(_field(path, raw, "appends", list)))],
    )
    _check_contents(path, manifest)
    if config is not None and config.columns.request is not None and manifest.request_column is None:
        raise DataFormatError(
            path,
            f"data.columns.request: {config.columns.request!r}, but this dataset was prepared without request ids "
            "(data.columns.request null); prepare it again with this config",
        )
    if config is not None and manifest.config_hash not in accepted_hashes(config):
        raise DataFormatError(path, f"prepared for another data config ({_difference(manifest.data, config)})")
    return manifest


def verify_digest(manifest: PreparedManifest, relpath: str, digest: str) -> None:
    """Raise DataFormatError naming ``relpath`` unless ``digest`` (sha256 hex of the bytes read) is
    the one the manifest lists: a reader that hashes a shard while streaming it calls this at its end."""
    if digest != manifest.checksum(relpath):
        raise DataFormatError(manifest.path(relpath), "checksum mismatch (corrupt or changed since preparation)")


def verify_file(manifest: PreparedManifest, relpath: str) -> None:
    """Check the sha256 of the file ``relpath`` against the manifest (missing: FileNotFoundError)."""
    path = manifest.path(relpath)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing file ({manifest.directory / MANIFEST} lists it)")
    verify_digest(manifest, relpath, file_sha256(path))


def check_shard_order(
    shard: PathLike,
    user_ids: np.ndarray,
    offsets: np.ndarray,
    timestamps: np.ndarray,
    users: IdMap,
    first_user: Optional[int],
) -> None:
    """Check rows read from ``shard`` (a whole shard or one row group of it).

    user_ids: [B] int64 dense user ids, expected ``first_user .. first_user+B-1``, or (``first_user``
    None: an append's shard) increasing, each below ``users.cardinality``
    offsets: [B+1] int64 row r's events are ``offsets[r]:offsets[r+1]``
    timestamps: [T] int64, expected non-decreasing within each row
    users: the dataset's user map (errors name the raw id)
    Raises DataFormatError naming the shard, the user (raw id) and the position in its sequence.
    """
    user_ids = np.asarray(user_ids)
    if first_user is None:
        wrong = np.flatnonzero((np.diff(user_ids, prepend=-1) <= 0) | (user_ids >= users.cardinality))
        if len(wrong):
            raise DataFormatError(
                shard,
                f"row {int(wrong[0])} holds dense user {int(user_ids[wrong[0]])} (an append's shard holds users "
                f"sorted by dense id, each once, below {users.cardinality})",
            )
    else:
        expected = first_user + np.arange(len(user_ids), dtype=np.int64)
        wrong = np.flatnonzero(user_ids != expected)
        if len(wrong):
            row = int(wrong[0])
            raise DataFormatError(
                shard,
                f"row {row} holds dense user {int(user_ids[row])}, expected {int(expected[row])} (a shard holds "
                "consecutive users sorted by dense id; prepare the dataset again)",
            )
    later = np.zeros(len(timestamps), dtype=bool)  # later[t]: event t is not its user's first
    later[1:] = True
    later[offsets[:-1][offsets[:-1] < len(timestamps)]] = False
    backwards = np.flatnonzero(later[1:] & (timestamps[1:] < timestamps[:-1])) + 1
    if len(backwards):
        event = int(backwards[0])
        row = int(np.searchsorted(offsets, event, side="right")) - 1
        dense = int(user_ids[row])
        position = event - int(offsets[row])
        raise DataFormatError(
            shard,
            f"user {users.decode(np.asarray([dense]))[0].item()!r} (dense id {dense}): timestamp "
            f"{int(timestamps[event])} at position {position} is before {int(timestamps[event - 1])} at "
            f"position {position - 1} (a user's timestamps never decrease; prepare the dataset again)",
        )


def _field(path: Path, raw: Mapping[str, Any], key: str, kind: type, where: str = "") -> Any:
    value = raw.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DataFormatError(path, f"{where}{key}: expected {kind.__name__}, got {value!r}")
    return value


def _shard(path: Path, raw: Mapping[str, Any], index: int, within: str = "") -> ShardEntry:
    entry = raw["shards"][index]
    where = f"{within}shards[{index}]."
    if not isinstance(entry, dict):
        raise DataFormatError(path, f"{within}shards[{index}]: expected an object, got {entry!r}")
    counts = {k: _field(path, entry, k, int, where) for k in ("first_user", "users", "interactions", "row_groups")}
    relpath, digest = (_field(path, entry, k, str, where) for k in ("path", "sha256"))
    return ShardEntry(relpath, sha256=digest, **counts)


def _append(path: Path, raw: Mapping[str, Any], index: int) -> AppendEntry:
    entry = raw["appends"][index]
    where = f"appends[{index}]."
    if not isinstance(entry, dict):
        raise DataFormatError(path, f"appends[{index}]: expected an object, got {entry!r}")
    shards = _field(path, entry, "shards", list, where)
    return AppendEntry(
        **{k: _field(path, entry, k, str, where) for k in ("path", "partition", "appended_at")},
        **{
            k: _field(path, entry, k, int, where)
            for k in (
                "rows_read",
                "duplicates_dropped",
                "events",
                "users_added",
                "items_added",
                "first_timestamp",
                "last_timestamp",
            )
        },
        shards=[_shard(path, {"shards": shards}, i, where) for i in range(len(shards))],
        files=_field(path, entry, "files", dict, where),
    )


def _check_contents(path: Path, manifest: PreparedManifest) -> None:
    """Summary keys, event kinds, shard ranges, paths inside DIR, listed files present."""
    missing = [k for k in SUMMARY_KEYS if k not in manifest.summary]
    if missing:
        raise DataFormatError(path, f"summary: lacks {missing}")
    bad_kinds = {n: k for n, k in manifest.event_features.items() if k not in EVENT_KINDS}
    if bad_kinds:
        raise DataFormatError(path, f"event_features: expected kinds among {list(EVENT_KINDS)}, got {bad_kinds}")
    first = 0
    for i, shard in enumerate(manifest.shards):
        if shard.first_user != first or shard.users < 1:
            raise DataFormatError(
                path,
                f"shards[{i}].first_user: expected {first} (shards cover consecutive users), got "
                f"{shard.first_user} with {shard.users} users",
            )
        first += shard.users
    for key, added in (("users", "users_added"), ("interactions", "events")):
        total = sum(getattr(shard, key) for shard in manifest.shards)
        total += sum(getattr(entry, added) for entry in manifest.appends)
        if manifest.summary[key] != total:
            raise DataFormatError(path, f"summary.{key}: {manifest.summary[key]!r}, but the shards hold {total}")
    listed = [(f"shards[{i}].path", s.path) for i, s in enumerate(manifest.shards)]
    listed += [(f"files.{rel}", rel) for rel in manifest.files]
    for k, entry in enumerate(manifest.appends):
        listed += [(f"appends[{k}].shards[{i}].path", s.path) for i, s in enumerate(entry.shards)]
        listed += [(f"appends[{k}].files.{rel}", rel) for rel in entry.files]
    for key, rel in listed:
        pure = PurePosixPath(rel)
        if not rel or pure.is_absolute() or ".." in pure.parts or rel == MANIFEST:
            raise DataFormatError(path, f"{key}: path {rel!r} is not a file inside the prepared directory")
        target = manifest.path(rel)
        if not target.resolve().is_relative_to(manifest.directory.resolve()):
            raise DataFormatError(path, f"{key}: path {rel!r} resolves outside the prepared directory")
        if not target.is_file():
            raise FileNotFoundError(f"{target}: missing file ({path} lists it)")


def _difference(prepared: Mapping[str, Any], config: DataConfig) -> str:
    """'data.<key> differs: prepared with X, this config has Y' for the first differing prepared key."""
    wanted = prepared_keys(config)
    sides = _side_table_keys(prepared)
    for key in (*PREPARED_KEYS, *SIDE_TABLE_KEYS):
        default = LATER_PREPARED_KEYS.get(key)
        found = _first_difference(f"data.{key}", sides.get(key, prepared.get(key, default)), wanted.get(key, default))
        if found:
            return found
    return f"config_hash {config_hash(config)} differs from the manifest's, whose data section was edited"


def _first_difference(key: str, prepared: Any, wanted: Any) -> Optional[str]:
    if isinstance(prepared, dict) and isinstance(wanted, dict):
        for sub in [*wanted, *(k for k in prepared if k not in wanted)]:
            found = _first_difference(f"{key}.{sub}", prepared.get(sub), wanted.get(sub))
            if found:
                return found
        return None
    if prepared != wanted:
        return f"{key} differs: prepared with {json.dumps(prepared)}, this config has {json.dumps(wanted)}"
    return None


def prepared_directory(config: DataConfig) -> Optional[Path]:
    """The prepared dataset ``config`` streams: ``data.prepared`` (which must hold a manifest.json),
    else ``data.path`` when it names a directory holding one; None: read the raw source."""
    if config.prepared is not None:
        directory = Path(config.prepared)
        if not (directory / MANIFEST).is_file():
            what = "no such directory" if not directory.is_dir() else f"no {MANIFEST} in it"
            raise FileNotFoundError(
                f"data.prepared: {directory}: {what} (expected a directory written by gr data prepare)"
            )
        return directory
    if config.path is not None and (Path(config.path) / MANIFEST).is_file():
        return Path(config.path)
    return None
