"""Declared features of generic CSV/Parquet data (``data.columns``): validated up front, read with
errors naming file, row and column, carried into GRInput (candidates take the unknown id for
features of the interaction row), exported in the request schema and served by raw value with
the trained model's scores."""

import copy
import csv
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from gr.commands.evaluate import evaluate_export, evaluate_run
from gr.data.config import ColumnConfig, DataConfig
from gr.data.datamodule import SequenceDataModule
from gr.data.features import FeatureSpec
from gr.data.interactions import DataFormatError
from gr.data.readers import read_source, read_table_csv, read_table_parquet
from gr.export.manifest import write_manifest
from gr.export.reader import check_export, open_export
from gr.export.writer import export_run
from gr.serving import Ranker
from gr.serving.errors import RequestError
from gr.serving.request import IdOptions
from gr.train.build import build_tables
from gr.train.config import TrainConfig
from gr.train.run import train
from helpers.runs import RANKING

COLUMNS = {
    "user_features": ["country"],
    "item_features": ["brand"],
    "token_features": ["action", "device"],
    "token_dense": {"watch": "watch_ratio"},
    "item_dense": {"price": ["price", "discount"]},
    "user_dense": {"age": "age"},
}


def _columns(**changes) -> dict:
    return {**copy.deepcopy(COLUMNS), **changes}


def _events(path: Path, users: int = 24, seed: int = 0) -> Path:
    """A CSV of users x 8..13 events over 30 items: row features (action, device, watch ratio),
    item features (brand, price, discount: fixed per item) and user features (country, age)."""
    rng = np.random.default_rng(seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["user_id", "item_id", "timestamp", *_flat_columns()])
        for u in range(users):
            for k in range(int(rng.integers(8, 14))):
                item = int(rng.integers(0, 30))
                writer.writerow(
                    [
                        f"u{u}",
                        item,
                        1000 + 60 * k,
                        ["fr", "de", "it"][u % 3],
                        f"brand{item % 4}",
                        ["click", "buy", "view"][int(rng.integers(0, 3))],
                        ["ios", "web"][int(rng.integers(0, 2))],
                        round(float(rng.random()), 3),
                        float(item % 7),
                        float(item % 3) / 10,
                        float(20 + u % 40),
                    ]
                )
    return path


def _flat_columns():
    return ["country", "brand", "action", "device", "watch_ratio", "price", "discount", "age"]


@pytest.mark.parametrize(
    "columns, source, message",
    [
        (_columns(token_dense={"watch": 3}), "csv", r"data\.columns\.token_dense: expected a mapping"),
        (_columns(user_dense=["age"]), "csv", r"data\.columns\.user_dense: expected a mapping"),
        (_columns(token_features="action"), "csv", r"data\.columns\.token_features: expected a list"),
        (_columns(token_dense={"action": "watch_ratio"}), "csv", r"feature name\(s\) \['action'\] used twice"),
        (
            _columns(token_features=["item_id"]),
            "csv",
            r"data\.columns: column 'item_id' is used twice \(data\.columns\.item and data\.columns\.token_features\)",
        ),
        (_columns(item_dense={"item_id": "price"}), "csv", r"feature name\(s\) \['item_id'\] used twice or reserved"),
        (
            _columns(user_dense={"age": "price"}),
            "csv",
            r"data\.columns: column 'price' is used twice \(data\.columns\.item_dense\.price and "
            r"data\.columns\.user_dense\.age\)",
        ),
        ({"token_features": ["action"]}, "ml-100k", r"data\.columns\.token_features: only the csv and parquet"),
    ],
)
def test_bad_declared_columns_are_refused_naming_the_key(columns, source, message):
    with pytest.raises(ValueError, match=message):
        DataConfig.from_dict({"source": source, "path": "x", "columns": columns})


def test_a_dense_feature_of_one_column_has_dim_one_and_the_config_round_trips():
    config = DataConfig.from_dict({"source": "csv", "path": "x", "columns": COLUMNS})
    assert config.columns.token_dense == {"watch": ("watch_ratio",)}
    assert config.columns.item_dense == {"price": ("price", "discount")}
    assert DataConfig.from_dict(config.to_dict()) == config


def test_csv_reads_row_item_and_user_features(tmp_path):
    path = tmp_path / "events.csv"
    path.write_text(
        "user_id,item_id,timestamp,action,watch,price,age\n"
        "7,42,100,click,0.5,3.0,30\n7,43,90,buy,1.0,9.5,31\n8,42,95,view,0.25,4.0,50\n"
    )
    columns = ColumnConfig(
        token_features=("action",), token_dense={"w": "watch"}, item_dense={"p": "price"}, user_dense={"age": ["age"]}
    )
    data = read_table_csv(str(path), columns)
    assert data.row_side.categorical["action"].tolist() == ["click", "buy", "view"]
    assert data.row_side.dense["w"].tolist() == [[0.5], [1.0], [0.25]]
    assert data.item_side.keys.tolist() == [42, 43]
    assert data.item_side.dense["p"].tolist() == [[4.0], [9.5]]  # an item's last row wins
    assert data.user_side.dense["age"].tolist() == [[31.0], [50.0]]
    assert data.user_side.dense_columns == {"age": ["age"]}


def test_dropped_duplicate_rows_take_their_row_features_with_them(tmp_path):
    path = tmp_path / "events.csv"
    path.write_text("user_id,item_id,timestamp,action\n7,42,100,click\n7,42,100,buy\n7,43,110,view\n")
    config = DataConfig(source="csv", path=str(path), columns=ColumnConfig(token_features=("action",)))
    data = read_source(config)
    assert data.duplicates == 1 and data.items.tolist() == [42, 43]
    assert data.row_side.categorical["action"].tolist() == ["click", "view"]


@pytest.mark.parametrize(
    "row, message",
    [
        ("8,42,95,view,abc", r"events\.csv:3: column 'watch': expected a number, got 'abc'"),
        ("8,42,95,view,inf", r"events\.csv:3: column 'watch': expected a number, got 'inf'"),
    ],
)
def test_csv_bad_dense_value_names_file_line_and_column(tmp_path, row, message):
    path = tmp_path / "events.csv"
    path.write_text(f"user_id,item_id,timestamp,action,watch\n7,42,100,click,0.5\n{row}\n")
    columns = ColumnConfig(token_features=("action",), token_dense={"w": "watch"})
    with pytest.raises(DataFormatError, match=message):
        read_table_csv(str(path), columns)


def test_csv_missing_declared_column_names_file_and_column(tmp_path):
    path = tmp_path / "events.csv"
    path.write_text("user_id,item_id,timestamp\n7,42,100\n")
    with pytest.raises(DataFormatError, match=r"events\.csv:1: the header lacks column\(s\) \['device'\]"):
        read_table_csv(str(path), ColumnConfig(token_features=("device",)))


def test_parquet_reads_declared_features_and_names_bad_values(tmp_path):
    good = {"user_id": ["a", "a", "b"], "item_id": [1, 2, 1], "timestamp": [5, 6, 7], "action": ["x", "y", "x"]}
    pq.write_table(pa.table({**good, "watch": [0.1, 0.2, 0.3]}), tmp_path / "ok.parquet")
    columns = ColumnConfig(token_features=("action",), token_dense={"w": "watch"})
    data = read_table_parquet(str(tmp_path / "ok.parquet"), columns)
    assert data.row_side.categorical["action"].tolist() == ["x", "y", "x"]
    assert data.row_side.dense["w"][:, 0].tolist() == pytest.approx([0.1, 0.2, 0.3])
    pq.write_table(pa.table({**good, "watch": [0.1, float("nan"), 0.3]}), tmp_path / "nan.parquet")
    with pytest.raises(DataFormatError, match=r"nan\.parquet: row 2: column 'watch' is not finite"):
        read_table_parquet(str(tmp_path / "nan.parquet"), columns)
    pq.write_table(pa.table({**good, "watch": ["a", "b", "c"]}), tmp_path / "text.parquet")
    with pytest.raises(DataFormatError, match=r"text\.parquet: column 'watch': expected numbers"):
        read_table_parquet(str(tmp_path / "text.parquet"), columns)
    with pytest.raises(DataFormatError, match=r"ok\.parquet: lacks column\(s\) \['device'\]"):
        read_table_parquet(str(tmp_path / "ok.parquet"), ColumnConfig(token_features=("device",)))


def _data(path: Path, task: str) -> SequenceDataModule:
    values = copy.deepcopy(RANKING["data"])
    values.pop("synthetic")
    values.update(source="csv", path=str(path), task=task, columns=COLUMNS)
    data = SequenceDataModule(values)
    data.setup()
    return data


def test_row_features_follow_their_events_and_candidates_take_the_unknown_id(tmp_path):
    path = _events(tmp_path / "events.csv")
    data = _data(path, "ranking")
    spec = data.feature_spec()
    assert set(spec.sequence) == {"item_id", "brand", "action", "device"} and set(spec.common) == {"country"}
    assert spec.token_dense == {"price": 2, "watch": 1} and spec.common_dense == {"age": 1}
    assert sorted(spec.event_features) == ["action", "device", "watch"]
    batch = data.splits["test"].build(np.arange(4), np.random.default_rng(0))
    action = batch.sequence_ids.to_dict()["action"].values().numpy()
    watch = batch.token_dense["watch"][:, 0].numpy()
    price = batch.token_dense["price"].numpy()
    candidate = np.zeros(len(action), dtype=bool)
    for b, n in enumerate(batch.num_targets.tolist()):
        candidate[int(batch.seq_offsets[b + 1]) - n : int(batch.seq_offsets[b + 1])] = True
    assert (action[candidate] == 0).all() and (watch[candidate] == 0).all()
    assert (action[~candidate] > 0).all()
    items = data.item_map.decode(batch.sequence_ids.to_dict()["item_id"].values().numpy())
    assert price[:, 0].tolist() == (items % 7).astype(np.float32).tolist()  # item features on every token
    # The first user's history, in time order, carries its own rows' values.
    rows = list(csv.DictReader(open(path)))
    user = data.user_map.decode(batch.labels["user"].numpy()[:1])[0]
    history = [r for r in rows if r["user_id"] == user]
    length = int(batch.seq_offsets[1]) - int(batch.num_targets[0])
    vocabulary = data.corpus.event_features.vocabularies["action"]
    assert vocabulary.decode(action[:length]).tolist() == [r["action"] for r in history][:length]
    assert watch[:length].tolist() == pytest.approx([float(r["watch_ratio"]) for r in history][:length])


def _ranking_config(events: Path, **trainer) -> TrainConfig:
    """A tiny ranking model (1 epoch) on the CSV ``events``, with a table for every categorical feature."""
    values = copy.deepcopy(RANKING)
    values["data"].pop("synthetic")
    values["data"].update(source="csv", path=str(events), columns=COLUMNS)
    values["model"]["tables"] = [
        values["model"]["tables"][0],
        {"name": "brand", "embedding_dim": 4, "features": ["brand"]},
        {"name": "event", "embedding_dim": 4, "features": ["action", "device"]},
        {"name": "country", "embedding_dim": 4, "features": ["country"], "kind": "common"},
    ]
    values["trainer"].update(max_epochs=1, **trainer)
    return TrainConfig.from_dict(values)


@pytest.fixture(scope="module")
def ranking_run(tmp_path_factory):
    """The tiny ranking model trained on the CSV, exported."""
    root = tmp_path_factory.mktemp("declared")
    train(_ranking_config(_events(root / "events.csv")), root / "run")
    export_run(root / "run", root / "export")
    return root / "run", root / "export"


def test_declared_features_are_in_the_exported_request_schema(ranking_run):
    _, export = ranking_run
    assert check_export(export) == []
    manifest = open_export(export)
    request = {t.name: t for t in manifest.graph.request}
    assert (request["action"].dtype, request["action"].shape, request["action"].candidates) == (
        "int64",
        ("tokens",),
        "optional",
    )
    assert (request["watch"].dtype, request["watch"].shape, request["watch"].candidates) == (
        "float32",
        ("tokens", 1),
        "optional",
    )
    assert (request["price"].shape, request["price"].candidates) == (("tokens", 2), None)
    assert (request["country"].shape, request["age"].shape) == (("bag",), ("batch", 1))
    assert {"action", "device", "brand", "country"} <= set(manifest.sparse.features)


def test_served_scores_equal_the_trained_model_s(ranking_run):
    run, export = ranking_run
    trained, served = evaluate_run(run), evaluate_export(export, run / "config.yaml")
    assert served["auc"] == pytest.approx(trained["auc"], abs=1e-6)
    assert served["logloss"] == pytest.approx(trained["logloss"], abs=1e-5)


def _raw_request(**changes) -> dict:
    history = {
        "item_id": [3, 7, 11],
        "timestamps": [1000, 1060, 1120],
        "brand": ["brand3", "brand3", "brand3"],
        "action": ["click", "buy", "view"],
        "device": ["ios", "web", "web"],
        "watch": [[0.5], [0.25], [1.0]],
        "price": [[3.0, 0.0], [0.0, 0.1], [4.0, 0.2]],
    }
    candidates = {"item_id": [5, 12], "brand": ["brand1", "brand0"], "price": [[5.0, 0.2], [5.0, 0.0]]}
    common = {"country": "fr", "age": [31.0]}
    request = {"history": history, "candidates": candidates, "common_features": common}
    for key, value in changes.items():
        request[key] = value
    return request


def test_raw_values_are_served_like_their_model_ids(ranking_run):
    run, export = ranking_run
    ranker = Ranker.load(export)
    maps = ranker.model.id_maps.maps
    raw = _raw_request()
    by_raw = ranker.rank("u", **raw, id_options=IdOptions("raw"))

    def encode(feature, values):
        return maps[feature].encode(np.asarray(values)).tolist()

    history = {k: encode(k, v) if k in maps else v for k, v in raw["history"].items()}
    candidates = {k: encode(k, v) if k in maps else v for k, v in raw["candidates"].items()}
    candidates.update(action=[0, 0], device=[0, 0], watch=[[0.0], [0.0]])  # what leaving them out means
    common = {"country": encode("country", ["fr"]), "age": [31.0]}
    by_model = ranker.rank("u2", history, candidates, common)
    np.testing.assert_allclose(by_raw.scores["watch"], by_model.scores["watch"], atol=1e-6)


def test_the_export_stores_item_features_and_serving_fills_them_by_item_id(ranking_run):
    ranker = Ranker.load(ranking_run[1])
    assert sorted(ranker.model.sparse.items.features) == ["brand", "price"]
    raw = _raw_request()  # its candidates' brand and price are those of items 5 and 12 in the data
    by_id = {**raw, "candidates": {"item_id": raw["candidates"]["item_id"]}}
    written, stored = (ranker.rank("u", **r, id_options=IdOptions("raw"), use_cache=False) for r in (raw, by_id))
    np.testing.assert_allclose(stored.scores["watch"], written.scores["watch"], rtol=0, atol=1e-6)


def test_a_warm_started_run_with_new_items_and_brands_exports_each_items_own_brand(tmp_path):
    """Day 0 lacks brand0 and its items (every fourth id); the warm run's maps append them after the
    old ids, so the export reads the run's data with those maps, not with maps sorted afresh."""
    everything = _events(tmp_path / "all.csv")
    lines = everything.read_text().splitlines()
    brand = lines[0].split(",").index("brand")
    (tmp_path / "day0.csv").write_text("\n".join([lines[0], *(x for x in lines[1:] if ",brand0," not in x)]) + "\n")
    train(_ranking_config(tmp_path / "day0.csv"), tmp_path / "day0")
    train(_ranking_config(everything, init_from=str(tmp_path / "day0")), tmp_path / "day1")
    ranker = Ranker.load(export_run(tmp_path / "day1", tmp_path / "export"))
    maps = ranker.model.id_maps.maps
    rows = np.arange(maps["item_id"].cardinality)
    stored = maps["brand"].decode(np.asarray(ranker.model.sparse.stored("brand", rows)).reshape(-1))
    want = {int(row[1]): row[brand] for row in (x.split(",") for x in lines[1:])}
    assert dict(zip(maps["item_id"].decode(rows).tolist(), stored.tolist())) == want
    assert maps["brand"].raw[-1] == "brand0" and maps["item_id"].raw[-1] % 4 == 0  # appended, not sorted in


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"common_features": {"country": "fr"}}, r"common_features: missing feature\(s\) \['age'\]"),
        ({"common_features": {"country": "fr", "age": [1.0], "size": 2}}, r"unknown feature\(s\) \['size'\]"),
        ({"candidates": {"brand": ["brand1"]}}, r"candidates: missing feature\(s\) \[.item_id.\]"),
        (
            {"history": {"item_id": [3], "timestamps": [1], "brand": ["brand3"], "price": [[1.0, 0.0]]}},
            "history: missing",
        ),
        (
            {"common_features": {"country": "xx", "age": [1.0]}},
            r"common_features\.country: unknown raw id\(s\) \['xx'\]",
        ),
    ],
)
def test_missing_or_unknown_features_are_refused_naming_them(ranking_run, changes, message):
    ranker = Ranker.load(ranking_run[1])
    with pytest.raises(RequestError, match=message):
        ranker.rank("u", **_raw_request(**changes), id_options=IdOptions("raw"))


def test_a_categorical_feature_without_a_table_is_refused_naming_it():
    values = copy.deepcopy(RANKING)
    config = TrainConfig.from_dict(values)
    spec = FeatureSpec(
        sequence={"item_id": 30, "item_category": 5, "action": 4},
        common={"user_age": 3, "user_gender": 3},
        event_features=["action"],
    )
    with pytest.raises(
        ValueError, match=r"model\.tables: no table reads the data's sequence feature\(s\) \['action'\]"
    ):
        build_tables(config, spec)
    values["model"]["tables"].append({"name": "action", "embedding_dim": 4, "features": ["action"]})
    tables = build_tables(TrainConfig.from_dict(values), spec)
    assert next(t for t in tables if t.name == "action").num_embeddings == 4  # sized from the data


@pytest.mark.parametrize(
    "old, new, key",
    [
        ("[request.action]\n", "[request.action]\ncandidates = maybe\n", "request.action.candidates"),
        ("[request.country]\n", "[request.country]\ncandidates = optional\n", "request.country.candidates"),
    ],
)
def test_a_bad_candidates_key_in_the_request_schema_is_named(ranking_run, tmp_path, old, new, key):
    export = tmp_path / "export"
    shutil.copytree(ranking_run[1], export)
    graph = export / "default" / "slice_graph.ini"
    text = graph.read_text().replace("shape = tokens\ncandidates = optional\n", "shape = tokens\n", 1)
    graph.write_text(text.replace(old, new, 1))
    write_manifest(export)
    assert [p.key for p in check_export(export)] == [key]


def test_an_export_is_evaluated_on_data_declaring_features_it_does_not_read(ranking_run, tmp_path):
    """The data of an older run's config (or a recipe's) may carry features the export does not read:
    they are left out of its requests, and the metrics are the run's."""
    run, export = ranking_run
    rows = list(csv.DictReader(open(run.parent / "events.csv")))
    with open(tmp_path / "events.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, [*rows[0], "mood"])
        writer.writeheader()
        writer.writerows({**r, "mood": ["calm", "busy"][i % 2]} for i, r in enumerate(rows))
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"]["path"] = str(tmp_path / "events.csv")
    config["data"]["columns"]["token_features"].append("mood")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    served = evaluate_export(export, tmp_path / "config.yaml")
    assert served["auc"] == pytest.approx(evaluate_run(run)["auc"], abs=1e-6)
