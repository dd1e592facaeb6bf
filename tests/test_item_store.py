"""The export's item feature store: ``export_model(item_features=...)`` writes each item's features
under the MANIFEST, serving fills them for items given by id alone (history, candidates, and the
catalogue's items for recommend and generate), a request's own values override them, an item the
store lacks has the unknown row, and a damaged store is refused by ``gr check`` and every loader."""

import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from gr import GRModel, HSTUConfig, TableConfig
from gr.commands.export import main as export_main
from gr.export import ExportFormatError, check_export, export_model
from gr.export.format import ExportError
from gr.export.item_store import ITEM_STORE
from gr.export.manifest import write_manifest
from gr.postfix_dnn import RetrievalHead
from gr.prefix_dnn import MLPTokenEncoder
from gr.serving import Ranker, RecommendRequest
from helpers.models import HSTU_KW, NUM_ITEMS, perturb

STORED = 40  # items 0..39 have features; 40..49 are not in the store
HISTORY = {"item_id": [3, 17, 42, 8], "timestamps": [10, 20, 30, 40]}
CANDIDATES = {"item_id": [5, 44, 21, 9]}


def build_model() -> GRModel:
    """Retrieval over tokens of an item id, a categorical item feature (genre) and a dense one (price)."""
    tables = [TableConfig("item", NUM_ITEMS, 16, ("item_id",)), TableConfig("genre", 6, 4, ("genre",))]
    prefix = MLPTokenEncoder({"item_id": 16, "genre": 4, "price": 3}, 16, mlp_dims=(24,))
    return perturb(GRModel(HSTUConfig(**HSTU_KW), prefix, RetrievalHead(16, 16, mlp_dims=(20,)), tables), seed=5)


def item_features():
    rng = np.random.default_rng(0)
    return {"genre": rng.integers(1, 6, STORED), "price": rng.normal(size=(STORED, 3)).astype(np.float32)}


@pytest.fixture(scope="module")
def store_export(tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "export"
    return export_model(build_model(), path, dense_dims={"price": 3}, item_features=item_features())


def with_features(columns):
    """``columns`` with each item's genre and price written out, the unknown row past the store."""
    features = item_features()
    items = np.asarray(columns["item_id"])
    known = items < STORED
    genre = np.where(known, features["genre"][np.minimum(items, STORED - 1)], 0)
    price = np.where(known[:, None], features["price"][np.minimum(items, STORED - 1)], 0.0)
    return {**columns, "genre": genre.tolist(), "price": price.tolist()}


def test_items_given_by_id_alone_score_as_with_their_features_written_out(store_export):
    assert check_export(store_export) == []
    assert ITEM_STORE in (store_export / "MANIFEST").read_text()
    stored = load_file(str(store_export / ITEM_STORE))
    assert stored["item_id"].tolist() == list(range(STORED)) and stored["price"].shape == (STORED, 3)
    ranker = Ranker.load(store_export)
    by_id = ranker.rank("a", HISTORY, CANDIDATES, use_cache=False)
    written = ranker.rank("a", with_features(HISTORY), with_features(CANDIDATES), use_cache=False)
    np.testing.assert_allclose(by_id.scores["retrieval"], written.scores["retrieval"], rtol=0, atol=1e-6)
    # a request's own values override the store, column by column (a retrieval score reads the history)
    own = {**HISTORY, "price": [[9.0, -9.0, 1.0]] * 4}
    overridden = ranker.rank("a", own, CANDIDATES, use_cache=False)
    want = ranker.rank("a", {**with_features(HISTORY), "price": own["price"]}, with_features(CANDIDATES))
    np.testing.assert_allclose(overridden.scores["retrieval"], want.scores["retrieval"], rtol=0, atol=1e-6)
    assert not np.allclose(overridden.scores["retrieval"], by_id.scores["retrieval"])


def test_recommend_and_generate_work_on_a_model_that_reads_item_features(store_export):
    ranker = Ranker.load(store_export)
    top = ranker.recommend(RecommendRequest("b", HISTORY, 3))
    assert len(top.items) == 3 and not set(top.items) & set(HISTORY["item_id"])
    same = Ranker.load(store_export).recommend(RecommendRequest("b", with_features(HISTORY), 3))
    assert same.items == top.items
    generated = ranker.generate("b", HISTORY, 4, request_time=50)
    assert generated.items[0] == ranker.recommend(RecommendRequest("c", HISTORY, 1, request_time=50)).items[0]
    assert len(set(generated.items)) == 4 and not set(generated.items) & set(HISTORY["item_id"])
    # the generated item as a token is the catalogue's item with its stored features: generating
    # one more item from history + the first equals ranking after that history with features written out
    longer = {"item_id": [*HISTORY["item_id"], generated.items[0]], "timestamps": [*HISTORY["timestamps"], 50]}
    second = ranker.recommend(RecommendRequest("d", with_features(longer), 1, request_time=50))
    assert generated.items[1] == second.items[0]


def test_export_model_refuses_item_features_the_model_cannot_read(tmp_path):
    model = build_model()
    for bad, message in (
        ({"colour": np.ones(4, dtype=np.int64)}, "not an item feature the prefix_dnn reads"),
        ({"item_id": np.ones(4, dtype=np.int64)}, "not an item feature"),
        ({"price": np.ones((4, 2), dtype=np.float32)}, r"expected floats \[n, 3\]"),
        ({"genre": np.ones(NUM_ITEMS + 1, dtype=np.int64)}, r"n <= 50"),
    ):
        with pytest.raises(ExportError, match=message):
            export_model(model, tmp_path / "e", dense_dims={"price": 3}, item_features=bad)


def damaged(store_export, tmp_path, change):
    """A copy of the export whose store ``change`` edits; the MANIFEST re-signed."""
    export = tmp_path / "export"
    shutil.copytree(store_export, export)
    tensors, metadata = load_file(str(export / ITEM_STORE)), {"format_version": "1", "item_feature": "item_id"}
    change(tensors, metadata)
    save_file(tensors, str(export / ITEM_STORE), metadata=metadata)
    write_manifest(export)
    return export


def test_an_edited_store_is_a_manifest_error_for_the_checker_and_every_loader(store_export, tmp_path):
    export = tmp_path / "export"
    shutil.copytree(store_export, export)
    tensors = load_file(str(export / ITEM_STORE))
    tensors["price"][0] += 1.0  # would change scores silently
    save_file(tensors, str(export / ITEM_STORE), metadata={"format_version": "1", "item_feature": "item_id"})
    assert [(p.file, p.message) for p in check_export(export)] == [
        (ITEM_STORE, "sha256 differs from MANIFEST: the file was changed after export")
    ]
    with pytest.raises(ExportFormatError, match="item_features.safetensors"):
        Ranker.load(export)


def _set(name, value):
    def change(tensors, metadata):
        tensors[name] = value

    return change


@pytest.mark.parametrize(
    "change, key, message",
    [
        (_set("genre", np.full(STORED, 6, dtype=np.int64)), "genre", r"ids out of range \[0, 6\)"),
        (_set("price", np.full((STORED, 3), np.nan, dtype=np.float32)), "price", "NaN"),
        (_set("price", np.zeros((STORED, 2), dtype=np.float32)), "price", r"expected float32 \[40, 3\]"),
        (_set("colour", np.zeros(STORED, dtype=np.int64)), "colour", "not a token feature"),
        (_set("item_id", np.arange(STORED)[::-1].copy()), "item_id", "strictly increasing"),
        (_set("item_id", np.arange(STORED) + NUM_ITEMS - STORED + 1), "item_id", r"model ids in \[0, 50\)"),
        (lambda t, m: m.update(format_version="7"), "format_version", "unknown format version '7'"),
    ],
)
def test_a_damaged_store_is_refused_naming_the_tensor(store_export, tmp_path, change, key, message):
    export = damaged(store_export, tmp_path, change)
    problems = check_export(export)
    assert [(p.file, p.key) for p in problems] == [(ITEM_STORE, key)] and re.search(message, problems[0].message)
    with pytest.raises(ExportFormatError, match=message):
        Ranker.load(export)


def test_an_item_id_past_the_table_is_a_named_error_for_check_and_reload(store_export, tmp_path, capsys):
    export = damaged(store_export, tmp_path, _set("item_id", np.arange(STORED) + NUM_ITEMS - STORED + 1))
    assert export_main(["check", str(export)]) == 1
    out = capsys.readouterr().out
    assert f"ERROR {ITEM_STORE} [item_id]: expected strictly increasing model ids in [0, 50)" in out
    ranker = Ranker.load(store_export)
    with pytest.raises(ExportFormatError, match=rf"{re.escape(ITEM_STORE)} \[item_id\]: expected strictly increasing"):
        ranker.reload(export)
    assert len(ranker.rank("a", HISTORY, CANDIDATES, use_cache=False).scores["retrieval"]) == 4  # the old model serves
