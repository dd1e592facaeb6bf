"""``gr items add``: new items join an export without retraining. The new export extends the item
id map (known items keep their rows and their scores), stores the new items' features (a
categorical, a dense and a list-valued one), serves them by id alone (also after /admin/reload),
and leaves the old export as it was (an --out inside it is refused); a bad items file is refused naming
file, row and column. On a retrieval export new items never crowd trained ones out of a catalogue
search, and the command reports where they land as ``recommend`` ranks them."""

import copy
import csv
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gr import GRModel, HSTUConfig, TableConfig
from gr.commands.items import main as items_main
from gr.data.mappings import load_mappings
from gr.export import export_model
from gr.export.new_items import ItemsFileError, add_items
from gr.export.popularity import read_popularity
from gr.export.reader import check_export
from gr.export.writer import export_run
from gr.postfix_dnn import RetrievalHead
from gr.prefix_dnn import MLPTokenEncoder
from gr.serving import IdOptions, Ranker, RecommendRequest
from gr.serving.http import create_app
from gr.train.config import TrainConfig
from gr.train.run import train
from helpers.corrupt_parquet import write_corrupt_parquet
from helpers.models import HSTU_KW, NUM_ITEMS, build_generative_model, perturb
from helpers.runs import RANKING
from helpers.servers import AppServer, write_item_map

GENRES = ["drama", "comedy", "action"]
COLUMNS = {
    "item_features": ["brand", "genres"],
    "item_dense": {"price": "price"},
    "list_features": ["genres"],
}
TOKEN = "t0ken"


def _item(item: int) -> dict:
    return {"brand": f"b{item % 3}", "genres": "|".join(GENRES[: 1 + item % 3]), "price": float(item % 5)}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny ranking run on 30 items with a brand, genres and a price, exported."""
    root = tmp_path_factory.mktemp("items")
    rng = np.random.default_rng(0)
    with open(root / "events.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["user_id", "item_id", "timestamp", "brand", "genres", "price"])
        for u in range(24):
            for k in range(int(rng.integers(8, 14))):
                item = int(rng.integers(0, 30))
                writer.writerow([f"u{u}", item, 1000 + 60 * k, *_item(item).values()])
    values = copy.deepcopy(RANKING)
    values["data"].pop("synthetic")
    values["data"].update(source="csv", path=str(root / "events.csv"), columns=COLUMNS, user_features=False)
    values["model"]["tables"] = [
        values["model"]["tables"][0],
        {"name": "brand", "embedding_dim": 4, "features": ["brand"]},
        {"name": "genre", "embedding_dim": 4, "features": ["genres"], "kind": "token_bag", "pooling": "mean"},
    ]
    values["trainer"]["max_epochs"] = 1
    train(TrainConfig.from_dict(values), root / "run")
    return export_run(root / "run", root / "export")


def _items_csv(path: Path, items, **changes) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["item_id", "brand", "genres", "price"])
        for item in items:
            writer.writerow([item, *{**_item(item), **changes}.values()])
    return path


def _digest(directory: Path) -> str:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


HISTORY = {"item_id": [3, 7, 11], "timestamps": [1000, 1060, 1120]}


def test_new_items_are_served_by_id_with_their_features_and_known_items_score_as_before(export, tmp_path):
    before = _digest(export)
    summary = add_items(export, _items_csv(tmp_path / "new.csv", [100, 101, 102]), tmp_path / "grown")
    assert summary == {"items_added": 3, "items_replaced": 0, "unknown_values": 0}
    assert _digest(export) == before and check_export(tmp_path / "grown") == []
    old_map = load_mappings(str(export / "sparse/id_maps"))[0]["items"]
    new_map = load_mappings(str(tmp_path / "grown/sparse/id_maps"))[0]["items"]
    assert new_map.raw.tolist() == [*old_map.raw.tolist(), 100, 101, 102]  # extended, not renumbered
    old, grown = Ranker.load(export), Ranker.load(tmp_path / "grown")
    raw = IdOptions("raw")
    known = {"item_id": [5, 12]}
    np.testing.assert_array_equal(
        grown.rank("u", HISTORY, known, id_options=raw, use_cache=False).scores["watch"],
        old.rank("u", HISTORY, known, id_options=raw, use_cache=False).scores["watch"],
    )
    by_id = grown.rank("u", HISTORY, {"item_id": [100, 101, 102]}, id_options=raw, use_cache=False)
    written = {"item_id": [100, 101, 102], **{k: [] for k in ("brand", "genres", "price")}}
    for item in (100, 101, 102):
        values = _item(item)
        written["brand"].append(values["brand"])
        written["genres"].append(values["genres"].split("|"))
        written["price"].append([values["price"]])
    with_features = grown.rank("u", HISTORY, written, id_options=raw, use_cache=False)
    np.testing.assert_allclose(by_id.scores["watch"], with_features.scores["watch"], rtol=0, atol=1e-6)
    assert len(set(np.round(by_id.scores["watch"], 6))) == 3  # their features tell them apart


def test_replace_known_gives_a_known_item_new_features_and_keeps_its_row_and_popularity(export, tmp_path):
    changed = _items_csv(tmp_path / "changed.csv", [5, 150], brand="b2", genres="action|comedy", price=4.0)
    with pytest.raises(ItemsFileError, match="item 5 is already in the export"):
        add_items(export, changed, tmp_path / "refused")
    assert items_main([str(export), str(changed), "--out", str(tmp_path / "new"), "--replace-known"]) == 0
    old, new = Ranker.load(export), Ranker.load(tmp_path / "new")
    old_map = load_mappings(str(export / "sparse/id_maps"))[0]["items"]
    assert load_mappings(str(tmp_path / "new/sparse/id_maps"))[0]["items"].raw.tolist() == [*old_map.raw.tolist(), 150]
    raw = IdOptions("raw")
    features = {"brand": ["b2"], "genres": [["action", "comedy"]], "price": [[4.0]]}
    by_id = new.rank("u", HISTORY, {"item_id": [5]}, id_options=raw, use_cache=False).scores["watch"]
    sent = old.rank("u", HISTORY, {"item_id": [5], **features}, id_options=raw, use_cache=False).scores["watch"]
    before = old.rank("u", HISTORY, {"item_id": [5]}, id_options=raw, use_cache=False).scores["watch"]
    np.testing.assert_allclose(by_id, sent, rtol=0, atol=1e-6)  # the old row with the new features
    assert abs(float(by_id[0]) - float(before[0])) > 1e-6
    others = {"item_id": [3, 12, 29]}  # every other known item keeps its features and scores
    np.testing.assert_array_equal(
        new.rank("u", HISTORY, others, id_options=raw, use_cache=False).scores["watch"],
        old.rank("u", HISTORY, others, id_options=raw, use_cache=False).scores["watch"],
    )
    counts = read_popularity(export)
    assert read_popularity(tmp_path / "new").tolist() == [*counts.tolist(), 0] and counts.sum() > 0


def test_a_reload_serves_the_new_items(export, tmp_path):
    add_items(export, _items_csv(tmp_path / "new.csv", [200]), tmp_path / "grown")
    with AppServer(create_app(Ranker.load(export), admin_token=TOKEN)) as server:
        server.wait_ready()
        body = {"user_id": "u", "history": HISTORY, "candidates": {"item_id": [200]}, "ids": "raw"}
        assert server.call("POST", "/v1/rank", body)[0] == 400  # unknown before the reload
        auth = [("Authorization", f"Bearer {TOKEN}")]
        status, answer = server.call("POST", "/admin/reload", {"export_dir": str(tmp_path / "grown")}, headers=auth)
        assert status == 200, answer
        status, answer = server.call("POST", "/v1/rank", body)
        assert status == 200 and len(answer["scores"]["watch"]) == 1


def test_the_command_reads_parquet_lists_and_counts_values_the_vocabularies_lack(export, tmp_path):
    table = {"item_id": [300, 301], "brand": ["b1", "new-brand"], "genres": [["drama"], ["noir", "comedy"]]}
    pq.write_table(pa.table({**table, "price": [1.0, 2.0]}), tmp_path / "new.parquet")
    assert items_main([str(export), str(tmp_path / "new.parquet"), "--out", str(tmp_path / "grown")]) == 0
    assert check_export(tmp_path / "grown") == []
    assert add_items(export, tmp_path / "new.parquet", tmp_path / "again")["unknown_values"] == 2


@pytest.mark.parametrize("spelling", ["EXPORT/sub", "LINK/sub", "EXPORT/../EXPORT/sub"])
def test_an_out_inside_the_export_is_refused_and_the_export_stays_whole(export, tmp_path, capsys, spelling):
    (tmp_path / "link").symlink_to(export)
    out = {
        "EXPORT/sub": export / "sub",
        "LINK/sub": tmp_path / "link" / "sub",
        "EXPORT/../EXPORT/sub": export / ".." / export.name / "sub",
    }[spelling]
    before = _digest(export)
    assert items_main([str(export), str(_items_csv(tmp_path / "new.csv", [600])), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gr items add: error: --out {out}: is inside EXPORT {export}") and err.count("\n") == 1
    assert _digest(export) == before and check_export(export) == []
    assert not (export / "sub").exists() and not list(export.glob(".sub*"))


def test_overwrite_replaces_an_existing_out_and_is_what_the_refusal_suggests(export, tmp_path, capsys):
    items, out = _items_csv(tmp_path / "new.csv", [700]), tmp_path / "grown"
    out.mkdir()
    (out / "old.txt").write_text("replaced")
    assert items_main([str(export), str(items), "--out", str(out)]) == 2
    assert "already exists; pass overwrite=True (--overwrite) to replace it" in capsys.readouterr().err
    assert items_main([str(export), str(items), "--out", str(out), "--overwrite"]) == 0
    assert check_export(out) == [] and not (out / "old.txt").exists()


@pytest.mark.parametrize(
    "rows, message",
    [
        ([[400, "b1", "drama", "cheap"]], r"new\.csv: row 1: column 'price': expected a number, got 'cheap'"),
        ([[401, "b1", "drama", "inf"]], r"new\.csv: row 1: column 'price': expected a finite number"),
        (
            [[402, "b1", "drama", 1.0], [402, "b2", "", 2.0]],
            r"new\.csv: row 2: column 'item_id': item 402 repeats row 1",
        ),
        (
            [[5, "b1", "drama", 1.0]],
            r"new\.csv: row 1: column 'item_id': item 5 is already in the export \(--replace-known replaces",
        ),
        ([["x9", "b1", "drama", 1.0]], r"new\.csv: row 1: column 'item_id': expected an integer, got 'x9'"),
        (
            [[403, "b1", "drama", 1.0], [2**64, "b1", "drama", 1.0]],
            r"new\.csv: row 2: column 'item_id': id 18446744073709551616 does not fit int64",
        ),
        (
            [[404, "b1", "drama||comedy", 1.0]],
            r"new\.csv: row 1: column 'genres': an empty value in the list 'drama\|\|comedy' \(values are separated",
        ),
    ],
)
def test_a_bad_items_file_is_refused_naming_file_row_and_column(export, tmp_path, rows, message):
    with open(tmp_path / "new.csv", "w", newline="") as f:
        csv.writer(f).writerows([["item_id", "brand", "genres", "price"], *rows])
    with pytest.raises(ItemsFileError, match=message):
        add_items(export, tmp_path / "new.csv", tmp_path / "grown")
    assert not (tmp_path / "grown").exists()


def test_a_missing_feature_column_is_named(export, tmp_path):
    (tmp_path / "new.csv").write_text("item_id,brand\n500,b1\n")
    with pytest.raises(ItemsFileError, match=r"new\.csv: lacks column\(s\) \['genres', 'price'\]"):
        add_items(export, tmp_path / "new.csv", tmp_path / "grown")


def test_a_column_the_export_has_no_feature_for_is_refused(export, tmp_path):
    (tmp_path / "new.csv").write_text("item_id,brand,genres,price,colour\n500,b1,drama,1.0,red\n")
    with pytest.raises(ItemsFileError, match=r"new\.csv: unknown column\(s\) \['colour'\]; an items file of this"):
        add_items(export, tmp_path / "new.csv", tmp_path / "grown")


def test_a_parquet_list_holding_an_empty_value_is_refused_as_training_refuses_it(export, tmp_path):
    table = {"item_id": [600, 601], "brand": ["b1", "b2"], "genres": [["drama"], ["comedy", ""]], "price": [1.0, 2.0]}
    pq.write_table(pa.table(table), tmp_path / "new.parquet")
    with pytest.raises(ItemsFileError, match=r"new\.parquet: row 2: column 'genres': a null or empty value inside"):
        add_items(export, tmp_path / "new.parquet", tmp_path / "grown")


def test_a_corrupt_parquet_page_is_one_line_naming_the_items_file(export, tmp_path, capsys):
    items = np.arange(700, 2700)
    table = pa.table({"item_id": items, "brand": [f"b{i % 3}" for i in items], "genres": [["drama"]] * len(items)})
    path = write_corrupt_parquet(
        table.append_column("price", pa.array(items % 5, pa.float64())), tmp_path / "n.parquet"
    )
    assert items_main([str(export), str(path), "--out", str(tmp_path / "grown")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"gr items add: error: {path}: not a readable CSV or Parquet items file ("), line


def test_an_export_whose_model_reads_no_item_feature_is_refused(tmp_path):
    plain = export_model(
        build_generative_model(1, 0), tmp_path / "plain", id_mappings_dir=write_item_map(tmp_path / "maps", range(50))
    )
    (tmp_path / "new.csv").write_text("item_id\n900\n")
    with pytest.raises(ValueError, match=r"its model reads no item feature, so every new item would score alike"):
        add_items(plain, tmp_path / "new.csv", tmp_path / "grown")


@pytest.fixture(scope="module")
def retrieval_export(tmp_path_factory):
    """An untrained retrieval export over item ids and a genre, shaped as training leaves one: item
    rows share one direction (plus noise) and queries point along it, so the mean row scores highest."""
    root = tmp_path_factory.mktemp("retrieval")
    tables = [TableConfig("item", NUM_ITEMS, 16, ("item_id",)), TableConfig("genre", 6, 4, ("genre",))]
    prefix = MLPTokenEncoder({"item_id": 16, "genre": 4}, 16, mlp_dims=(24,))
    model = perturb(GRModel(HSTUConfig(**HSTU_KW), prefix, RetrievalHead(16, 16, mlp_dims=(20,)), tables), seed=5)
    generator = torch.Generator().manual_seed(0)
    direction = torch.nn.functional.normalize(torch.randn(16, generator=generator), dim=0)
    state = model.state_dict()
    with torch.no_grad():
        state["embeddings.sequence.dim16.embeddings.item.weight"].copy_(
            direction + 0.3 * torch.randn(NUM_ITEMS, 16, generator=generator)
        )
        state["postfix_dnn.mlp.2.weight"].mul_(0.01)
        state["postfix_dnn.mlp.2.bias"].copy_(10 * direction)
    genres = np.random.default_rng(0).integers(1, 6, NUM_ITEMS)
    maps = write_item_map(root / "maps", range(NUM_ITEMS))
    return export_model(model, root / "export", id_mappings_dir=maps, item_features={"genre": genres})


def _one_item_histories(items):
    return [RecommendRequest(f"item{i}", {"item_id": [i], "timestamps": [0]}, k=10) for i in items]


def test_new_items_on_a_retrieval_export_rank_below_trained_items_the_query_matches(retrieval_export, tmp_path):
    (tmp_path / "new.csv").write_text("item_id,genre\n" + "".join(f"{1000 + i},{1 + i % 5}\n" for i in range(20)))
    summary = add_items(retrieval_export, tmp_path / "new.csv", tmp_path / "grown")
    assert summary["items_added"] == 20 and summary["trained_items"] == NUM_ITEMS
    results = Ranker.load(tmp_path / "grown").recommend(_one_item_histories(range(NUM_ITEMS)))
    top = np.array([result.items for result in results])  # [users, 10] model ids, new ones from NUM_ITEMS
    assert top.shape == (NUM_ITEMS, 10) and (top >= NUM_ITEMS).mean() < 0.1
    assert all(np.isfinite(result.scores).all() for result in results)


def test_the_command_reports_where_new_items_land_as_recommend_ranks_them(retrieval_export, tmp_path, capsys):
    (tmp_path / "new.csv").write_text("item_id,genre\n1000,1\n1001,2\n")
    assert items_main([str(retrieval_export), str(tmp_path / "new.csv"), "--out", str(tmp_path / "grown")]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)["placement"]
    assert "trained_items" not in json.loads(out) and err == ""
    results = Ranker.load(tmp_path / "grown").recommend(_one_item_histories(range(NUM_ITEMS)))
    ranks = [1 + min(np.flatnonzero(np.asarray(r.items) >= NUM_ITEMS), default=np.inf) for r in results]
    reached = [int(rank) for rank in ranks if np.isfinite(rank)]
    new = sum(int((np.asarray(r.items) >= NUM_ITEMS).sum()) for r in results)
    assert report == {
        "histories": NUM_ITEMS,
        "histories_with_new": len(reached),
        "best_new_rank": min(reached, default=None),
        "new_share": round(new / (10 * NUM_ITEMS), 4),
        "catalogue_share": round(2 / (NUM_ITEMS + 2), 4),
    }


@pytest.mark.parametrize(
    ("new_share", "catalogue_share", "warned"), [(0.5, 0.05, True), (0.5, 0.4, False), (0.08, 0.0, False)]
)
def test_the_command_warns_of_new_items_flooding_the_top_10_not_of_their_share(
    retrieval_export, tmp_path, capsys, monkeypatch, new_share, catalogue_share, warned
):
    """A warning when new items take over 10% of the slots and over twice their share of the catalogue."""
    import gr.commands.items as items

    report = {"histories": 100, "histories_with_new": 50, "best_new_rank": 1}
    monkeypatch.setattr(
        items, "placement", lambda *_: {**report, "new_share": new_share, "catalogue_share": catalogue_share}
    )
    (tmp_path / "new.csv").write_text("item_id,genre\n1000,1\n")
    assert items_main([str(retrieval_export), str(tmp_path / "new.csv"), "--out", str(tmp_path / "grown")]) == 0
    err = capsys.readouterr().err
    assert ("warning: new items take 50% of the top-10 slots" in err) == warned and (err == "") == (not warned)


def test_a_value_that_is_not_an_integer_for_an_integer_feature_names_its_row(retrieval_export, tmp_path):
    (tmp_path / "new.csv").write_text("item_id,genre\n1000,1\n1001,drama\n")
    with pytest.raises(ItemsFileError, match=r"new\.csv: row 2: column 'genre': expected an integer, got 'drama'$"):
        add_items(retrieval_export, tmp_path / "new.csv", tmp_path / "grown")
    assert not (tmp_path / "grown").exists()
