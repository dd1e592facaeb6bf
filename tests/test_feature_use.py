"""Every declared feature is read by a module, and no module reads a feature the data does not
declare: checked before any data is read (``check_declared_features``) and again when the model
is built on the data; the built-in modules read every declared feature."""

import copy
from pathlib import Path
from typing import Dict

import numpy as np
import pytest
from torch import Tensor, nn

from gr import PostfixDNN
from gr.data.config import DataConfig
from gr.data.datamodule import SequenceDataModule
from gr.data.declared import declared_spec
from gr.data.features import FeatureSpec
from gr.data.readers import read_table_csv, read_table_parquet
from gr.train.build import build_model, check_declared_features
from gr.train.config import TrainConfig
from gr.train.run import train
from helpers.runs import RANKING, RETRIEVAL

# A CSV config declaring a feature of each kind, with a table for each categorical one.
CSV_COLUMNS = {
    "user_features": ["country"],
    "item_features": ["brand"],
    "token_features": ["action"],
    "token_dense": {"watch": "watch_ratio"},
    "item_dense": {"price": "price"},
    "user_dense": {"age": "age"},
}
CSV_TABLES = [
    {"name": "item", "embedding_dim": 16, "features": ["item_id"]},
    {"name": "brand", "embedding_dim": 4, "features": ["brand"]},
    {"name": "action", "embedding_dim": 4, "features": ["action"]},
    {"name": "country", "embedding_dim": 4, "features": ["country"], "kind": "common"},
]


def _csv_config(path: Path, task: str = "retrieval", **model) -> TrainConfig:
    values = copy.deepcopy(RANKING if task == "ranking" else RETRIEVAL)
    values["data"].pop("synthetic")
    values["data"].update(source="csv", path=str(path), columns=copy.deepcopy(CSV_COLUMNS))
    values["data"].update(item_features=True, user_features=True)
    values["model"]["tables"] = copy.deepcopy(CSV_TABLES)
    values["model"].update(model)
    return TrainConfig.from_dict(values)


def test_declared_features_no_module_reads_stop_training_before_the_data_is_read(tmp_path):
    prefix = {"class": "gr.prefix_dnn.MLPTokenEncoder", "kwargs": {"feature_dims": ["item_id", "brand"]}}
    config = _csv_config(tmp_path / "absent.csv", prefix_dnn=prefix)
    message = (
        r"data: declared feature\(s\) \['action', 'price', 'watch'\] are read by no module \(model\.prefix_dnn "
        r"MLPTokenEncoder reads \['item_id', 'brand'\], model\.postfix_dnn RetrievalHead reads \['country', 'age'\]\)"
    )
    with pytest.raises(ValueError, match=message):  # not FileNotFoundError: the file is never opened
        train(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


class ReadsUserAge(PostfixDNN):
    """A ranking head that reads ``user_age`` whatever the data declares."""

    common_feature_names = ("user_age",)

    def __init__(self, hidden_dim: int, tasks, common_dims: Dict[str, int]) -> None:
        super().__init__()
        self.output_names = tuple(tasks)
        self.age = nn.Linear(common_dims["user_age"], 1)

    def forward(self, hidden: Tensor, common: Dict[str, Tensor]) -> Dict[str, Tensor]:
        return {t: self.age(common["user_age"]).squeeze(-1) for t in self.output_names}


class ListsUserAge(ReadsUserAge):
    """The same head, reading ``user_age`` only through ``common_feature_names``."""

    def __init__(self, hidden_dim: int, tasks) -> None:
        PostfixDNN.__init__(self)
        self.output_names = tuple(tasks)


@pytest.mark.parametrize(
    "head, message",
    [
        (
            "ReadsUserAge",
            r"model\.postfix_dnn: ReadsUserAge looks up 'user_age', which the data does not declare \(token "
            r"features: \['action', 'brand', 'item_id', 'price', 'watch'\], common features: \['age', 'country'\]\)",
        ),
        (
            "ListsUserAge",
            r"model\.postfix_dnn: ListsUserAge reads common feature\(s\) \['user_age'\], which the data does not "
            r"declare \(its common features: \['country', 'age'\]",
        ),
    ],
)
def test_a_module_reading_an_undeclared_feature_is_refused_naming_module_and_feature(tmp_path, head, message):
    config = _csv_config(tmp_path / "absent.csv", "ranking", postfix_dnn={"class": f"test_feature_use.{head}"})
    with pytest.raises(ValueError, match=message):
        check_declared_features(config)


def test_the_built_in_modules_read_every_declared_feature():
    spec = FeatureSpec(
        sequence={"item_id": 30, "brand": 4, "action": 3},
        common={"country": 3},
        token_dense={"price": 1, "watch": 1},
        common_dense={"age": 1},
        event_features=["action", "watch"],
    )
    for task in ("retrieval", "ranking"):
        config = _csv_config(Path("unused.csv"), task)
        model = build_model(config, spec, config.data.label_names(), for_training=False)
        assert set(model.prefix_dnn.feature_names) == {"item_id", "brand", "action", "price", "watch"}
        assert set(model.postfix_dnn.common_feature_names) == {"country", "age"}


def test_the_retrieval_head_starts_as_the_query_without_user_features():
    values = copy.deepcopy(RETRIEVAL)
    values["data"]["user_features"] = True
    values["model"]["tables"].append(
        {"name": "user", "embedding_dim": 4, "features": ["user_age", "user_gender"], "kind": "common"}
    )
    data = SequenceDataModule(values["data"])
    data.setup()
    model = build_model(TrainConfig.from_dict(values), data.feature_spec(), for_training=False).eval()
    batch = data.splits["test"].build(np.arange(4), np.random.default_rng(0))
    output = model(batch)
    assert set(output.common_features) == {"user_age", "user_gender"}
    hidden = model.postfix_dnn.mlp(output.hidden)
    expected = hidden / hidden.norm(dim=-1, keepdim=True)
    assert (output.predictions["query"] - expected).abs().max() < 1e-6


@pytest.mark.parametrize("source", ["synthetic", "csv"])
def test_the_declared_spec_names_what_the_data_provides(tmp_path, source):
    from test_declared_features import _events

    values = {"source": source, "item_features": True, "user_features": True}
    if source == "csv":
        values.update(path=str(_events(tmp_path / "events.csv")), columns={**CSV_COLUMNS, "token_dense": {}})
    data = SequenceDataModule(values)
    data.setup()
    declared, read = declared_spec(data.config), data.feature_spec()
    assert (set(declared.sequence), set(declared.common)) == (set(read.sequence), set(read.common))
    assert (declared.token_dense, declared.common_dense) == (read.token_dense, read.common_dense)
    assert sorted(declared.event_features) == sorted(read.event_features)


@pytest.mark.parametrize("release_year", [False, True])
def test_the_ml_100k_declared_spec_names_what_its_reader_provides(ml_100k, release_year):
    config = DataConfig.from_dict({"source": "ml-100k", "path": str(ml_100k), "release_year": release_year})
    data = SequenceDataModule(config)
    data.setup()
    declared, read = declared_spec(config), data.feature_spec()
    assert (set(declared.sequence), set(declared.common)) == (set(read.sequence), set(read.common))
    assert declared.token_dense == read.token_dense
    assert ("item_year" in read.sequence) == release_year


def test_switching_off_declared_item_or_user_columns_is_refused_naming_both_keys():
    columns = {"item_features": ["brand"]}
    with pytest.raises(
        ValueError, match=r"data\.item_features: false switches off the declared data\.columns\.item_features"
    ):
        DataConfig.from_dict({"source": "csv", "path": "x", "item_features": False, "columns": columns})


@pytest.mark.parametrize("feature", [{"token_features": ["stars"]}, {"token_dense": {"stars": "stars"}}])
def test_the_rating_column_may_also_be_a_token_feature(tmp_path, feature):
    path = tmp_path / "events.csv"
    path.write_text("user_id,item_id,timestamp,stars\n1,2,10,4\n1,3,11,3.5\n")
    config = DataConfig.from_dict({"source": "csv", "path": str(path), "columns": {"rating": "stars", **feature}})
    data = read_table_csv(str(path), config.columns)
    assert data.ratings.tolist() == [4.0, 3.5]
    if "token_features" in feature:
        assert data.row_side.categorical["stars"].tolist() == ["4", "3.5"]  # ids are the text as written
    else:
        assert data.row_side.dense["stars"][:, 0].tolist() == [4.0, 3.5]
    path.write_text("user_id,item_id,timestamp,stars\n1,2,10,4\n1,3,11,good\n")
    with pytest.raises(ValueError, match=r"events\.csv:3: column 'stars': expected a number, got 'good'"):
        read_table_csv(str(path), config.columns)


def test_a_parquet_rating_column_may_also_be_a_categorical_token_feature(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "events.parquet"
    pq.write_table(pa.table({"user_id": [1, 1], "item_id": [2, 3], "timestamp": [10, 11], "stars": [4, 5]}), path)
    config = DataConfig.from_dict(
        {"source": "parquet", "path": str(path), "columns": {"rating": "stars", "token_features": ["stars"]}}
    )
    data = read_table_parquet(str(path), config.columns)
    assert data.ratings.tolist() == [4.0, 5.0] and data.row_side.categorical["stars"].tolist() == ["4", "5"]


def test_the_rating_column_is_refused_as_an_item_or_user_feature():
    with pytest.raises(
        ValueError, match=r"column 'stars' is used twice \(data\.columns\.rating and data\.columns\.item_features\)"
    ):
        DataConfig.from_dict({"source": "csv", "path": "x", "columns": {"rating": "stars", "item_features": ["stars"]}})
