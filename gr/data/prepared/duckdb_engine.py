"""``gr data prepare``'s DuckDB engine: a source -> a prepared dataset (``gr.data.prepared.manifest``).

Every per-interaction step runs in DuckDB SQL, out of core (``memory_limit``; what does not fit spills
to a temporary directory inside the output's temporary directory), on ``threads`` cores:

1. read: the source into table ``typed`` (``duckdb_sources.load_source``: the readers' rules and errors)
2. duplicates: rows repeating an earlier row's (user, item, timestamp) dropped, the first in file order
   kept (``QUALIFY row_number() ...``), unless ``data.keep_duplicates``
3. filter: items with fewer than ``data.min_item_interactions`` rows, then users with fewer than
   ``data.min_seq_len``; dense ids ``row_number() OVER (ORDER BY raw id) - 1`` (``IdMap.of``'s order)
4. side tables and vocabularies: each key's last row (file order); vocabularies as
   ``SideFeatures.align`` makes them (catalogue- and user-sized work, in numpy)
5. shards: per user ``list(x ORDER BY ts, fr)`` (equal timestamps keep file order, as
   ``build_sequences``; request ids as text), ``users_per_shard`` users per file, streamed from DuckDB as Arrow and
   written in row groups of ``ROW_GROUP_USERS`` users (DuckDB's own COPY rounds a row group up to 2048
   rows)

The result equals ``build_sequences(read_source(config), ...)`` and ``SideFeatures.align`` of the same
config: same maps, sequences, side tables, summary counts and log lines.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gr.data.config import DataConfig
from gr.data.mappings import IdMap, save_mappings
from gr.data.prepared.duckdb_sources import (
    CATEGORICAL,
    DENSE,
    LIST,
    Feature,
    SourceTable,
    literal,
    load_source,
    scalar,
)
from gr.data.prepared.duckdb_sources import side_table as read_side_table
from gr.data.prepared.manifest import (
    DEFAULT_USERS_PER_SHARD,
    ITEMS,
    ITEMS_TABLE,
    MAPS,
    RATINGS,
    REQUESTS,
    ROW_GROUP_USERS,
    SHARDS,
    TIMESTAMPS,
    USER,
    USERS_TABLE,
    PreparedManifest,
    ShardEntry,
    check_preparable,
    config_data,
    config_hash,
    describe_shard,
    event_column,
    file_checksums,
    prepared_summary,
    shard_path,
    write_manifest,
)
from gr.data.prepared.side_tables import raw_values, write_side_table
from gr.data.readers import log_duplicates, side_table_summary
from gr.data.sequences import log_rare_items, log_short_users, no_user_left, too_wide_span
from gr.utils.atomic import atomic_directory

log = logging.getLogger(__name__)

ENGINE = "duckdb"
WORK = ".work"  # DuckDB's database and spill files, inside the output's temporary directory
DEFAULT_MEMORY_LIMIT = "4GB"
ARROW_VALUES = {CATEGORICAL: pa.string(), LIST: pa.list_(pa.string()), DENSE: pa.list_(pa.float32())}


def prepare_with_duckdb(
    config: DataConfig,
    out: Union[str, Path],
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    threads: Optional[int] = None,
    users_per_shard: int = DEFAULT_USERS_PER_SHARD,
    overwrite: bool = False,
) -> PreparedManifest:
    """Prepare ``config``'s source into the directory ``out`` (written beside it, renamed at the end).

    memory_limit: DuckDB's (e.g. "4GB"); threads: DuckDB's (None: one per core); users_per_shard:
    users per shard file (the last may hold fewer); overwrite: replace an existing ``out``.
    Bad input raises DataFormatError / ValueError naming the file, line, column or config key.
    """
    check_preparable(config)
    if users_per_shard < 1:
        raise ValueError(f"users_per_shard: expected a positive number of users, got {users_per_shard}")
    out = Path(out)
    with atomic_directory(out, command="gr data prepare", overwrite=overwrite) as tmp:
        con = connect(tmp / WORK, memory_limit, threads)
        try:
            manifest = _Preparation(con, config, tmp).run(users_per_shard)
        finally:
            con.close()
        shutil.rmtree(tmp / WORK)
        manifest.files = file_checksums(tmp)
        write_manifest(tmp, manifest)
    manifest.directory = out
    return manifest


def connect(work: Path, memory_limit: str, threads: Optional[int]) -> duckdb.DuckDBPyConnection:
    """A DuckDB database in the new directory ``work``, spilling there beyond ``memory_limit``, on
    ``threads`` cores (None: one per core); a memory limit DuckDB cannot read is a ValueError."""
    work.mkdir()
    con = duckdb.connect(str(work / "prepare.duckdb"))
    try:
        con.execute(f"SET memory_limit = {literal(memory_limit)}")
    except duckdb.Error:
        con.close()
        raise ValueError(
            f"memory_limit (--memory-limit): expected a size such as 4GB or 80%, got {memory_limit!r}"
        ) from None
    con.execute(f"SET temp_directory = {literal(str(work / 'spill'))}")
    con.execute("SET enable_progress_bar = false")
    if threads is not None:
        con.execute(f"SET threads = {int(threads)}")
    return con


class _Preparation:
    """One preparation's stages over one DuckDB connection, writing into ``tmp``."""

    def __init__(self, con: duckdb.DuckDBPyConnection, config: DataConfig, tmp: Path) -> None:
        self.con, self.config, self.tmp = con, config, tmp
        self.started = time.perf_counter()

    def stage(self, name: str, message: str, *args: object) -> None:
        log.info(f"prepare %s: {message} (%.1f s)", name, *args, time.perf_counter() - self.started)

    def count(self, query: str) -> int:
        return int(scalar(self.con, query))

    def run(self, users_per_shard: int) -> PreparedManifest:
        con, config = self.con, self.config
        con.execute("SET preserve_insertion_order = true")  # rowid = file order while reading
        source = load_source(con, config)
        rows = self.count("SELECT count(*) FROM typed")
        self.stage("read", "%d rows from %s", rows, source.source)
        con.execute("SET preserve_insertion_order = false")  # from here on every order is an ORDER BY
        duplicates = self._events(source)
        users, items = self._dense_ids(source)
        sides = side_table_summary(
            config, {"users": source.user_side, "items": source.item_side}, {"users": users, "items": items}
        )
        interactions = self._sequences(source)
        maps, columns = self._side_tables(source, users, items)
        maps.update(self._event_vocabularies(source.event_features))
        save_mappings(str(self.tmp / MAPS), maps, columns)
        self.stage("maps", "%d users, %d items, %d vocabularies", len(users.raw), len(items.raw), len(maps) - 2)
        shards = self._shards(source, len(users.raw), users_per_shard)
        self.stage("shards", "%d shards of up to %d users", len(shards), users_per_shard)
        return PreparedManifest(
            directory=self.tmp,
            engine=ENGINE,
            engine_version=duckdb.__version__,
            config_hash=config_hash(config),
            data=config_data(config),
            summary={
                **prepared_summary(
                    source.source,
                    rows,
                    duplicates,
                    config.keep_duplicates,
                    len(users.raw),
                    len(items.raw),
                    interactions,
                ),
                **sides,
            },
            has_ratings=source.has_ratings,
            event_features={f.name: f.kind for f in source.event_features},
            shards=shards,
        )

    def _events(self, source: SourceTable) -> int:
        """Table ``events`` (typed without side-feature columns), duplicates dropped unless kept;
        -> how many rows repeat an earlier row's (user, item, timestamp)."""
        con, config = self.con, self.config
        columns = ", ".join(["fr", "u", "i", "ts", *["r"] * source.has_ratings, *["q"] * source.has_requests])
        columns += "".join(f", {f.column}" for f in source.event_features)
        duplicates = self.count(
            "SELECT COALESCE(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM typed GROUP BY u, i, ts)"
        )
        if duplicates and not config.keep_duplicates:
            con.execute(
                f"CREATE TABLE events AS SELECT {columns} FROM typed "
                "QUALIFY row_number() OVER (PARTITION BY u, i, ts ORDER BY fr) = 1"
            )
        else:
            con.execute(f"CREATE VIEW events AS SELECT {columns} FROM typed")
        log_duplicates(source.source, duplicates, not config.keep_duplicates)
        self.stage("duplicates", "%d %s", duplicates, "kept" if config.keep_duplicates else "dropped")
        return duplicates

    def _dense_ids(self, source: SourceTable) -> Tuple[IdMap, IdMap]:
        """Tables ``kept`` (events of kept items), ``users`` (u, uid) and ``items`` (i, iid) -> the maps."""
        con, config = self.con, self.config
        least = config.min_item_interactions
        if least > 1:
            con.execute("CREATE TABLE item_counts AS SELECT i, count(*) AS n FROM events GROUP BY i")
            con.execute(
                f"CREATE VIEW kept AS SELECT * FROM events SEMI JOIN item_counts c ON events.i = c.i AND c.n >= {least}"
            )
            dropped_items = self.count(f"SELECT count(*) FROM item_counts WHERE n < {least}")
            log_rare_items(source.source, dropped_items, self.count("SELECT count(*) FROM item_counts"), least)
        else:
            con.execute("CREATE VIEW kept AS SELECT * FROM events")
        shortest = config.min_seq_len
        con.execute("CREATE TABLE user_counts AS SELECT u, count(*) AS n FROM kept GROUP BY u")
        dropped = self.count(f"SELECT count(*) FROM user_counts WHERE n < {shortest}")
        if dropped:
            log_short_users(source.source, dropped, self.count("SELECT count(*) FROM user_counts"), shortest)
        con.execute(
            "CREATE TABLE users AS SELECT u, row_number() OVER (ORDER BY u) - 1 AS uid "
            f"FROM user_counts WHERE n >= {shortest}"
        )
        if self.count("SELECT count(*) FROM users") == 0:
            raise no_user_left(source.source, shortest)
        con.execute(
            "CREATE TABLE items AS SELECT i, row_number() OVER (ORDER BY i) - 1 AS iid "
            "FROM (SELECT DISTINCT i FROM kept SEMI JOIN users ON kept.u = users.u)"
        )
        users = IdMap(_raw_ids(self.con, "SELECT u FROM users ORDER BY uid"))
        items = IdMap(_raw_ids(self.con, "SELECT i FROM items ORDER BY iid"))
        self.stage("filter", "%d users, %d items kept", len(users.raw), len(items.raw))
        return users, items

    def _sequences(self, source: SourceTable) -> int:
        """Table ``seq`` (uid, iid, ts, fr[, r][, q], event features) sorted by user and time -> its rows."""
        con = self.con
        extra = "".join(
            [
                ", e.r" if source.has_ratings else "",
                ", e.q" if source.has_requests else "",
                *(f", e.{f.column}" for f in source.event_features),
            ]
        )
        con.execute(
            f"CREATE TABLE seq AS SELECT users.uid, items.iid, e.ts, e.fr{extra} FROM kept e "
            "JOIN users ON e.u = users.u JOIN items ON e.i = items.i ORDER BY users.uid, e.ts, e.fr"
        )
        wide = con.execute(
            "SELECT users.u, s.lo, s.hi FROM (SELECT uid, min(ts) AS lo, max(ts) AS hi FROM seq GROUP BY uid "
            f"HAVING CAST(max(ts) AS HUGEINT) - min(ts) >= {2**63}) s JOIN users ON s.uid = users.uid "
            "ORDER BY s.uid LIMIT 1"
        ).fetchall()
        if wide:
            raise too_wide_span(source.source, *wide[0])
        interactions = self.count("SELECT count(*) FROM seq")
        self.stage("sequences", "%d interactions", interactions)
        return interactions

    def _side_tables(
        self, source: SourceTable, users: IdMap, items: IdMap
    ) -> Tuple[Dict[str, IdMap], Dict[str, List[str]]]:
        """items.parquet / users.parquet and their features' vocabularies -> (maps, dense column names)."""
        maps: Dict[str, IdMap] = {"users": users, "items": items}
        columns: Dict[str, List[str]] = {}
        tables = (
            (ITEMS_TABLE, source.item_side or read_side_table(self.con, "i", source.item_features), items),
            (USERS_TABLE, source.user_side or read_side_table(self.con, "u", source.user_features), users),
        )
        for name, table, ids in tables:
            if table is None:
                continue
            vocabularies, dense_columns = write_side_table(table, ids, self.tmp / name)
            maps.update(vocabularies)
            columns.update(dense_columns)
            self.stage(
                "side tables", "%s: %d rows, %d features", name, len(table.keys), len(vocabularies) + len(table.dense)
            )
        for feature in source.event_features:
            if feature.kind == DENSE:
                columns[feature.name] = list(feature.dense_columns)
        return maps, columns

    def _event_vocabularies(self, features: Sequence[Feature]) -> Dict[str, IdMap]:
        """{feature: IdMap offset 1} of the kept events' categorical and list features, in
        ``SideFeatures.align``'s order (categorical, then lists)."""
        vocabularies = {}
        for kind in (CATEGORICAL, LIST):
            for feature in (f for f in features if f.kind == kind):
                values = f"unnest({feature.column})" if kind == LIST else feature.column
                query = f"SELECT DISTINCT v FROM (SELECT {values} AS v FROM seq) ORDER BY v"
                vocabularies[feature.name] = IdMap(_raw_ids(self.con, query), offset=1)
        return vocabularies

    def _shards(self, source: SourceTable, num_users: int, users_per_shard: int) -> List[ShardEntry]:
        """Write every shard (``users_per_shard`` consecutive users each) -> their manifest entries."""
        self.con.execute("SET preserve_insertion_order = true")  # streamed in ORDER BY uid
        schema = _shard_schema(source)
        # One ordered aggregate of every event's values (one sort per user), split into the columns.
        values = shard_values(source)
        fields = {name: f"v{k}" for k, name in enumerate(values)}
        events = ", ".join(f"{fields[name]}: {column}" for name, column in values.items())
        columns = [f'list_transform(e, lambda x: x.{fields[name]}) AS "{name}"' for name in values]
        (self.tmp / SHARDS).mkdir()
        shards = []
        for index in range(math.ceil(num_users / users_per_shard)):
            first = index * users_per_shard
            last = min(num_users, first + users_per_shard)
            query = (
                f'SELECT uid AS "{USER}", {", ".join(columns)} FROM (SELECT uid, list({{{events}}} ORDER BY ts, fr) '
                f"AS e FROM seq WHERE uid >= {first} AND uid < {last} GROUP BY uid) ORDER BY uid"
            )
            relpath = shard_path(index)
            with pq.ParquetWriter(self.tmp / relpath, schema) as writer:
                for batch in self.con.sql(query).to_arrow_reader(ROW_GROUP_USERS):
                    writer.write_table(pa.Table.from_batches([batch]).cast(schema), row_group_size=ROW_GROUP_USERS)
            shards.append(describe_shard(self.tmp, relpath, first))
        return shards


def shard_values(source: SourceTable) -> Dict[str, str]:
    """{shard column: the SQL of its value per event in table ``seq``} of every per-event column."""
    values = {ITEMS: "iid", TIMESTAMPS: "ts", **({RATINGS: "r"} if source.has_ratings else {})}
    values.update({REQUESTS: "CAST(q AS VARCHAR)"} if source.has_requests else {})
    values.update({event_column(f.name): f.column for f in source.event_features})
    return values


def _raw_ids(con: duckdb.DuckDBPyConnection, query: str) -> np.ndarray:
    """The single column of ``query`` -> numpy raw ids (int64, or str)."""
    return raw_values(con.sql(query).to_arrow_table().column(0).combine_chunks())


def _shard_schema(source: SourceTable) -> pa.Schema:
    """The Arrow schema of a shard (``gr.data.prepared.manifest``'s columns)."""
    fields = [
        pa.field(USER, pa.int64()),
        pa.field(ITEMS, pa.list_(pa.int64())),
        pa.field(TIMESTAMPS, pa.list_(pa.int64())),
        *([pa.field(RATINGS, pa.list_(pa.float32()))] if source.has_ratings else []),
        *([pa.field(REQUESTS, pa.list_(pa.string()))] if source.has_requests else []),
        *(pa.field(event_column(f.name), pa.list_(ARROW_VALUES[f.kind])) for f in source.event_features),
    ]
    return pa.schema(fields)
