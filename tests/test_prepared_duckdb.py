"""``gr data prepare`` with DuckDB: the prepared dataset decodes to exactly what the raw source gives
(``build_sequences(read_source(config))`` and ``SideFeatures.align``), bad input is refused with the
readers' messages, and a reader's checks catch a corrupt, missing, foreign or disordered shard."""

import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gr.commands import cli
from gr.data.config import DataConfig
from gr.data.features import SideFeatures
from gr.data.interactions import DataFormatError, SideTable
from gr.data.mappings import IdMap, load_mappings
from gr.data.prepared.duckdb_engine import _Preparation, prepare_with_duckdb
from gr.data.prepared.manifest import (
    ITEMS_TABLE,
    MANIFEST,
    MAPS,
    REQUESTS,
    SIDE_KEY,
    USERS_TABLE,
    check_shard_order,
    event_column,
    read_manifest,
    verify_file,
)
from gr.data.readers import read_source, side_table_summary
from gr.data.sequences import build_sequences, request_starts
from gr.jagged_rows import JaggedRows
from helpers.corrupt_parquet import write_corrupt_parquet
from helpers.request_log import request_data, request_rows, write_request_log

ROOT = Path(__file__).resolve().parents[1]
HEADER = "user_id,item_id,timestamp,rating,genre,brand_w,tags,age,device,actions,watch"
COLUMNS = {
    "rating": "rating",
    "item_features": ["genre", "tags"],
    "item_dense": {"brand": ["brand_w"]},
    "user_features": ["age"],
    "token_features": ["device", "actions"],
    "token_dense": {"watch": ["watch", "rating"]},
    "list_features": ["tags", "actions"],
}


def table_rows(seed: int = 0, rows: int = 400):
    """CSV rows of a table source with every kind of declared feature, ties in timestamps, decimal
    seconds, string user ids, repeated (user, item, timestamp) rows, rare items and short users."""
    rng = np.random.default_rng(seed)
    lines = []
    for k in range(rows):
        user, item = f"u{rng.integers(0, 25)}", int(rng.integers(1, 40))
        stamp = f"{rng.integers(0, 30)}" + (".75" if k % 7 == 0 else "")
        tags = "|".join(f"t{x}" for x in rng.choice(6, rng.integers(0, 3), replace=False))
        actions = "|".join(rng.choice(["click", "buy", "NA"], rng.integers(0, 3)))
        lines.append(
            f"{user},{item},{stamp},{rng.integers(1, 6)},g{item % 5},{item / 7:.3f},{tags},a{rng.integers(0, 3)},"
            f"d{k % 3},{actions},{rng.random():.4f}"
        )
    lines += [lines[3], lines[10], lines[10]]  # exact repeats of earlier rows: duplicates
    lines += ["lonely,7,5,3,g2,1.000,,a1,d0,,0.5"]  # a user with one interaction (min_seq_len drops it)
    return lines


def write_csv(path: Path, lines) -> Path:
    path.write_text("\n".join([HEADER, *lines]) + "\n")
    return path


def table_config(path: Path, source: str = "csv", **overrides) -> DataConfig:
    return DataConfig.from_dict({"source": source, "path": str(path), "columns": COLUMNS, **overrides})


@dataclass
class Decoded:
    """A prepared dataset read back with pyarrow alone."""

    maps: Dict[str, IdMap]
    columns: Dict[str, list]
    offsets: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray
    ratings: Optional[np.ndarray]
    events: Dict[str, object]
    item_side: Optional[SideTable]
    user_side: Optional[SideTable]
    requests: Optional[np.ndarray]


def flat(column: pa.ChunkedArray) -> pa.Array:
    return column.combine_chunks().flatten()


def jagged(array: pa.Array) -> JaggedRows:
    """A list<raw values> array -> rows of str (or int64) values."""
    values = array.flatten()
    raw = values.to_numpy() if pa.types.is_integer(values.type) else values.to_numpy(zero_copy_only=False).astype(str)
    return JaggedRows.from_lengths(array.value_lengths().to_numpy(), raw)


def side_table(path: Path) -> Optional[SideTable]:
    if not path.is_file():
        return None
    table = pq.read_table(path)
    keys = table[SIDE_KEY].to_numpy()
    keys = keys if keys.dtype.kind == "i" else keys.astype(str)
    categorical, dense, lists = {}, {}, {}
    for name in table.column_names[1:]:
        column = table[name].combine_chunks()
        if pa.types.is_list(column.type) and pa.types.is_floating(column.type.value_type):
            dense[name] = column.flatten().to_numpy().reshape(len(column), -1)
        elif pa.types.is_list(column.type):
            lists[name] = jagged(column)
        else:
            values = column.to_numpy(zero_copy_only=False)
            categorical[name] = values if values.dtype.kind == "i" else values.astype(str)
    return SideTable(keys, categorical, dense, {}, lists)


def decode(directory: Path, config: DataConfig) -> Decoded:
    manifest = read_manifest(directory, config)
    for relpath in [*manifest.files, *(shard.path for shard in manifest.shards)]:
        verify_file(manifest, relpath)
    shards = pa.concat_tables([pq.read_table(directory / shard.path) for shard in manifest.shards])
    assert shards["user"].to_numpy().tolist() == list(range(manifest.num_users))
    lengths = shards["items"].combine_chunks().value_lengths().to_numpy()
    events: Dict[str, object] = {}
    for name, kind in manifest.event_features.items():
        values = flat(shards[event_column(name)])
        if kind == "categorical":
            events[name] = values.to_numpy(zero_copy_only=False).astype(str)
        elif kind == "list":
            events[name] = jagged(values)
        else:
            events[name] = values.flatten().to_numpy().reshape(len(values), -1)
    maps, columns = load_mappings(str(directory / MAPS))
    return Decoded(
        maps=maps,
        columns=columns,
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
        items=flat(shards["items"]).to_numpy(),
        timestamps=flat(shards["timestamps"]).to_numpy(),
        ratings=flat(shards["ratings"]).to_numpy() if manifest.has_ratings else None,
        events=events,
        item_side=side_table(directory / ITEMS_TABLE),
        user_side=side_table(directory / USERS_TABLE),
        requests=flat(shards[REQUESTS]).to_numpy(zero_copy_only=False) if REQUESTS in shards.column_names else None,
    )


def assert_same_map(got: IdMap, expected: IdMap) -> None:
    assert got.offset == expected.offset and got.raw.dtype.kind == expected.raw.dtype.kind
    np.testing.assert_array_equal(got.raw, expected.raw)


def assert_same_features(got: SideFeatures, expected: SideFeatures) -> None:
    assert got.categorical.keys() == expected.categorical.keys() and got.lists.keys() == expected.lists.keys()
    for name in expected.categorical:
        np.testing.assert_array_equal(got.categorical[name], expected.categorical[name])
    for name in expected.dense:
        np.testing.assert_array_equal(got.dense[name], expected.dense[name])
    for name in expected.lists:
        np.testing.assert_array_equal(got.lists[name].offsets, expected.lists[name].offsets)
        np.testing.assert_array_equal(got.lists[name].values, expected.lists[name].values)
    for name, vocabulary in expected.vocabularies.items():
        assert_same_map(got.vocabularies[name], vocabulary)


def assert_prepared_equals_raw(directory: Path, config: DataConfig, raw_config: Optional[DataConfig] = None) -> None:
    """``directory`` decodes to what ``raw_config`` (default: ``config``) gives through the readers."""
    data = read_source(raw_config or config)
    sequences, users, items = build_sequences(data, config.min_seq_len, config.min_item_interactions)
    got = decode(directory, config)
    assert_same_map(got.maps["users"], users)
    assert_same_map(got.maps["items"], items)
    np.testing.assert_array_equal(got.offsets, sequences.offsets)
    np.testing.assert_array_equal(got.items, sequences.items)
    np.testing.assert_array_equal(got.timestamps, sequences.timestamps)
    if sequences.ratings is None:
        assert got.ratings is None
    else:
        assert got.ratings is not None and got.ratings.dtype == np.float32
        np.testing.assert_array_equal(got.ratings, sequences.ratings)
    events = sequences.events or SideTable(np.zeros(0))
    assert set(got.events) == {*events.categorical, *events.lists, *events.dense}
    for name, values in events.categorical.items():
        np.testing.assert_array_equal(got.events[name], values)
    for name, rows in events.lists.items():
        np.testing.assert_array_equal(got.events[name].offsets, rows.offsets)
        np.testing.assert_array_equal(got.events[name].values, rows.values)
    for name, matrix in events.dense.items():
        np.testing.assert_array_equal(got.events[name], matrix)
    if sequences.request_starts is None:
        assert got.requests is None
    else:  # the raw ids as text, so each event's request starts where raw reading starts it
        assert got.requests is not None and got.requests.dtype == object
        np.testing.assert_array_equal(request_starts(got.offsets, got.requests), sequences.request_starts)
    expected = {
        "items": SideFeatures.align(data.item_side if config.item_features else None, items),
        "users": SideFeatures.align(data.user_side if config.user_features else None, users),
        "events": SideFeatures.align(sequences.events, IdMap(np.arange(len(sequences.items)))),
    }
    assert_same_features(SideFeatures.align(got.item_side, got.maps["items"]), expected["items"])
    assert_same_features(SideFeatures.align(got.user_side, got.maps["users"]), expected["users"])
    vocabularies = {name: m for side in expected.values() for name, m in side.vocabularies.items()}
    assert set(got.maps) == {"users", "items", *vocabularies}
    for name, vocabulary in vocabularies.items():
        assert_same_map(got.maps[name], vocabulary)
    assert got.columns == {name: list(c) for side in expected.values() for name, c in side.dense_columns.items()}
    dropped = data.duplicates if data.duplicates_dropped else 0
    summary = read_manifest(directory).summary
    assert summary == {
        "source": summary["source"] if raw_config else data.source,
        "rows_read": len(data.users) + dropped,
        "duplicates_dropped": dropped,
        "duplicates_kept": data.duplicates - dropped,
        "users": sequences.num_users,
        "items": sequences.num_items,
        "interactions": len(sequences.items),
        **side_table_summary(
            config, {"users": data.user_side, "items": data.item_side}, {"users": users, "items": items}
        ),
    }


@pytest.mark.parametrize("keep_duplicates", [False, True])
def test_table_csv_with_every_feature_kind_prepares_to_what_the_readers_give(tmp_path, keep_duplicates):
    config = table_config(
        write_csv(tmp_path / "events.csv", table_rows()), keep_duplicates=keep_duplicates, min_item_interactions=3
    )
    manifest = prepare_with_duckdb(config, tmp_path / "prepared", threads=2, users_per_shard=4)
    summary = manifest.summary
    users = summary["users"]
    assert [s.users for s in manifest.shards] == [4] * (users // 4) + [users % 4] * (users % 4 > 0)
    assert manifest.event_features == {"device": "categorical", "actions": "list", "watch": "dense"}
    assert summary["duplicates_dropped" if not keep_duplicates else "duplicates_kept"] >= 3
    assert_prepared_equals_raw(tmp_path / "prepared", config)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_request_ids_prepare_to_the_requests_the_readers_give(tmp_path, suffix):
    """Text (CSV) or integer (Parquet) request ids, ids coming back later, requests sharing a time,
    repeated rows dropped and rare items filtered before the requests are found."""
    rows = request_rows(range(12), 0, 40, seed=3)
    events = write_request_log(tmp_path / f"requests{suffix}", rows, rows[:4])
    config = DataConfig.from_dict(request_data(events, min_item_interactions=2))
    prepare_with_duckdb(config, tmp_path / "prepared", threads=1, users_per_shard=5)
    assert_prepared_equals_raw(tmp_path / "prepared", config)
    sequences, _, _ = build_sequences(read_source(config), config.min_seq_len, config.min_item_interactions)
    assert sequences.request_starts is not None
    sizes = np.bincount(sequences.request_starts)[np.unique(sequences.request_starts)]
    assert sizes.min() == 1 and sizes.max() > 1  # requests of one impression and of several


def test_parquet_directory_of_partitions_prepares_to_the_single_file_they_split(tmp_path):
    lines = table_rows(seed=1)
    whole = pa.csv.read_csv(write_csv(tmp_path / "all.csv", lines))
    table = pa.table(
        {
            "user_id": whole["user_id"],
            "item_id": whole["item_id"],
            "timestamp": pa.array(np.floor(whole["timestamp"].to_numpy() * 1.0)).cast(pa.float64()),
            "rating": whole["rating"],
            "genre": whole["genre"],
            "brand_w": whole["brand_w"],
            "tags": pa.array(
                [t.split("|") if t else [] for t in whole["tags"].cast(pa.string()).fill_null("").to_pylist()]
            ),
            "age": whole["age"],
            "device": whole["device"],
            "actions": pa.array(
                [a.split("|") if a else [] for a in whole["actions"].cast(pa.string()).fill_null("").to_pylist()]
            ),
            "watch": whole["watch"],
        }
    )
    pq.write_table(table, tmp_path / "single.parquet")
    parts = tmp_path / "parts"
    parts.mkdir()
    pq.write_table(table.slice(0, 150), parts / "part-0.parquet")
    pq.write_table(table.slice(150), parts / "part-1.parquet")
    (parts / "_SUCCESS").write_text("")
    config = table_config(parts, source="parquet")
    prepare_with_duckdb(config, tmp_path / "prepared", threads=2)
    assert_prepared_equals_raw(tmp_path / "prepared", config, table_config(tmp_path / "single.parquet", "parquet"))


def test_movielens_100k_prepares_to_what_its_reader_gives(tmp_path, ml_100k):
    config = DataConfig.from_dict({"source": "ml-100k", "path": str(ml_100k), "genres": "list"})
    manifest = prepare_with_duckdb(config, tmp_path / "prepared", threads=2, users_per_shard=400)
    assert [s.users for s in manifest.shards] == [400, 400, 143]
    shard = pq.ParquetFile(tmp_path / "prepared" / manifest.shards[0].path).metadata
    assert [shard.row_group(g).num_rows for g in range(shard.num_row_groups)] == [400]
    assert_prepared_equals_raw(tmp_path / "prepared", config)


def test_movielens_100k_release_years_prepare_to_what_the_reader_gives(tmp_path, ml_100k):
    config = DataConfig.from_dict({"source": "ml-100k", "path": str(ml_100k), "genres": "list", "release_year": True})
    prepare_with_duckdb(config, tmp_path / "prepared", threads=2)
    assert "item_year" in pq.read_table(tmp_path / "prepared" / ITEMS_TABLE).column_names
    assert_prepared_equals_raw(tmp_path / "prepared", config)


def ml_100k_dir(root: Path, ratings: str) -> Path:
    root.mkdir()
    (root / "u.data").write_text(ratings)
    return root


@pytest.mark.parametrize(
    "source,text",
    [
        ("ml-100k", "1\t10\t5\t100\n1\t11\tx\t101\n"),
        ("ml-100k", "1\t10\t5\t100\n2\t11\t4\n"),
        ("ml-100k", "1\t10\t5\t100\n2\t99999999999999999999\t4\t100\n"),
        ("csv", "user_id,item_id,timestamp\n1,2,3\n1,3,1e\n"),
        ("csv", "user_id,item_id,timestamp\n1,2,3\n1,,4\n"),
        ("csv", 'user_id,item_id,timestamp\n1,2,3\n"7\n8",99999999999999999999,4\n'),
    ],
)
def test_bad_values_are_refused_with_the_readers_file_and_line(tmp_path, source, text):
    if source == "ml-100k":
        config = DataConfig.from_dict({"source": source, "path": str(ml_100k_dir(tmp_path / "ml", text))})
    else:
        (tmp_path / "e.csv").write_text(text)
        config = DataConfig.from_dict({"source": source, "path": str(tmp_path / "e.csv")})
    with pytest.raises(DataFormatError) as expected:
        read_source(config)
    with pytest.raises(DataFormatError) as got:
        prepare_with_duckdb(config, tmp_path / "prepared")
    assert str(got.value) == str(expected.value) and expected.value.line is not None
    assert not (tmp_path / "prepared").exists()


@pytest.mark.parametrize("request_id", ["", "99999999999999999999"])
def test_a_request_id_the_readers_refuse_is_refused_with_their_file_line_and_words(tmp_path, request_id):
    events = tmp_path / "e.csv"
    events.write_text(f"user,item,ts,clicked,request\nu1,1,1,0,7\nu1,2,2,1,8\nu1,3,5,1,{request_id}\n")
    config = DataConfig.from_dict(request_data(events))
    with pytest.raises(DataFormatError) as expected:
        read_source(config)
    with pytest.raises(DataFormatError) as got:
        prepare_with_duckdb(config, tmp_path / "prepared")
    assert str(got.value) == str(expected.value) and expected.value.line == 4
    assert "column 'request'" in str(got.value) and not (tmp_path / "prepared").exists()


def test_empty_value_inside_a_list_names_its_line(tmp_path):
    lines = table_rows(rows=30)
    lines.insert(12, "u1,3,4,2,g1,0.5,t1||t2,a0,d1,,0.1")
    config = table_config(write_csv(tmp_path / "e.csv", lines))
    with pytest.raises(DataFormatError) as expected:
        read_source(config)
    with pytest.raises(DataFormatError, match="column 'tags': an empty value in the list 't1||t2'") as got:
        prepare_with_duckdb(config, tmp_path / "prepared")
    assert str(got.value) == str(expected.value) and got.value.line == 14


def test_exact_seconds_match_the_readers_for_every_decimal_form(tmp_path):
    stamps = [
        "5",
        "-0",
        "007",
        "1.5",
        "-1.5",
        "-0.25",
        ".5",
        "+3.",
        "1e3",
        "1.5E1",
        "-2e-1",
        "12.000",
        "-12.000",
        "9223372036854775807",
        "9223372036854775807.9",
        "-9223372036854775808",
        "4.2e1",
        "0.000001e7",
    ]
    lines = [f"u{k % 2},{k},{s}" for k, s in enumerate(stamps)]
    (tmp_path / "e.csv").write_text("user_id,item_id,timestamp\n" + "\n".join(lines) + "\n")
    config = DataConfig.from_dict({"source": "csv", "path": str(tmp_path / "e.csv"), "min_seq_len": 3})
    with pytest.raises(DataFormatError, match="lie 2\\^63 s or more apart") as expected:
        read_source(config) and build_sequences(read_source(config))
    with pytest.raises(DataFormatError) as got:
        prepare_with_duckdb(config, tmp_path / "prepared")
    assert str(got.value) == str(expected.value)
    del lines[13:16]  # the int64 extremes
    (tmp_path / "e.csv").write_text("user_id,item_id,timestamp\n" + "\n".join(lines) + "\n")
    prepare_with_duckdb(config, tmp_path / "prepared")
    assert_prepared_equals_raw(tmp_path / "prepared", config)


def test_synthetic_source_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="^data.source: 'synthetic' is generated in memory"):
        prepare_with_duckdb(DataConfig(), tmp_path / "prepared")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A small prepared table dataset (3 shards) and its config."""
    root = tmp_path_factory.mktemp("prepared")
    config = table_config(write_csv(root / "events.csv", table_rows(seed=2, rows=120)))
    prepare_with_duckdb(config, root / "out", threads=2, users_per_shard=8)
    return root / "out", config


def test_reader_checks_catch_a_corrupt_shard(prepared, tmp_path):
    directory, _ = prepared
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in directory.rglob("*"):
        if path.is_file():
            (copy / path.relative_to(directory)).parent.mkdir(parents=True, exist_ok=True)
            (copy / path.relative_to(directory)).write_bytes(path.read_bytes())
    shard = copy / "shards" / "part-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(
        DataFormatError, match=f"^{shard}: checksum mismatch \\(corrupt or changed since preparation\\)$"
    ):
        verify_file(read_manifest(copy), "shards/part-00001.parquet")
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"^{shard}: missing file \\({copy / MANIFEST} lists it\\)$"):
        read_manifest(copy)


def test_manifest_of_another_config_is_refused_naming_the_key(prepared):
    directory, config = prepared
    other = table_config(Path(config.path), min_seq_len=4)
    with pytest.raises(DataFormatError, match="prepared for another data config \\(data.min_seq_len differs"):
        read_manifest(directory, other)
    read_manifest(directory, table_config(Path("/moved/events.csv")))  # another path: the same data


def test_shard_order_check_names_shard_raw_user_and_position(prepared):
    directory, _ = prepared
    maps, _ = load_mappings(str(directory / MAPS))
    path = directory / "shards" / "part-00001.parquet"
    table = pq.read_table(path)
    stamps = table["timestamps"].combine_chunks()
    offsets = stamps.offsets.to_numpy().astype(np.int64)
    times = stamps.flatten().to_numpy().copy()
    check_shard_order(path, table["user"].to_numpy(), offsets, times, maps["users"], first_user=8)
    row = 2
    start = offsets[row]
    times[start], times[start + 1] = times[start + 1] + 1, times[start]  # the second event now precedes the first
    with pytest.raises(DataFormatError) as error:
        check_shard_order(path, table["user"].to_numpy(), offsets, times, maps["users"], first_user=8)
    raw = maps["users"].raw[8 + row].tolist()
    assert str(error.value).startswith(
        f"{path}: user {raw!r} (dense id {8 + row}): timestamp {times[start + 1]} at position 1"
    )


def test_gr_data_prepare_command_applies_data_overrides(tmp_path, capsys):
    events = write_csv(tmp_path / "events.csv", table_rows(seed=3, rows=150))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"data:\n  source: csv\n  path: elsewhere.csv\n  columns: {COLUMNS}\n")
    argv = ["data", "prepare", "--config", str(recipe), "--out", str(tmp_path / "out"), "--threads", "1"]
    assert cli.main([*argv, "--data.path", str(events), "--data.min_seq_len", "4"]) == 0
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'out'}: ")
    config = table_config(events, min_seq_len=4)
    assert_prepared_equals_raw(tmp_path / "out", config)
    assert cli.main([*argv, "--data.path", str(events)]) == 2
    assert "already exists; pass overwrite=True (--overwrite)" in capsys.readouterr().err
    recipe.write_text("data:\n  source: synthetic\n")
    assert cli.main([*argv, "--overwrite"]) == 2
    assert capsys.readouterr().err == (
        "gr data prepare: error: data.source: 'synthetic' is generated in memory at training time; gr data prepare "
        "reads files (csv, parquet, ml-100k, ml-1m, ml-20m, amazon)\n"
    )


def test_a_memory_limit_duckdb_cannot_read_is_one_line_naming_the_flag_and_nothing_is_written(tmp_path, capsys):
    events = write_csv(tmp_path / "events.csv", table_rows(seed=3, rows=150))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"data:\n  source: csv\n  path: {events}\n  columns: {COLUMNS}\n")
    out = tmp_path / "out"
    argv = ["data", "prepare", "--config", str(recipe), "--out", str(out), "--memory-limit", "abc"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "gr data prepare: error: memory_limit (--memory-limit): expected a size such as 4GB or 80%, got 'abc'\n"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["events.csv", "recipe.yaml"]


def test_a_second_prepare_into_an_out_being_written_is_refused_and_the_first_completes(tmp_path, capsys, monkeypatch):
    events = write_csv(tmp_path / "events.csv", table_rows(seed=3, rows=150))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"data:\n  source: csv\n  path: {events}\n  columns: {COLUMNS}\n")
    out = tmp_path / "out"
    argv = ["data", "prepare", "--config", str(recipe), "--out", str(out), "--threads", "1"]
    first_run, second = _Preparation.run, []

    def run_and_start_a_second(self, users_per_shard):
        if not second:  # the first preparation, halfway: the second starts
            second.append(None)
            second[0] = cli.main(argv)
        return first_run(self, users_per_shard)

    monkeypatch.setattr(_Preparation, "run", run_and_start_a_second)
    assert cli.main(argv) == 0
    assert second == [2]
    [line] = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert line.startswith(
        f"gr data prepare: error: {out}: in use by another process (pid {os.getpid()}: gr data prepare); "
        "gr data prepare stops here without touching it"
    )
    assert_prepared_equals_raw(out, table_config(events))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.csv", "out", "recipe.yaml"]


def corrupt_events(path: Path) -> Path:
    """A Parquet source (user_id, item_id, timestamp) whose footer reads but one of its data pages does not."""
    rng = np.random.default_rng(0)
    ids = {name: rng.integers(0, high, 2000) for name, high in (("user_id", 50), ("item_id", 300))}
    return write_corrupt_parquet(pa.table({**ids, "timestamp": np.arange(2000)}), path)


def test_a_corrupt_parquet_page_is_one_line_naming_the_file_as_raw_reading_says_it(tmp_path, capsys):
    path = corrupt_events(tmp_path / "events.parquet")
    unreadable = f"{path}: not a readable Parquet file ("
    with pytest.raises(DataFormatError, match=f"^{re.escape(unreadable)}"):
        read_source(DataConfig.from_dict({"source": "parquet", "path": str(path)}))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"data:\n  source: parquet\n  path: {path}\n")
    assert cli.main(["data", "prepare", "--config", str(recipe), "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"gr data prepare: error: {unreadable}") and line.endswith(")"), line
    assert not (tmp_path / "out").exists()


def test_spark_engine_absent_from_this_installation_is_one_line(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("data:\n  source: ml-100k\n  path: x\n")
    code = cli.main(["data", "prepare", "--config", str(recipe), "--out", str(tmp_path / "o"), "--engine", "spark"])
    err = capsys.readouterr().err
    if code == 2 and "no gr.data.prepared.spark_engine module" in err:
        assert err.count("\n") == 1
    else:  # the Spark engine is installed: it refuses the missing source in one line too
        assert code == 2 and err.count("\n") == 1


def test_a_cluster_master_is_spark_only_and_excludes_threads(tmp_path, capsys):
    level = logging.getLogger("gr.data").level
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("data:\n  source: ml-100k\n  path: x\n")
    argv = ["data", "prepare", "--config", str(recipe), "--out", str(tmp_path / "o"), "--master", "yarn"]
    assert cli.main(argv) == 2
    assert "--master: only the spark engine runs on a cluster (got --engine duckdb)" in capsys.readouterr().err
    assert cli.main([*argv, "--engine", "spark", "--threads", "2"]) == 2
    assert "--master and --threads: give one" in capsys.readouterr().err
    assert logging.getLogger("gr.data").level == level  # the command's INFO stage lines end with it


def test_gr_help_imports_no_torch():
    code = "import sys; from gr.commands import cli; cli.main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip().endswith("False")


def test_shards_hold_row_groups_of_at_most_1024_users_in_user_order(tmp_path):
    users = np.repeat(np.arange(2500), 3)
    lines = [f"{u},{(u * 7 + k) % 50},{k}" for k, u in enumerate(users)]
    (tmp_path / "e.csv").write_text("user_id,item_id,timestamp\n" + "\n".join(lines) + "\n")
    config = DataConfig.from_dict({"source": "csv", "path": str(tmp_path / "e.csv")})
    manifest = prepare_with_duckdb(config, tmp_path / "prepared", users_per_shard=2100)
    groups = []
    for shard in manifest.shards:
        metadata = pq.ParquetFile(tmp_path / "prepared" / shard.path).metadata
        groups.append([metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)])
    assert groups == [[1024, 1024, 52], [400]]
    assert [(s.first_user, s.users, s.interactions, s.row_groups) for s in manifest.shards] == [
        (0, 2100, 6300, 3),
        (2100, 400, 1200, 1),
    ]
    assert_prepared_equals_raw(tmp_path / "prepared", config)


def write_source(root: Path, source: str) -> Path:
    """A few users' ratings in the built-in ``source``'s format (with its side files); -> data.path."""
    rng = np.random.default_rng(4)
    events = [
        (u, int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.integers(0, 5)))
        for u in range(1, 7)
        for _ in range(5)
    ]
    root.mkdir()
    if source == "ml-1m":
        (root / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in events))
        genres = ["Drama", "Comedy|Drama", "Animation|Children's"]
        movies = "".join(f"{i}::Movie {i} (1999)::{genres[i % 3]}\n" for i in range(1, 9))
        (root / "movies.dat").write_bytes(movies.replace("Movie 3", "Café").encode("latin-1"))
        (root / "users.dat").write_text(
            "".join(f"{u}::{'FM'[u % 2]}::{18 + u}::{u % 4}::0000{u}\n" for u in range(1, 7))
        )
        return root
    if source == "ml-20m":
        (root / "ratings.csv").write_text(
            "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r - 0.5},{t}\n" for u, i, r, t in events)
        )
        movies = "".join(
            f'{i},"Movie, {i} (1999)",{"Drama|Comedy" if i % 2 else "(no genres listed)"}\n' for i in range(1, 9)
        )
        (root / "movies.csv").write_text("movieId,title,genres\n" + movies)
        return root
    path = root / "ratings_Books.csv"
    path.write_text("".join(f"A{u:03d},{i:010d},{r}.0,{t}\n" for u, i, r, t in events))
    return path


@pytest.mark.parametrize("source,genres", [("ml-1m", "multi_hot"), ("ml-20m", "list"), ("amazon", "multi_hot")])
def test_built_in_sources_prepare_to_what_their_readers_give(tmp_path, source, genres):
    path = write_source(tmp_path / "raw", source)
    settings = {"genres": genres} if source != "amazon" else {}
    config = DataConfig.from_dict({"source": source, "path": str(path), **settings})
    prepare_with_duckdb(config, tmp_path / "prepared", threads=1)
    assert_prepared_equals_raw(tmp_path / "prepared", config)


def test_parquet_timestamp_types_and_unsigned_ids_prepare_to_what_the_reader_gives(tmp_path):
    seconds = np.array([-3, -3, 0, 5, 5, 9, 1, 2, 2, 7], dtype=np.int64)
    table = pa.table(
        {
            "user_id": pa.array([1, 1, 1, 1, 2, 2, 2, 2, 2, 1], pa.uint64()),
            "item_id": pa.array(["b", "a", "c", "a", "b", "c", "a", "d", "d", "e"]),
            "timestamp": pa.array(seconds * 1_000_000_000 + 999_999_999, pa.timestamp("ns")),
            "ms": pa.array(seconds * 1000 - 1, pa.timestamp("ms")),
            "float": pa.array(seconds + 0.5),
        }
    )
    pq.write_table(table, tmp_path / "e.parquet")
    for column in ("timestamp", "ms", "float"):
        config = DataConfig.from_dict(
            {"source": "parquet", "path": str(tmp_path / "e.parquet"), "columns": {"timestamp": column}}
        )
        prepare_with_duckdb(config, tmp_path / column)
        assert_prepared_equals_raw(tmp_path / column, config)


@pytest.mark.parametrize(
    "column,values",
    [
        ("item_id", pa.array([1, None, 3, 4])),
        ("rating", pa.array([1.0, 2.0, float("nan"), 4.0])),
        ("user_id", pa.array([1, 2, 2**63, 4], pa.uint64())),
        ("timestamp", pa.array([1.0, 2.0, 3.0, 1e19])),
    ],
)
def test_bad_parquet_values_are_refused_with_the_readers_row(tmp_path, column, values):
    columns = {"user_id": pa.array([1, 2, 2, 4]), "item_id": pa.array([1, 2, 3, 4])}
    columns.update({"timestamp": pa.array([1, 2, 3, 4]), "rating": pa.array([1.0, 2.0, 3.0, 4.0])})
    columns[column] = values
    pq.write_table(pa.table(columns), tmp_path / "e.parquet")
    config = DataConfig.from_dict(
        {"source": "parquet", "path": str(tmp_path / "e.parquet"), "columns": {"rating": "rating"}}
    )
    with pytest.raises(DataFormatError) as expected:
        read_source(config)
    with pytest.raises(DataFormatError) as got:
        prepare_with_duckdb(config, tmp_path / "prepared")
    assert str(got.value) == str(expected.value) and "row " in str(got.value)
