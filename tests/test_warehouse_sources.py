"""Data as a warehouse hands it over: ``data.path`` names a file, a directory of partition files
(Hive-style ``month=2024-01/`` folders too) or a glob, of CSV or Parquet, read raw and prepared
alike, in path order (the order of equal timestamps); bad partitions are one line naming the file."""

import re
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
from gr.data.prepared.manifest import read_manifest
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


# ---- side tables: data.users, data.items ----------------------------------------------------

USER_SIDE = ("country", "langs", "age")  # the user features of ``write_events``, one value per user
ITEM_SIDE = ("category", "genres", "price")  # its item features, one value per item


def write_side_tables(events: Path, root: Path, without: tuple = (), unused: bool = True) -> dict:
    """The events CSV split as a warehouse keeps it: the events without their user and item features,
    ``users/`` (two Parquet partitions: list<string> langs, float age) and ``items.csv`` keyed by a
    ``movie`` column, each key's values as the events give them; the ids ``without`` left out of the
    side tables, and with ``unused`` a row of each for an id the events lack -> the data section's
    overrides."""
    root.mkdir(parents=True, exist_ok=True)
    header, *lines = events.read_text().splitlines()
    names = header.split(",")
    rows = [dict(zip(names, line.split(","))) for line in lines]
    kept = [n for n in names if n not in USER_SIDE + ITEM_SIDE]
    (root / "events.csv").write_text("\n".join([",".join(kept), *(",".join(r[n] for n in kept) for r in rows)]) + "\n")
    users = {r["user_id"]: r for r in rows if r["user_id"] not in without}
    users.update({"ghost": {"user_id": "ghost", "country": "nz", "langs": "mi", "age": "1"}} if unused else {})
    table = pa.table(
        {
            "user_id": list(users),
            "country": [r["country"] for r in users.values()],
            "langs": [r["langs"].split("|") for r in users.values()],
            "age": [float(r["age"]) for r in users.values()],
        }
    )
    (root / "users").mkdir()
    pq.write_table(table.slice(0, 10), root / "users" / "part-0.parquet")
    pq.write_table(table.slice(10), root / "users" / "part-1.parquet")
    items = {r["item_id"]: r for r in rows if r["item_id"] not in without}
    items.update({"999999": {"category": "c9", "genres": "g9", "price": "9.0"}} if unused else {})
    lines = [f"{i},{r['category']},{r['genres']},{r['price']}" for i, r in items.items()]
    (root / "items.csv").write_text("\n".join(["movie,category,genres,price", *lines]) + "\n")
    return {
        "path": str(root / "events.csv"),
        "users": str(root / "users"),
        "items": {"path": str(root / "items.csv"), "key": "movie"},
    }


def test_side_tables_give_the_batches_of_the_events_joined_by_hand(events, tmp_path):
    sides = write_side_tables(events, tmp_path)
    joined = SequenceDataModule(data_config(events, shuffle_buffer=USERS, **SPLIT_CONFIGS["time"]))
    joined.setup()
    module = SequenceDataModule(data_config(events, shuffle_buffer=USERS, **SPLIT_CONFIGS["time"], **sides))
    module.setup()
    assert batches(module) == batches(joined)
    assert module.summary["side_tables"] == {
        "users": {"path": sides["users"], "rows": USERS + 1, "unused_rows": 1, "ids_without_row": 0},
        "items": {"path": sides["items"]["path"], "rows": joined.num_items + 1, "unused_rows": 1, "ids_without_row": 0},
    }


def test_ids_missing_from_a_side_table_are_unknown_and_counted_raw_and_prepared_alike(events, tmp_path):
    sides = write_side_tables(events, tmp_path / "log", without=("u3", "7"))
    config = data_config(events, shuffle_buffer=USERS, **SPLIT_CONFIGS["time"], **sides)
    raw = SequenceDataModule(config)
    raw.setup()
    prepared = prepare(config, tmp_path / "prepared", users_per_shard=30)
    streamed = SequenceDataModule({**config, "prepared": str(prepared)})
    streamed.setup()
    assert batches(streamed) == batches(raw)
    counts = {"unused_rows": 1, "ids_without_row": 1}
    assert raw.summary["side_tables"]["users"] == {"path": sides["users"], "rows": USERS, **counts}
    assert raw.summary["side_tables"]["items"]["unused_rows"] == 1
    assert raw.summary["side_tables"]["items"]["ids_without_row"] == 1
    assert (
        read_manifest(prepared).summary["side_tables"] == streamed.summary["side_tables"] == raw.summary["side_tables"]
    )
    for module in (raw, streamed):
        user = int(module.user_map.encode(np.asarray(["u3"]))[0])
        assert module.user_features.categorical["country"][user] == 0  # the unknown value
        assert module.user_features.lists["langs"].lengths()[user] == 0
        assert module.user_features.dense["age"][user].tolist() == [0.0]
        assert module.user_features.categorical["country"][user + 1] > 0


def bad_side_tables(events: Path, root: Path) -> dict:
    """{case: (the data section, the start of its one-line error)}."""
    sides = write_side_tables(events, root / "log")
    users, items = Path(sides["users"]), Path(sides["items"]["path"])
    table = pq.read_table(users)
    base = data_config(sides["path"], **sides)
    cases = {}
    doubled = root / "doubled"
    doubled.mkdir()
    pq.write_table(table.slice(0, 50), doubled / "part-0.parquet")
    pq.write_table(table.slice(40), doubled / "part-1.parquet")
    cases["duplicate_id"] = (
        {**base, "users": str(doubled)},
        f"{doubled / 'part-1.parquet'}: row 1: column 'user_id': id 'u40' is on an earlier row too (data.users",
    )
    cases["in_both"] = (
        {**base, "path": str(events)},
        f"{users / 'part-0.parquet'}: data.columns.user_features: column 'country' is in this side table "
        f"(data.users) and in the events {events} (data.path)",
    )
    pq.write_table(table.drop_columns("age"), root / "no_age.parquet")
    cases["in_neither"] = (
        {**base, "users": str(root / "no_age.parquet")},
        f"{root / 'no_age.parquet'}: data.columns.user_dense.age: lacks column 'age'; with data.users every declared "
        "user feature is read from it",
    )
    cases["no_key_column"] = (
        {**base, "items": {"path": str(items), "key": "item"}},
        f"{items}: data.items.key: lacks the id column 'item' (data.items)",
    )
    pq.write_table(table.set_column(1, "country", pa.array([1.5] * table.num_rows)), root / "float.parquet")
    cases["wrong_type"] = (
        {**base, "users": str(root / "float.parquet")},
        f"{root / 'float.parquet'}: data.columns.user_features: column 'country' has type double; expected integer "
        "or string values",
    )
    text_ids = root / "text_ids.csv"
    text_ids.write_text(re.sub(r"(?m)^(\d)", r"m\1", items.read_text()))
    cases["text_ids"] = (
        {**base, "items": {"path": str(text_ids), "key": "movie"}},
        f"{text_ids}: data.items: the ids of column 'movie' are strings (e.g. 'm266'), the events' integers",
    )
    cases["missing_file"] = ({**base, "users": str(root / "nowhere")}, f"data.users: {root / 'nowhere'}: no such file")
    return cases


@pytest.mark.parametrize(
    "case", ["duplicate_id", "text_ids", "in_both", "in_neither", "no_key_column", "wrong_type", "missing_file"]
)
def test_a_bad_side_table_is_one_line_naming_the_key_and_file_up_front_raw_and_prepared_alike(events, tmp_path, case):
    from gr.data.prepared.duckdb_engine import prepare_with_duckdb

    values, message = bad_side_tables(events, tmp_path)[case]
    config = DataConfig.from_dict(values)
    with pytest.raises((DataFormatError, FileNotFoundError)) as raw:
        SequenceDataModule(config).setup()
    assert str(raw.value).startswith(message) and "\n" not in str(raw.value)
    with pytest.raises((DataFormatError, FileNotFoundError)) as prepared:
        prepare_with_duckdb(config, tmp_path / "prepared")
    assert str(prepared.value) == str(raw.value)
    if case not in ("duplicate_id", "text_ids"):  # found before gr train imports its training stack (not reading ids)
        with pytest.raises((DataFormatError, FileNotFoundError)) as found:
            find_source(config)
        assert str(found.value) == str(raw.value)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"source": "ml-100k", "path": "d", "users": "u.parquet"}, "data.users: only the csv and parquet sources"),
        ({"source": "csv", "path": "e.csv", "users": "u.parquet"}, "data.users: declares no user feature"),
        ({"source": "csv", "path": "e.csv", "items": {"key": "movie"}}, "data.items.path: expected a non-empty string"),
        ({"source": "csv", "path": "e.csv", "items": {"path": "i.csv", "id": 1}}, "data.items: unknown key(s) ['id']"),
    ],
)
def test_a_side_table_key_is_checked_with_the_config(values, message):
    with pytest.raises(ValueError) as error:
        DataConfig.from_dict(values)
    assert str(error.value).startswith(message)
