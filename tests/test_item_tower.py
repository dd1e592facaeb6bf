"""The retrieval item tower (``model.item_tower``): an item's vector is its id row plus an encoder of
its item features, so an item with no trained row is scored by its features. Training-side
evaluation, ``gr evaluate`` and serving rank the same catalogue vectors; ``gr items add`` on a tower
export gives new items the encoder of their features (different features, different scores); a bad
section is one line naming the key; a model without the tower is built as before; warm start
grows the tower's bags, their new rows at zero. With ``popularity`` the encoder also reads each
item's log count, and ``gr items add`` takes a new item's count from its file."""

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from gr.commands.evaluate import evaluate_run
from gr.data.datamodule import SequenceDataModule
from gr.data.mappings import load_mappings, model_maps
from gr.export.item_encoder import ITEM_ENCODER, MEAN_QUERY, SERVED_QUERIES
from gr.export.manifest import write_manifest
from gr.export.new_item_rows import place
from gr.export.new_items import add_items
from gr.export.reader import check_export
from gr.export.writer import export_run
from gr.jagged_rows import JaggedRows
from gr.model import GRInput, GROutput
from gr.postfix_dnn.item_tower import POPULARITY_FEATURE, ItemEncoder, ItemTower, TowerFeature
from gr.serving import Ranker
from gr.sparse.keyed_jagged import KeyedJaggedTensor
from gr.train import load_trained_model
from gr.train.build import SAMPLED_ITEMS, build_model, check_declared_features, dense_optimizer, seeded_model
from gr.train.config import TrainConfig
from gr.train.run import _warm_start, run_popularity, train
from gr.train.tasks import RetrievalTask, query_rows
from helpers.runs import RETRIEVAL

CATEGORY = "item_category"


def _values(**tower) -> dict:
    """RETRIEVAL on synthetic data with its item category, and ``model.item_tower`` = ``tower`` (if any)."""
    values = copy.deepcopy(RETRIEVAL)
    values["data"]["item_features"] = True
    values["sparse"]["backend"] = "torch"
    values["trainer"]["max_epochs"] = 1
    values["model"]["tables"].append({"name": "category", "embedding_dim": 8, "features": [CATEGORY]})
    if tower:
        values["model"]["item_tower"] = tower
    return values


@pytest.fixture(scope="module")
def tower_run(tmp_path_factory):
    """A 1-epoch retrieval run with an item tower over the item category, and its export."""
    root = tmp_path_factory.mktemp("tower")
    train(TrainConfig.from_dict(_values(features=[CATEGORY])), root / "run")
    return root / "run", export_run(root / "run", root / "export")


@pytest.fixture(scope="module")
def popularity_run(tmp_path_factory):
    """As ``tower_run``, the tower also reading the items' popularity."""
    root = tmp_path_factory.mktemp("popularity")
    train(TrainConfig.from_dict(_values(features=[CATEGORY], popularity=True)), root / "run")
    return root / "run", export_run(root / "run", root / "export")


def _trained(run: Path):
    """The run's model with its items' features given, and its data module."""
    model, config = load_trained_model(run)
    data = SequenceDataModule(config.data, base_maps=model_maps(str(run / "mappings")))
    data.setup()
    model.item_tower.set_items(data.item_features.columns(), run_popularity(run))
    return model, config, data


def _placed(model, export: Path, n: int, features_only: torch.Tensor, counts) -> torch.Tensor:
    """What ``gr items add`` writes for new items of ``features_only`` [k, d] and ``counts`` [k]: the
    rows ``gr.export.new_item_rows`` places from the trained items' vectors and feature-only vectors,
    their counts, and the export's mean and served queries."""
    encoder_file = load_file(str(export / ITEM_ENCODER))
    trained_counts = load_file(str(export / "sparse" / "popularity.safetensors"))["count"]
    items = torch.arange(n)
    with torch.no_grad():
        trained = model.item_tower.item_vectors(items, model.embeddings.table_weight("item")[:n]).numpy()
        trained_features = model.item_tower.feature_vectors(items).numpy()
    rows, _ = place(
        features_only.numpy(),
        np.asarray(counts),
        trained,
        trained_features,
        trained_counts,
        encoder_file[MEAN_QUERY],
        encoder_file[SERVED_QUERIES],
    )
    return torch.from_numpy(rows)


def _category_id(run: Path, raw: str) -> int:
    return int(load_mappings(str(run / "mappings"))[0][CATEGORY].encode(np.array([int(raw)]), unknown=0)[0])


# ---- the module ------------------------------------------------------------------------------
def _tower(id_dropout: float = 0.5) -> ItemTower:
    features = [TowerFeature("brand", "categorical", 4, 3), TowerFeature("genres", "list", 5, 2)]
    features.append(TowerFeature("price", "dense", 0, 1))
    tower = ItemTower("item_id", ("item_id",), 4, ItemEncoder(features, 6, mlp_dims=(7,)), id_dropout)
    genres = JaggedRows.from_lengths([2, 0, 1], np.array([1, 2, 4]))  # item 3: past the data, an empty bag
    tower.set_items({"brand": np.array([1, 2, 3]), "genres": genres, "price": np.array([[1.0], [2.0], [3.0]])})
    return tower


def test_the_tower_starts_as_the_id_rows_and_reads_each_items_own_features():
    tower = _tower()
    rows = torch.randn(4, 6)
    assert torch.equal(tower.item_vectors(torch.arange(4), rows), rows)  # zero-initialised projection
    torch.nn.init.normal_(tower.encoder.mlp[-1].weight)
    items = torch.tensor([3, 0, 2, 0])
    features = tower.item_features(items)
    ids, offsets = features["genres"]
    assert features["brand"].tolist() == [0, 1, 3, 1] and features["price"].flatten().tolist() == [0, 1, 3, 1]
    assert ids.tolist() == [1, 2, 4, 1, 2] and offsets.tolist() == [0, 0, 2, 3, 5]
    one_by_one = torch.cat([tower.item_vectors(items[i : i + 1], rows[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(tower.item_vectors(items, rows), one_by_one)


def test_id_dropout_zeroes_whole_id_rows_in_training_only():
    tower = _tower(id_dropout=0.5)
    torch.nn.init.normal_(tower.encoder.mlp[-1].weight)
    items, rows = torch.zeros(400, dtype=torch.int64), torch.ones(400, 6)
    encoded = tower.item_vectors(items, torch.zeros(400, 6))
    dropped = (tower.train()(items, rows) - encoded).sum(1)
    assert set(dropped.round().tolist()) == {0.0, 6.0} and 0.35 < float((dropped < 3).float().mean()) < 0.65
    assert torch.equal(tower.eval()(items, rows), encoded + rows)


def test_the_feature_loss_scores_each_target_by_its_features_alone_against_the_same_negatives():
    """Each target's feature-only vector (no id row) is the positive, the main loss's negatives (as
    the model embeds them) the rest, the target's own row among them masked; only the encoder learns."""
    tower = _tower()
    torch.nn.init.normal_(tower.encoder.mlp[-1].weight)
    config = TrainConfig.from_dict(_values()).task.retrieval
    normalise = torch.nn.functional.normalize
    task = RetrievalTask(config, 4, normalise, feature_vectors=tower.feature_vectors, feature_loss_weight=1.0)
    sampled, rows = torch.tensor([2, 0, 3]), torch.randn(3, 6, requires_grad=True)
    queries = normalise(torch.randn(2, 6), dim=-1).requires_grad_()
    labels = {
        "next_item": torch.tensor([2, 3]),
        "positive_index": torch.tensor([0, 2]),  # items 2 and 3
        "negative_index": torch.tensor([[1, 0], [2, 1]]),  # each row's own item once, item 0 once
    }
    inputs = GRInput(
        seq_offsets=torch.tensor([0, 2]),
        max_seq_len=2,
        sequence_ids=KeyedJaggedTensor.from_lengths_sync([SAMPLED_ITEMS], sampled, torch.tensor([3])),
        labels=labels,
    )
    output = GROutput({"query": queries}, queries, torch.arange(2), torch.tensor([0, 2]), {SAMPLED_ITEMS: rows}, {})
    losses = task.loss(output, inputs)
    features = normalise(tower.feature_vectors(torch.tensor([2, 3])), dim=-1)
    negative = normalise(rows[1], dim=0)  # item 0 as the model embeds it: each row's only unmasked negative
    logits = torch.stack([(queries * features).sum(-1), queries @ negative], dim=-1).detach() / config.temperature
    want = torch.nn.functional.cross_entropy(logits, torch.zeros(2, dtype=torch.int64))
    torch.testing.assert_close(losses["feature_loss"], want)
    torch.testing.assert_close(losses["loss"], RetrievalTask(config, 4, normalise).loss(output, inputs)["loss"] + want)
    task.feature_loss(queries, normalise(rows, dim=-1), inputs).backward()
    assert queries.grad is None and rows.grad is None and tower.encoder.mlp[-1].weight.grad.abs().sum() > 0


def test_the_popularity_feature_is_each_items_log_count():
    features = [TowerFeature("brand", "categorical", 4, 3), TowerFeature(POPULARITY_FEATURE, "popularity", 0, 1)]
    tower = ItemTower("item_id", ("item_id",), 4, ItemEncoder(features, 6), 0.0)
    with pytest.raises(ValueError, match=r"^model.item_tower.popularity: the items' training counts were not given"):
        tower.set_items({"brand": np.array([1, 2, 3, 1])})
    tower.set_items({"brand": np.array([1, 2, 3, 1])}, np.array([0, 1, 9, 99]))
    read = tower.item_features(torch.tensor([3, 0, 2]))[POPULARITY_FEATURE]
    torch.testing.assert_close(read, torch.log1p(torch.tensor([[99.0], [0.0], [9.0]])))
    torch.nn.init.normal_(tower.encoder.mlp[-1].weight)
    vectors = tower.feature_vectors(torch.tensor([0, 3]))  # brand 1 both: only the counts differ
    assert not torch.equal(vectors[0], vectors[1])


def test_a_tower_without_its_items_features_says_so():
    features = [TowerFeature("brand", "categorical", 4, 3)]
    tower = ItemTower("item_id", ("item_id",), 4, ItemEncoder(features, 6), 0.5)
    with pytest.raises(RuntimeError, match="no item features given"):
        tower(torch.tensor([0]), torch.zeros(1, 6))
    with pytest.raises(ValueError, match=r"model.item_tower.features: the data has no item values for \['brand'\]"):
        tower.set_items({})


# ---- config --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda v: v["model"].update(item_tower={"features": []}), r"model.item_tower.features: expected a non-empty"),
        (lambda v: v["model"].update(item_tower={"features": [CATEGORY], "id_dropout": 1}), r"item_tower.id_dropout"),
        (lambda v: v["model"].update(item_tower={"features": [CATEGORY], "mlp": [4]}), r"model.item_tower: unknown"),
        (
            lambda v: v["model"].update(item_tower={"features": [CATEGORY], "feature_loss_weight": -1}),
            r"^model.item_tower.feature_loss_weight: ",
        ),
        (lambda v: v["model"].update(item_tower={"features": ["brand"]}), r"'brand' is not a declared item feature"),
        (
            lambda v: v["model"].update(item_tower={"features": [CATEGORY], "popularity": "yes"}),
            r"^model.item_tower.popularity: ",
        ),
        (lambda v: v["model"].update(item_tower={"features": ["item_id"]}), r"'item_id' is the item itself"),
        (
            lambda v: (
                v["model"].update(item_tower={"features": [CATEGORY]}),
                v["data"].update(item_features=False),
                v["model"]["tables"].pop(),
            ),
            r"model.item_tower.features: 'item_category' is not a declared item feature \(item features: \[\]",
        ),
    ],
)
def test_a_bad_item_tower_is_one_line_naming_the_key(change, message):
    values = _values()
    change(values)
    with pytest.raises(ValueError, match=message) as error:
        check_declared_features(TrainConfig.from_dict(values))
    assert "\n" not in str(error.value)


def test_an_item_tower_on_a_ranking_task_is_refused():
    values = _values(features=[CATEGORY])
    values["data"]["task"] = "ranking"
    with pytest.raises(ValueError, match=r"^model.item_tower: an item tower embeds retrieval's items; data.task is"):
        TrainConfig.from_dict(values)


def test_a_model_without_the_tower_is_built_as_before():
    """No section: no tower, the config reads as before, and the other weights are those a tower
    model starts with (the tower is built last, drawing nothing before the rest)."""
    plain_config, tower_config = TrainConfig.from_dict(_values()), TrainConfig.from_dict(_values(features=[CATEGORY]))
    assert "item_tower" not in plain_config.to_dict()["model"]
    spec = SequenceDataModule(plain_config.data)
    spec.setup()
    plain = seeded_model(plain_config, spec.feature_spec()).state_dict()
    tower = seeded_model(tower_config, spec.feature_spec())
    assert tower.item_tower is not None and seeded_model(plain_config, spec.feature_spec()).item_tower is None
    state = {k: v for k, v in tower.state_dict().items() if not k.startswith("item_tower.")}
    assert state.keys() == plain.keys() and all(torch.equal(state[k], plain[k]) for k in plain)


# ---- train, evaluate, export, serve ------------------------------------------------------------------
def test_evaluation_and_serving_rank_the_same_catalogue_vectors(tower_run):
    run, export = tower_run
    model, config, data = _trained(run)
    task = RetrievalTask(
        config.task.retrieval, data.num_items, model.postfix_dnn.item_embedding, model.item_tower.item_vectors
    )
    task.start_evaluation(model.embeddings)
    served = Ranker.load(export).model.catalogue().vectors
    assert torch.equal(task.catalogue, served)
    encoded = model.item_tower.item_vectors(torch.arange(data.num_items), torch.zeros(data.num_items, 16))
    assert encoded.abs().sum() > 0  # the encoder trained: the catalogue is more than the id rows
    metrics = json.loads((run / "metrics.json").read_text())
    assert evaluate_run(run)["hr@10"] == pytest.approx(metrics["hr@10"], abs=1e-6)


def test_the_export_stores_the_validation_events_served_queries_and_their_mean(tower_run):
    """Beside the encoder: the normalised queries the model serves for its validation events (what
    places new items' rows) and their mean."""
    run, export = tower_run
    model, _, data = _trained(run)
    with torch.no_grad():
        served = [
            torch.nn.functional.normalize(model(b).predictions["query"].index_select(0, query_rows(b)), dim=-1)
            for b in data.val_dataloader()
        ]
    stored = load_file(str(export / ITEM_ENCODER))
    torch.testing.assert_close(torch.from_numpy(stored[SERVED_QUERIES]), torch.cat(served), rtol=0, atol=1e-5)
    np.testing.assert_allclose(stored[MEAN_QUERY], stored[SERVED_QUERIES].mean(0), rtol=0, atol=1e-6)


def test_added_items_are_scored_by_their_features(tower_run, tmp_path):
    """Two new items with different categories get different rows and scores, each row placed from
    the trained encoder of its features with no id part (its nearest trained items, the export's mean
    and served queries, count 0); a known item given a new category keeps its id part."""
    run, export = tower_run
    (tmp_path / "new.csv").write_text(f"item_id,{CATEGORY}\n9001,3\n9002,5\n1,7\n")
    summary = add_items(export, tmp_path / "new.csv", tmp_path / "grown", replace_known=True)
    assert summary["items_added"] == 2 and summary["items_replaced"] == 1 and check_export(tmp_path / "grown") == []
    model, _, data = _trained(run)
    rows = load_file(str(tmp_path / "grown" / "sparse" / "item.safetensors"))["weight"]
    n = data.num_items
    categories = torch.tensor([_category_id(run, "3"), _category_id(run, "5")])
    with torch.no_grad():
        want = model.item_tower.encoder({CATEGORY: categories})
        id_row = model.embeddings.table_weight("item")[0]
        replaced = id_row + model.item_tower.encoder({CATEGORY: torch.tensor([_category_id(run, "7")])})[0]
    placed = _placed(model, export, n, want, [0, 0])
    torch.testing.assert_close(torch.from_numpy(rows[n:]), placed, rtol=0, atol=1e-6)
    np.testing.assert_allclose(rows[0], replaced.numpy(), rtol=0, atol=1e-6)
    catalogue = Ranker.load(tmp_path / "grown").model.catalogue()
    query = torch.nn.functional.normalize(torch.randn(16), dim=0)
    scores = catalogue.vectors[n:] @ query
    assert scores[0] != scores[1]
    torch.testing.assert_close(catalogue.vectors[n:], model.postfix_dnn.item_embedding(placed), rtol=0, atol=1e-6)


def test_added_items_are_placed_by_their_counts_on_a_popularity_tower(popularity_run, tmp_path):
    """Two new items of one category, one without a count: rows differ by the count alone, each the
    trained encoder of its category and log count; the counts join the export's popularity; a known
    item given a count keeps its id part and takes the count; evaluation ranks what serving ranks."""
    run, export = popularity_run
    (tmp_path / "new.csv").write_text(f"item_id,{CATEGORY},{POPULARITY_FEATURE}\n9001,3,0\n9002,3,40\n1,3,7\n")
    add_items(export, tmp_path / "new.csv", tmp_path / "grown", replace_known=True)
    assert check_export(tmp_path / "grown") == []
    model, config, data = _trained(run)
    n, category = data.num_items, _category_id(run, "3")
    rows = load_file(str(tmp_path / "grown" / "sparse" / "item.safetensors"))["weight"]
    trained = run_popularity(run)
    with torch.no_grad():
        counts = torch.from_numpy(np.log1p(np.array([[0.0], [40.0], [7.0]])).astype(np.float32))
        encoded = model.item_tower.encoder({CATEGORY: torch.tensor([category] * 3), POPULARITY_FEATURE: counts})
        replaced = model.embeddings.table_weight("item")[0] + encoded[2]
    placed = _placed(model, export, n, encoded[:2], [0, 40])
    torch.testing.assert_close(torch.from_numpy(rows[n:]), placed, rtol=0, atol=1e-6)
    assert (encoded[0] - encoded[1]).abs().max() > 1e-4  # the counts alone move the encoder's vector
    np.testing.assert_allclose(rows[0], replaced.numpy(), rtol=0, atol=1e-5)
    popularity = load_file(str(tmp_path / "grown" / "sparse" / "popularity.safetensors"))["count"]
    assert popularity[n:].tolist() == [0, 40] and popularity[0] == 7 and (popularity[1:n] == trained[1:]).all()
    task = RetrievalTask(config.task.retrieval, n, model.postfix_dnn.item_embedding, model.item_tower.item_vectors)
    task.start_evaluation(model.embeddings)
    assert torch.equal(task.catalogue, Ranker.load(export).model.catalogue().vectors)
    (tmp_path / "bad.csv").write_text(f"item_id,{CATEGORY},{POPULARITY_FEATURE}\n9003,3,-2\n")
    with pytest.raises(ValueError, match=rf"bad.csv: row 1: column '{POPULARITY_FEATURE}': expected a count"):
        add_items(export, tmp_path / "bad.csv", tmp_path / "bad")


def test_an_items_count_is_refused_where_the_export_stores_no_popularity(tower_run, tmp_path):
    _, export = tower_run
    shutil.copytree(export, tmp_path / "export")
    (tmp_path / "export" / "sparse" / "popularity.safetensors").unlink()
    write_manifest(tmp_path / "export")
    (tmp_path / "new.csv").write_text(f"item_id,{CATEGORY},{POPULARITY_FEATURE}\n9001,3,5\n")
    with pytest.raises(ValueError, match=rf"unknown column\(s\) \['{POPULARITY_FEATURE}'\]"):
        add_items(tmp_path / "export", tmp_path / "new.csv", tmp_path / "grown")


@pytest.mark.parametrize(
    "broken_queries",
    [lambda q: q * 2.0, lambda q: q[:, :-1], lambda q: q[:0]],
    ids=["not_unit", "another_width", "none"],
)
def test_check_names_served_queries_that_are_not_unit_queries_of_the_embedding_width(
    tower_run, tmp_path, broken_queries
):
    problems = _encoder_problems(tower_run, tmp_path, SERVED_QUERIES, broken_queries)
    assert len(problems) == 1 and SERVED_QUERIES in problems[0] and ITEM_ENCODER in problems[0]
    assert "unit rows" in problems[0]


def test_check_names_an_item_encoder_that_does_not_fit_its_features(tower_run, tmp_path):
    problems = _encoder_problems(tower_run, tmp_path, f"bags.{CATEGORY}.weight", lambda weight: weight[:-1])
    assert len(problems) == 1 and f"bags.{CATEGORY}.weight" in problems[0] and ITEM_ENCODER in problems[0]


def _encoder_problems(tower_run, tmp_path, name, change):
    """``check_export``'s problems with a copy of the run's export whose item-encoder tensor ``name`` is
    ``change(tensor)`` (its manifest rewritten to match)."""
    _, export = tower_run
    broken = tmp_path / "broken"
    shutil.copytree(export, broken)
    weights = load_file(str(broken / ITEM_ENCODER))
    with safe_open(str(broken / ITEM_ENCODER), framework="numpy") as f:
        metadata = f.metadata()
    weights[name] = np.ascontiguousarray(change(weights[name]))
    save_file(weights, str(broken / ITEM_ENCODER), metadata=metadata)
    write_manifest(broken)
    return [str(p) for p in check_export(broken)]


# ---- warm start -------------------------------------------------------------------------------------
def test_warm_start_grows_the_towers_bags_with_new_rows_at_zero(tower_run, tmp_path):
    """Their carried dense optimizer state too: the run's for its rows, zero for the new ones."""
    run, _ = tower_run
    values = _values(features=[CATEGORY])
    values["data"]["synthetic"]["num_categories"] = 16  # values the run never saw: the category vocabulary grows
    values["trainer"].update(init_from=str(run), limit_train_batches=2)
    values["warm_start"] = {"dense_optimizer_state": "carry"}
    config = TrainConfig.from_dict(values)
    warm = _warm_start(config)
    data = SequenceDataModule(config.data, base_maps=warm.maps)
    data.setup()
    model = build_model(config, data.feature_spec())
    warm.copy_weights(model)
    old, new = warm.model.item_tower.encoder.bags[CATEGORY].weight, model.item_tower.encoder.bags[CATEGORY].weight
    assert new.shape[0] > old.shape[0]
    assert torch.equal(new[: old.shape[0]], old) and not new[old.shape[0] :].any()
    dense = [(name, p) for name, p in model.named_parameters() if not name.startswith("embeddings.")]
    optimizer = dense_optimizer(config.optimizer, [p for _, p in dense])
    warm.copy_dense_optimizer_state(optimizer, dense)
    saved = warm.dense_optimizer_state[f"item_tower.encoder.bags.{CATEGORY}.weight"]["exp_avg_sq"]
    moments = optimizer.state[new]["exp_avg_sq"]
    assert saved.any() and torch.equal(moments[: old.shape[0]], saved) and not moments[old.shape[0] :].any()
    metrics = train(config, tmp_path / "warm")
    assert np.isfinite(metrics["hr@10"])
