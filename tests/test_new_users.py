"""New users (an empty history) served from their features: an export of a model that learned the
new-user state (``empty_history``) answers recommend, generate and rank for an empty history with the
user's common features from ``postfix_dnn(empty_history, features)``, marked ``"fallback":
"user_features"`` and counted in /metrics; without features, or from an export without the state, the
popularity fallback answers as before. A common id feature with an unknown id may be left out; any
other is a 400 naming it. ``gr predict`` answers empty histories the same way; ``gr check`` refuses
a broken state file."""

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gr import GRModel, HSTUConfig, TableConfig
from gr.commands.predict import predict
from gr.data.mappings import IdMap, save_mappings
from gr.export import check_export, export_model
from gr.export.manifest import write_manifest
from gr.export.new_user import EMPTY_HISTORY_FILE, EMPTY_HISTORY_TENSOR
from gr.postfix_dnn import RetrievalHead
from gr.prefix_dnn import MLPTokenEncoder
from gr.serving import GenerateRequest, IdOptions, Ranker, RecommendRequest
from gr.serving.errors import RequestError
from gr.serving.http import create_app
from helpers.models import HSTU_KW, perturb
from helpers.servers import AppServer, metric

NUM_ITEMS = 40
RAW_ITEMS = [500 + 3 * i for i in range(NUM_ITEMS)]
AGES = [18, 25, 35, 45, 56]  # raw user_age values: model ids 1..5, 0 the unknown age
COUNTS = (np.arange(NUM_ITEMS) * 13) % 17
RAW = IdOptions("raw")
EMPTY = {"item_id": [], "timestamps": []}
YOUNG = {"user_age": 18, "user_score": [1.0, -0.5]}
OLD = {"user_age": 56, "user_score": [-1.0, 2.0]}


def most_popular(k):
    return [RAW_ITEMS[i] for i in sorted(range(NUM_ITEMS), key=lambda i: (-COUNTS[i], i))[:k]]


def new_user_model() -> GRModel:
    """A retrieval model whose head reads a pooled common id (user_age) and a dense common feature
    (user_score), with a new-user state; weights perturbed so that the features move the query."""
    torch.manual_seed(0)
    tables = [
        TableConfig("item", NUM_ITEMS, 16, ("item_id",)),
        TableConfig("age", len(AGES) + 1, 4, ("user_age",), kind="common", pooling="mean"),
    ]
    head = RetrievalHead(16, 16, mlp_dims=(20,), common_dims={"user_age": 4, "user_score": 2})
    model = GRModel(HSTUConfig(**HSTU_KW), MLPTokenEncoder({"item_id": 16}, 16, mlp_dims=(24,)), head, tables)
    model.empty_history = nn.Parameter(torch.randn(16))
    perturb(model, seed=1)
    with torch.no_grad():
        head.common.weight.normal_(0.0, 1.0)  # features matter as much as the history
        model.embeddings.table_weight("age").normal_(0.0, 1.0)
    return model


def reference(model: GRModel, age: int, score) -> torch.Tensor:
    """[NUM_ITEMS] the cosines of the new-user query of (model age id, score) with every item."""
    with torch.no_grad():
        common = {"user_age": model.embeddings.table_weight("age")[age][None], "user_score": torch.tensor([score])}
        query = model.new_user_predictions(common, 1)["query"][0]
        return F.normalize(model.embeddings.table_weight("item"), dim=-1) @ query


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{"model": the GRModel, "new": its export (item popularity, new-user state, raw id maps),
    "old": the same export without the new-user state (an export of a model trained without it)}."""
    root = tmp_path_factory.mktemp("new_users")
    model = new_user_model()
    save_mappings(
        str(root / "maps"), {"items": IdMap(np.array(RAW_ITEMS)), "user_age": IdMap(np.array(AGES), offset=1)}, {}
    )
    new = export_model(
        model, root / "new", id_mappings_dir=root / "maps", dense_dims={"user_score": 2}, popularity=COUNTS
    )
    old = root / "old"
    shutil.copytree(new, old)
    (old / EMPTY_HISTORY_FILE).unlink()
    write_manifest(old)
    return {"model": model, "new": new, "old": old}


def recommend(ranker, common, k=5, history=EMPTY):
    return ranker.recommend(RecommendRequest("u", history, k, common, id_options=RAW))


def test_an_empty_history_with_user_features_gets_the_new_user_querys_items_marked_user_features(exports):
    ranker, model = Ranker.load(exports["new"]), exports["model"]
    young, old = recommend(ranker, YOUNG), recommend(ranker, OLD)
    for answer, (age, score) in ((young, (1, YOUNG["user_score"])), (old, (5, OLD["user_score"]))):
        want = reference(model, age, score)
        top = torch.topk(want, 5)
        assert answer.fallback == "user_features" and answer.to_json()["fallback"] == "user_features"
        assert answer.items == [RAW_ITEMS[i] for i in top.indices.tolist()]
        np.testing.assert_allclose(answer.scores, top.values.numpy(), rtol=0, atol=1e-5)
        assert answer.cache_status == "off" and answer.history_length == 0
    assert young.items != old.items  # two users' features: two answers
    assert len(ranker.cache) == 0  # nothing encoded, nothing cached

    [generated] = ranker.generate([GenerateRequest("u", EMPTY, 4, YOUNG, id_options=RAW)])
    assert generated.fallback == "user_features" and generated.items[0] == young.items[0]
    assert len(set(generated.items)) == 4 and all(s <= 0 for s in generated.scores)  # log-probabilities

    candidates = {"item_id": [RAW_ITEMS[3], RAW_ITEMS[7]]}
    ranked = ranker.rank("u", EMPTY, candidates, YOUNG, id_options=RAW)
    np.testing.assert_allclose(ranked.scores["retrieval"], reference(model, 1, YOUNG["user_score"])[[3, 7]], atol=1e-5)
    assert ranked.to_json()["fallback"] == "user_features"

    warm = recommend(ranker, YOUNG, history={"item_id": [RAW_ITEMS[2]], "timestamps": [10]})
    assert warm.fallback is None  # a history: the model's own answer


def test_without_features_or_without_the_state_an_empty_history_gets_the_popularity_fallback(exports):
    new, old = Ranker.load(exports["new"]), Ranker.load(exports["old"])
    for ranker, common in ((new, None), (new, {}), (old, YOUNG)):
        answer = recommend(ranker, common)
        assert answer.fallback == "popularity" and answer.items == most_popular(5)
        [generated] = ranker.generate([GenerateRequest("u", EMPTY, 3, common, id_options=RAW)])
        assert generated.fallback == "popularity" and generated.items == most_popular(3)
    with pytest.raises(RequestError, match="history: empty"):  # a retrieval rank needs a query
        old.rank("u", EMPTY, {"item_id": [RAW_ITEMS[3]]}, YOUNG, id_options=RAW)


def test_an_id_feature_with_an_unknown_id_may_be_left_out_any_other_is_named(exports):
    ranker, model = Ranker.load(exports["new"]), exports["model"]
    unknown_age = recommend(ranker, {"user_score": YOUNG["user_score"]})
    assert unknown_age.fallback == "user_features"
    top = torch.topk(reference(model, 0, YOUNG["user_score"]), 5)  # the unknown age: id 0
    assert unknown_age.items == [RAW_ITEMS[i] for i in top.indices.tolist()]
    with pytest.raises(RequestError, match=r"common_features: missing feature\(s\) \['user_score'\]"):
        recommend(ranker, {"user_age": 18})
    with_history = {"item_id": [RAW_ITEMS[2]], "timestamps": [10]}
    assert recommend(ranker, {"user_score": [0.0, 0.0]}, history=with_history).fallback is None
    with pytest.raises(RequestError, match=r"missing feature\(s\) \['user_score'\]"):  # a history: required as ever
        recommend(ranker, None, history=with_history)


def test_http_answers_a_new_user_from_features_and_counts_the_fallback(exports):
    with AppServer(create_app(Ranker.load(exports["new"]))) as server:
        ok = server.call("POST", "/v1/recommend", {"user_id": "u", "history": EMPTY, "k": 3, "common_features": OLD})
        plain = server.call("POST", "/v1/recommend", {"user_id": "v", "history": EMPTY, "k": 3})
        bad = server.call(
            "POST", "/v1/recommend", {"user_id": "w", "history": EMPTY, "k": 3, "common_features": {"user_age": 18}}
        )
        text = server.call("GET", "/metrics")[1]
    assert ok[0] == 200 and ok[1]["fallback"] == "user_features" and len(ok[1]["items"]) == 3
    assert plain[0] == 200 and plain[1]["fallback"] == "popularity" and plain[1]["items"] == most_popular(3)
    assert bad[0] == 400 and "user_score" in bad[1]["detail"]
    assert metric(text, "gr_fallback_total", kind="user_features") == 1
    assert metric(text, "gr_fallback_total", kind="popularity") == 1


def test_gr_predict_answers_empty_histories_from_features_or_popularity(exports, tmp_path):
    ranker = Ranker.load(exports["new"])
    table = pa.table(
        {
            "user_id": ["a", "b"],
            "history.item_id": pa.array([[], [RAW_ITEMS[4]]], pa.list_(pa.int64())),
            "history.timestamps": pa.array([[], [100]], pa.list_(pa.int64())),
            "common_features.user_score": [YOUNG["user_score"], OLD["user_score"]],
        }
    )
    pq.write_table(table, tmp_path / "users.parquet")
    predict(exports["new"], tmp_path / "users.parquet", tmp_path / "top.parquet", k=4, progress=False)
    cold, warm = pq.read_table(tmp_path / "top.parquet").to_pylist()
    want = recommend(ranker, {"user_score": YOUNG["user_score"]}, k=4)  # user_age left out: the unknown age
    assert cold["fallback"] == "user_features" and cold["items"] == want.items and cold["history_length"] == 0
    assert warm["fallback"] is None and warm["history_length"] == 1

    pq.write_table(table.select(["user_id", "history.item_id", "history.timestamps"]), tmp_path / "bare.parquet")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['common_features.user_score'\]"):
        predict(exports["new"], tmp_path / "bare.parquet", tmp_path / "no.parquet", k=4, progress=False)


def test_gr_check_names_a_new_user_state_of_the_wrong_shape(exports, tmp_path):
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    shutil.copytree(exports["new"], broken)
    save_file({EMPTY_HISTORY_TENSOR: torch.zeros(7)}, str(broken / EMPTY_HISTORY_FILE))
    write_manifest(broken)
    [problem] = check_export(broken)
    assert problem.file == EMPTY_HISTORY_FILE and "expected float32 [16]" in problem.message
