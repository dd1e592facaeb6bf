"""The time split: events before the cut train, each user's first event at or after it is its
validation target and the second its test target; with a train start, training predicts only
events at or after it. Leave-one-out stays the default."""

import copy

import numpy as np
import pytest

from gr.data.config import DataConfig
from gr.data.datamodule import SequenceDataModule
from gr.data.sequences import NO_TARGET
from helpers.runs import RANKING, RETRIEVAL


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
        users = seqs.evaluated_users(split)
        targets = seqs.targets(split)[users]
        assert len(users) > 0 and (seqs.timestamps[targets] >= cut).all()
        first_after = np.array(
            [seqs.starts[u] + (seqs.timestamps[seqs.starts[u] : seqs.offsets[u + 1]] < cut).sum() for u in users]
        )
        assert (targets == first_after + position).all()
        assert (seqs.timestamps[targets - position - 1] < cut).all()  # a history before the cut
        batch = data.splits[split].build(np.arange(len(users)), np.random.default_rng(0))
        assert batch.labels["target_item"].tolist() == seqs.items[targets].tolist()
    never = np.setdiff1d(np.arange(seqs.num_users), seqs.evaluated_users("val"))
    assert (seqs.targets("val")[never] == NO_TARGET).all()
    assert data.summary["split"] == {"kind": "time", "split_time": cut}


def test_an_end_drops_later_events_from_the_targets(times):
    data = _data(split="time", split_time=times[50], split_end=times[70])
    seqs = data.corpus.sequences
    for split in ("val", "test"):
        targets = seqs.targets(split)[seqs.evaluated_users(split)]
        assert (seqs.timestamps[targets] < times[70]).all()


def test_a_train_start_leaves_earlier_events_as_history_only(times):
    data = _data(split="time", split_time=times[90], train_start=times[70])
    batch = data.splits["train"].build(np.arange(len(data.splits["train"])), np.random.default_rng(0))
    labelled = (batch.labels["next_item"] >= 0).numpy()
    query_times = batch.query_times.numpy()
    assert labelled.any() and (~labelled).any()
    assert (query_times[labelled] >= times[70]).all() and (query_times[labelled] < times[90]).all()
    cold = _data(split="time", split_time=times[90])
    assert len(data.splits["train"]) < len(cold.splits["train"])  # only users with new events train


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
    assert seqs.targets("test").tolist() == (seqs.offsets[1:] - 1).tolist()
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
            r"data\.split_time: expected null or an integer number of seconds, got 1\.5",
        ),
        ({"split": "days"}, r"data\.split: expected one of"),
    ],
)
def test_bad_split_keys_are_refused_naming_them(values, message):
    with pytest.raises(ValueError, match=message):
        DataConfig.from_dict(values)


def test_a_cut_with_no_target_after_it_is_one_line(times):
    with pytest.raises(ValueError, match=r"data\.split_time: no user has a val target"):
        _data(split="time", split_time=times[90] * 2)
