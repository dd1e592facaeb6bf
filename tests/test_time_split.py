"""The time split: events before the cut train, each user's first event at or after it is its
validation target and the second its test target (or every later one, each user counted once in
the metrics); with a train start, training predicts only events at or after it. Leave-one-out
stays the default. ``data.split: none`` trains on every event (a train start still applies) and
holds nothing out: the run validates and tests nothing, and is evaluated on later data."""

import copy
import json

import numpy as np
import pytest
import yaml

from gr.commands.cli import main as gr_main
from gr.commands.evaluate import evaluate_run
from gr.data.config import DataConfig
from gr.data.datamodule import SequenceDataModule
from gr.data.sequences import replayed_users
from gr.jagged_rows import concat_ranges
from gr.train.config import TrainConfig
from gr.train.metrics import retrieval_metrics
from helpers.runs import RANKING, RETRIEVAL, step_losses, with_overrides


def _data(task: str = "retrieval", **split) -> SequenceDataModule:
    values = copy.deepcopy((RANKING if task == "ranking" else RETRIEVAL)["data"])
    values.update(split)
    data = SequenceDataModule(values)
    data.setup()
    return data


def _cut(data: SequenceDataModule, q: float) -> int:
    return int(np.percentile(data.corpus.sequences.timestamps, q))


@pytest.fixture(scope="module")
def times():
    data = _data()
    return {q: _cut(data, q) for q in (50, 70, 90)}


def test_no_training_label_lies_at_or_after_the_cut_and_targets_are_the_next_two_events(times):
    cut = times[70]
    data = _data(split="time", split_time=cut)
    seqs = data.corpus.sequences
    batch = data.splits["train"].build(np.arange(len(data.splits["train"])), np.random.default_rng(0))
    labelled_rows = batch.labels["next_item"] >= 0
    query_times = batch.query_times.numpy()  # each token's next event's time: its label's
    assert labelled_rows.any() and (query_times[labelled_rows.numpy()] < cut).all()
    for split, position in (("val", 0), ("test", 1)):
        users, targets = seqs.targets(split)
        assert len(users) > 0 and (np.diff(users) > 0).all() and (seqs.timestamps[targets] >= cut).all()
        first_after = np.array(
            [seqs.starts[u] + (seqs.timestamps[seqs.starts[u] : seqs.offsets[u + 1]] < cut).sum() for u in users]
        )
        assert (targets == first_after + position).all()
        assert (seqs.timestamps[targets - position - 1] < cut).all()  # a history before the cut
        batch = data.splits[split].build(np.arange(len(users)), np.random.default_rng(0))
        assert batch.labels["target_item"].tolist() == seqs.items[targets].tolist()
    never = np.setdiff1d(np.arange(seqs.num_users), seqs.evaluated_users("val"))
    assert (
        len(never) > 0
        and ((seqs.timestamps[seqs.starts[never]] >= cut) | (seqs.timestamps[seqs.offsets[never + 1] - 1] < cut)).all()
    )
    assert data.summary["split"] == {"kind": "time", "split_time": cut, "test_events": "next"}


def test_every_test_event_is_each_later_event_in_the_window_with_its_whole_history(times):
    cut, end = times[50], times[90]
    data = _data(split="time", split_time=cut, split_end=end, test_events="all")
    seqs = data.corpus.sequences
    next_only = _data(split="time", split_time=cut, split_end=end).corpus.sequences
    users, targets = seqs.targets("test")
    expected = [
        (u, row)
        for u in range(seqs.num_users)
        for row in range(seqs.starts[u], seqs.offsets[u + 1])
        if cut <= seqs.timestamps[row] < end
        and row - 1 >= seqs.starts[u]
        and seqs.timestamps[row - 1] >= cut
        and seqs.timestamps[seqs.starts[u]] < cut
    ]
    assert list(zip(users.tolist(), targets.tolist())) == expected
    assert len(targets) > 2 * len(np.unique(users))  # several targets per user
    assert [t.tolist() for t in seqs.targets("val")] == [t.tolist() for t in next_only.targets("val")]
    first = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    assert [targets[first].tolist(), users[first].tolist()] == [
        next_only.targets("test")[1].tolist(),
        next_only.targets("test")[0].tolist(),
    ]
    batch = data.splits["test"].build(np.arange(len(users)), np.random.default_rng(0))
    offsets, tokens = batch.seq_offsets.numpy(), batch.sequence_ids["item_id"].values().numpy()
    query = batch.labels["query_index"].numpy()
    sequence = np.searchsorted(offsets[1:], query, side="right")
    starts = np.maximum(seqs.starts[users], targets - data.config.max_seq_len)
    for s, t, q, w in zip(sequence.tolist(), targets.tolist(), query.tolist(), starts.tolist()):
        assert tokens[offsets[s] : q + 1].tolist() == seqs.items[w:t].tolist()  # earlier test events are history
    assert batch.labels["user"][sequence].tolist() == users.tolist()
    assert len(offsets) - 1 == np.unique(np.stack([users, starts]), axis=1).shape[1]  # one sequence a window
    assert batch.labels["target_item"].tolist() == seqs.items[targets].tolist()
    assert data.summary["evaluated_users"]["test"] == len(np.unique(users))
    assert data.summary["evaluated_targets"]["test"] == len(users)
    assert data.summary["split"]["test_events"] == "all"


def test_a_user_with_several_targets_counts_once_in_the_metrics():
    import torch

    ranks = torch.tensor([0, 50, 50, 50, 50])  # user 7 hits once; user 9 misses four times
    users = torch.tensor([7, 9, 9, 9, 9])
    assert retrieval_metrics(ranks, (10,), users)["hr@10"] == 0.5
    assert retrieval_metrics(ranks, (10,))["hr@10"] == 0.2
    assert retrieval_metrics(ranks, (10,), torch.tensor([1, 2, 3, 4, 5]))["hr@10"] == 0.2


def test_an_end_drops_later_events_from_the_targets(times):
    data = _data(split="time", split_time=times[50], split_end=times[70])
    seqs = data.corpus.sequences
    for split in ("val", "test"):
        _, targets = seqs.targets(split)
        assert len(targets) > 0 and (seqs.timestamps[targets] < times[70]).all()


def test_a_train_start_leaves_earlier_events_as_history_only(times):
    data = _data(split="time", split_time=times[90], train_start=times[70])
    batch = data.splits["train"].build(np.arange(len(data.splits["train"])), np.random.default_rng(0))
    labelled = (batch.labels["next_item"] >= 0).numpy()
    query_times = batch.query_times.numpy()
    assert labelled.any() and (~labelled).any()
    assert (query_times[labelled] >= times[70]).all() and (query_times[labelled] < times[90]).all()
    cold = _data(split="time", split_time=times[90])
    assert len(data.splits["train"]) < len(cold.splits["train"])  # only users with new events train


def _label_rows(data: SequenceDataModule) -> np.ndarray:
    """The flat rows the training samples predict."""
    seqs = data.corpus.sequences
    users = data.splits["train"].users
    starts = np.maximum(seqs.label_starts()[users], seqs.starts[users] + 1)
    return concat_ranges(starts, seqs.train_ends()[users] - starts)


def test_a_replayed_share_of_users_predicts_its_earlier_events_again_and_never_a_held_out_one(times):
    split = dict(split="time", split_time=times[90], train_start=times[70], test_events="all")
    new_day, data = _data(**split, seed=3), _data(**split, replay=0.5, seed=3)  # synthetic data: drawn by the seed too
    seqs = data.corpus.sequences
    replayed = replayed_users(np.arange(seqs.num_users), 0.5, 3)
    assert 0 < replayed.sum() < seqs.num_users
    assert (seqs.label_starts()[replayed] == seqs.starts[replayed]).all()  # from each replayed user's first event
    assert (seqs.label_starts()[~replayed] == new_day.corpus.sequences.label_starts()[~replayed]).all()
    rows = _label_rows(data)
    assert (seqs.timestamps[rows] < times[70]).any() and (seqs.timestamps[rows] < times[90]).all()
    held_out = np.concatenate([seqs.targets(split)[1] for split in ("val", "test")])
    assert len(held_out) and not np.isin(rows, held_out).any()
    batch = data.splits["train"].build(np.arange(len(data.splits["train"])), np.random.default_rng(0))
    labelled = (batch.labels["next_item"] >= 0).numpy()
    assert labelled.sum() == len(rows) and (batch.query_times.numpy()[labelled] < times[90]).all()
    assert (
        len(new_day.splits["train"])
        < len(data.splits["train"])
        < len(_data(split="time", split_time=times[90], seed=3).splits["train"])
    )
    assert data.summary["split"]["replay"] == 0.5


def test_the_replayed_users_are_a_fixed_sample_per_seed_whichever_users_are_read_with_them():
    ids = np.arange(20_000)
    draws = {seed: replayed_users(ids, 0.25, seed) for seed in (0, 1)}
    assert np.array_equal(replayed_users(ids, 0.25, 0), draws[0])
    assert abs(draws[0].mean() - 0.25) < 0.02 and abs((draws[0] & draws[1]).mean() - 0.25**2) < 0.01  # independent
    assert np.array_equal(replayed_users(ids[500:700], 0.25, 1), draws[1][500:700])  # a prepared dataset's chunk
    assert replayed_users(ids, 1.0, 0).all() and not replayed_users(ids, 0.0, 0).any()


def test_a_replay_start_bounds_the_replayed_events_under_split_none(times):
    data = _data(split="none", train_start=times[90], replay=1.0, replay_start=times[50])
    seqs = data.corpus.sequences
    rows = _label_rows(data)
    assert (seqs.timestamps[rows] >= times[50]).all() and (seqs.timestamps[rows] < times[90]).any()
    everything = _data(split="none", train_start=times[90], replay=1.0)
    assert len(rows) < len(_label_rows(everything))


def test_a_validation_start_validates_every_event_before_the_cut_never_trains_them_and_keeps_the_tests(times):
    split = dict(split="time", split_time=times[90], train_start=times[50], test_events="all", replay=1.0)
    data, without = _data(**split, val_start=times[70]), _data(**split)
    seqs = data.corpus.sequences
    users, targets = seqs.targets("val")
    expected = [
        (u, row)
        for u in range(seqs.num_users)
        for row in range(seqs.starts[u], seqs.offsets[u + 1])
        if times[70] <= seqs.timestamps[row] < times[90] and seqs.timestamps[seqs.starts[u]] < times[70]
    ]
    assert list(zip(users.tolist(), targets.tolist())) == expected and len(targets) > 2 * len(np.unique(users))
    test = [t.tolist() for t in seqs.targets("test")]
    assert test == [t.tolist() for t in without.corpus.sequences.targets("test")] and test[0]  # never a test event
    rows = _label_rows(data)
    assert (seqs.timestamps[rows] < times[70]).all() and (seqs.timestamps[rows] >= times[50]).any()
    assert not np.isin(rows, targets).any()  # replayed or not, no validation event trains
    assert data.summary["split"]["val_start"] == times[70]
    again = _data(**split, val_start=times[70]).corpus.sequences  # deterministic
    assert [t.tolist() for t in again.targets("val")] == [users.tolist(), targets.tolist()]


def test_ranking_cuts_lie_in_the_training_window(times):
    data = _data("ranking", split="time", split_time=times[90], train_start=times[50])
    seqs, train = data.corpus.sequences, data.splits["train"]
    assert len(train) > 0
    assert (seqs.timestamps[train.cuts] >= times[50]).all() and (seqs.timestamps[train.cuts] < times[90]).all()
    test = data.splits["test"]
    assert (seqs.timestamps[test.cuts] >= times[90]).all()


def test_leave_one_out_is_unchanged_by_the_split_machinery():
    data = _data()
    seqs = data.corpus.sequences
    assert seqs.targets("test")[1].tolist() == (seqs.offsets[1:] - 1).tolist()
    assert len(data.splits["test"]) == seqs.num_users and data.summary["split"] == {"kind": "leave_one_out"}


@pytest.mark.parametrize(
    "values, message",
    [
        ({"split": "time"}, r"data\.split_time: required by data\.split 'time'"),
        ({"split_time": 5}, r"data\.split_time: only data\.split 'time' reads it"),
        ({"split": "time", "split_time": 5, "split_end": 5}, r"data\.split_end: expected after split_time 5"),
        ({"split": "time", "split_time": 5, "train_start": 9}, r"data\.train_start: expected before split_time 5"),
        (
            {"split": "time", "split_time": 1.5},
            r"data\.split_time: expected null or an integer number of seconds, or an ISO 8601 date .*, got 1\.5",
        ),
        ({"split": "days"}, r"data\.split: expected one of"),
        ({"test_events": "all"}, r"data\.test_events: only data\.split 'time' reads it"),
        ({"split": "time", "split_time": 5, "test_events": "every"}, r"data\.test_events: expected one of"),
        ({"split": "none", "split_time": 5}, r"data\.split_time: only data\.split 'time' reads it \(the split is none"),
        ({"split": "none", "test_events": "all"}, r"data\.test_events: only data\.split 'time' reads it"),
        (
            {"split": "time", "split_time": 9, "replay": 0.5},
            r"data\.replay: replays the events before data\.train_start",
        ),
        ({"split": "none", "train_start": 5, "replay": 1.5}, r"data\.replay: expected a number in \[0\.0, 1\.0\]"),
        ({"split": "none", "train_start": 5, "replay_start": 3}, r"data\.replay_start: is read only with data\.replay"),
        (
            {"split": "time", "split_time": 9, "train_start": 5, "replay": 0.5, "replay_start": 5},
            r"data\.replay_start: expected before train_start 5",
        ),
        ({"split": "time", "split_time": 9, "val_start": 9}, r"data\.val_start: expected before split_time 9"),
        (
            {"split": "time", "split_time": 9, "train_start": 5, "val_start": 4},
            r"data\.val_start: expected after train_start 5 \(the new day's events before it train\), got 4",
        ),
        ({"split": "none", "val_start": 5}, r"data\.val_start: only data\.split 'time' reads it \(the split is none"),
    ],
)
def test_bad_split_keys_are_refused_naming_them(values, message):
    with pytest.raises(ValueError, match=message):
        DataConfig.from_dict(values)


def test_split_times_may_be_iso_8601_dates_or_times_and_become_seconds():
    """UTC unless an offset is given; YAML's unquoted dates and times alike; the config keeps seconds."""
    config = DataConfig.from_dict(
        {"split": "time", "split_time": "2023-11-14T23:13:20+01:00", "split_end": "2023-11-15", "train_start": 5}
    )
    assert (config.split_time, config.split_end, config.train_start) == (1_700_000_000, 1_700_006_400, 5)
    from_yaml = yaml.safe_load("split: none\ntrain_start: 2023-11-14T22:13:20.9Z\n")
    assert DataConfig.from_dict(from_yaml).train_start == 1_700_000_000
    assert DataConfig.from_dict({"split": "none", "train_start": "2023-11-14 22:13:20"}).to_dict()["train_start"] == (
        1_700_000_000
    )
    with pytest.raises(ValueError, match=r"data\.split_time: expected null or an integer number of seconds, or an ISO"):
        DataConfig.from_dict({"split": "time", "split_time": "yesterday"})


def test_split_times_out_of_order_are_named_as_dates_when_dates_were_given():
    """The seconds too, which the run's config.yaml keeps; a config of seconds alone is answered in seconds."""
    with pytest.raises(
        ValueError, match=r"split_end: expected after split_time 2001-01-01 \(978307200\), got 2000-12-01 \("
    ):
        DataConfig.from_dict({"split": "time", "split_time": "2001-01-01", "split_end": 975_628_800})
    message = (
        r"train_start: expected before split_time 2001-01-01T06:00:00Z \(978328800\), got 2001-01-02 \(978393600\)$"
    )
    with pytest.raises(ValueError, match=message):
        DataConfig.from_dict({"split": "time", "split_time": 978_328_800, "train_start": "2001-01-02"})
    with pytest.raises(ValueError, match=r"split_end: expected after split_time 978307200, got 975628800$"):
        DataConfig.from_dict({"split": "time", "split_time": 978_307_200, "split_end": 975_628_800})


def test_a_cut_with_no_target_after_it_is_one_line(times):
    with pytest.raises(ValueError, match=r"data\.split_time: no user has a val target"):
        _data(split="time", split_time=times[90] * 2)


def test_split_none_trains_on_every_event_after_a_train_start_and_holds_nothing_out(times):
    data = _data(split="none")
    seqs = data.corpus.sequences
    assert all(len(seqs.targets(split)[0]) == 0 for split in ("val", "test"))
    assert (seqs.train_ends() == seqs.offsets[1:]).all()  # each user's last event trains too
    assert int(data.popularity().sum()) == len(seqs.items)  # every event counts, the last two included
    assert int(_data().popularity().sum()) == len(seqs.items) - 2 * seqs.num_users
    recent = _data(split="none", train_start=times[90])
    batch = recent.splits["train"].build(np.arange(len(recent.splits["train"])), np.random.default_rng(0))
    labelled = (batch.labels["next_item"] >= 0).numpy()
    assert labelled.any() and (batch.query_times.numpy()[labelled] >= times[90]).all()
    assert recent.summary["split"] == {"kind": "none", "train_start": times[90]}


def test_split_none_and_time_keep_users_of_two_events_when_min_seq_len_is_two(tmp_path):
    """A user's two events are a history and a target: a training sample (none) or a validation one (time)."""
    rows = ["user_id,item_id,timestamp", "a,1,10", "a,2,20", "b,5,5", "b,3,10", "b,1,20", "b,2,30", "c,4,10"]
    (tmp_path / "events.csv").write_text("\n".join(rows) + "\n")
    base = {"source": "csv", "path": str(tmp_path / "events.csv"), "min_seq_len": 2, "max_seq_len": 5}
    none = SequenceDataModule({**base, "split": "none"})
    none.setup()
    assert none.user_map.raw.tolist() == ["a", "b"] and len(none.splits["train"]) == 2
    timed = SequenceDataModule({**base, "split": "time", "split_time": 20})
    timed.setup()
    assert timed.corpus.sequences.evaluated_users("val").tolist() == [0, 1]
    message = r"^csv: no user has 2 training events at all, the later at or after data.train_start; nothing to"
    with pytest.raises(ValueError, match=message):
        SequenceDataModule({**base, "split": "none", "train_start": 31}).setup()


def test_a_split_none_run_checkpoints_its_last_epoch_resumes_and_is_evaluated_on_later_events(times, tmp_path, capsys):
    run, recipe = tmp_path / "run", tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(with_overrides(RETRIEVAL, ("data.split", "none"), ("trainer.max_epochs", 2))))
    assert gr_main(["train", "--config", str(recipe), "--out", str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"nothing was held out (data.split none); judge the run on later events with: gr evaluate {run} "
        "--data.path LATER --data.split time --data.split_time SECONDS"
    )
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["best_checkpoint"] == "checkpoints/last" and metrics["epochs"] == 2
    assert not any(k.startswith(("hr@", "ndcg@", "val/")) for k in metrics) and "popularity" not in metrics
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last"]
    assert len(step_losses(run)) > 0 and "val/" not in (run / "logs" / "metrics.csv").read_text()
    assert gr_main(["evaluate", str(run)]) == 2
    assert "data.split: 'none' holds no test events out" in capsys.readouterr().err
    later = evaluate_run(run, [("data.split", "time"), ("data.split_time", str(times[90]))])
    assert later["data"]["split"]["kind"] == "time" and 0 < later["hr@10"] <= 1
    assert metrics["data"]["split"] == {"kind": "none"}
    steps = len(step_losses(run))
    assert gr_main(["train", "--resume", str(run), "--trainer.max_epochs", "3"]) == 0
    resumed = json.loads((run / "metrics.json").read_text())
    assert resumed["epochs"] == 3 and resumed["best_checkpoint"] == "checkpoints/last"
    assert len(step_losses(run)) == steps * 3 // 2  # the third epoch's steps appended once


def test_early_stopping_without_validation_is_refused_naming_the_key():
    values = copy.deepcopy(RETRIEVAL)
    values["data"]["split"] = "none"
    values["trainer"]["early_stopping_patience"] = 3
    with pytest.raises(ValueError, match=r"trainer\.early_stopping_patience: data\.split 'none' validates nothing"):
        TrainConfig.from_dict(values)
