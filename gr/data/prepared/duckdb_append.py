"""``gr data prepare --append PARTITION --out DIR``: a partition of later events added to a prepared dataset.

The partition is read as ``gr data prepare`` reads a source (``duckdb_sources.load_source``: the
dataset's data config with ``data.path`` the partition, so the same columns, features and errors),
its repeated rows dropped by the same rule, then written to ``DIR/appends/0000N/`` (a temporary
sibling renamed whole), and the manifest rewritten last (``AppendEntry``); no file the manifest
listed is rewritten, and a crash leaves the dataset as it was (an unlisted append folder is
replaced by the next append).

* time order: every event of the partition must be later than the dataset's last event, so each
  user's sequence is its old events then its new ones (as preparing everything at once orders them);
* ids: every known user, item and feature value keeps its dense id; new ones are appended in sorted
  raw order (``IdMap.extended``, as a warm start grows its vocabularies). The filters apply to the
  new ids only, counted within the partition: a new item needs ``data.min_item_interactions``
  events in it, a new user ``data.min_seq_len``; a known user keeps every new event;
* side tables: the current ``items.parquet`` / ``users.parquet`` with rows added for the keys they
  lack (from ``data.items`` / ``data.users`` read again, or each new key's last row); a known key
  keeps its row;
* shards: one row per user with a new event: its whole sequence (its current row, then its new
  events in time order, ties in file order), sorted by dense user id, ``users_per_shard`` users a file.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gr.data.config import DataConfig
from gr.data.features import SideFeatures
from gr.data.interactions import DataFormatError, SideTable
from gr.data.mappings import IdMap, id_kind, load_mappings, save_mappings
from gr.data.prepared.duckdb_engine import (
    DEFAULT_MEMORY_LIMIT,
    WORK,
    _Preparation,
    _raw_ids,
    _shard_schema,
    connect,
    shard_values,
)
from gr.data.prepared.duckdb_sources import SourceTable, literal, load_source
from gr.data.prepared.duckdb_sources import side_table as read_side_table
from gr.data.prepared.manifest import (
    APPENDS,
    DEFAULT_USERS_PER_SHARD,
    ITEMS_TABLE,
    MAPS,
    ROW_GROUP_USERS,
    SHARDS,
    SIDE_KEY,
    TIMESTAMPS,
    USER,
    USERS_TABLE,
    AppendEntry,
    PreparedManifest,
    ShardEntry,
    describe_shard,
    file_checksums,
    read_manifest,
    shard_path,
    verify_file,
    write_manifest,
)
from gr.data.prepared.side_tables import CATEGORICAL, DENSE, LIST, side_table_arrow, side_table_from_arrow
from gr.data.sequences import log_rare_items, log_short_users
from gr.utils.atomic import atomic_directory
from gr.utils.run_lock import output_lock

log = logging.getLogger(__name__)

COMMAND = "gr data prepare --append"
TABLE_SOURCES = ("csv", "parquet")
# a shard column's DuckDB type: the new events' lists are cast to it before the old rows' lists lead them
DUCKDB_TYPES = {pa.int64(): "BIGINT", pa.float32(): "FLOAT", pa.string(): "VARCHAR"}


def append_with_duckdb(
    directory: Union[str, Path],
    partition: Union[str, Path],
    config: Optional[DataConfig] = None,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    threads: Optional[int] = None,
    users_per_shard: int = DEFAULT_USERS_PER_SHARD,
) -> PreparedManifest:
    """Append the events of ``partition`` (a file, directory of partition files or glob, as ``data.path``)
    to the prepared dataset ``directory`` -> its new manifest (the module docstring says what is written).

    config: the data config to read with (its prepared keys must be the dataset's: one line naming
    the first that differs); None: the manifest's. Its ``data.path`` is replaced by ``partition``.
    Bad input raises DataFormatError / ValueError / FileNotFoundError in one line naming it.
    """
    if users_per_shard < 1:
        raise ValueError(f"users_per_shard: expected a positive number of users, got {users_per_shard}")
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory (--out: the prepared dataset to append to)")
    with output_lock(directory, COMMAND):
        manifest = read_manifest(directory, config)
        config = dataclasses.replace(config or manifest.data_config(), path=str(partition), prepared=None)
        if config.source not in TABLE_SOURCES:
            raise ValueError(
                f"--append: appends a csv or parquet partition; {directory} was prepared from data.source "
                f"{config.source!r} (prepare it again with the new events instead)"
            )
        number = len(manifest.appends) + 1
        relpath = f"{APPENDS}/{number:05d}"
        (directory / APPENDS).mkdir(exist_ok=True)
        # overwrite: an append folder the manifest does not list is what a crash left behind
        with atomic_directory(directory / relpath, command=COMMAND, overwrite=True) as tmp:
            con = connect(tmp / WORK, memory_limit, threads)
            try:
                entry, summary = _Append(con, config, tmp, manifest, relpath).append(users_per_shard)
            finally:
                con.close()
            shutil.rmtree(tmp / WORK)
            entry = dataclasses.replace(
                entry, files={f"{relpath}/{path}": digest for path, digest in file_checksums(tmp).items()}
            )
        appended = dataclasses.replace(manifest, summary=summary, appends=[*manifest.appends, entry])
        write_manifest(directory, appended)
    return appended


def last_timestamp(manifest: PreparedManifest) -> int:
    """The dataset's last event's timestamp: its last append's, else the largest in its shards."""
    if manifest.appends:
        return manifest.appends[-1].last_timestamp
    last = None
    for shard in manifest.shards:
        verify_file(manifest, shard.path)
        column = pq.read_table(manifest.path(shard.path), columns=[TIMESTAMPS])[TIMESTAMPS]
        found = pc.max(pc.list_flatten(column)).as_py()
        last = found if last is None or (found is not None and found > last) else last
    assert last is not None  # a prepared dataset holds at least one user with events
    return int(last)


class _Append(_Preparation):
    """One append's stages over one DuckDB connection, writing into ``tmp`` (the append's folder)."""

    def __init__(
        self, con: duckdb.DuckDBPyConnection, config: DataConfig, tmp: Path, manifest: PreparedManifest, relpath: str
    ) -> None:
        super().__init__(con, config, tmp)
        self.manifest, self.relpath = manifest, relpath
        self.maps, self.columns = load_mappings(str(manifest.path(manifest.current(MAPS))))

    def append(self, users_per_shard: int) -> Tuple[AppendEntry, Dict[str, Any]]:
        """-> (the append's manifest entry, its files left to fill in; the dataset's new summary)."""
        con, config, manifest = self.con, self.config, self.manifest
        con.execute("SET preserve_insertion_order = true")  # rowid = file order while reading
        source = load_source(con, config)
        rows = self.count("SELECT count(*) FROM typed")
        self.stage("read", "%d rows from %s", rows, source.source)
        con.execute("SET preserve_insertion_order = false")
        self._check_schema(source)
        duplicates = self._events(source)
        first, last = self._check_time_order(source)
        users, items = self._dense_ids(source)
        events = self._sequences(source)
        maps = {**self.maps, "users": users, "items": items}
        maps.update(self._extended_side_tables(source, users, items))
        for name, new in self._event_vocabularies(source.event_features).items():
            maps[name] = self.maps[name].extended(new.raw, f"{source.source}: column {name!r}")
        save_mappings(str(self.tmp / MAPS), maps, self.columns)
        old = self.maps
        added = (len(users.raw) - len(old["users"].raw), len(items.raw) - len(old["items"].raw))
        self.stage("maps", "%d users, %d items (%d and %d new)", len(users.raw), len(items.raw), *added)
        shards = self._append_shards(source, len(old["users"].raw), users_per_shard)
        self.stage("shards", "%d shards of up to %d users", len(shards), users_per_shard)
        dropped = 0 if config.keep_duplicates else duplicates
        entry = AppendEntry(
            path=self.relpath,
            partition=str(config.path),
            appended_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            rows_read=rows,
            duplicates_dropped=dropped,
            events=events,
            users_added=added[0],
            items_added=added[1],
            first_timestamp=first,
            last_timestamp=last,
            shards=shards,
            files={},
        )
        summary = dict(manifest.summary)
        summary.update(
            rows_read=summary["rows_read"] + rows,
            duplicates_dropped=summary["duplicates_dropped"] + dropped,
            duplicates_kept=summary["duplicates_kept"] + duplicates - dropped,
            users=summary["users"] + entry.users_added,
            items=len(items.raw),
            interactions=summary["interactions"] + events,
        )
        return entry, summary

    def _check_schema(self, source: SourceTable) -> None:
        """The partition's ids and features as the dataset's: ratings, event feature kinds, id kinds."""
        manifest, where = self.manifest, source.source
        kinds = {f.name: f.kind for f in source.event_features}
        if source.has_ratings != manifest.has_ratings or kinds != manifest.event_features:
            raise DataFormatError(
                Path(where),
                f"holds ratings: {source.has_ratings}, event features {kinds}; the dataset holds ratings: "
                f"{manifest.has_ratings}, event features {manifest.event_features} (append events of its schema)",
            )
        for key, name in (("u", "users"), ("i", "items")):
            found = _raw_ids(self.con, f"SELECT {key} FROM typed LIMIT 1")
            known = self.maps[name].raw
            if len(found) and id_kind(found) != id_kind(known):
                column = self.config.columns.user if key == "u" else self.config.columns.item
                raise DataFormatError(
                    Path(where),
                    f"column {column!r}: {id_kind(found)}, the dataset's {name} are {id_kind(known)} "
                    "(append events of its schema)",
                )

    def _check_time_order(self, source: SourceTable) -> Tuple[int, int]:
        """(first, last) timestamp of the new events; DataFormatError unless every one is later than
        the dataset's last event (a user's old events would no longer lead its sequence)."""
        found = self.con.execute("SELECT min(ts), max(ts) FROM events").fetchall()[0]
        if found[0] is None:
            raise DataFormatError(Path(source.source), "holds no event to append")
        first, last = int(found[0]), int(found[1])
        before = last_timestamp(self.manifest)
        if first <= before:
            user = self.con.execute("SELECT u FROM events WHERE ts = ? ORDER BY fr LIMIT 1", [first]).fetchall()
            raise DataFormatError(
                Path(source.source),
                f"user {user[0][0]!r} has an event at {first}, not after the dataset's last event "
                f"({before}, {self.manifest.directory}); an append adds later events only (prepare the whole log "
                "again to add earlier ones)",
            )
        return first, last

    def _dense_ids(self, source: SourceTable) -> Tuple[IdMap, IdMap]:
        """View ``kept`` (the new events the filters keep), tables ``users`` (u, uid) and ``items``
        (i, iid) of the extended maps -> the maps (the module docstring's rules)."""
        con, config = self.con, self.config
        old_users, old_items = self.maps["users"], self.maps["items"]
        con.register("known_users", pa.table({"u": old_users.raw}))
        con.register("known_items", pa.table({"i": old_items.raw}))
        least = config.min_item_interactions
        if least > 1:
            con.execute("CREATE TABLE item_counts AS SELECT i, count(*) AS n FROM events GROUP BY i")
            con.execute(
                "CREATE VIEW frequent AS SELECT * FROM events SEMI JOIN (SELECT i FROM item_counts WHERE n >= "
                f"{least} UNION SELECT i FROM known_items) k ON events.i = k.i"
            )
            new_counts = "SELECT count(*) FROM item_counts ANTI JOIN known_items ON item_counts.i = known_items.i"
            dropped = self.count(f"{new_counts} WHERE n < {least}")
            log_rare_items(source.source, dropped, self.count(new_counts), least)
        else:
            con.execute("CREATE VIEW frequent AS SELECT * FROM events")
        shortest = config.min_seq_len
        con.execute(
            "CREATE TABLE user_counts AS SELECT c.u, c.n, k.u IS NOT NULL AS known FROM (SELECT u, count(*) AS n "
            "FROM frequent GROUP BY u) c LEFT JOIN known_users k ON c.u = k.u"
        )
        dropped = self.count(f"SELECT count(*) FROM user_counts WHERE NOT known AND n < {shortest}")
        if dropped:
            new_users = self.count("SELECT count(*) FROM user_counts WHERE NOT known")
            log_short_users(source.source, dropped, new_users, shortest)
        con.execute(
            "CREATE VIEW kept AS SELECT * FROM frequent SEMI JOIN (SELECT u FROM user_counts WHERE known OR "
            f"n >= {shortest}) k ON frequent.u = k.u"
        )
        if self.count("SELECT count(*) FROM kept") == 0:
            raise DataFormatError(
                Path(source.source),
                f"no event to append: the new users have fewer than data.min_seq_len {shortest} events and the "
                "known users none",
            )
        users = old_users.extended(_raw_ids(con, "SELECT DISTINCT u FROM kept"), f"{source.source}: users")
        items = old_items.extended(_raw_ids(con, "SELECT DISTINCT i FROM kept"), f"{source.source}: items")
        con.register("user_map", pa.table({"u": users.raw, "uid": np.arange(len(users.raw), dtype=np.int64)}))
        con.register("item_map", pa.table({"i": items.raw, "iid": np.arange(len(items.raw), dtype=np.int64)}))
        con.execute("CREATE TABLE users AS SELECT * FROM user_map")
        con.execute("CREATE TABLE items AS SELECT * FROM item_map")
        self.stage("filter", "%d users, %d items", len(users.raw), len(items.raw))
        return users, items

    def _extended_side_tables(self, source: SourceTable, users: IdMap, items: IdMap) -> Dict[str, IdMap]:
        """items.parquet / users.parquet: the current rows, then the new side table's rows of the keys
        they lack -> the side features' vocabularies, extended."""
        vocabularies: Dict[str, IdMap] = {}
        tables = (
            (ITEMS_TABLE, source.item_side or read_side_table(self.con, "i", source.item_features), items),
            (USERS_TABLE, source.user_side or read_side_table(self.con, "u", source.user_features), users),
        )
        for name, new, ids in tables:
            current = self.manifest.current(name)
            old = pq.read_table(self.manifest.path(current)) if current in self.manifest.current_files() else None
            if new is None and old is None:
                continue
            table = _extended_table(self.manifest.path(current), old, new)
            pq.write_table(table, self.tmp / name)
            kinds = _side_kinds(new) if new is not None else {}
            side = side_table_from_arrow(table, kinds, {n: self.columns[n] for n, k in kinds.items() if k == DENSE})
            vocabularies.update(SideFeatures.align(side, ids, self.maps).vocabularies)
            self.stage("side tables", "%s: %d rows", name, table.num_rows)
        return vocabularies

    def _append_shards(self, source: SourceTable, known_users: int, users_per_shard: int) -> List[ShardEntry]:
        """Write the shards of every user with a new event (their current rows then the new events) ->
        their manifest entries (paths relative to the dataset)."""
        con = self.con
        schema = _shard_schema(source)
        self._current_rows(known_users, schema)
        con.execute("SET preserve_insertion_order = true")  # streamed in ORDER BY uid
        values = shard_values(source)
        fields = {name: f"v{k}" for k, name in enumerate(values)}
        events = ", ".join(f"{fields[name]}: {column}" for name, column in values.items())
        columns = [
            f'list_concat(o."{name}", CAST(list_transform(n.e, lambda x: x.{fields[name]}) AS '
            f'{_duckdb_type(schema.field(name).type)})) AS "{name}"'
            for name in values
        ]
        con.execute(
            f"CREATE TABLE touched AS SELECT uid, list({{{events}}} ORDER BY ts, fr) AS e, "
            "row_number() OVER (ORDER BY uid) - 1 AS pos FROM seq GROUP BY uid"
        )
        touched = self.count("SELECT count(*) FROM touched")
        (self.tmp / SHARDS).mkdir()
        shards = []
        for index in range(-(-touched // users_per_shard)):
            low, high = index * users_per_shard, (index + 1) * users_per_shard
            query = (
                f'SELECT n.uid AS "{USER}", {", ".join(columns)} FROM (SELECT * FROM touched WHERE pos >= {low} '
                f'AND pos < {high}) n LEFT JOIN old_rows o ON o."{USER}" = n.uid ORDER BY n.uid'
            )
            relpath = shard_path(index)
            with pq.ParquetWriter(self.tmp / relpath, schema) as writer:
                for batch in con.sql(query).to_arrow_reader(ROW_GROUP_USERS):
                    writer.write_table(pa.Table.from_batches([batch]).cast(schema), row_group_size=ROW_GROUP_USERS)
            first = int(pq.read_table(self.tmp / relpath, columns=[USER])[USER][0].as_py())
            entry = describe_shard(self.tmp, relpath, first)
            shards.append(dataclasses.replace(entry, path=f"{self.relpath}/{relpath}"))
        return shards

    def _current_rows(self, known_users: int, schema: pa.Schema) -> None:
        """Table ``old_rows`` (``schema``'s columns): the current rows of the known users with a new
        event, read by DuckDB (out of core) from the shards holding their last rows, each verified
        against the manifest first."""
        manifest, con = self.manifest, self.con
        wanted = _raw_ids(con, f"SELECT DISTINCT uid FROM seq WHERE uid < {known_users}").astype(np.int64)
        owner = np.full(known_users, -1, dtype=np.int64)
        shards = manifest.shards_since()
        for position, shard in enumerate(shards):
            if position < len(manifest.shards):
                owner[shard.first_user : shard.first_user + shard.users] = position
            else:
                owner[pq.read_table(manifest.path(shard.path), columns=[USER])[USER].to_numpy()] = position
        if not len(wanted):
            con.register("old_rows", schema.empty_table())
            return
        files = {int(p): str(manifest.path(shards[int(p)].path)) for p in np.unique(owner[wanted])}
        for position in files:
            verify_file(manifest, shards[position].path)
        con.register("owners", pa.table({"uid": wanted, "file": [files[int(p)] for p in owner[wanted]]}))
        casts = ", ".join(
            f'CAST(p."{name}" AS {_duckdb_type(schema.field(name).type)}) AS "{name}"' for name in schema.names[1:]
        )
        paths = ", ".join(map(literal, files.values()))
        con.execute(
            f'CREATE TABLE old_rows AS SELECT p."{USER}", {casts} FROM read_parquet([{paths}], filename = true) p '
            f'JOIN owners o ON p."{USER}" = o.uid AND p.filename = o.file'
        )


def _extended_table(path: Path, old: Optional[pa.Table], new: Optional[SideTable]) -> pa.Table:
    """The side table ``old`` (read from ``path``) with the rows of ``new`` whose keys it lacks."""
    if new is None:
        assert old is not None
        return old
    added = side_table_arrow(new)
    if old is None:
        return added
    added = added.filter(pc.invert(pc.is_in(added[SIDE_KEY], value_set=old[SIDE_KEY].combine_chunks())))
    try:
        return pa.concat_tables([old, added.select(old.column_names).cast(old.schema)])
    except (pa.ArrowException, KeyError) as error:
        raise DataFormatError(
            path, f"the new side table's columns differ from this table's ({error}; append events of its schema)"
        ) from None


def _side_kinds(table: SideTable) -> Mapping[str, str]:
    """{feature: categorical | list | dense} of a side table."""
    return {
        **{name: CATEGORICAL for name in table.categorical},
        **{name: LIST for name in table.lists},
        **{name: DENSE for name in table.dense},
    }


def _duckdb_type(kind: pa.DataType) -> str:
    """A shard column's Arrow list type as DuckDB names it (``BIGINT[]``, ``VARCHAR[][]``, ...)."""
    suffix = ""
    while pa.types.is_list(kind):
        kind, suffix = kind.value_type, suffix + "[]"
    return DUCKDB_TYPES[kind] + suffix
