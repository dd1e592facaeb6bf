"""``model.class``: a GRModel subclass named in the config is built, trained (its split_input
receives every batch), exported and served like the built-in GRModel."""

import copy

import numpy as np
import pytest

from gr.export.reader import check_export
from gr.export.writer import export_run
from gr.model import GRInput, GRModel
from gr.serving.runtime import Ranker
from gr.train.build import build_model
from gr.train.config import TrainConfig
from gr.train.run import load_trained_model, train
from helpers.runs import RETRIEVAL


class CountingModel(GRModel):
    """Counts the batches its split_input receives (GRInputs, every feature included)."""

    seen: list = []

    def split_input(self, batch):
        assert isinstance(batch, GRInput) and batch.sequence_ids is not None
        CountingModel.seen.append(int(batch.seq_offsets.numel() - 1))
        return super().split_input(batch)


class NotAModel:
    pass


def _values(model_class=None, **model):
    values = copy.deepcopy(RETRIEVAL)
    values["trainer"]["max_epochs"] = 1
    if model_class is not None:
        values["model"]["class"] = model_class
    values["model"].update(model)
    return values


def test_default_class_is_grmodel_and_the_config_round_trips():
    config = TrainConfig.from_dict(_values())
    assert config.model.class_path == "gr.model.GRModel" and config.model.model_class() is GRModel
    named = TrainConfig.from_dict(_values(f"{__name__}.CountingModel"))
    assert TrainConfig.from_dict(named.to_dict()) == named
    assert named.to_dict()["model"]["class"] == f"{__name__}.CountingModel"


@pytest.mark.parametrize(
    "path,message",
    [
        (f"{__name__}.NotAModel", "model.class: .*NotAModel is not a GRModel subclass"),
        ("no_such_module.Model", "model.class: cannot import module 'no_such_module'"),
        ("GRModel", "model.class: expected an import path"),
    ],
)
def test_a_bad_model_class_is_refused_naming_the_key(path, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_dict(_values(path))


def test_model_class_is_checked_after_the_rest_of_the_model_section():
    with pytest.raises(ValueError, match="model.hstu.num_layers"):
        TrainConfig.from_dict(_values("no_such_module.Model", hstu={**RETRIEVAL["model"]["hstu"], "num_layers": 0}))


def test_named_subclass_is_trained_exported_and_served(tmp_path):
    from gr.data.features import FeatureSpec

    config = TrainConfig.from_dict(_values(f"{__name__}.CountingModel"))
    assert type(build_model(config, FeatureSpec(sequence={"item_id": 100}))) is CountingModel
    CountingModel.seen.clear()
    train(config, tmp_path / "run")
    assert CountingModel.seen and sum(CountingModel.seen) > 0  # training, validation and test batches
    model, _ = load_trained_model(tmp_path / "run")
    assert type(model) is CountingModel
    export_run(tmp_path / "run", tmp_path / "export")
    assert check_export(tmp_path / "export") == []
    ranker = Ranker.load(tmp_path / "export")
    result = ranker.rank(
        "u", {"item_id": [1, 2, 3], "timestamps": [100, 200, 300]}, {"item_id": [4, 5]}, request_time=400
    )
    scores = next(iter(result.scores.values()))
    assert scores.shape[0] == 2 and np.isfinite(scores).all()
