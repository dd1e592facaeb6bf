"""The prepared dataset format's manifest: config hash, write/read round trip, and every check a
reader relies on (format, paths, missing files, checksums, another config, shard order)."""

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gr.data.config import DataConfig
from gr.data.interactions import DataFormatError
from gr.data.mappings import IdMap, save_mappings
from gr.data.prepared.manifest import (
    ENGINES,
    LATER_PREPARED_KEYS,
    MANIFEST,
    PREPARED_KEYS,
    PreparedManifest,
    check_shard_order,
    config_data,
    config_hash,
    describe_shard,
    file_checksums,
    prepared_keys,
    read_manifest,
    shard_path,
    verify_digest,
    verify_file,
    write_manifest,
)
from gr.utils.checksums import file_sha256


def table_config(**overrides) -> DataConfig:
    values = {"source": "csv", "path": "events.csv", "columns": {"item_features": ["genre"]}, **overrides}
    return DataConfig.from_dict(values)


def write_dataset(root, config: DataConfig) -> PreparedManifest:
    """Two shards of users 0-2 and 3 (raw ids 10, 20, 30, 40), maps, and the manifest."""
    save_mappings(str(root / "maps"), {"users": IdMap(np.array([10, 20, 30, 40])), "items": IdMap(np.arange(3))}, {})
    (root / "shards").mkdir()
    rows = [([0, 1, 2], [[0, 1, 2], [1, 2, 0], [2, 2, 1]]), ([3], [[0, 1, 1, 2]])]
    shards, first = [], 0
    for index, (users, items) in enumerate(rows):
        times = [list(range(len(seq))) for seq in items]
        table = pa.table({"user": pa.array(users, pa.int64()), "items": items, "timestamps": times})
        pq.write_table(table, root / shard_path(index), row_group_size=2)
        shards.append(describe_shard(root, shard_path(index), first))
        first += len(users)
    summary = {"source": "events.csv", "rows_read": 13, "duplicates_dropped": 0, "duplicates_kept": 0}
    manifest = PreparedManifest(
        directory=root,
        engine=ENGINES[0],
        engine_version="test",
        config_hash=config_hash(config),
        data=config_data(config),
        summary={**summary, "users": 4, "items": 3, "interactions": 13},
        has_ratings=False,
        shards=shards,
        files=file_checksums(root),
    )
    write_manifest(root, manifest)
    return manifest


def hash_before_later_keys(data: dict) -> str:
    """The config hash of a manifest's ``data`` as written before the prepared keys added later."""
    kept = {key: data[key] for key in PREPARED_KEYS if key not in LATER_PREPARED_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode("utf8")).hexdigest()


def edit_manifest(root, edit) -> None:
    raw = json.loads((root / MANIFEST).read_text())
    edit(raw)
    (root / MANIFEST).write_text(json.dumps(raw))


def test_config_hash_ignores_path_splits_batching_and_seeds_but_not_what_is_prepared():
    base = config_hash(table_config())
    same = [
        {"path": "moved/events.csv"},
        {"split": "time", "split_time": 100},
        {"batch_size": 7, "seed": 3, "max_seq_len": 9, "task": "ranking", "num_workers": 2},
        {"eval_exclude": "window"},
    ]
    assert all(config_hash(table_config(**o)) == base for o in same)
    different = [
        {"min_seq_len": 4},
        {"min_item_interactions": 2},
        {"keep_duplicates": True},
        {"columns": {"item_features": ["genre"], "user": "uid"}},
        {"source": "parquet"},
    ]
    assert len({config_hash(table_config(**o)) for o in different} | {base}) == len(different) + 1


def test_release_year_is_prepared_but_left_out_of_the_hash_of_configs_without_it():
    ml = {"source": "ml-100k", "path": "ml"}
    assert "release_year" not in prepared_keys(DataConfig.from_dict(ml))  # directories prepared before it still match
    assert prepared_keys(DataConfig.from_dict({**ml, "release_year": True}))["release_year"] is True


def test_a_dataset_prepared_before_request_ids_still_reads_and_a_config_asking_for_them_is_one_line(tmp_path):
    write_dataset(tmp_path, table_config())

    edit_manifest(tmp_path, lambda raw: raw.update(config_hash=hash_before_later_keys(raw["data"])))
    assert read_manifest(tmp_path, table_config()).request_column is None  # hashed with "request": null

    def without_the_key(raw: dict) -> None:  # data.columns before it had a "request" key
        del raw["data"]["columns"]["request"]
        raw["config_hash"] = hash_before_later_keys(raw["data"])

    edit_manifest(tmp_path, without_the_key)
    assert read_manifest(tmp_path, table_config()).request_column is None
    requests = table_config(
        task="ranking",
        columns={"item_features": ["genre"], "rating": "clicked", "request": "page"},
        ranking={"candidates": "impressions", "tasks": [{"name": "click", "min_rating": 1}]},
    )
    with pytest.raises(DataFormatError) as error:
        read_manifest(tmp_path, requests)
    assert str(error.value) == (
        f"{tmp_path / MANIFEST}: data.columns.request: 'page', but this dataset was prepared without request ids "
        "(data.columns.request null); prepare it again with this config"
    )


def test_written_manifest_reads_back_with_shard_counts_and_file_checksums(tmp_path):
    written = write_dataset(tmp_path, table_config())
    manifest = read_manifest(tmp_path, table_config(path="elsewhere.csv"))
    assert manifest == written
    assert [(s.path, s.first_user, s.users, s.interactions, s.row_groups) for s in manifest.shards] == [
        ("shards/part-00000.parquet", 0, 3, 9, 2),
        ("shards/part-00001.parquet", 3, 1, 4, 1),
    ]
    assert set(manifest.files) == {"maps/mappings.json", "maps/users.tsv", "maps/items.tsv"}
    assert manifest.num_users == 4 and manifest.data_config() == table_config()
    for relpath in [*manifest.files, *(s.path for s in manifest.shards)]:
        verify_file(manifest, relpath)


def test_manifest_of_another_config_names_the_first_differing_key(tmp_path):
    write_dataset(tmp_path, table_config())
    with pytest.raises(DataFormatError) as error:
        read_manifest(tmp_path, table_config(columns={"item_features": ["genre", "brand"]}))
    assert str(error.value) == (
        f"{tmp_path / MANIFEST}: prepared for another data config (data.columns.item_features differs: "
        'prepared with ["genre"], this config has ["genre", "brand"])'
    )
    with pytest.raises(DataFormatError, match="data.min_seq_len differs: prepared with 3, this config has 5"):
        read_manifest(tmp_path, table_config(min_seq_len=5))


def test_a_side_table_is_a_prepared_key_by_its_id_column_not_its_path(tmp_path):
    write_dataset(tmp_path, table_config(items={"path": "items.parquet", "key": "movie"}))
    read_manifest(tmp_path, table_config(items={"path": "moved/items.csv", "key": "movie"}))
    with pytest.raises(DataFormatError, match='data.items.key differs: prepared with "movie", this config has null'):
        read_manifest(tmp_path, table_config(items="items.parquet"))
    with pytest.raises(
        DataFormatError, match='data.items differs: prepared with {"key": "movie"}, this config has null'
    ):
        read_manifest(tmp_path, table_config())
    values = config_data(table_config())  # without side tables, the hash of a dataset prepared before them
    del values["columns"]["request"]  # and before data.columns.request
    assert config_hash(table_config()) == hash_before_later_keys(values)


def test_corrupt_shard_fails_its_checksum_naming_the_file(tmp_path):
    manifest = write_dataset(tmp_path, table_config())
    shard = tmp_path / shard_path(1)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataFormatError) as error:
        verify_file(manifest, shard_path(1))
    assert str(error.value) == f"{shard}: checksum mismatch (corrupt or changed since preparation)"
    verify_digest(manifest, shard_path(0), file_sha256(tmp_path / shard_path(0)))


def test_missing_shard_is_one_line_naming_it(tmp_path):
    write_dataset(tmp_path, table_config())
    (tmp_path / shard_path(1)).unlink()
    with pytest.raises(FileNotFoundError) as error:
        read_manifest(tmp_path)
    assert str(error.value) == f"{tmp_path / shard_path(1)}: missing file ({tmp_path / MANIFEST} lists it)"


def test_missing_manifest_says_the_preparation_did_not_finish(tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest.json: missing file .*did not finish"):
        read_manifest(tmp_path)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: m.update(format="other"), "format: expected 'gr-prepared', got 'other'"),
        (lambda m: m.update(version=2), "version: expected 1, got 2"),
        (lambda m: m["shards"][0].update(path="../outside.parquet"), "shards\\[0\\].path: path '../outside.parquet'"),
        (lambda m: m["files"].update({"/etc/passwd": "0"}), "files./etc/passwd: path '/etc/passwd'"),
        (lambda m: m["shards"][1].update(first_user=4), "shards\\[1\\].first_user: expected 3"),
        (lambda m: m["shards"][0].update(users="3"), "shards\\[0\\].users: expected int, got '3'"),
        (lambda m: m["summary"].update(interactions=12), "summary.interactions: 12, but the shards hold 13"),
        (lambda m: m.update(event_features={"device": "float"}), "event_features: expected kinds among"),
    ],
)
def test_malformed_manifest_names_the_key(tmp_path, edit, message):
    write_dataset(tmp_path, table_config())
    edit_manifest(tmp_path, edit)
    with pytest.raises(DataFormatError, match=f"^{tmp_path / MANIFEST}: {message}"):
        read_manifest(tmp_path)


def test_out_of_order_timestamps_name_the_shard_raw_user_and_position():
    users = IdMap(np.array(["a", "b", "c"]))
    offsets = np.array([0, 3, 6])
    ok = np.array([5, 5, 7, 1, 2, 2])
    check_shard_order("part-00000.parquet", np.array([1, 2]), offsets, ok, users, first_user=1)
    backwards = np.array([5, 5, 7, 1, 3, 2])
    with pytest.raises(DataFormatError) as error:
        check_shard_order("part-00000.parquet", np.array([1, 2]), offsets, backwards, users, first_user=1)
    assert str(error.value).startswith(
        "part-00000.parquet: user 'c' (dense id 2): timestamp 2 at position 2 is before 3 at position 1"
    )


def test_shard_rows_out_of_user_order_are_refused():
    users = IdMap(np.arange(3))
    with pytest.raises(DataFormatError, match="row 1 holds dense user 2, expected 1"):
        check_shard_order("s.parquet", np.array([0, 2]), np.array([0, 1, 2]), np.array([1, 1]), users, first_user=0)
