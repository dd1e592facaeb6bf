"""Publishing from a training run (``trainer.publish_every``, ``trainer.publish_dir``): a live
training publishes a full export, then deltas of the rows it updated, each complete or absent, a
chain ``gr check`` accepts; a service reloaded with them answers as the full export of the run's
checkpoint does, bit for bit. The keys are validated up front, naming themselves."""

import copy
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gr.export.delta import check_chain, is_delta
from gr.export.publish import BASE, Publisher, published
from gr.export.writer import export_run
from gr.serving import Ranker
from gr.serving.request import RankRequest, RecommendRequest
from gr.train.config import TrainConfig, publish_interval
from gr.train.run import train
from helpers.runs import RETRIEVAL, ratings_csv


def _values(path: Path, **trainer) -> dict:
    values = copy.deepcopy(RETRIEVAL)
    values["data"].pop("synthetic")
    values["data"].update(source="csv", path=str(path), columns={"rating": "rating"}, batch_size=8)
    values["trainer"].update(max_epochs=1, limit_train_batches=6, **trainer)
    return values


def _answers(ranker: Ranker, items: list) -> tuple:
    history = {"item_id": items[:4], "timestamps": [100, 200, 300, 400]}
    rank = ranker.rank(RankRequest("u", history, {"item_id": items[4:10]}))
    top = ranker.recommend(RecommendRequest("u", history, k=5))
    return rank.scores["retrieval"], top.items, top.scores


@pytest.mark.parametrize(
    "backend, every, steps",
    [("torch", 2, [2, 4, 6]), ("torchrec", 4, [4, 6])],
    ids=["torch-every-2", "torchrec-every-4-and-the-end"],
)
def test_a_live_training_publishes_deltas_a_service_follows_to_the_full_exports_answers(
    tmp_path, backend, every, steps, caplog
):
    """Six training steps publish after each step the interval falls on, and after the last one
    (once, when it falls there too): the chain ends at the run's final model."""
    events = ratings_csv(tmp_path / "events.csv")
    out = tmp_path / "publish"
    values = _values(events, publish_every=every, publish_dir=str(out))
    values["sparse"]["backend"] = backend
    config = TrainConfig.from_dict(values)
    with caplog.at_level(logging.INFO, logger="gr.export"):
        train(config, tmp_path / "run", callbacks=[Publisher(config.self_contained(), tmp_path / "run")])
    chain = published(out)
    assert [p.name for p in chain] == [f"{n:06d}" for n in range(len(steps))]
    assert [m for m in caplog.messages if m.startswith("published the model at step")] == [
        f"published the model at step {step}: {p} ({'a delta' if n else 'a full export'})"
        for n, (step, p) in enumerate(zip(steps, chain))
    ]
    assert not is_delta(chain[0]) and all(is_delta(p) for p in chain[1:]) and (out / BASE).is_dir()
    assert check_chain(chain) == []
    assert caplog.messages.count("delta rows: tracked by training for tables ['item']") == len(steps) - 1
    assert not (tmp_path / "run/publish").exists()  # the publish checkpoint is gone once exported

    export_run(tmp_path / "run", tmp_path / "full")  # the run's one epoch ends at step 6
    lines = (tmp_path / "full/sparse/id_maps/items.tsv").read_text().splitlines()
    items = [int(line.split("\t")[1]) for line in lines[1:11]]
    ranker = Ranker.load(chain[0])
    first = _answers(ranker, items)
    for delta in chain[1:]:
        ranker.reload(delta)
    served, expected = _answers(ranker, items), _answers(Ranker.load(tmp_path / "full"), items)
    assert np.array_equal(served[0], expected[0]) and served[1] == expected[1]
    assert np.array_equal(served[2], expected[2]) and not np.array_equal(first[0], served[0])


def test_publish_every_takes_steps_or_a_duration():
    assert publish_interval(5) == (5, 0.0) and publish_interval("90s") == (0, 90.0)
    assert publish_interval("10m") == (0, 600.0) and publish_interval("2h") == (0, 7200.0)


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        (
            {"publish_every": "10 minutes", "publish_dir": "p"},
            r"^trainer\.publish_every: expected null or a number of training steps",
        ),
        (
            {"publish_every": 0, "publish_dir": "p"},
            r"^trainer\.publish_every: expected null or a number of training steps",
        ),
        ({"publish_every": 10}, r"^trainer\.publish_dir: required with trainer\.publish_every"),
        ({"publish_dir": "p"}, r"^trainer\.publish_every: required with trainer\.publish_dir"),
        ({"publish_base": "e"}, r"^trainer\.publish_base: set only with trainer\.publish_every"),
    ],
)
def test_bad_publishing_keys_are_refused_naming_them(tmp_path, trainer, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_dict(_values(tmp_path / "events.csv", **trainer))


def test_a_publish_dir_whose_newest_export_is_not_the_kept_base_is_refused_in_one_line(tmp_path):
    values = _values(tmp_path / "events.csv", publish_every=5, publish_dir=str(tmp_path / "live"))
    (tmp_path / "live/000000").mkdir(parents=True)  # a publish cut short before its full export was kept
    publisher = Publisher(TrainConfig.from_dict(values), tmp_path / "run")
    with pytest.raises(ValueError, match=r"^trainer\.publish_dir: .*live holds exports up to 000000, but \.base"):
        publisher.on_train_start(SimpleNamespace(is_global_zero=True, global_step=0), None)
