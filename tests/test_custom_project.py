"""examples/custom_project end to end at a small size: its config trains its GRModel subclass with
item genres (a list-valued feature, pooled by mean) and user demographics, the run exports (with its
items' genres) and passes ``gr check``,
and a rank request over HTTP (the app on an in-process server), by raw values, scores as the
trained model does, with the genres written out or given by item id alone; recommend and generate
work."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gr.commands import cli
from gr.data.datamodule import SequenceDataModule
from gr.data.mappings import load_mappings
from gr.jagged_rows import JaggedRows
from gr.serving import Ranker
from gr.serving.http import create_app
from gr.train.build import build_model
from gr.train.config import TrainConfig, load_config
from gr.train.run import load_trained_model, train
from helpers.movielens import CUSTOM_PROJECT, SMALL, small_ml_100k
from helpers.servers import AppServer


def test_genre_dropout_hides_genres_of_training_tokens_only(tmp_path):
    config = load_config(CUSTOM_PROJECT, [("data.path", str(small_ml_100k(tmp_path / "ml-100k"))), *SMALL])
    data = SequenceDataModule(config.data, eviction_block=config.model.hstu.eviction_block)
    data.setup()
    model = build_model(config, data.feature_spec())
    batch = next(iter(data.train_dataloader()))
    genres = batch.token_lists.to_dict()["item_genres"]
    model.train()
    hidden = model.split_input(batch).token_lists.to_dict()["item_genres"]
    lengths, offsets = genres.lengths(), genres.offsets()
    kept = hidden.lengths() == lengths
    emptied = hidden.lengths() == 0
    assert (kept | emptied).all() and (emptied & (lengths > 0)).any() and kept.float().mean() > 0.5
    kept_ids = [genres.values()[offsets[t] : offsets[t + 1]] for t in torch.nonzero(kept).flatten().tolist()]
    assert torch.equal(hidden.values(), torch.cat(kept_ids))
    model.eval()
    assert torch.equal(model.split_input(batch).token_lists.values(), batch.token_lists.values())


@pytest.mark.parametrize("query_time", ["next_event", "token"])
def test_custom_project_trains_exports_and_serves_raw_features_with_the_trained_scores(tmp_path, query_time):
    run, export = tmp_path / "run", tmp_path / "export"
    data_path = str(small_ml_100k(tmp_path / "ml-100k"))
    config = load_config(CUSTOM_PROJECT, [("data.path", data_path), ("model.hstu.query_time", query_time), *SMALL])
    assert config.model.class_path == "examples.custom_project.model.GenreModel"
    train(config, run)
    assert cli.main(["export", str(run), str(export)]) == 0
    assert cli.main(["check", str(export)]) == 0

    model, config = load_trained_model(run)
    assert type(model).__name__ == "GenreModel" and not model.training
    data = SequenceDataModule(config.data, eviction_block=config.model.hstu.eviction_block)
    data.setup()
    batch = data.splits["test"].build(np.arange(2), np.random.default_rng(0))
    with torch.no_grad():
        query = model(batch).predictions["query"][int(batch.seq_offsets[1]) - 1]  # user 0's last token
        items = torch.tensor([int(batch.labels["target_item"][0]), 0, 5, 17])
        rows = model.embeddings.table_weight("item")[items]
        trained = (F.normalize(rows, dim=-1) @ query).numpy()

    maps, _ = load_mappings(str(run / "mappings"))
    length = int(batch.seq_offsets[1])
    history_items = batch.sequence_ids.to_dict()["item_id"].values()[:length].numpy()
    genre_ids = data.corpus.item_features.lists["item_genres"]

    def genres(items):  # each item's genre names
        rows = genre_ids.take(np.asarray(items))
        names = maps["item_genres"].decode(rows.values).tolist()
        return [names[a:b] for a, b in zip(rows.offsets[:-1], rows.offsets[1:])]

    common = batch.common_ids.to_dict()
    request = {
        "user_id": str(maps["users"].decode(batch.labels["user"][:1].numpy())[0]),
        "history": {
            "item_id": maps["items"].decode(history_items).tolist(),
            "timestamps": batch.timestamps[:length].tolist(),
            "item_genres": genres(history_items),
        },
        "candidates": {"item_id": maps["items"].decode(items.numpy()).tolist(), "item_genres": genres(items)},
        "common_features": {
            name: maps[name].decode(common[name].values()[:1].numpy()).tolist()[0]
            for name in ("user_age", "user_gender", "user_occupation")
        },
        "request_time": int(batch.query_times[length - 1]),
    }
    with AppServer(create_app(Ranker.load(export), warm_up=False)) as server:
        status, answer = server.call("POST", "/v1/rank", request)
        assert status == 200, answer
        np.testing.assert_allclose(answer["scores"]["retrieval"], trained, atol=1e-5)
        by_id = {
            **request,
            "history": {k: v for k, v in request["history"].items() if k != "item_genres"},
            "candidates": {"item_id": request["candidates"]["item_id"]},
        }
        status, answer = server.call("POST", "/v1/rank", by_id)  # the export's item store fills the genres
        assert status == 200, answer
        np.testing.assert_allclose(answer["scores"]["retrieval"], trained, atol=1e-5)
        recommend = {k: v for k, v in by_id.items() if k != "candidates"}
        status, answer = server.call("POST", "/v1/recommend", {**recommend, "k": 3})
        assert status == 200 and len(answer["items"]) == 3, answer
        status, generated = server.call("POST", "/v1/generate", {**recommend, "k": 3})
        assert status == 200 and generated["items"][0] == answer["items"][0], generated
        status, answer = server.call(
            "POST", "/v1/rank", {**request, "common_features": {**request["common_features"], "user_zip": "x"}}
        )
        assert status == 400 and "user_zip" in answer["detail"]


@pytest.mark.parametrize("backend", ["torch", "torchrec"])
def test_release_years_reach_the_genre_encoder_and_the_item_tower_on_both_backends(tmp_path, backend):
    root = small_ml_100k(tmp_path / "ml-100k")
    lines = (root / "u.item").read_text().splitlines()
    years = [1975, 1994, 1997]  # items i, i+1, i+2 (same genres or not) by turn; "1970s", "1994", "1997"
    dated = [line.replace("01-Jan-1995", f"01-Jan-{years[i % 3]}") for i, line in enumerate(lines)]
    (root / "u.item").write_text("\n".join(dated) + "\n")
    config = load_config(
        CUSTOM_PROJECT,
        [("data.path", str(root)), *SMALL, ("sparse.backend", backend), ("data.release_year", "true")],
    )
    values = config.to_dict()
    values["model"]["tables"].append({"name": "year", "embedding_dim": 4, "features": ["item_year"]})
    values["model"]["prefix_dnn"]["kwargs"]["year_feature"] = "item_year"
    values["model"]["item_tower"] = {"features": ["item_genres", "item_year"]}
    train(TrainConfig.from_dict(values), tmp_path / "run")

    model, config = load_trained_model(tmp_path / "run")
    assert model.prefix_dnn.feature_names == ("item_id", "item_genres", "item_year")
    assert model.prefix_dnn.out.weight[:, -4:].abs().sum() > 0  # the year's columns learned
    data = SequenceDataModule(config.data, eviction_block=config.model.hstu.eviction_block)
    data.setup()
    columns = data.item_features.columns()
    assert set(np.asarray(columns["item_year"])[1:].tolist()) == {1, 2, 3}  # 0: the unknown id
    features = [f.name for f in model.item_tower.encoder.features]
    assert features == ["item_genres", "item_year"]
    no_genres = JaggedRows.from_lengths(np.zeros(3, dtype=np.int64), np.zeros(0, dtype=np.int64))
    encoded = model.item_tower.encoder.encode_columns({"item_genres": no_genres, "item_year": np.array([1, 2, 3])})
    assert torch.cdist(encoded, encoded)[np.triu_indices(3, 1)].min() > 0  # same genres, three years: three vectors
