"""``prepare_with_spark``: a prepared dataset (``gr.data.prepared.manifest``) made by Spark.

The same transformation as the DuckDB engine, as Spark DataFrame operations: read the source
(``gr.data.prepared.spark_read``), drop repeated (user, item, timestamp) rows keeping the first in
the files' order, drop items then users below the config's minimums, number users and items by
their sorted raw ids, gather each user's events sorted by (timestamp, file order) and write one
Parquet file per shard of consecutive users (row groups of ``ROW_GROUP_USERS`` users). Only id
maps, vocabularies and per-file / per-shard counts reach the driver.

On a cluster: ``spark-submit --master yarn ... -m gr.data.prepared.spark_engine --config C --out
DIR`` (the module's command line), with DIR on a file system that the driver and every executor
mount at the same path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gr.data.config import DataConfig
from gr.data.features import SideFeatures
from gr.data.interactions import DataFormatError, SideTable
from gr.data.mappings import IdMap, save_mappings
from gr.data.prepared.manifest import (
    ITEMS,
    ITEMS_TABLE,
    MAPS,
    RATINGS,
    ROW_GROUP_USERS,
    SHARDS,
    SIDE_KEY,
    TIMESTAMPS,
    USER,
    USERS_TABLE,
    PreparedManifest,
    config_hash,
    describe_shard,
    event_column,
    file_checksums,
    shard_path,
    write_manifest,
)
from gr.data.prepared.spark_read import (
    ITEM,
    ORD,
    PARTITION_BITS,
    RATING,
    TIME,
    INT64_SPAN,
    SourceRows,
    feature_column,
    read_rows,
)
from gr.data.prepared.spark_read import USER as RAW_USER
from gr.utils.atomic import atomic_directory

log = logging.getLogger(__name__)

USERS_PER_SHARD = 100_000
SCRATCH = ".spark"  # inside the output's temporary directory: Spark's part files and local spill
READ_CONF = {
    # Parquet nanosecond timestamps as int64 nanoseconds (floored to seconds), and timestamps
    # without a time zone read as their stored value (no session time zone applied).
    "spark.sql.legacy.parquet.nanosAsLong": "true",
    "spark.sql.parquet.inferTimestampNTZ.enabled": "false",
}


@contextlib.contextmanager
def spark_session(master: str, memory: Optional[str], local_dir: Path) -> Iterator[object]:
    """The active SparkSession, or a new one (stopped on exit) on ``master`` with ``memory`` for
    the driver and executors and its spill files under ``local_dir``. Under spark-submit, the
    master and resources are spark-submit's."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    builder = SparkSession.builder.appName("gr data prepare").config("spark.local.dir", str(local_dir))
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # not launched by spark-submit
        builder = builder.master(master)
    if memory is not None:
        builder = builder.config("spark.driver.memory", memory).config("spark.executor.memory", memory)
    session = builder.getOrCreate()
    try:
        yield session
    finally:
        session.stop()


@contextlib.contextmanager
def _session_conf(spark, values: Dict[str, str]) -> Iterator[None]:
    """``values`` set on the session's SQL conf for the block, the previous values restored after."""
    before = {key: spark.conf.get(key, None) for key in values}
    for key, value in values.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


def prepare_with_spark(
    config: DataConfig,
    out: Path,
    master: str = "local[2]",
    users_per_shard: int = USERS_PER_SHARD,
    memory: Optional[str] = None,
) -> PreparedManifest:
    """Prepare ``config``'s source into the directory ``out`` (written in a temporary sibling and
    renamed at the end; an existing ``out`` is a FileExistsError) and return its manifest.

    master: Spark's master URL (``local[N]``: N threads) when no session is active and the process
    was not launched by spark-submit; memory: e.g. "8g", the driver's and executors' heap."""
    if users_per_shard < 1:
        raise ValueError(f"users_per_shard: expected at least 1, got {users_per_shard}")
    out = Path(out)
    with atomic_directory(out) as temp:
        scratch = temp / SCRATCH
        with spark_session(master, memory, scratch / "local") as spark, _session_conf(spark, READ_CONF):
            manifest = _prepare(spark, config, temp, scratch, users_per_shard)
        shutil.rmtree(scratch, ignore_errors=True)
        manifest.files = file_checksums(temp)
        write_manifest(temp, manifest)
    manifest.directory = out
    return manifest


def _prepare(spark, config: DataConfig, temp: Path, scratch: Path, users_per_shard: int) -> PreparedManifest:
    import pyspark

    cached: List = []  # the DataFrames persisted on the way, unpersisted at the end
    try:
        source = read_rows(spark, config, cached)
        return _prepared(config, source, temp, scratch, users_per_shard, cached, pyspark.__version__)
    finally:
        for frame in cached:
            frame.unpersist()


def _prepared(
    config: DataConfig,
    source: SourceRows,
    temp: Path,
    scratch: Path,
    users_per_shard: int,
    cached: List,
    version: str,
) -> PreparedManifest:
    """``_prepare`` past reading: side tables, duplicates, filters, numbering, shards, maps."""
    from pyspark import StorageLevel
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    vocabularies: Dict[str, IdMap] = {}
    dense_columns: Dict[str, List[str]] = {}
    for side, table_name in (("item", ITEMS_TABLE), ("user", USERS_TABLE)):
        found = _side_table(config, source.rows, side, temp / table_name, scratch)
        if found is not None:
            vocabularies.update(found[0])
            dense_columns.update(found[1])
    first = Window.partitionBy(RAW_USER, ITEM, TIME).orderBy(ORD)
    marked = source.rows.withColumn("repeat", F.row_number().over(first) > 1)
    cached.append(marked.persist(StorageLevel.MEMORY_AND_DISK))
    rows_read, repeats = marked.agg(F.count(F.lit(1)), F.count_if(F.col("repeat"))).first()
    _log_duplicates(source.source, repeats, config.keep_duplicates)
    events = marked if config.keep_duplicates else marked.filter(~F.col("repeat"))
    events = _frequent_items(events, source.source, config.min_item_interactions)
    users = _kept_users(events, source.source, config.min_seq_len, cached)
    user_index, user_map = _numbered(users, RAW_USER, "user_id", cached)
    events = events.join(user_index, RAW_USER)
    item_index, item_map = _numbered(events.select(ITEM).distinct(), ITEM, "item_id", cached)
    events = events.join(item_index, ITEM)
    cached.append(events.persist(StorageLevel.MEMORY_AND_DISK))

    event_kinds = {name: source.features[name] for name in _row_features(config)}
    shards = _write_shards(events, len(user_map.raw), list(event_kinds), source.has_ratings, temp, scratch, users_per_shard)
    vocabularies.update(_vocabularies(events, event_kinds, lambda n: F.col(f"`{feature_column(n)}`")))
    dense_columns.update({n: _dense_names(config, n) for n, kind in event_kinds.items() if kind == "dense"})
    save_mappings(str(temp / MAPS), {"users": user_map, "items": item_map, **vocabularies}, dense_columns)
    interactions = sum(shard.interactions for shard in shards)
    log.info("%s: %d users, %d items, %d interactions", source.source, len(user_map.raw), len(item_map.raw), interactions)
    dropped = 0 if config.keep_duplicates else repeats
    summary = {
        "source": source.source,
        "rows_read": rows_read,
        "duplicates_dropped": dropped,
        "duplicates_kept": repeats - dropped,
        "users": len(user_map.raw),
        "items": len(item_map.raw),
        "interactions": interactions,
    }
    return PreparedManifest(
        directory=temp,
        engine="spark",
        engine_version=version,
        config_hash=config_hash(config),
        data=json.loads(json.dumps(config.to_dict())),
        summary=summary,
        has_ratings=source.has_ratings,
        event_features=event_kinds,
        shards=shards,
    )


def _log_duplicates(source: str, repeats: int, keep: bool) -> None:
    """``readers.read_source``'s log line about repeated (user, item, timestamp) rows."""
    if repeats and not keep:
        log.warning(
            "%s: dropped %d duplicate interactions (same user, item and timestamp as an earlier row); "
            "set data.keep_duplicates: true to keep them",
            source,
            repeats,
        )
    elif repeats:
        log.info("%s: kept %d duplicate interactions (data.keep_duplicates)", source, repeats)


def _frequent_items(events, source: str, minimum: int):
    """``events`` without the items that have fewer than ``minimum`` of them (logged as
    ``build_sequences`` logs it)."""
    from pyspark.sql import functions as F

    if minimum <= 1:
        return events
    counts = events.groupBy(ITEM).agg(F.count(F.lit(1)).alias("n"))
    total, rare = counts.agg(F.count(F.lit(1)), F.count_if(F.col("n") < minimum)).first()
    log.info(
        "%s: dropped %d of %d items with fewer than %d interactions (data.min_item_interactions)",
        source,
        rare,
        total,
        minimum,
    )
    return events.join(counts.filter(F.col("n") >= minimum).select(ITEM), ITEM, "left_semi")


def _kept_users(events, source: str, min_seq_len: int, cached: List):
    """The raw ids (column USER) of the users with at least ``min_seq_len`` events; the users
    dropped are logged, no user left or a user whose timestamps span 2^63 s or more raise
    DataFormatError (``build_sequences``' checks and words)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    per_user = events.groupBy(RAW_USER).agg(
        F.count(F.lit(1)).alias("n"), F.min(TIME).alias("first"), F.max(TIME).alias("last")
    )
    cached.append(per_user.persist(StorageLevel.MEMORY_AND_DISK))
    kept = F.col("n") >= min_seq_len
    span = F.col("last").cast("decimal(20,0)") - F.col("first").cast("decimal(20,0)")
    wide = kept & (span >= F.lit(str(INT64_SPAN)).cast("decimal(20,0)"))
    total, short, first_wide = per_user.agg(
        F.count(F.lit(1)), F.count_if(~kept), F.min(F.when(wide, F.struct(RAW_USER, "first", "last")))
    ).first()
    if short:
        log.warning(
            "%s: dropped %d of %d users with fewer than %d interactions (data.min_seq_len; leave-one-out "
            "needs a training, a validation and a test event per user)",
            source,
            short,
            total,
            min_seq_len,
        )
    if short == total:
        raise DataFormatError(
            source,
            f"no user has at least {min_seq_len} interactions (data.min_seq_len): the dataset is empty after filtering",
        )
    if first_wide is not None:
        user, first, last = first_wide
        raise DataFormatError(
            source,
            f"user {user!r}: timestamps from {first} to {last} lie 2^63 s or more apart "
            "(the model takes their differences in int64)",
        )
    return per_user.filter(kept).select(RAW_USER)


def _numbered(keys, key: str, name: str, cached: List) -> Tuple[object, IdMap]:
    """(DataFrame [key, name]: each distinct ``key`` with its position in sorted order, the IdMap
    of the sorted keys). Numbered in the engine: a range-partitioned sort, then each partition's
    row ids shifted by the sizes of the partitions before it (counted from the keys collected for
    the map)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    ordered = keys.orderBy(key).select(key, F.monotonically_increasing_id().alias("row_id"))
    cached.append(ordered.persist(StorageLevel.MEMORY_AND_DISK))
    collected = ordered.toArrow()
    column, row_ids = collected.column(0), collected.column(1).to_numpy()
    raw = column.to_numpy() if pa.types.is_integer(column.type) else column.to_numpy(zero_copy_only=False).astype(str)
    if len(raw) > 1 and not bool((raw[1:] > raw[:-1]).all()):
        raise RuntimeError(f"Spark sorted the {key} ids in another order than numpy sorts them")
    partitions, starts = np.unique(row_ids >> PARTITION_BITS, return_index=True)
    pairs = [F.lit(int(v)) for p, start in zip(partitions, starts) for v in (p, start)]
    partition = F.shiftright("row_id", PARTITION_BITS)
    within = F.col("row_id").bitwiseAND((1 << PARTITION_BITS) - 1)
    index = ordered.select(key, (F.element_at(F.create_map(*pairs), partition) + within).alias(name))
    return index, IdMap(raw)


def _row_features(config: DataConfig) -> List[str]:
    """The interaction rows' own features in ``Interactions.row_side``'s order: categorical, dense, lists."""
    columns = config.columns
    if config.source not in ("csv", "parquet"):
        return []
    single = [c for c in columns.token_features if c not in columns.list_features]
    lists = [c for c in columns.token_features if c in columns.list_features]
    return [*single, *columns.token_dense, *lists]


def _dense_names(config: DataConfig, name: str) -> List[str]:
    groups = {**config.columns.token_dense, **config.columns.item_dense, **config.columns.user_dense}
    return list(groups[name])


def _vocabularies(frame, kinds: Mapping[str, str], column_of) -> Dict[str, IdMap]:
    """{feature: IdMap (offset 1) of its distinct values in ``frame``} (``SideFeatures.align``'s
    vocabularies) of the categorical and list features in ``kinds``; column_of(feature): its column."""
    from pyspark.sql import functions as F

    single = [n for n, kind in kinds.items() if kind == "categorical"]
    found: Dict[str, list] = {}
    if single:
        found.update(zip(single, frame.agg(*[F.collect_set(column_of(n)) for n in single]).first()))
    for name in (n for n, kind in kinds.items() if kind == "list"):
        found[name] = frame.select(F.explode(column_of(name)).alias("v")).agg(F.collect_set("v")).first()[0]
    return {name: IdMap.of(np.asarray(found[name], dtype=str), offset=1) for name in kinds if name in found}


def _write_shards(
    events, users: int, row_features: Sequence[str], has_ratings: bool, temp: Path, scratch: Path, users_per_shard: int
) -> List:
    """Write ``temp/shards/part-NNNNN.parquet`` (shard k: dense users k*users_per_shard ...) and
    return their manifest entries. Spark writes each shard as one part file of its own partition
    (repartitioned by shard, sorted by user), which is then moved into place."""
    from pyspark.sql import functions as F

    fields = [TIME, ORD, "item_id", *([RATING] if has_ratings else []), *[feature_column(f) for f in row_features]]
    grouped = events.groupBy("user_id").agg(F.sort_array(F.collect_list(F.struct(*fields))).alias("e"))

    def each(field: str):
        return F.transform("e", lambda x: x[field])

    columns = [F.col("user_id").alias(USER), each("item_id").alias(ITEMS), each(TIME).alias(TIMESTAMPS)]
    columns += [each(RATING).alias(RATINGS)] if has_ratings else []
    columns += [each(feature_column(f)).alias(event_column(f)) for f in row_features]
    shard = F.expr(f"user_id div {users_per_shard}").alias("shard")
    count = -(-users // users_per_shard)
    written = scratch / "shards"
    (
        grouped.select(shard, *columns)
        .repartition(count, "shard")
        .sortWithinPartitions("shard", USER)
        .write.partitionBy("shard")
        .option("parquet.block.row.count.limit", ROW_GROUP_USERS)
        .option("parquet.block.size", 1 << 40)  # row groups end at ROW_GROUP_USERS users, not at a size
        .parquet(str(written))
    )
    (temp / SHARDS).mkdir()
    entries = []
    for k in range(count):
        parts = sorted(p for p in (written / f"shard={k}").glob("*.parquet") if not p.name.startswith("."))
        if len(parts) != 1:
            raise RuntimeError(f"{written / f'shard={k}'}: Spark wrote {len(parts)} part files, expected 1")
        os.replace(parts[0], temp / shard_path(k))
        entry = describe_shard(temp, shard_path(k), k * users_per_shard)
        _check_shard_users(temp / shard_path(k), k * users_per_shard, min(users_per_shard, users - k * users_per_shard))
        entries.append(entry)
    return entries


def _check_shard_users(path: Path, first_user: int, users: int) -> None:
    """A written shard holds dense users first_user .. first_user+users-1 in order, in row groups
    of at most ROW_GROUP_USERS users (read one row group's user column at a time)."""
    parquet = pq.ParquetFile(path)
    expected = first_user
    for g in range(parquet.num_row_groups):
        ids = parquet.read_row_group(g, columns=[USER])[USER].to_numpy()
        if len(ids) > ROW_GROUP_USERS or not np.array_equal(ids, np.arange(expected, expected + len(ids))):
            raise RuntimeError(f"{path}: row group {g} does not hold the next {len(ids)} users from {expected}")
        expected += len(ids)
    if expected != first_user + users:
        raise RuntimeError(f"{path}: holds users {first_user} .. {expected - 1}, expected {users} users")


def _side_features(config: DataConfig, side: str) -> Tuple[List[str], List[str], List[str]]:
    """(categorical, dense, list) features of a table source's ``side`` ("item" | "user")."""
    columns = config.columns
    declared = getattr(columns, f"{side}_features")
    single = [c for c in declared if c not in columns.list_features]
    lists = [c for c in declared if c in columns.list_features]
    return single, list(getattr(columns, f"{side}_dense")), lists


def _side_table(config: DataConfig, rows, side: str, path: Path, scratch: Path):
    """Write ``path`` (items.parquet / users.parquet) when the source has ``side`` features and
    return ({feature: vocabulary}, {dense feature: column names}); None when it has none."""
    if not getattr(config, f"{side}_features"):
        return None
    if config.source in ("csv", "parquet"):
        return _table_side(config, rows, side, path, scratch)
    return None


def _table_side(config: DataConfig, rows, side: str, path: Path, scratch: Path):
    """A table source's side table: each key's features at its last row in the files (all rows
    read, as ``readers._last_value_table``), sorted by key, written by Spark as one file."""
    from pyspark.sql import functions as F

    single, dense, lists = _side_features(config, side)
    names = [*single, *dense, *lists]
    if not names:
        return None
    key = RAW_USER if side == "user" else ITEM
    last = F.max_by(F.struct(*[F.col(f"`{feature_column(n)}`").alias(n) for n in names]), ORD)
    table = rows.groupBy(key).agg(last.alias("last"))
    table = table.select(F.col(key).alias(SIDE_KEY), *[F.col("last")[n].alias(n) for n in names])
    written = scratch / path.stem
    table.orderBy(SIDE_KEY).coalesce(1).write.parquet(str(written))
    parts = sorted(p for p in written.glob("*.parquet") if not p.name.startswith("."))
    if len(parts) != 1:
        raise RuntimeError(f"{written}: Spark wrote {len(parts)} part files, expected 1")
    os.replace(parts[0], path)
    kinds = {**{n: "categorical" for n in single}, **{n: "list" for n in lists}}
    vocabularies = _vocabularies(table, kinds, lambda n: F.col(f"`{n}`"))
    return vocabularies, {n: _dense_names(config, n) for n in dense}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m gr.data.prepared.spark_engine --config C --out DIR`` (also under spark-submit)."""
    from gr.utils.cli_errors import one_line

    parser = argparse.ArgumentParser(
        prog="python -m gr.data.prepared.spark_engine",
        description="Prepare a config's data source with Spark (run it directly, or through spark-submit).",
    )
    parser.add_argument("--config", required=True, type=Path, help="a YAML config; its data: section is read")
    parser.add_argument("--out", required=True, type=Path, help="the prepared dataset directory to create")
    parser.add_argument("--master", default="local[2]", help="Spark master URL when not under spark-submit")
    parser.add_argument("--users-per-shard", type=int, default=USERS_PER_SHARD)
    parser.add_argument("--memory", help="driver and executor memory, e.g. 8g")
    args = parser.parse_args(argv)
    import yaml

    try:
        raw = yaml.safe_load(args.config.read_text(encoding="utf8")) or {}
        config = DataConfig.from_dict(raw.get("data", {}) if isinstance(raw, dict) else {})
        manifest = prepare_with_spark(config, args.out, args.master, args.users_per_shard, args.memory)
    except (OSError, ValueError) as error:
        print(f"error: {one_line(error)}")
        return 2
    print(json.dumps(manifest.summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
