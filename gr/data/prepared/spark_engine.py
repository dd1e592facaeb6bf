"""``prepare_with_spark``: a prepared dataset (``gr.data.prepared.manifest``) written by Spark.

The DuckDB engine's transformation, as Spark DataFrame operations (no Python UDF: executors run
JVM code only):

1. read: the source's rows with their place in the files (``spark_read.read_rows``: the readers'
   rules and errors)
2. duplicates: rows repeating an earlier row's (user, item, timestamp) dropped, the first in file
   order kept (``row_number`` over the repeats), unless ``data.keep_duplicates``
3. filter: items with fewer than ``data.min_item_interactions`` events, then users with fewer than
   ``data.min_seq_len``; dense ids are positions in sorted raw ids, numbered in the engine (a
   range-partitioned sort, each partition's row ids shifted by the partitions before it)
4. side tables: each key's features at its last row in the files (``max_by`` over that place), or a
   MovieLens side file read by the readers; brought to the driver (catalogue- and user-sized) and
   written with their vocabularies (``side_tables.write_side_table``); the events' vocabularies
5. shards: per user ``sort_array(collect_list(struct(timestamp, place, ...)))`` (equal timestamps
   keep file order, as ``build_sequences``; request ids as text), repartitioned by shard and sorted
   by user, so each shard is one part file (moved into ``shards/``), in row groups of
   ``ROW_GROUP_USERS`` users (``parquet.block.row.count.limit``)

Only id maps, vocabularies, side tables and per-shard counts reach the driver.

On a cluster (YARN, Kubernetes, standalone), in client mode, DIR and the source on a file system
that the driver and every executor mount at the same path (Spark's executors write the part
files, the driver moves them)::

    spark-submit --master yarn --deploy-mode client --executor-memory 8g \\
        "$(python -c 'import gr.data.prepared.spark_engine as m; print(m.__file__)')" --config C --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from gr.data.config import DataConfig
from gr.data.interactions import SideTable
from gr.data.mappings import IdMap, save_mappings
from gr.data.prepared.manifest import (
    DEFAULT_USERS_PER_SHARD,
    ITEMS,
    ITEMS_TABLE,
    MAPS,
    RATINGS,
    REQUESTS,
    ROW_GROUP_USERS,
    SHARDS,
    SIDE_KEY,
    TIMESTAMPS,
    USER,
    USERS_TABLE,
    PreparedManifest,
    ShardEntry,
    config_data,
    config_hash,
    describe_shard,
    event_column,
    file_checksums,
    prepared_summary,
    shard_path,
    write_manifest,
)
from gr.data.prepared.side_tables import CATEGORICAL, DENSE, LIST, side_table_from_arrow, write_side_table
from gr.data.prepared.spark_read import (
    INT64_SPAN,
    ITEM,
    ORD,
    RATING,
    REQUEST,
    TIME,
    Source,
    feature_column,
    read_failures,
    read_rows,
    source_of,
)
from gr.data.prepared.spark_read import USER as RAW_USER
from gr.data.readers import log_duplicates, side_table_summary
from gr.data.sequences import log_rare_items, log_short_users, no_user_left, too_wide_span
from gr.utils.atomic import atomic_directory

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

log = logging.getLogger(__name__)

ENGINE = "spark"
PARTITION_BITS = 33  # monotonically_increasing_id() = partition index << 33 | row within the partition
DEFAULT_MASTER = "local[2]"
SCRATCH = ".spark"  # inside the output's temporary directory: Spark's part files and spill files
READ_CONF = {
    # Parquet nanosecond timestamps as int64 nanoseconds (floored to seconds here), and timestamps
    # without a time zone read as their stored value, so no session time zone shifts them.
    "spark.sql.legacy.parquet.nanosAsLong": "true",
    "spark.sql.parquet.inferTimestampNTZ.enabled": "false",
}


def prepare_with_spark(
    config: DataConfig,
    out: Union[str, Path],
    master: str = DEFAULT_MASTER,
    users_per_shard: int = DEFAULT_USERS_PER_SHARD,
    memory: Optional[str] = None,
    overwrite: bool = False,
) -> PreparedManifest:
    """Prepare ``config``'s source into the directory ``out`` (written beside it, renamed at the end).

    master: Spark's master URL ("local[N]": N threads; "yarn", "spark://host:7077", ...), used when
    no SparkSession is active and the process was not started by spark-submit (whose --master and
    resources then apply); memory: the driver's and executors' heap (e.g. "8g") of a session
    started here; users_per_shard: users per shard file (the last may hold fewer); overwrite:
    replace an existing ``out``. Bad input raises DataFormatError / ValueError naming the file,
    line (or row), column or config key.
    """
    if users_per_shard < 1:
        raise ValueError(f"users_per_shard: expected a positive number of users, got {users_per_shard}")
    source = source_of(config)  # the driver's checks, before Spark starts
    with atomic_directory(Path(out), command="gr data prepare", overwrite=overwrite) as tmp:
        scratch = tmp / SCRATCH
        with spark_session(master, memory, scratch / "local") as spark, _conf(spark, READ_CONF):
            with read_failures(source):  # Spark reads the source lazily, in the jobs that follow
                manifest = _prepare(spark, config, source, tmp, scratch, users_per_shard)
        shutil.rmtree(scratch, ignore_errors=True)
        manifest.files = file_checksums(tmp)
        write_manifest(tmp, manifest)
    manifest.directory = Path(out)
    return manifest


@contextlib.contextmanager
def spark_session(master: str, memory: Optional[str], local_dir: Path) -> Iterator[SparkSession]:
    """The active SparkSession, else a new one (stopped on exit): on ``master`` unless spark-submit
    started this process, with ``memory`` for the driver and executors, spilling under ``local_dir``."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    builder = SparkSession.builder.appName("gr data prepare").config("spark.local.dir", str(local_dir))
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # spark-submit sets it (and its own master)
        builder = builder.master(master)
    if memory is not None:
        builder = builder.config("spark.driver.memory", memory).config("spark.executor.memory", memory)
    session = builder.getOrCreate()
    try:
        yield session
    finally:
        session.stop()


@contextlib.contextmanager
def _conf(spark: SparkSession, values: Mapping[str, str]) -> Iterator[None]:
    """``values`` set in the session's SQL conf for the block; the earlier values restored after."""
    before = {key: spark.conf.get(key, None) for key in values}
    for key, value in values.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, earlier in before.items():
            if earlier is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, earlier)


def _prepare(
    spark: SparkSession, config: DataConfig, source: Source, tmp: Path, scratch: Path, users_per_shard: int
) -> PreparedManifest:
    """The preparation's stages (the module docstring) -> its manifest (without ``files``)."""
    import pyspark
    from pyspark import StorageLevel
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    cached: List[DataFrame] = []  # every DataFrame persisted on the way, unpersisted at the end
    try:
        rows = read_rows(spark, source, cached)
        first = Window.partitionBy(RAW_USER, ITEM, TIME).orderBy(ORD)
        marked = rows.withColumn("repeat", F.row_number().over(first) > 1)
        cached.append(marked.persist(StorageLevel.MEMORY_AND_DISK))
        read, duplicates = _first(marked.agg(F.count(F.lit(1)), F.count_if(F.col("repeat"))))
        log_duplicates(source.source, duplicates, not config.keep_duplicates)
        events = marked if config.keep_duplicates else marked.filter(~F.col("repeat"))
        events = _frequent_items(events, source.source, config.min_item_interactions, cached)
        users = _kept_users(events, source.source, config.min_seq_len, cached)
        user_index, user_map = _numbered(users, RAW_USER, "user_id", cached)
        events = events.join(user_index, RAW_USER)
        item_index, item_map = _numbered(events.select(ITEM).distinct(), ITEM, "item_id", cached)
        events = events.join(item_index, ITEM)
        cached.append(events.persist(StorageLevel.MEMORY_AND_DISK))
        maps: Dict[str, IdMap] = {"users": user_map, "items": item_map}
        sides = side_table_summary(config, {"users": source.user_side, "items": source.item_side}, maps)
        columns: Dict[str, List[str]] = {}
        for side, name, ids in (("item", ITEMS_TABLE, item_map), ("user", USERS_TABLE, user_map)):
            table = _side_table(source, rows, side)
            if table is not None:
                vocabularies, dense_columns = write_side_table(table, ids, tmp / name)
                maps.update(vocabularies)
                columns.update(dense_columns)
        event_kinds = source.features["event"]
        maps.update(_vocabularies(events, event_kinds))
        columns.update({n: source.dense_columns[n] for n, kind in event_kinds.items() if kind == DENSE})
        save_mappings(str(tmp / MAPS), maps, columns)
        shards = _write_shards(events, len(user_map.raw), source, tmp, scratch, users_per_shard)
    finally:
        for frame in cached:
            frame.unpersist()
    interactions = sum(shard.interactions for shard in shards)
    log.info(
        "%s: %d users, %d items, %d interactions", source.source, len(user_map.raw), len(item_map.raw), interactions
    )
    return PreparedManifest(
        directory=tmp,
        engine=ENGINE,
        engine_version=pyspark.__version__,
        config_hash=config_hash(config),
        data=config_data(config),
        summary={
            **prepared_summary(
                source.source,
                read,
                duplicates,
                config.keep_duplicates,
                len(user_map.raw),
                len(item_map.raw),
                interactions,
            ),
            **sides,
        },
        has_ratings=source.has_ratings,
        event_features=dict(event_kinds),
        shards=shards,
    )


def _first(frame: DataFrame) -> Any:
    """The first row of ``frame`` (an aggregate's one row)."""
    row = frame.first()
    assert row is not None  # an aggregate without grouping has one row
    return row


def _frequent_items(events: DataFrame, source: str, minimum: int, cached: List[DataFrame]) -> DataFrame:
    """``events`` of the items with at least ``minimum`` of them (``build_sequences``' log line)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    if minimum <= 1:
        return events
    counts = events.groupBy(ITEM).agg(F.count(F.lit(1)).alias("n"))
    cached.append(counts.persist(StorageLevel.MEMORY_AND_DISK))
    items, rare = _first(counts.agg(F.count(F.lit(1)), F.count_if(F.col("n") < minimum)))
    log_rare_items(source, rare, items, minimum)
    return events.join(counts.filter(F.col("n") >= minimum).select(ITEM), ITEM, "left_semi")


def _kept_users(events: DataFrame, source: str, min_seq_len: int, cached: List[DataFrame]) -> DataFrame:
    """The raw ids (USER) of the users with at least ``min_seq_len`` events; ``build_sequences``'
    log line and errors (no user left, a user's timestamps 2^63 s or more apart)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    per_user = events.groupBy(RAW_USER).agg(
        F.count(F.lit(1)).alias("n"), F.min(TIME).alias("first"), F.max(TIME).alias("last")
    )
    cached.append(per_user.persist(StorageLevel.MEMORY_AND_DISK))
    kept = F.col("n") >= min_seq_len
    span = F.col("last").cast("decimal(20,0)") - F.col("first").cast("decimal(20,0)")
    wide = kept & (span >= F.lit(str(INT64_SPAN)).cast("decimal(20,0)"))
    users, short, first_wide = _first(
        per_user.agg(F.count(F.lit(1)), F.count_if(~kept), F.min(F.when(wide, F.struct(RAW_USER, "first", "last"))))
    )
    log_short_users(source, short, users, min_seq_len)
    if short == users:
        raise no_user_left(source, min_seq_len)
    if first_wide is not None:
        raise too_wide_span(source, *first_wide)
    return per_user.filter(kept).select(RAW_USER)


def _numbered(keys: DataFrame, key: str, name: str, cached: List[DataFrame]) -> Tuple[DataFrame, IdMap]:
    """(DataFrame [key, name]: each distinct ``key`` of ``keys`` and its position in sorted order,
    the IdMap of the sorted keys). A range-partitioned sort numbers the keys: a partition's first
    position is the count of the keys before it (read off the keys collected for the map)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    ordered = keys.orderBy(key).select(key, F.monotonically_increasing_id().alias("row_id"))
    cached.append(ordered.persist(StorageLevel.MEMORY_AND_DISK))
    collected = ordered.toArrow()
    column, row_ids = collected.column(0).combine_chunks(), collected.column(1).to_numpy()
    raw = column.to_numpy() if pa.types.is_integer(column.type) else column.to_numpy(zero_copy_only=False).astype(str)
    if len(raw) > 1 and not bool((raw[1:] > raw[:-1]).all()):
        raise RuntimeError(f"Spark sorted the {name} keys in another order than numpy (IdMap.of) sorts them")
    partitions, starts = np.unique(row_ids >> PARTITION_BITS, return_index=True)
    firsts = F.create_map(*[F.lit(int(v)) for pair in zip(partitions, starts) for v in pair])
    partition = F.shiftright("row_id", PARTITION_BITS)
    within = F.col("row_id").bitwiseAND((1 << PARTITION_BITS) - 1)
    return ordered.select(key, (F.element_at(firsts, partition) + within).alias(name)), IdMap(raw)


def _side_table(source: Source, rows: DataFrame, side: str) -> Optional[SideTable]:
    """The ``side`` ("item" | "user") side table: a MovieLens side file's, or each key's declared
    features at its last row in the files (all rows read, as ``readers._last_value_table``)."""
    from pyspark.sql import functions as F

    kinds = source.features[side]
    if not kinds:
        return source.item_side if side == "item" else source.user_side
    key = ITEM if side == "item" else RAW_USER
    last = F.max_by(F.struct(*[F.col(f"`{feature_column(n)}`").alias(n) for n in kinds]), ORD)
    table = rows.groupBy(key).agg(last.alias("last")).orderBy(key)
    table = table.select(F.col(key).alias(SIDE_KEY), *[F.col("last")[n].alias(n) for n in kinds])
    return side_table_from_arrow(table.toArrow(), kinds, source.dense_columns)


def _vocabularies(events: DataFrame, kinds: Mapping[str, str]) -> Dict[str, IdMap]:
    """{feature: IdMap (offset 1)} of the kept events' categorical, then list features
    (``SideFeatures.align``'s vocabularies and order)."""
    from pyspark.sql import functions as F

    def column(name: str) -> Column:
        return F.col(f"`{feature_column(name)}`")

    found: Dict[str, list] = {}
    single = [n for n, kind in kinds.items() if kind == CATEGORICAL]
    if single:
        found.update(zip(single, _first(events.agg(*[F.collect_set(column(n)) for n in single]))))
    for name in (n for n, kind in kinds.items() if kind == LIST):
        found[name] = _first(events.select(F.explode(column(name)).alias("v")).agg(F.collect_set("v")))[0]
    return {name: IdMap.of(np.asarray(values, dtype=str), offset=1) for name, values in found.items()}


def _write_shards(
    events: DataFrame, users: int, source: Source, tmp: Path, scratch: Path, users_per_shard: int
) -> List[ShardEntry]:
    """Write ``tmp/shards/part-NNNNN.parquet`` (shard k: dense users from k * users_per_shard) ->
    their manifest entries. Spark writes each shard as the one part file of its partition
    (repartitioned by shard, sorted by user); the driver moves it into place and checks it."""
    from pyspark.sql import functions as F

    features = list(source.features["event"])
    values = {ITEMS: "item_id", TIMESTAMPS: TIME, **({RATINGS: RATING} if source.has_ratings else {})}
    if source.columns.request is not None:  # the raw ids as text (``gr.data.prepared.manifest``)
        values[REQUESTS] = REQUEST
        events = events.withColumn(REQUEST, F.col(REQUEST).cast("string"))
    values.update({event_column(f): feature_column(f) for f in features})
    fields = [F.col(TIME), F.col(ORD), *[F.col(f"`{c}`") for c in values.values() if c != TIME]]
    grouped = events.groupBy("user_id").agg(F.sort_array(F.collect_list(F.struct(*fields))).alias("e"))
    columns = [F.transform("e", _field(c)).alias(name) for name, c in values.items()]
    count = -(-users // users_per_shard)
    written = scratch / SHARDS
    (
        grouped.select(F.expr(f"user_id div {users_per_shard}").alias("shard"), F.col("user_id").alias(USER), *columns)
        .repartition(count, "shard")
        .sortWithinPartitions("shard", USER)
        .write.partitionBy("shard")
        .option("parquet.block.row.count.limit", ROW_GROUP_USERS)
        .option("parquet.block.size", 1 << 40)  # a row group ends at ROW_GROUP_USERS users, not at a size
        .parquet(str(written))
    )
    (tmp / SHARDS).mkdir()
    entries = []
    for index in range(count):
        parts = sorted(p for p in (written / f"shard={index}").glob("*.parquet") if not p.name.startswith("."))
        if len(parts) != 1:
            raise RuntimeError(f"{written}/shard={index}: Spark wrote {len(parts)} part files, expected one")
        first = index * users_per_shard
        os.replace(parts[0], tmp / shard_path(index))
        _check_shard_users(tmp / shard_path(index), first, min(users_per_shard, users - first))
        entries.append(describe_shard(tmp, shard_path(index), first))
    return entries


def _field(name: str) -> Callable[[Column], Column]:
    """The one-argument lambda (Spark reads its arity) taking a struct's field ``name``."""
    return lambda x: x[name]


def _check_shard_users(path: Path, first_user: int, users: int) -> None:
    """A written shard holds dense users ``first_user`` .. ``first_user + users - 1`` in order, in
    row groups of at most ROW_GROUP_USERS users (read one row group's user column at a time)."""
    parquet = pq.ParquetFile(path)
    expected = first_user
    for group in range(parquet.num_row_groups):
        ids = parquet.read_row_group(group, columns=[USER])[USER].to_numpy()
        if len(ids) > ROW_GROUP_USERS or not np.array_equal(ids, np.arange(expected, expected + len(ids))):
            raise RuntimeError(f"{path}: row group {group} does not hold users {expected} .. in order")
        expected += len(ids)
    if expected != first_user + users:
        raise RuntimeError(f"{path}: holds {expected - first_user} users, expected {users}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``spark-submit .../spark_engine.py --config C --out DIR`` (or ``python -m`` this module)."""
    from gr.utils.cli_errors import run_cli

    parser = argparse.ArgumentParser(
        prog="gr.data.prepared.spark_engine",
        description="Prepare the data section of a config with Spark (gr data prepare --engine spark), "
        "e.g. through spark-submit, whose --master and resources apply.",
    )
    parser.add_argument("--config", required=True, type=Path, help="recipe YAML (its data: section is read)")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="the prepared dataset to write")
    parser.add_argument("--master", default=DEFAULT_MASTER, help="Spark master URL when not under spark-submit")
    parser.add_argument("--users-per-shard", type=int, default=DEFAULT_USERS_PER_SHARD)
    parser.add_argument("--memory", help="driver and executor heap of a session started here, e.g. 8g")
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    args = parser.parse_args(argv)

    def run() -> int:
        values = yaml.safe_load(args.config.read_text(encoding="utf8"))
        data = values.get("data") if isinstance(values, dict) else None
        if not isinstance(data, dict):
            raise ValueError(f"{args.config}: expected a data: section (a mapping)")
        config = DataConfig.from_dict(data)
        manifest = prepare_with_spark(
            config, args.out, args.master, args.users_per_shard, args.memory, overwrite=args.overwrite
        )
        print(json.dumps(manifest.summary))
        return 0

    logging.basicConfig(level=logging.INFO)
    return run_cli("gr.data.prepared.spark_engine", run)


if __name__ == "__main__":
    raise SystemExit(main())
