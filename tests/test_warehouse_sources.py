"""Data as a warehouse hands it over: ``data.path`` names a file, a directory of partition files
(Hive-style ``month=2024-01/`` folders too) or a glob, of CSV or Parquet, read raw and prepared
alike, in path order (the order of equal timestamps); bad partitions are one line naming the file."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from test_prepared_duckdb import assert_prepared_equals_raw
from test_prepared_stream import COLUMNS, SPLIT_CONFIGS, USERS, data_config, in_order, prepare, write_events

from gr.data.config import DataConfig
from gr.data.datamodule import SequenceDataModule
from gr.data.interactions import DataFormatError
from gr.data.readers import find_source, read_source
from gr.data.sequences import SPLITS, build_sequences
from gr.timestamps import PER_SECOND
from helpers.instants import SECONDS, TEXTS, iso_text, timestamps

LISTS = COLUMNS["list_features"]
# The partitions' relative paths in path order, and the rows of the events file each holds: written
# in another order, so that only their paths can order them.
PARTITIONS = {
    "month=1970-01/part-0.parquet": slice(0, 400),
    "month=1970-01/part-1.parquet": slice(400, 700),
    "month=1970-02/part-0.parquet": slice(700, None),
}


def warehouse_table(events: Path) -> pa.Table:
    """The events CSV as a warehouse writes it: the timestamp a TIMESTAMP(ms) with a zone (plus
    up to 999 ms, floored away), list features as list<string> columns."""
    table = pacsv.read_csv(events, convert_options=pacsv.ConvertOptions(strings_can_be_null=False))
    millis = table["ts"].to_numpy() * 1000 + np.arange(table.num_rows) % 1000
    table = table.set_column(table.column_names.index("ts"), "ts", pa.array(millis, pa.timestamp("ms", "Asia/Tokyo")))
    for name in LISTS:
        cells = table[name].cast(pa.string()).to_pylist()
        table = table.set_column(
            table.column_names.index(name), name, pa.array([c.split("|") if c else [] for c in cells])
        )
    return table


def write_warehouse(root: Path, table: pa.Table) -> Path:
    """``PARTITIONS`` of ``table`` under ``root``, the last first, beside a marker and a hidden file."""
    for relative, rows in reversed(PARTITIONS.items()):
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table[rows], path)
    (root / "_SUCCESS").write_text("")
    (root / "month=1970-01" / ".part-0.parquet.crc").write_text("")
    return root


@pytest.fixture(scope="module")
def events(tmp_path_factory) -> Path:
    return write_events(tmp_path_factory.mktemp("raw") / "events.csv")


@pytest.fixture(scope="module")
def warehouse(events, tmp_path_factory) -> Path:
    return write_warehouse(tmp_path_factory.mktemp("warehouse") / "log", warehouse_table(events))


def raw_module(path: Path, source: str) -> SequenceDataModule:
    module = SequenceDataModule(data_config(path, source=source, shuffle_buffer=USERS, **SPLIT_CONFIGS["time"]))
    module.setup()
    return module


def batches(module: SequenceDataModule) -> dict:
    """{split: its batches in order} (train: two epochs, sampled negatives included)."""
    found = {}
    for name in SPLITS:
        loader = getattr(module, f"{name}_dataloader")()
        for epoch in (0, 1) if name == "train" else (0,):
            (
                loader.sampler if hasattr(loader, "sampler") and hasattr(loader.sampler, "set_epoch") else loader
            ).set_epoch(epoch)
            found[name, epoch] = in_order(loader, sampled=name == "train")
    return found


def test_a_hive_partitioned_parquet_log_reads_raw_as_the_csv_it_was_written_from(events, warehouse):
    expected = batches(raw_module(events, "csv"))
    assert batches(raw_module(warehouse, "parquet")) == expected
    assert all(len(split) > 1 for split in expected.values())


def test_a_warehouse_log_trains_raw_and_prepared_to_the_same_batches(warehouse, tmp_path):
    config = data_config(warehouse, source="parquet", shuffle_buffer=USERS, **SPLIT_CONFIGS["time"])
    prepared = prepare(config, tmp_path / "prepared", users_per_shard=30)
    streamed = SequenceDataModule({**config, "prepared": str(prepared)})
    streamed.setup()
    assert batches(streamed) == batches(raw_module(warehouse, "parquet"))


def write_iso_partitions(events: Path, root: Path) -> Path:
    """The events CSV as CSV partitions (``PARTITIONS``, with a partition of no rows) whose timestamps
    are ISO 8601 texts of their seconds, in varied forms."""
    lines = events.read_text().splitlines(keepends=True)
    position = lines[0].split(",").index("ts")
    for relative, rows in PARTITIONS.items():
        path = root / relative.replace(".parquet", ".csv")
        path.parent.mkdir(parents=True, exist_ok=True)
        start, stop = rows.start + 1, None if rows.stop is None else rows.stop + 1
        texts = []
        for k, line in enumerate(lines[start:stop]):
            fields = line.split(",")
            fields[position] = iso_text(int(fields[position]), k % 4)
            texts.append(",".join(fields))
        path.write_text(lines[0] + "".join(texts))
    (root / "month=1970-02" / "empty.csv").write_text(lines[0])
    return root


def test_csv_partitions_of_iso_times_and_globs_read_as_the_directory_does(events, warehouse, tmp_path):
    write_iso_partitions(events, tmp_path / "csv")
    expected = read_source(DataConfig.from_dict(data_config(events)))
    for path, source in [
        (tmp_path / "csv", "csv"),
        (tmp_path / "csv" / "month=*" / "*.csv", "csv"),
        (tmp_path / "csv" / "**", "csv"),
        (warehouse / "month=1970-0[12]", "parquet"),
    ]:
        got = read_source(DataConfig.from_dict(data_config(path, source=source)))
        assert got.source == str(path)
        for name in ("users", "items", "timestamps", "ratings"):
            assert np.array_equal(getattr(got, name), getattr(expected, name)), (path, name)
        assert np.array_equal(got.row_side.lists["tags"].values, expected.row_side.lists["tags"].values)


def test_csv_partitions_of_iso_times_train_raw_and_prepared_to_the_events_batches(events, tmp_path):
    partitions = write_iso_partitions(events, tmp_path / "csv")
    config = data_config(partitions, shuffle_buffer=USERS, **SPLIT_CONFIGS["time"])
    streamed = SequenceDataModule({**config, "prepared": str(prepare(config, tmp_path / "prepared", 30))})
    streamed.setup()
    expected = batches(raw_module(events, "csv"))
    assert batches(raw_module(partitions, "csv")) == expected
    assert batches(streamed) == expected


def test_one_instant_is_the_same_seconds_in_the_readers_and_the_duckdb_engine(tmp_path):
    """ISO 8601 texts in a CSV; TIMESTAMP columns of every unit, with and without a zone, in Parquet."""
    users = [1 + k % 2 for k in range(len(TEXTS))]
    (tmp_path / "e.csv").write_text(
        "user_id,item_id,timestamp\n" + "".join(f"{u},{k},{t}\n" for k, (u, t) in enumerate(zip(users, TEXTS)))
    )
    columns = {"user_id": users, "item_id": list(range(len(TEXTS)))}
    for unit in PER_SECOND:
        for zone in (None, "UTC", "America/St_Johns"):
            columns[f"{unit}_{zone}"] = timestamps(SECONDS, unit, zone)
    pq.write_table(pa.table(columns), tmp_path / "e.parquet")
    configs = [DataConfig.from_dict({"source": "csv", "path": str(tmp_path / "e.csv")})]
    configs += [
        DataConfig.from_dict({"source": "parquet", "path": str(tmp_path / "e.parquet"), "columns": {"timestamp": c}})
        for c in columns
        if c not in ("user_id", "item_id")
    ]
    for k, config in enumerate(configs):
        assert read_source(config).timestamps.tolist() == SECONDS, config.columns.timestamp
        prepare(config.to_dict(), tmp_path / f"prepared{k}", users_per_shard=1)
        assert_prepared_equals_raw(tmp_path / f"prepared{k}", config)


def test_equal_timestamps_are_read_in_path_order_then_row_order(tmp_path):
    """The same user's events at one second, in three partitions written in reverse path order."""
    for k, folder in reversed(list(enumerate(["day=1/a.parquet", "day=1/b.parquet", "day=2/a.parquet"]))):
        path = tmp_path / "log" / folder
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"user_id": [7, 7], "item_id": [2 * k, 2 * k + 1], "timestamp": [5, 5]}), path)
    config = DataConfig.from_dict({"source": "parquet", "path": str(tmp_path / "log")})
    sequences, _, items = build_sequences(read_source(config))
    assert items.raw[sequences.items].tolist() == [0, 1, 2, 3, 4, 5]
    prepared = prepare(config.to_dict(), tmp_path / "prepared", users_per_shard=1)
    [shard] = pq.read_table(prepared / "shards").to_pylist()
    assert items.raw[shard["items"]].tolist() == [0, 1, 2, 3, 4, 5]


def test_partition_keys_are_not_read_as_columns(tmp_path):
    path = tmp_path / "log" / "user_id=9" / "part-0.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"user_id": [1, 1, 1], "item_id": [1, 2, 3], "timestamp": [1, 2, 3]}), path)
    data = read_source(DataConfig.from_dict({"source": "parquet", "path": str(tmp_path / "log")}))
    assert data.users.tolist() == [1, 1, 1]
    config = DataConfig.from_dict({"source": "parquet", "path": str(tmp_path / "log"), "columns": {"user": "month"}})
    with pytest.raises(DataFormatError, match=rf"^{path}: lacks column\(s\) \['month'\]"):
        read_source(config)


def bad_sources(root: Path) -> dict:
    """{case: (data.path, the start of its one-line error)}."""
    table = pa.table({"user_id": [1, 1, 1], "item_id": [1, 2, 3], "timestamp": [1, 2, 3]})
    cases = {}
    for case in ("missing_column", "unreadable", "mixed", "other_type"):
        (root / case / "month=01").mkdir(parents=True)
        pq.write_table(table, root / case / "month=01" / "part-0.parquet")
    pq.write_table(table.drop_columns("item_id"), root / "missing_column" / "month=02.parquet")
    cases["missing_column"] = f"{root / 'missing_column' / 'month=02.parquet'}: lacks column(s) ['item_id']"
    (root / "unreadable" / "month=02.parquet").write_bytes(b"a page of text, not Parquet")
    cases["unreadable"] = f"{root / 'unreadable' / 'month=02.parquet'}: not a readable Parquet file ("
    (root / "mixed" / "month=01" / "part-1.csv").write_text("user_id,item_id,timestamp\n1,4,4\n")
    cases["mixed"] = f"{root / 'mixed' / 'month=01' / 'part-1.csv'}: a .csv file among the .parquet files of data.path"
    pq.write_table(table.set_column(2, "timestamp", pa.array([1.0, 2.0, 3.0])), root / "other_type" / "b.parquet")
    cases["other_type"] = f"{root / 'other_type' / 'month=01' / 'part-0.parquet'}: column 'timestamp' has type int64"
    cases["glob_matching_nothing"] = f"data.path: {root / 'nothing*'}: no file or directory matches the pattern"
    (root / "no_parquet").mkdir()
    (root / "no_parquet" / "_SUCCESS").write_text("")
    cases["no_parquet"] = f"{root / 'no_parquet'}: no *.parquet files (data.path: a file, a directory"
    return {
        case: (root / case if case != "glob_matching_nothing" else root / "nothing*", text)
        for case, text in cases.items()
    }


@pytest.mark.parametrize(
    "case", ["missing_column", "unreadable", "mixed", "other_type", "glob_matching_nothing", "no_parquet"]
)
def test_a_bad_partition_is_one_line_naming_its_file_raw_and_prepared_alike(tmp_path, case):
    from gr.data.prepared.duckdb_engine import prepare_with_duckdb

    path, message = bad_sources(tmp_path / "sources")[case]
    config = DataConfig.from_dict({"source": "parquet", "path": str(path)})
    with pytest.raises((DataFormatError, FileNotFoundError)) as raw:
        read_source(config)
    assert str(raw.value).startswith(message) and "\n" not in str(raw.value)
    with pytest.raises((DataFormatError, FileNotFoundError)) as prepared:
        prepare_with_duckdb(config, tmp_path / "prepared")
    assert str(prepared.value) == str(raw.value)
    if case in ("mixed", "glob_matching_nothing", "no_parquet"):  # found before gr train imports its training stack
        with pytest.raises((DataFormatError, FileNotFoundError)) as found:
            find_source(config)
        assert str(found.value) == str(raw.value)


def test_gr_train_finds_a_directory_or_a_glob_of_partitions(warehouse):
    for path in (warehouse, warehouse / "month=*" / "*.parquet"):
        assert find_source(DataConfig.from_dict({"source": "parquet", "path": str(path)})) == path
