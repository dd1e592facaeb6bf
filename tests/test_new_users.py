"""New users (an empty history) served from their features: an export of a model that learned the
new-user state (``empty_history``) answers recommend, generate and rank for an empty history with the
user's common features from ``postfix_dnn(empty_history, features)``, marked ``"fallback":
"user_features"`` and counted in /metrics; without features, or from an export without the state, the
popularity fallback answers as before. A common id feature with an unknown id may be left out; any
other is a 400 naming it. ``gr predict`` answers empty histories the same way; ``gr check`` refuses
a broken state file."""

import csv
import dataclasses
import json
import math
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from gr import GRInput, GRModel, GROutput, HSTUConfig, TableConfig
from gr.commands import cli
from gr.commands.predict import predict
from gr.commands.serve import main as serving_main
from gr.data.datamodule import SequenceDataModule
from gr.data.features import FeatureSpec
from gr.data.mappings import IdMap, save_mappings
from gr.export import check_export, export_model
from gr.export.manifest import write_manifest
from gr.export.new_user import EMPTY_HISTORY_FILE, EMPTY_HISTORY_TENSOR
from gr.ops.sampled_softmax import sampled_softmax_loss
from gr.postfix_dnn import RetrievalHead
from gr.prefix_dnn import MLPTokenEncoder
from gr.serving import GenerateRequest, IdOptions, Ranker, RecommendRequest
from gr.serving.errors import RequestError
from gr.serving.http import create_app
from gr.sparse.keyed_jagged import KeyedJaggedTensor
from gr.train.build import build_model, seeded_model
from gr.train.config import RetrievalSection, TrainConfig
from gr.train.run import load_trained_model, train
from gr.train.tasks import RetrievalTask
from helpers.models import HSTU_KW, perturb
from helpers.runs import RANKING, RETRIEVAL, config, with_overrides
from helpers.servers import AppServer, metric

NUM_ITEMS = 40
RAW_ITEMS = [500 + 3 * i for i in range(NUM_ITEMS)]
AGES = [18, 25, 35, 45, 56]  # raw user_age values: model ids 1..5, 0 the unknown age
COUNTS = (np.arange(NUM_ITEMS) * 13) % 17
RAW = IdOptions("raw")
EMPTY = {"item_id": [], "timestamps": []}
YOUNG = {"user_age": 18, "user_score": [1.0, -0.5]}
OLD = {"user_age": 56, "user_score": [-1.0, 2.0]}
# The tiny synthetic retrieval recipe with its user features (age, gender) read by the retrieval head.
NEW_USERS = with_overrides(
    RETRIEVAL,
    ("data.user_features", True),
    (
        "model.tables",
        [
            *RETRIEVAL["model"]["tables"],
            {"name": "age", "embedding_dim": 4, "features": ["user_age"], "kind": "common"},
            {"name": "gender", "embedding_dim": 4, "features": ["user_gender"], "kind": "common"},
        ],
    ),
)


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


def test_the_one_shot_commands_answer_a_new_user_from_features(exports, tmp_path, capsys):
    request = tmp_path / "requests.json"
    new, cold = {"user_id": "a", "history": EMPTY, "common_features": OLD}, {"user_id": "b", "history": EMPTY}
    request.write_text(json.dumps([new, cold]))
    want = recommend(Ranker.load(exports["new"]), OLD, k=3)
    for verb in ("recommend", "generate"):
        capsys.readouterr()
        assert serving_main([verb, str(exports["new"]), "--request", str(request), "--k", "3"]) == 0
        featured, plain = json.loads(capsys.readouterr().out)
        assert featured["fallback"] == "user_features" and featured["items"][0] == want.items[0]
        assert plain["fallback"] == "popularity" and plain["items"] == most_popular(3)
    ranked = tmp_path / "rank.json"
    ranked.write_text(json.dumps({**new, "candidates": {"item_id": want.items}}))
    assert serving_main(["rank", str(exports["new"]), "--request", str(ranked)]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["fallback"] == "user_features"
    np.testing.assert_allclose(answer["scores"]["retrieval"], want.scores, rtol=0, atol=1e-5)


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


# ---- training -----------------------------------------------------------------------------------
def test_first_items_are_targets_with_negatives_of_their_own_and_the_tokens_draws_unchanged():
    config = RetrievalSection(num_negatives=4, negatives="block", negatives_block=2, new_user_weight=3.0)
    batch = GRInput(
        seq_offsets=torch.tensor([0, 3, 5]),
        max_seq_len=3,
        sequence_ids=KeyedJaggedTensor.from_lengths_sync(
            ["item_id"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([3, 2])
        ),
        labels={"next_item": torch.tensor([2, 3, 9, 5, -1]), "first_item": torch.tensor([-1, 4])},
    )
    plain = RetrievalTask(config, 50, lambda rows: rows).training_inputs(batch, torch.Generator().manual_seed(3))
    task = RetrievalTask(config, 50, lambda rows: rows, new_user=True)
    both = task.training_inputs(batch, torch.Generator().manual_seed(3))
    distinct = {name: kjt.values() for name, kjt in both.sequence_ids.to_dict().items()}["sampled_item_id"]
    plain_distinct = plain.sequence_ids.to_dict()["sampled_item_id"].values()
    for key in ("positive_index", "negative_index"):  # the tokens' targets and draws as without first items
        assert torch.equal(distinct[both.labels[key]], plain_distinct[plain.labels[key]])
    assert distinct[both.labels["first_positive_index"]].tolist() == [4]  # the second sequence's first item
    assert both.labels["first_negative_index"].shape == (1, 4)

    items = torch.randn(distinct.numel(), 8)
    queries, new_user = torch.randn(5, 8), torch.randn(2, 8)
    output = GROutput({"query": queries}, queries, torch.arange(5), batch.seq_offsets, {"sampled_item_id": items}, {})
    tokens = task.loss(output, both)["loss"]
    output.new_user = {"query": new_user}
    losses = task.loss(output, both)
    first = sampled_softmax_loss(
        new_user[1:], items, both.labels["first_positive_index"], both.labels["first_negative_index"], 0.05, 2
    )
    torch.testing.assert_close(losses["new_user_loss"], first)
    torch.testing.assert_close(losses["loss"], (4 * tokens + 3.0 * first) / 7)  # 4 scored tokens, 1 target x 3

    windows = dataclasses.replace(batch, labels={**batch.labels, "first_item": torch.tensor([-1, -1])})
    cut = task.training_inputs(windows, torch.Generator().manual_seed(3))  # no sequence starts a history
    rows = torch.randn(cut.sequence_ids.to_dict()["sampled_item_id"].values().numel(), 8)
    state = torch.randn(2, 8, requires_grad=True)
    output = GROutput({"query": queries}, queries, torch.arange(5), batch.seq_offsets, {"sampled_item_id": rows}, {})
    output.new_user = {"query": state}
    task.loss(output, cut)["loss"].backward()
    assert state.grad is not None and not state.grad.any()  # in the graph (data parallelism), a zero gradient


def test_a_sequence_holds_a_first_item_target_only_when_it_starts_at_the_users_first_event(tmp_path):
    values = with_overrides(RETRIEVAL, ("data.max_seq_len", 10), ("model.hstu.max_seq_len", 10))
    data = SequenceDataModule(TrainConfig.from_dict(values).data)
    data.setup()
    batches = data.splits["train"]
    batch = batches.build(np.arange(len(batches)), np.random.default_rng(0))
    seqs, users = batches.corpus.sequences, batches.users
    whole = seqs.train_ends()[users] - 1 - seqs.starts[users] <= 10  # the window holds the whole history
    first = batch.labels["first_item"].numpy()
    assert whole.any() and (~whole).any()
    assert (first[~whole] == -1).all()
    assert (first[whole] == seqs.items[seqs.starts[users[whole]]]).all()


def test_the_new_user_query_is_on_by_default_when_the_retrieval_head_reads_common_features():
    spec = FeatureSpec(sequence={"item_id": 100}, common={"user_age": 8, "user_gender": 3})
    with_features = config(NEW_USERS)
    assert build_model(with_features, spec).empty_history.shape == (16,)
    assert build_model(config(NEW_USERS, ("task.retrieval.new_user_query", False)), spec).empty_history is None
    assert build_model(config(RETRIEVAL), FeatureSpec(sequence={"item_id": 100})).empty_history is None
    assert (
        build_model(
            config(RETRIEVAL, ("task.retrieval.new_user_query", True)), FeatureSpec(sequence={"item_id": 100})
        ).empty_history
        is not None
    )
    ranking = FeatureSpec(sequence={"item_id": 100, "item_category": 13}, common=spec.common)
    assert build_model(config(RANKING), ranking, ["watch"]).empty_history is None
    without = seeded_model(config(NEW_USERS, ("task.retrieval.new_user_query", False)), spec).state_dict()
    for name, value in seeded_model(with_features, spec).state_dict().items():  # drawn last: the rest unchanged
        assert name == "empty_history" or torch.equal(value, without[name]), name


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """A run whose checkpoints hold no empty_history and whose config.yaml leaves new_user_query at its
    default: a run trained before the new-user query existed."""
    run = tmp_path_factory.mktemp("old") / "run"
    train(config(NEW_USERS, ("task.retrieval.new_user_query", False), ("trainer.max_epochs", 1)), run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["task"]["retrieval"].pop("new_user_query")
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    return run


@pytest.mark.parametrize("backend", ["torchrec", "torch"])
def test_both_sparse_backends_train_the_new_user_query_which_the_export_serves(tmp_path, backend):
    run = tmp_path / "run"
    metrics = train(config(NEW_USERS, ("sparse.backend", backend), ("trainer.max_epochs", 1)), run)
    assert metrics["config"]["sparse"]["backend"] == backend
    with open(run / "logs" / "metrics.csv") as handle:
        logged = [float(row["train/new_user_loss"]) for row in csv.DictReader(handle) if row.get("train/new_user_loss")]
    assert logged and all(math.isfinite(v) and v > 0 for v in logged)
    model, _ = load_trained_model(run)
    fresh = seeded_model(config(NEW_USERS), FeatureSpec(**json.loads((run / "features.json").read_text())["spec"]))
    assert not torch.equal(model.empty_history, fresh.empty_history)  # trained
    assert cli.main(["export", str(run), str(tmp_path / "export")]) == 0
    ranker = Ranker.load(tmp_path / "export")
    answer = ranker.recommend(RecommendRequest("u", EMPTY, 3, {"user_age": 1, "user_gender": 2}))
    assert answer.fallback == "user_features"


def test_a_checkpoint_without_the_new_user_state_loads_exports_resumes_and_warm_starts(old_run, tmp_path):
    model, loaded = load_trained_model(old_run)
    assert loaded.task.retrieval.new_user_query is None and model.empty_history is None
    assert cli.main(["export", str(old_run), str(tmp_path / "export")]) == 0
    assert not (tmp_path / "export" / EMPTY_HISTORY_FILE).exists()
    answer = Ranker.load(tmp_path / "export").recommend(
        RecommendRequest("u", EMPTY, 3, {"user_age": 1, "user_gender": 2})
    )
    assert answer.fallback == "popularity"

    resumed = tmp_path / "resumed"
    shutil.copytree(old_run, resumed)
    metrics = train(config(NEW_USERS, ("trainer.max_epochs", 2)), resumed, resume=True)
    assert metrics["epochs"] == 2 and metrics["config"]["task"]["retrieval"]["new_user_query"] is False

    warm = train(config(NEW_USERS, ("trainer.max_epochs", 1), ("trainer.init_from", str(old_run))), tmp_path / "warm")
    assert warm["epochs"] == 1 and load_trained_model(tmp_path / "warm")[0].empty_history is not None
