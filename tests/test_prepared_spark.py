"""gr data prepare's Spark engine writes what the DuckDB engine writes (the same shards, maps, side
tables and summary) and what the readers give, and refuses bad input with the readers' words.

One SparkSession (local[2]) serves the module. The CSV partition test reads its files in 4 KB
splits, so line numbers and file order are checked across many Spark partitions; the rest keep
Spark's default splits (each Spark job costs seconds here). The table CSV is prepared once, by
``gr data prepare --engine spark``, for the test of that command and the test of the table. The
DuckDB module covers each source and bad input against the readers; this one checks that Spark
writes what DuckDB writes.
"""

import contextlib
import io
import shutil
from pathlib import Path
from typing import Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_prepared_duckdb import (
    COLUMNS,
    HEADER,
    assert_prepared_equals_raw,
    corrupt_events,
    ml_100k_dir,
    table_config,
    table_rows,
    write_csv,
    write_source,
)
from test_prepared_stream import data_config, write_events
from test_warehouse_sources import write_side_tables

from gr.commands import cli
from gr.data.config import DataConfig
from gr.data.interactions import DataFormatError
from gr.data.prepared.duckdb_append import append_with_duckdb
from gr.data.prepared.duckdb_engine import prepare_with_duckdb
from gr.data.prepared.manifest import read_manifest
from gr.data.prepared.spark_engine import main, prepare_with_spark
from gr.data.prepared.spark_read import read_failure, source_of
from gr.data.readers import read_source
from helpers.instants import SECONDS, TEXTS, iso_text
from helpers.request_log import request_data, request_rows, write_request_log


@pytest.fixture(scope="module")
def spark():
    """The module's SparkSession: the engine uses the active session."""
    if shutil.which("java") is None:
        pytest.skip("no java on PATH (Spark needs a Java 17 runtime)")
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("gr tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        # A short-lived JVM (local mode: the executors run in it): the quick JIT compiler alone and a serial
        # GC; the optimising compiler's and the parallel GC's threads took a third of its CPU time here.
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        # Rows in the hundreds: Spark's interpreted expressions, not Java source compiled per query (whole-stage
        # and expression code generation compile more than the rows take to evaluate), and one plan per query
        # (adaptive execution re-plans after each shuffle). Spark computes the same rows either way.
        .config("spark.sql.codegen.wholeStage", "false")
        .config("spark.sql.codegen.factoryMode", "NO_CODEGEN")
        .config("spark.sql.adaptive.enabled", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("OFF")
    yield session
    session.stop()


def assert_same_prepared(got: Path, expected: Path) -> None:
    """Two prepared datasets hold the same data: manifests equal but for the engine and the shards'
    checksums (Spark's Parquet writer is not pyarrow's), shards equal column by column and row group
    by row group, maps and side tables byte for byte."""
    spark_manifest, duckdb_manifest = read_manifest(got), read_manifest(expected)
    assert (spark_manifest.engine, duckdb_manifest.engine) == ("spark", "duckdb")
    for key in ("config_hash", "data", "summary", "has_ratings", "files"):
        assert getattr(spark_manifest, key) == getattr(duckdb_manifest, key), key
    assert list(spark_manifest.event_features.items()) == list(duckdb_manifest.event_features.items())
    assert len(spark_manifest.shards) == len(duckdb_manifest.shards)
    for ours, theirs in zip(spark_manifest.shards, duckdb_manifest.shards):
        assert (ours.path, ours.first_user, ours.users, ours.interactions, ours.row_groups) == (
            theirs.path,
            theirs.first_user,
            theirs.users,
            theirs.interactions,
            theirs.row_groups,
        )
        ours_file, theirs_file = pq.ParquetFile(got / ours.path), pq.ParquetFile(expected / theirs.path)
        assert ours_file.schema_arrow.names == theirs_file.schema_arrow.names
        for group in range(ours.row_groups):
            ours_rows, theirs_rows = ours_file.read_row_group(group), theirs_file.read_row_group(group)
            for name in ours_rows.column_names:
                assert ours_rows[name].to_pylist() == theirs_rows[name].to_pylist(), (ours.path, group, name)


def prepare_both(config: DataConfig, root: Path, **options) -> Path:
    """Prepare ``config`` with Spark and DuckDB under ``root``, check they agree -> Spark's directory."""
    prepare_with_spark(config, root / "spark", **options)
    prepare_with_duckdb(config, root / "duckdb", threads=1, **options)
    assert_same_prepared(root / "spark", root / "duckdb")
    return root / "spark"


@pytest.fixture(scope="module")
def table_prepared(spark, tmp_path_factory) -> Tuple[Path, DataConfig, str]:
    """The table CSV (every kind of feature, ties, duplicates) prepared by ``gr data prepare --engine
    spark`` from a recipe and overrides -> (its directory, the config it prepared, what it printed)."""
    root = tmp_path_factory.mktemp("table")
    events = write_csv(root / "events.csv", table_rows())
    recipe = root / "recipe.yaml"
    recipe.write_text(f"data:\n  source: csv\n  path: {events}\n  columns: {COLUMNS}\n")
    argv = ["data", "prepare", "--config", str(recipe), "--out", str(root / "spark"), "--engine", "spark"]
    overrides = ["--data.min_item_interactions", "3", "--data.min_seq_len", "4", "--users-per-shard", "10"]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert cli.main([*argv, "--master", "local[2]", *overrides]) == 0
    return root / "spark", table_config(events, min_item_interactions=3, min_seq_len=4), printed.getvalue()


def test_table_csv_with_features_ties_and_duplicates_prepares_what_duckdb_and_the_readers_do(table_prepared):
    prepared, config, _ = table_prepared
    prepare_with_duckdb(config, prepared.parent / "duckdb", threads=1, users_per_shard=10)
    assert_same_prepared(prepared, prepared.parent / "duckdb")
    assert read_manifest(prepared).summary["duplicates_dropped"] >= 3
    assert_prepared_equals_raw(prepared, config)


@pytest.fixture
def small_splits(spark):
    """Spark reads files in 4 KB splits while the test runs (several partitions per test file)."""
    spark.conf.set("spark.sql.files.maxPartitionBytes", "4096")
    spark.conf.set("spark.sql.files.openCostInBytes", "1024")
    yield
    spark.conf.unset("spark.sql.files.maxPartitionBytes")
    spark.conf.unset("spark.sql.files.openCostInBytes")


def test_hive_csv_partitions_with_iso_times_quotes_crlf_and_their_own_header_order_prepare_as_one_file(
    small_splits, tmp_path
):
    """The partitions write each time as ISO 8601 text (helpers.instants' texts, then four forms), the
    one file as its seconds."""
    names = [*HEADER.split(","), "note"]
    rows = [line.split(",") + [f'"said ""hi"", {k}"'] for k, line in enumerate(table_rows(seed=5, rows=300))]
    rows[200][-1] = '"a note\r\nover two lines"'  # the second partition's records then span lines
    for k, seconds in enumerate(SECONDS):
        rows[k][2] = str(seconds)
    whole = write_csv(tmp_path / "whole.csv", [",".join(row[:-1]) for row in rows])
    for k, row in enumerate(rows):
        row[2] = TEXTS[k] if k < len(TEXTS) else iso_text(int(float(row[2])), k % 4)
    orders = [names, names[::-1]]  # the second partition lists its columns in reverse
    parts = tmp_path / "parts"
    for index, chunk in enumerate((rows[:170], rows[170:])):
        order = orders[index]
        lines = [",".join(order), "", *(",".join(row[names.index(c)] for c in order) for row in chunk)]
        (parts / f"month={index + 1:02d}").mkdir(parents=True)
        (parts / f"month={index + 1:02d}" / "part-0.csv").write_bytes(("\r\n".join(lines) + "\r\n").encode())
    (parts / "_SUCCESS").write_text("")
    config = table_config(parts)
    prepared = prepare_both(config, tmp_path, users_per_shard=10)
    assert_prepared_equals_raw(prepared, config, table_config(whole))


def test_parquet_partitions_prepare_what_duckdb_and_the_single_file_they_split_do(spark, tmp_path):
    lines = table_rows(seed=1)
    whole = pa.csv.read_csv(write_csv(tmp_path / "all.csv", lines))

    def lists(column: str) -> pa.Array:
        cells = whole[column].cast(pa.string()).fill_null("").to_pylist()
        return pa.array([cell.split("|") if cell else [] for cell in cells])

    seconds = whole["timestamp"].to_numpy() - 15.0  # some before 1970: floored to the earlier second
    table = pa.table(
        {
            "user_id": whole["user_id"],
            "item_id": whole["item_id"].cast(pa.uint32()),
            "timestamp": pa.array(np.round(seconds * 1e9).astype(np.int64), pa.timestamp("ns")),
            "rating": whole["rating"],
            "genre": whole["genre"],
            "brand_w": whole["brand_w"],
            "tags": lists("tags"),
            "age": whole["age"],
            "device": whole["device"],
            "actions": lists("actions"),
            "watch": whole["watch"],
        }
    )
    pq.write_table(table, tmp_path / "single.parquet")
    parts = tmp_path / "parts"
    parts.mkdir()
    for index, (start, stop) in enumerate(((0, 120), (120, 121), (121, len(table)))):
        pq.write_table(table.slice(start, stop - start), parts / f"part-{index}.parquet", row_group_size=50)
    config = table_config(parts, source="parquet")
    prepared = prepare_both(config, tmp_path, users_per_shard=10)
    assert_prepared_equals_raw(prepared, config, table_config(tmp_path / "single.parquet", "parquet"))


def test_a_movielens_source_with_side_files_prepares_what_duckdb_and_its_reader_do(spark, tmp_path):
    source = "ml-1m"
    path = write_source(tmp_path / "raw", source)
    config = DataConfig.from_dict({"source": source, "path": str(path), "genres": "multi_hot"})
    assert_prepared_equals_raw(prepare_both(config, tmp_path), config)


def write_parquet(path: Path, **replaced: pa.Array) -> Path:
    columns = {"user_id": pa.array([1, 2, 2, 4]), "item_id": pa.array([1, 2, 3, 4])}
    columns.update({"timestamp": pa.array([1, 2, 3, 4]), "rating": pa.array([1.0, 2.0, 3.0, 4.0]), **replaced})
    pq.write_table(pa.table(columns), path)
    return path


BAD_CSV = {  # each case's words come from the readers; the DuckDB module runs every bad input there is
    "a timestamp": "user_id,item_id,timestamp\n1,2,3\n\n1,3,1e\n",
    "an id outside int64": 'user_id,item_id,timestamp\n1,2,3\n"7\n8",99999999999999999999,4\n',
}


@pytest.mark.parametrize(
    "case",
    [
        *[("csv", text) for text in BAD_CSV.values()],
        ("ml-100k", "1\t10\t5\t100\n1\t11\tx\t101\n"),
        ("parquet", {"item_id": pa.array([1, None, 3, 4])}),
        ("parquet", {"timestamp": pa.array([1.0, 2.0, 3.0, 1e19])}),
    ],
    ids=[*BAD_CSV, "ml-100k rating", "parquet null", "parquet time"],
)
def test_bad_values_are_refused_with_the_readers_file_line_and_words(spark, tmp_path, case):
    source, content = case
    if source == "ml-100k":
        config = DataConfig.from_dict({"source": source, "path": str(ml_100k_dir(tmp_path / "ml", content))})
    elif source == "parquet":
        path = write_parquet(tmp_path / "e.parquet", **content)
        config = DataConfig.from_dict({"source": source, "path": str(path), "columns": {"rating": "rating"}})
    else:
        (tmp_path / "e.csv").write_bytes(content.encode("utf8", "surrogateescape"))
        config = DataConfig.from_dict({"source": source, "path": str(tmp_path / "e.csv")})
    with pytest.raises(DataFormatError) as expected:
        read_source(config)
    with pytest.raises(DataFormatError) as got:
        prepare_with_spark(config, tmp_path / "prepared")
    assert str(got.value) == str(expected.value)
    assert expected.value.line is not None or "row " in str(expected.value)
    assert not (tmp_path / "prepared").exists() and not list(tmp_path.glob(".prepared*"))


# The lines of a real Spark 4 error for a corrupt Parquet page but its ~100 "at ..." frames.
SPARK_FAILED_READ = """An error occurred while calling o172.collectToPython.
: org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file {uri}.  \
SQLSTATE: KD001
\tat org.apache.spark.sql.errors.QueryExecutionErrors$.cannotReadFilesError(QueryExecutionErrors.scala:920)
Caused by: java.lang.RuntimeException: java.io.IOException: could not read page Page [bytes.size=16007] in col [item_id]
\tat org.apache.parquet.hadoop.ParquetFileReader.readNextRowGroup(ParquetFileReader.java:1050)
Caused by: java.io.IOException: could not read page Page [bytes.size=16007] in col [item_id]
Caused by: java.io.IOException: FAILED_TO_UNCOMPRESS(5)
\t... 30 more
"""


def test_spark_failing_to_read_a_file_becomes_one_line_naming_it_with_the_jvm_causes(tmp_path):
    path = corrupt_events(tmp_path / "events.parquet")
    source = source_of(DataConfig.from_dict({"source": "parquet", "path": str(path)}))
    error = read_failure(SPARK_FAILED_READ.format(uri=path.as_uri()), source)
    assert isinstance(error, DataFormatError) and str(error) == (
        f"{path}: not a readable Parquet file (could not read page Page [bytes.size=16007] in col [item_id]: "
        "FAILED_TO_UNCOMPRESS(5))"
    )
    assert read_failure("An error occurred while calling o1.count.\n: java.lang.OutOfMemoryError", source) is None


def test_a_corrupt_parquet_page_is_refused_in_one_line_naming_the_file(spark, tmp_path):
    path = corrupt_events(tmp_path / "events.parquet")
    with pytest.raises(DataFormatError) as got:
        prepare_with_spark(DataConfig.from_dict({"source": "parquet", "path": str(path)}), tmp_path / "prepared")
    [line] = str(got.value).splitlines()
    assert line.startswith(f"{path}: not a readable Parquet file (") and "more" not in line, line
    assert not (tmp_path / "prepared").exists()


def test_malformed_quoting_is_refused_as_duckdb_and_the_readers_line_scan_refuse_it(spark, tmp_path):
    (tmp_path / "e.csv").write_text('user_id,item_id,timestamp\n1,2,3\n1,2,4\n1,3,5\n"1"x,2,3\n')
    config = DataConfig.from_dict({"source": "csv", "path": str(tmp_path / "e.csv")})
    with pytest.raises(DataFormatError) as expected:
        prepare_with_duckdb(config, tmp_path / "duckdb")
    with pytest.raises(DataFormatError, match=":5: malformed quoting") as got:
        prepare_with_spark(config, tmp_path / "spark")
    assert str(got.value) == str(expected.value)


def test_gr_data_prepare_runs_the_spark_engine_on_a_master_and_the_module_entry_point_reads_a_recipe(
    table_prepared, tmp_path, capsys
):
    prepared, config, printed = table_prepared
    assert "(spark 4." in printed
    assert read_manifest(prepared).data["min_seq_len"] == 4 and len(read_manifest(prepared).shards) > 1
    assert_prepared_equals_raw(prepared, config)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {}\n")  # the spark-submit entry point reads the recipe as gr data prepare does
    assert main(["--config", str(recipe), "--out", str(tmp_path / "other")]) == 2
    assert capsys.readouterr().err.endswith(f"error: {recipe}: expected a data: section (a mapping)\n")


def test_synthetic_and_missing_sources_are_refused_before_spark_starts(tmp_path):
    with pytest.raises(ValueError, match="^data.source: 'synthetic' is generated in memory"):
        prepare_with_spark(DataConfig(), tmp_path / "prepared")
    config = DataConfig.from_dict({"source": "ml-1m", "path": str(tmp_path / "absent")})
    with pytest.raises(FileNotFoundError, match="ratings.dat: missing file"):
        prepare_with_spark(config, tmp_path / "prepared")
    assert not (tmp_path / "prepared").exists()


def test_side_tables_with_ids_missing_both_ways_prepare_what_duckdb_and_the_readers_do(spark, tmp_path):
    events = write_events(tmp_path / "events.csv", users=30, items=20)
    sides = write_side_tables(events, tmp_path / "log", without=("u3", "7"))
    config = DataConfig.from_dict(data_config(events, **sides))
    prepared = prepare_both(config, tmp_path, users_per_shard=10)
    assert_prepared_equals_raw(prepared, config)
    counts = read_manifest(prepared).summary["side_tables"]
    assert [counts[key]["ids_without_row"] for key in ("users", "items")] == [1, 1]


def test_request_ids_prepare_what_duckdb_and_the_readers_do(spark, tmp_path):
    """Integer request ids in a CSV (read as int64, written as text): the same ``requests`` column as
    DuckDB's, and the requests the readers find."""
    rows = [(*row[:4], row[4][1:]) for row in request_rows(range(12), 0, 40, seed=3)]  # r2 -> 2
    config = DataConfig.from_dict(request_data(write_request_log(tmp_path / "requests.csv", rows, rows[:4])))
    assert_prepared_equals_raw(prepare_both(config, tmp_path, users_per_shard=5), config)


def test_an_append_to_a_spark_prepared_dataset_is_the_one_to_a_duckdb_prepared_dataset(table_prepared, tmp_path):
    """The table CSV prepared by each engine, then later rows (new items and users, rare items, short
    users, duplicates) appended, on DuckDB, to each: the same append, its shards, maps and side tables
    byte for byte."""
    prepared, config, _ = table_prepared
    rows = [line.split(",", 3) for line in table_rows(seed=5)]  # user u3 comes back as a new user, v3
    day = write_csv(tmp_path / "day.csv", [f"{u.replace('u3', 'v3')},{i},{float(t) + 100},{r}" for u, i, t, r in rows])
    spark_prepared = Path(shutil.copytree(prepared, tmp_path / "spark"))
    prepare_with_duckdb(config, tmp_path / "duckdb", threads=1, users_per_shard=10)
    appends = [
        append_with_duckdb(directory, day, threads=1, users_per_shard=10).appends[0]
        for directory in (spark_prepared, tmp_path / "duckdb")
    ]
    assert appends[0].shards == appends[1].shards and appends[0].files == appends[1].files
    assert appends[0].users_added == 1 and appends[0].duplicates_dropped > 0 and len(appends[0].shards) > 1
