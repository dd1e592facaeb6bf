"""Streaming a prepared dataset (``data.prepared``, gr.data.prepared.reader / stream): every split's
batches are raw reading's, each rank reads its own shards and takes as many steps as the others,
the training order is seeded per epoch, the shuffle buffer is bounded, and bad shards are named."""

import bisect
import collections
import csv
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from gr.commands.evaluate import evaluate_run
from gr.data.config import DataConfig
from gr.data.datamodule import SequenceDataModule
from gr.data.mappings import IdMap, load_mappings
from gr.data.prepared import manifest as prepared_format
from gr.data.prepared.duckdb_engine import prepare_with_duckdb
from gr.data.prepared.stream import PreparedSplit, SampleBuffer, apportion
from gr.data.sequences import SPLITS
from gr.export.writer import run_item_features
from gr.train import train
from gr.train.config import TrainConfig, plain, save_config
from gr.train.run import CONFIG_FILE, FEATURES_FILE, MAPPINGS_DIR
from gr.utils.atomic import write_json
from helpers.request_log import request_data, request_rows, request_samples, write_request_log
from helpers.runs import RETRIEVAL, ratings_csv, with_overrides

ROOT = Path(__file__).resolve().parents[1]
HELPERS = Path(__file__).resolve().parent / "helpers"
COLUMNS = {
    "timestamp": "ts",
    "rating": "rating",
    "token_features": ["device", "tags"],
    "token_dense": {"watch": "watch"},
    "user_features": ["country", "langs"],
    "user_dense": {"age": "age"},
    "item_features": ["category", "genres"],
    "item_dense": {"price": "price"},
    "list_features": ["tags", "langs", "genres"],
}
RANKING = {
    "positives_per_sample": 2,
    "samples_per_user": 3,
    "num_negatives": 4,
    "eval_num_negatives": 5,
    "tasks": [{"name": "watch"}, {"name": "like", "min_rating": 4}],
}
SPLIT_TIME = 1_003_500
SPLIT_CONFIGS = {
    "leave_one_out": {},
    "time": {"split": "time", "split_time": SPLIT_TIME},
    "time_every_test_event": {"split": "time", "split_time": SPLIT_TIME, "test_events": "all"},
    "none_from_a_train_start": {"split": "none", "train_start": SPLIT_TIME},
    # half the users replay their events from 1_001_000 on: drawn by dataset id, alike in every chunk
    "time_replaying_half_the_users": {
        "split": "time",
        "split_time": SPLIT_TIME,
        "train_start": 1_002_500,
        "replay": 0.5,
        "replay_start": 1_001_000,
    },
}
USERS = 90


EVENTS_HEADER = "user_id,item_id,ts,rating,device,tags,watch,country,langs,age,category,genres,price"


def event_row(rng: np.random.Generator, user: str, u: int, i: int, stamp: int, k: int) -> str:
    """One CSV row of ``EVENTS_HEADER``: user ``user`` (number ``u``: its features), item ``7 i`` (its
    features from ``i``), the user's ``k``-th event at ``stamp``; tags, rating and watch drawn from ``rng``."""
    tags = "|".join(rng.choice(["x", "y", "z", "w"], size=int(rng.integers(0, 3)), replace=False))
    country = ("fr", "de", "jp")[u % 3]
    return (
        f"{user},{i * 7},{stamp},{int(rng.integers(1, 6))},{('web', 'app')[k % 2]},{tags},"
        f"{rng.random():.3f},{country},{'en|' + country if u % 2 else 'en'},{20 + u % 40},"
        f"c{i % 5},g{i % 4}|g{i % 3},{i / 10:.1f}"
    )


def write_events(path: Path, users: int = USERS, items: int = 70) -> Path:
    """A CSV of every feature kind (row, item and user; categorical, list and dense), with ratings,
    tied timestamps and string user ids."""
    rng = np.random.default_rng(0)
    lines = [EVENTS_HEADER]
    for u in range(users):
        n = int(rng.integers(3, 30))
        times = 1_000_000 + np.sort(rng.integers(0, 5000, size=n))
        for k in range(n):
            lines.append(event_row(rng, f"u{u}", u, int(rng.integers(0, items)), int(times[k]), k))
    path.write_text("\n".join(lines) + "\n")
    return path


def data_config(events: Path, **overrides) -> dict:
    return {
        "source": "csv",
        "path": str(events),
        "columns": COLUMNS,
        "max_seq_len": 6,
        "batch_size": 16,
        "eval_batch_size": 16,
        "ranking": RANKING,
        **overrides,
    }


def prepare(config: dict, out: Path, users_per_shard: int) -> Path:
    """``gr data prepare`` (DuckDB) of the data section ``config`` into ``out``."""
    prepare_with_duckdb(DataConfig.from_dict(config), out, threads=1, users_per_shard=users_per_shard)
    return out


def regroup(directory: Path, users_per_group: int) -> Path:
    """Rewrite every shard of ``directory`` with row groups of ``users_per_group`` users (and its
    manifest with their checksums)."""
    manifest = prepared_format.read_manifest(directory)
    for shard in manifest.shards:
        path = directory / shard.path
        pq.write_table(pq.read_table(path), path, row_group_size=users_per_group)
    manifest.shards = [prepared_format.describe_shard(directory, s.path, s.first_user) for s in manifest.shards]
    prepared_format.write_manifest(directory, manifest)
    return directory


@pytest.fixture(scope="module")
def events(tmp_path_factory) -> Path:
    return write_events(tmp_path_factory.mktemp("raw") / "events.csv")


@pytest.fixture(scope="module")
def prepared(events, tmp_path_factory) -> Path:
    """Three shards of 30 users (one row group each)."""
    return prepare(data_config(events), tmp_path_factory.mktemp("prepared") / "dir", users_per_shard=30)


@pytest.fixture(scope="module")
def grouped(events, tmp_path_factory) -> Path:
    """One shard of every user, in row groups of 7 users."""
    out = prepare(data_config(events), tmp_path_factory.mktemp("grouped") / "dir", users_per_shard=USERS)
    return regroup(out, 7)


def modules(events: Path, prepared: Path, **overrides):
    """(raw module, prepared module) of the same data config, set up."""
    raw = SequenceDataModule(data_config(events, **overrides))
    streamed = SequenceDataModule({**data_config(events, **overrides), "prepared": str(prepared)})
    raw.setup()
    streamed.setup()
    return raw, streamed


def positives(config: DataConfig, split: str) -> int:
    """Real candidates per ranking sample (the rest are sampled negatives); 0 for retrieval."""
    if config.task != "ranking":
        return 0
    return config.ranking.positives_per_sample if split == "train" else 1


def samples(batch, real: int) -> list:
    """[(dataset user id, everything the batch says of one sample but its sampled negatives)]; a
    retrieval evaluation sample per target (a sequence may hold several: ``query_index``)."""
    offsets = batch.seq_offsets.tolist()
    targets = None if batch.num_targets is None else batch.num_targets.tolist()
    ids = {k: jt.values().tolist() for k, jt in batch.sequence_ids.to_dict().items()}
    bags = {k: _bags(jt) for k, jt in (batch.token_lists.to_dict() if batch.token_lists else {}).items()}
    common = {k: _bags(jt) for k, jt in (batch.common_ids.to_dict() if batch.common_ids else {}).items()}
    query = batch.labels.get("query_index")
    if query is None:  # (sequence, its end, its sample's index among the labels)
        pieces = [(b, offsets[b + 1], b) for b in range(len(offsets) - 1)]
    else:
        pieces = [(bisect.bisect_right(offsets, q) - 1, q + 1, i) for i, q in enumerate(query.tolist())]
    found, candidate = [], 0
    for b, end, i in pieces:
        start = offsets[b]
        kept = end if targets is None else end - targets[b] + real
        sample = {
            "ids": {k: v[start:kept] for k, v in ids.items()},
            "bags": {k: v[start:kept] for k, v in bags.items()},
            "dense": {k: v[start:kept].tolist() for k, v in batch.token_dense.items()},
            "common": {k: v[b] for k, v in common.items()},
            "common_dense": {k: v[b].tolist() for k, v in batch.common_dense.items()},
            "times": batch.timestamps[start:kept].tolist(),
            "query_times": batch.query_times[start:kept].tolist(),
        }
        for name, value in batch.labels.items():
            if name == "next_item":
                sample[name] = value[start:end].tolist()
            elif name == "target_item":
                sample[name] = int(value[i])
            elif name == "exclude_offsets":
                sample["exclude"] = sorted(batch.labels["exclude_items"][value[i] : value[i + 1]].tolist())
            elif name not in ("user", "exclude_items", "query_index"):  # a ranking task: one label per candidate
                sample[name] = value[candidate : candidate + real].tolist()
        candidate += 0 if targets is None else targets[b]
        found.append((int(batch.labels["user"][b]), repr(sample)))
    return found


def _bags(jagged) -> list:
    offsets, values = jagged.offsets().tolist(), jagged.values().tolist()
    return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def by_user(batches, real: int) -> dict:
    """{user: sorted samples} of ``batches``."""
    found = collections.defaultdict(list)
    for batch in batches:
        for user, sample in samples(batch, real):
            found[user].append(sample)
    return {user: sorted(values) for user, values in found.items()}


def users_of(batches) -> list:
    return [u for batch in batches for u in batch.labels["user"].tolist()]


@pytest.mark.parametrize("task", ["retrieval", "ranking"])
@pytest.mark.parametrize("split", list(SPLIT_CONFIGS))
def test_every_split_streams_the_batches_raw_reading_makes(events, prepared, task, split):
    raw, streamed = modules(events, prepared, task=task, shuffle_buffer=10, **SPLIT_CONFIGS[split])
    assert streamed.corpus is None and streamed.prepared is not None
    for name in SPLITS if raw.config.validates else ("train",):
        real = positives(raw.config, name)
        loader = getattr(streamed, f"{name}_dataloader")()
        expected = by_user(getattr(raw, f"{name}_dataloader")(), real)
        assert by_user(loader, real) == expected, name
        assert len(loader) == len(getattr(raw, f"{name}_dataloader")())
        assert sum(map(len, expected.values())) > 0
    for module in () if raw.config.validates else (raw, streamed):
        with pytest.raises(ValueError, match=r"^data\.split: 'none' holds no test events out"):
            module.test_dataloader()


def in_order(batches, sampled: bool) -> list:
    """Every batch's samples, batch by batch, in order; ranking's with their sampled negatives when ``sampled``."""
    return [
        samples(batch, int(batch.num_targets[0]) if sampled and batch.num_targets is not None else 1)
        for batch in batches
    ]


@pytest.mark.parametrize("task", ["retrieval", "ranking"])
@pytest.mark.parametrize("layout", ["prepared", "grouped"])
def test_one_rank_with_every_user_in_the_buffer_takes_raw_readings_batches_in_order(events, layout, task, request):
    """Time split, three shards or thirteen row groups, a buffer of every user: each training epoch
    is raw reading's batch for batch (sampled negatives included), and so is evaluation (ranking's
    evaluation negatives are drawn per row group)."""
    prepared = request.getfixturevalue(layout)
    raw, streamed = modules(events, prepared, task=task, shuffle_buffer=USERS, **SPLIT_CONFIGS["time"])
    for name in SPLITS:
        loaders = [getattr(module, f"{name}_dataloader")() for module in (raw, streamed)]
        for epoch in (0, 1) if name == "train" else (0,):
            loaders[0].sampler.set_epoch(epoch)
            loaders[1].set_epoch(epoch)
            expected = in_order(loaders[0], sampled=name == "train")
            assert in_order(loaders[1], sampled=name == "train") == expected, (name, epoch)
            assert len(expected) > 1


def test_impressions_stream_from_a_prepared_dataset_as_raw_reading_makes_them(events, prepared):
    """``candidates: impressions``: every split's batches hold the shown items alone, those of raw reading."""
    impressions = {**RANKING, "candidates": "impressions", "num_negatives": 0, "eval_num_negatives": 0}
    impressions["tasks"] = [{"name": "like", "min_rating": 4}]
    raw, streamed = modules(
        events, prepared, task="ranking", shuffle_buffer=USERS, ranking=impressions, **SPLIT_CONFIGS["time"]
    )
    for name in SPLITS:
        batches = [list(getattr(module, f"{name}_dataloader")()) for module in (raw, streamed)]
        expected = in_order(batches[0], sampled=True)
        assert in_order(batches[1], sampled=True) == expected and len(expected) > 1, name
        real = positives(raw.config, name)
        assert all(batch.num_targets.tolist() == [real] * len(batch.num_targets) for batch in batches[1]), name


@pytest.fixture(scope="module")
def request_log(tmp_path_factory):
    """(an impressions log of 30 users grouped in requests, it prepared in 5 shards)."""
    root = tmp_path_factory.mktemp("requests")
    log = write_request_log(root / "requests.csv", request_rows(range(30), 0, 60, seed=5))
    return log, prepare(request_data(log), root / "prepared", users_per_shard=7)


@pytest.mark.parametrize("split", [{}, {"split": "time", "split_time": 30, "test_events": "all"}])
def test_request_impressions_stream_from_a_prepared_dataset_as_raw_reading_makes_them(request_log, split):
    """``data.columns.request``: a training sample is a request's impressions after the history before
    it, a held-out impression's history ends before its request; one rank holding every user takes
    raw reading's batches, in order."""
    log, prepared = request_log
    data = request_data(log, **split)
    raw, streamed = SequenceDataModule(data), SequenceDataModule({**data, "prepared": str(prepared)})
    raw.setup()
    streamed.setup()
    for name in SPLITS:
        batches = [[request_samples([b]) for b in getattr(m, f"{name}_dataloader")()] for m in (raw, streamed)]
        assert batches[1] == batches[0] and len(batches[0]) > 1, name
    assert {len(sample[3]) for sample in request_samples(raw.test_dataloader())} == {1}  # one at a time
    assert {len(sample[3]) for sample in request_samples(raw.train_dataloader())} == {1, 2, 3}  # at most 3


@pytest.mark.parametrize("split", list(SPLIT_CONFIGS))
def test_maps_features_summary_and_popularity_are_raw_readings(events, prepared, split, tmp_path):
    raw, streamed = modules(events, prepared, task="ranking", **SPLIT_CONFIGS[split])
    assert streamed.feature_spec() == raw.feature_spec()
    assert torch.equal(streamed.popularity(), raw.popularity())
    assert {k: v for k, v in streamed.summary.items() if k != "prepared"} == raw.summary
    assert streamed.summary["prepared"] == str(prepared)
    raw.save_mappings(str(tmp_path / "raw"))
    streamed.save_mappings(str(tmp_path / "streamed"))
    (raw_maps, raw_columns), (maps, columns) = (load_mappings(str(tmp_path / d)) for d in ("raw", "streamed"))
    assert columns == raw_columns and maps.keys() == raw_maps.keys()
    assert all(np.array_equal(maps[k].raw, raw_maps[k].raw) and maps[k].offset == raw_maps[k].offset for k in maps)


def test_ranking_negatives_are_unseen_distinct_and_evaluation_ones_fixed(events, prepared):
    _, streamed = modules(events, prepared, task="ranking")
    data = streamed.prepared
    seen = {}
    for _, rows in data.scan(data.row_groups):
        for u, a, b in zip(rows.users, rows.offsets[:-1], rows.offsets[1:]):
            seen[int(u)] = set(rows.items[a:b].tolist())
    for name, real in (("train", 2), ("val", 1)):
        negatives = []
        for batch in getattr(streamed, f"{name}_dataloader")():
            ids, offsets = batch.sequence_ids["item_id"].values(), batch.seq_offsets
            for b, user in enumerate(batch.labels["user"].tolist()):
                drawn = ids[offsets[b + 1] - int(batch.num_targets[b]) + real : offsets[b + 1]].tolist()
                assert len(set(drawn)) == len(drawn) and not seen[user] & set(drawn)
                negatives.append((user, drawn))
        assert len(negatives) > 0
    one_rank = sorted(n for batch in streamed.val_dataloader() for n in _negatives(batch))
    two_ranks = [PreparedSplit(data, "val", rank, 2) for rank in range(2)]
    assert sorted(n for split in two_ranks for batch in split for n in _negatives(batch)) == one_rank


def _negatives(batch) -> list:
    ids, offsets = batch.sequence_ids["item_id"].values(), batch.seq_offsets
    return [
        (user, ids[offsets[b + 1] - int(batch.num_targets[b]) + 1 : offsets[b + 1]].tolist())
        for b, user in enumerate(batch.labels["user"].tolist())
    ]


def test_training_order_is_seeded_and_changes_every_epoch(events, prepared):
    _, streamed = modules(events, prepared, shuffle_buffer=20)
    loader = streamed.train_dataloader()
    orders = []
    for epoch in (0, 0, 1):
        loader.set_epoch(epoch)
        orders.append(users_of(loader))
    assert orders[0] == orders[1] and orders[0] != orders[2]
    assert sorted(orders[0]) == sorted(orders[2]) and len(set(orders[0])) == len(orders[0])
    _, reseeded = modules(events, prepared, shuffle_buffer=20, seed=1)
    assert users_of(reseeded.train_dataloader()) != orders[0]
    assert users_of(streamed.val_dataloader()) == users_of(streamed.val_dataloader())  # evaluation: in order


@pytest.mark.parametrize("capacity, batch", [(12, 4), (1, 8), (40, 16)])
def test_the_shuffle_buffer_holds_a_bounded_number_of_users(events, grouped, capacity, batch):
    _, streamed = modules(events, grouped, shuffle_buffer=capacity)
    data = streamed.prepared
    positions = list(range(len(data.row_groups)))
    buffer = SampleBuffer(data, "train", positions, capacity, np.random.default_rng(0))
    total, taken = int(data.counts["train"].sum()), []
    while len(taken) < total:
        corpus, owners, _, _ = buffer.take(min(batch, total - len(taken)))
        taken += corpus.user_ids[owners].tolist()
        assert buffer.held_users <= max(capacity, batch) + 7  # + one row group
    assert min(max(capacity, batch), total) <= buffer.peak_users <= max(capacity, batch) + 7
    assert sorted(taken) == sorted(set(taken))
    assert len(taken) == total


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_read_disjoint_shards_and_take_the_same_steps(events, prepared, world):
    raw, streamed = modules(events, prepared)
    data = streamed.prepared
    for name in SPLITS:
        ranks = [PreparedSplit(data, name, rank, world) for rank in range(world)]
        shards = [{data.row_groups[p].shard for p in split.groups} for split in ranks]
        assert sum(map(len, shards)) == len(set().union(*shards)) == 3
        batches = [list(split) for split in ranks]
        assert len({len(b) for b in batches}) == 1 and all(len(b) == len(s) for b, s in zip(batches, ranks))
        seen = [u for rank in batches for u in users_of(rank)]
        assert sorted(seen) == sorted(users_of(getattr(raw, f"{name}_dataloader")()))
        assert len(seen) == len(set(seen))


def test_fewer_shards_than_ranks_deal_row_groups(events, grouped):
    raw, streamed = modules(events, grouped)
    data = streamed.prepared
    ranks = [PreparedSplit(data, "train", rank, 2) for rank in range(2)]
    assert ranks[0].groups == list(range(0, len(data.row_groups), 2)) and ranks[1].groups[0] == 1
    batches = [users_of(split) for split in ranks]
    assert sorted(batches[0] + batches[1]) == sorted(users_of(raw.train_dataloader()))
    assert not set(batches[0]) & set(batches[1])


def test_workers_split_their_rank_row_groups_and_follow_the_epoch(events, grouped):
    _, streamed = modules(events, grouped, shuffle_buffer=8)
    split = PreparedSplit(streamed.prepared, "train", 0, 1)
    simulated = [list(split.batches(0, worker, 3)) for worker in range(3)]
    assert sum(map(len, simulated)) == len(split)
    groups = [set(plan[0]) for plan in split.worker_plans(3)]
    assert sum(map(len, groups)) == len(set().union(*groups)) == len(split.groups)
    alone = users_of(split)
    assert sorted(u for batches in simulated for u in users_of(batches)) == sorted(alone)
    loader = SequenceDataModule({**streamed.config.to_dict(), "num_workers": 2})
    loader.setup()
    workers = loader.train_dataloader()
    epochs = []
    for epoch in (0, 1):
        workers.set_epoch(epoch)
        epochs.append(users_of(workers))
    assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(alone) and epochs[0] != epochs[1]


def test_steps_are_shared_in_proportion_and_no_part_goes_empty():
    assert apportion(10, np.array([30, 10, 0])).tolist() == [7, 3, 0]
    assert apportion(2, np.array([1, 100])).tolist() == [1, 1]
    assert apportion(3, np.array([1, 1, 1])).tolist() == [1, 1, 1]


def test_a_prepared_path_streams_and_bad_directories_are_one_line(events, prepared, tmp_path):
    by_path = SequenceDataModule(data_config(prepared))
    by_path.setup()
    assert by_path.prepared is not None and by_path.corpus is None
    with pytest.raises(FileNotFoundError, match=rf"^data.prepared: {tmp_path / 'none'}: no such directory"):
        SequenceDataModule({**data_config(events), "prepared": str(tmp_path / "none")}).setup()
    with pytest.raises(FileNotFoundError, match=rf"^data.prepared: {tmp_path}: no manifest.json in it"):
        SequenceDataModule({**data_config(events), "prepared": str(tmp_path)}).setup()
    other = {**data_config(events), "prepared": str(prepared), "min_seq_len": 4}
    with pytest.raises(ValueError, match=r"prepared for another data config \(data.min_seq_len differs"):
        SequenceDataModule(other).setup()
    with pytest.raises(ValueError, match=r"^data.prepared: the synthetic source is generated in memory"):
        DataConfig.from_dict({"prepared": str(prepared)})
    with pytest.raises(ValueError, match=r"^data.shuffle_buffer: "):
        DataConfig.from_dict({**data_config(events), "shuffle_buffer": 0})


def _copy(prepared: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "copy"))


def test_a_corrupt_or_missing_shard_is_named(events, prepared, tmp_path):
    copy = _copy(prepared, tmp_path)
    shard = copy / "shards" / "part-00001.parquet"
    content = bytearray(shard.read_bytes())
    content[len(content) // 2] ^= 0xFF
    shard.write_bytes(bytes(content))
    with pytest.raises(ValueError, match=rf"^{shard}: checksum mismatch"):
        SequenceDataModule({**data_config(events), "prepared": str(copy)}).setup()
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"^{shard}: missing file"):
        SequenceDataModule({**data_config(events), "prepared": str(copy)}).setup()


def test_timestamps_out_of_order_name_the_shard_user_and_position(events, prepared, tmp_path):
    copy = _copy(prepared, tmp_path)
    shard = copy / "shards" / "part-00002.parquet"
    table = pq.read_table(shard)
    times = table["timestamps"].to_pylist()
    times[3] = times[3][::-1] if times[3][0] != times[3][-1] else times[3]
    pq.write_table(table.set_column(2, "timestamps", pa.array(times, pa.list_(pa.int64()))), shard)
    manifest = prepared_format.read_manifest(copy)
    manifest.shards[2] = prepared_format.describe_shard(copy, manifest.shards[2].path, manifest.shards[2].first_user)
    prepared_format.write_manifest(copy, manifest)
    user = manifest.shards[2].first_user + 3
    with pytest.raises(ValueError, match=rf"^{shard}: user 'u\d+' \(dense id {user}\): timestamp .* at position 1 "):
        SequenceDataModule({**data_config(events), "prepared": str(copy), "split": "time", "split_time": 1}).setup()


def test_a_warm_start_extends_the_prepared_maps(events, prepared):
    before = SequenceDataModule(data_config(events))
    before.setup()
    items = before.item_map.raw
    base = {
        "items": IdMap(np.concatenate([items[::3][::-1], [999_999]])),  # another order, and an item gone since
        "category": IdMap(np.array(["c9", "c3"]), offset=1),
        "genres": IdMap(np.array(["g7", "g1"]), offset=1),
    }
    raw = SequenceDataModule(data_config(events), base_maps=base)
    streamed = SequenceDataModule({**data_config(events), "prepared": str(prepared)}, base_maps=base)
    raw.setup()
    streamed.setup()
    assert np.array_equal(streamed.item_map.raw, raw.item_map.raw) and streamed.item_map.raw[0] == items[::3][-1]
    for name in ("category", "genres"):
        assert np.array_equal(streamed.item_features.vocabularies[name].raw, raw.item_features.vocabularies[name].raw)
    assert streamed.feature_spec() == raw.feature_spec()
    assert torch.equal(streamed.popularity(), raw.popularity())
    assert by_user(streamed.train_dataloader(), 0) == by_user(raw.train_dataloader(), 0)


def test_evaluation_keeps_a_models_maps_leaves_out_new_items_and_refuses_a_prepared_dataset_with_new_ids(
    events, prepared
):
    """new_ids="unknown" (a trained model read on later data): its ids keep their rows, the events of
    an item it has no row for are left out and counted, a side-feature value it never saw is id 0."""
    before = SequenceDataModule(data_config(events))
    before.setup()
    items = before.item_map.raw
    base = {"items": IdMap(items[1:][::-1]), "category": IdMap(np.array(["c9", "c3"]), offset=1)}  # items[0]: new
    evaluated = SequenceDataModule(data_config(events), base_maps=base, new_ids="unknown")
    evaluated.setup()
    assert np.array_equal(evaluated.item_map.raw, items[1:][::-1])  # as the model has it: not extended
    new_events = sum(1 for row in csv.DictReader(events.open()) if row["item_id"] == str(items[0]))
    assert new_events > 0 and evaluated.summary["unknown_items"] == {"items": 1, "events": new_events}
    assert evaluated.summary["interactions"] == before.summary["interactions"] - new_events
    category = before.item_features.categorical["category"][before.item_map.encode(evaluated.item_map.raw)]
    known = np.isin(before.item_features.vocabularies["category"].decode(category), ["c9", "c3"])
    assert known.any() and not known.all()
    assert np.array_equal(evaluated.item_features.categorical["category"] > 0, known)
    assert np.array_equal(evaluated.item_features.vocabularies["category"].raw, ["c9", "c3"])
    streamed = {**data_config(events), "prepared": str(prepared)}
    with pytest.raises(ValueError, match=r"^data.prepared: .* has ids the model has no row for \(new ids per map: "):
        SequenceDataModule(streamed, base_maps=base, new_ids="unknown").setup()


@pytest.mark.slow
def test_two_ranks_train_on_their_own_shards_and_the_run_evaluates_and_warm_starts(tmp_path, warm_python):
    """torchrun, 2 gloo ranks, ``gr train`` on 3 shards: rank 0 reads two, rank 1 one; every epoch
    each training user is in one batch of one rank, both ranks take the same steps (rank 1's
    batches smaller); the run's test metrics are the ones ``gr evaluate`` computes on one rank, and
    a warm start from it trains on the same prepared data."""
    events = ratings_csv(tmp_path / "events.csv")
    values = with_overrides(RETRIEVAL, ("trainer.max_epochs", 2), ("data.shuffle_buffer", 16))
    values["data"].update(source="csv", path=str(events), columns={"rating": "rating"})
    prepared = prepare(values["data"], tmp_path / "prepared", users_per_shard=55)
    values["data"]["prepared"] = str(prepared)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(values))
    out = tmp_path / "run"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HELPERS.parent), env.get("PYTHONPATH", "")])
    run = warm_python.torchrun(2, [str(HELPERS / "prepared_ranks.py"), str(recipe), str(out)], ROOT, env, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["shards"] == [0, 2] and ranks[1]["shards"] == [1]
    one_rank = SequenceDataModule(values["data"])
    one_rank.setup()
    trainable = sorted(users_of(one_rank.train_dataloader()))
    for epoch in ("0", "1"):
        steps = [rank["train"][epoch] for rank in ranks]
        assert len(steps[0]) == len(steps[1]) and max(map(len, steps[1])) < max(map(len, steps[0]))
        assert sorted(u for rank in steps for batch in rank for u in batch) == trainable
        assert ranks[0]["val"][epoch] == ranks[1]["val"][epoch]
    assert ranks[0]["test"] == ranks[1]["test"] > 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["data"]["prepared"] == str(prepared)
    evaluated = evaluate_run(out)
    for key in ("hr@10", "ndcg@10", "mrr"):
        assert evaluated[key] == pytest.approx(metrics[key], abs=1e-6), key
    warm = with_overrides(values, ("trainer.init_from", str(out)), ("trainer.max_epochs", 1))
    assert train(TrainConfig.from_dict(warm), tmp_path / "warm")["world_size"] == 1


def test_an_export_takes_the_item_features_of_a_run_trained_on_prepared_data(events, prepared, tmp_path):
    values = with_overrides(RETRIEVAL)
    values["data"] = {**data_config(events), "prepared": str(prepared)}
    config = TrainConfig.from_dict(values)
    raw, streamed = modules(events, prepared)
    run = tmp_path / "run"
    run.mkdir()
    save_config(config, run / CONFIG_FILE)
    write_json(run / FEATURES_FILE, plain({"spec": vars(streamed.feature_spec()), "tasks": []}))
    streamed.save_mappings(str(run / MAPPINGS_DIR))
    features = run_item_features(run, ["category", "genres", "price", "device"])
    assert sorted(features) == ["category", "genres", "price"]  # device is the event's, not the item's
    side = raw.item_features
    assert np.array_equal(features["category"], side.categorical["category"])
    assert np.array_equal(features["price"], side.dense["price"])
    assert np.array_equal(features["genres"].offsets, side.lists["genres"].offsets)
    assert np.array_equal(features["genres"].values, side.lists["genres"].values)


def test_real_ml_100k_streams_raw_readings_batches(ml_100k, tmp_path):
    config = {"source": "ml-100k", "path": str(ml_100k), "genres": "list", "max_seq_len": 20, "batch_size": 256}
    prepared = prepare(config, tmp_path / "prepared", users_per_shard=400)
    raw, streamed = SequenceDataModule(config), SequenceDataModule({**config, "prepared": str(prepared)})
    raw.setup()
    streamed.setup()
    assert streamed.feature_spec() == raw.feature_spec() and torch.equal(streamed.popularity(), raw.popularity())
    for name in ("train", "test"):
        loaders = [getattr(module, f"{name}_dataloader")() for module in (raw, streamed)]
        assert by_user(loaders[1], 0) == by_user(loaders[0], 0), name
