"""List-valued categorical features (``data.columns.list_features``, MovieLens ``data.genres: list``):
read from CSV cells and Parquet lists with errors naming file, line/row and column, pooled per token
by ``token_bag`` tables (or per request by common tables) alike on both sparse backends, exported
with the item store holding each item's list, and served and predicted from ids alone."""

import copy
import csv
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gr.commands.evaluate import evaluate_export, evaluate_run
from gr.commands.predict import predict
from gr.data.config import ColumnConfig, DataConfig
from gr.data.datamodule import SequenceDataModule
from gr.data.interactions import DataFormatError
from gr.data.readers import read_ml_100k, read_table_csv, read_table_parquet
from gr.export.item_store import ITEM_STORE
from gr.export.reader import check_export, open_export
from gr.export.writer import export_run
from gr.serving import Ranker
from gr.serving.request import IdOptions
from gr.sparse.keyed_jagged import KeyedJaggedTensor
from gr.sparse.tables import SparseEmbeddings, TableConfig
from gr.train.config import TrainConfig
from gr.train.run import train
from helpers.runs import RANKING

GENRES = ("Action", "Comedy", "Drama", "Horror", "Sci-Fi")
TAGS = ("a", "b", "c", "d")
MOODS = ("calm", "tense")
COLUMNS = {
    "item_features": ["genres"],
    "user_features": ["tags", "country"],
    "token_features": ["moods"],
    "list_features": ["genres", "tags", "moods"],
}


def _item_genres(item: int) -> str:
    """Items 0..29: 0 to 2 genres each (item % 3 of them); every third item has none."""
    return "|".join(GENRES[(item + k) % len(GENRES)] for k in range(item % 3))


def _events(path: Path, users: int = 24) -> Path:
    rng = np.random.default_rng(0)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["user_id", "item_id", "timestamp", "genres", "tags", "country", "moods"])
        for u in range(users):
            tags = "|".join(TAGS[: 1 + u % len(TAGS)])
            for k in range(int(rng.integers(8, 14))):
                item = int(rng.integers(0, 30))
                moods = "|".join(MOODS[: int(rng.integers(0, 3))])
                writer.writerow([f"u{u}", item, 1000 + 60 * k, _item_genres(item), tags, ["fr", "de"][u % 2], moods])
    return path


# ---- reading ---------------------------------------------------------------------------------


def test_csv_list_cells_split_on_the_separator_and_an_empty_cell_is_an_empty_list(tmp_path):
    path = tmp_path / "e.csv"
    path.write_text("user_id,item_id,ts,genres\nu1,1,10,Action;Comedy\nu1,2,20,\nu2,1,30,Drama\n")
    columns = ColumnConfig(timestamp="ts", item_features=("genres",), list_features=("genres",), list_separator=";")
    side = read_table_csv(str(path), columns).item_side
    assert side.keys.tolist() == [1, 2]
    genres = side.lists["genres"]
    assert [genres.values[a:b].tolist() for a, b in zip(genres.offsets[:-1], genres.offsets[1:])] == [["Drama"], []]
    assert "genres" not in side.categorical


@pytest.mark.parametrize("cell", ["Action||Comedy", "Action|", "|Action"])
def test_an_empty_value_inside_a_csv_list_names_file_line_and_column(tmp_path, cell):
    path = tmp_path / "e.csv"
    path.write_text(f"user_id,item_id,ts,genres\nu1,1,10,Action\nu1,2,20,{cell}\n")
    columns = ColumnConfig(timestamp="ts", item_features=("genres",), list_features=("genres",))
    with pytest.raises(DataFormatError, match=rf"e\.csv:3: column 'genres': an empty value in the list '{cell}'"):
        read_table_csv(str(path), columns)


def test_parquet_list_columns_read_strings_and_integers_exactly(tmp_path):
    path = tmp_path / "e.parquet"
    big = 2**62 + 1  # past float64's exact integers
    table = {
        "user_id": ["u1", "u1", "u2"],
        "item_id": [1, 2, 3],
        "ts": [10, 20, 30],
        "genres": pa.array([["Action", "Comedy"], [], ["Drama"]], pa.list_(pa.string())),
        "codes": pa.array([[big, 7], [big, 7], [3]], pa.list_(pa.int64())),
    }
    pq.write_table(pa.table(table), path)
    columns = ColumnConfig(
        timestamp="ts", item_features=("genres",), user_features=("codes",), list_features=("genres", "codes")
    )
    data = read_table_parquet(str(path), columns)
    assert data.item_side.lists["genres"].lengths().tolist() == [2, 0, 1]
    assert data.user_side.lists["codes"].values.tolist() == [str(big), "7", "3"]


@pytest.mark.parametrize(
    "column, declared, message",
    [
        (
            pa.array([["Action"], ["Drama"]]),
            (),
            "column 'genres' holds lists .*declare it in data.columns.list_features",
        ),
        (pa.array(["Action", "Drama"]), ("genres",), "column 'genres': a list feature .* got type string"),
        (pa.array([[1.5], [2.0]]), ("genres",), "column 'genres': a list feature .* got type list<.*double>"),
        (pa.array([["Action"], ["Drama", None]]), ("genres",), "row 2: column 'genres': a null or empty value"),
        (pa.array([["Action"], None]), ("genres",), "row 2: column 'genres' is null"),
    ],
)
def test_parquet_list_type_mismatches_name_file_and_column(tmp_path, column, declared, message):
    path = tmp_path / "e.parquet"
    pq.write_table(pa.table({"user_id": ["u1", "u2"], "item_id": [1, 2], "ts": [1, 2], "genres": column}), path)
    columns = ColumnConfig(timestamp="ts", item_features=("genres",), list_features=declared)
    with pytest.raises(DataFormatError, match=rf"e\.parquet: {message}"):
        read_table_parquet(str(path), columns)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"list_features": ["genres"]}, r"data.columns.list_features: \['genres'\] must name distinct declared"),
        ({"item_features": ["genres"], "list_features": ["genres"], "list_separator": ","}, "is the delimiter"),
    ],
)
def test_list_features_are_checked_before_any_file_is_read(values, message):
    with pytest.raises(ValueError, match=message):
        DataConfig.from_dict({"source": "csv", "path": "missing.csv", "columns": values})


def test_movielens_genres_can_be_a_list_valued_item_feature(tmp_path):
    (tmp_path / "u.data").write_text("1\t1\t5\t100\n1\t2\t3\t200\n")
    flags = "|".join(["0"] * 19)
    action_comedy = "|".join("1" if i in (1, 5) else "0" for i in range(19))
    (tmp_path / "u.item").write_text(f"1|A|||url|{action_comedy}\n2|B|||url|{flags}\n", encoding="latin-1")
    names = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", *(f"g{i}" for i in range(6, 19))]
    (tmp_path / "u.genre").write_text("".join(f"{n}|{i}\n" for i, n in enumerate(names)))
    multi_hot = read_ml_100k(str(tmp_path), user_features=False).item_side
    lists = read_ml_100k(str(tmp_path), user_features=False, genres="list").item_side
    assert multi_hot.dense["item_genres"].shape == (2, 19) and not multi_hot.lists
    assert lists.lists["item_genres"].values.tolist() == ["Action", "Comedy"]
    assert lists.lists["item_genres"].lengths().tolist() == [2, 0] and not lists.dense


# ---- pooling -----------------------------------------------------------------------------------


def _bag_tables(pooling: str):
    return [
        TableConfig("item", 10, 8, ("item_id",)),
        TableConfig("genre", 6, 6, ("genres",), kind="token_bag", pooling=pooling),
        TableConfig("tag", 5, 4, ("tags",), kind="common", pooling=pooling),
    ]


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("backend", ["torch", "torchrec"])
def test_token_bags_pool_to_the_sum_or_mean_of_their_rows(backend, pooling):
    torch.manual_seed(0)
    tables = SparseEmbeddings(_bag_tables(pooling), backend=backend)
    bags = [[1, 2, 3], [], [5], [2, 2]]  # one bag per token; an empty one pools to zeros
    lengths = torch.tensor([len(b) for b in bags])
    token_lists = KeyedJaggedTensor(["genres"], torch.tensor([i for b in bags for i in b]), lengths)
    items = KeyedJaggedTensor(["item_id"], torch.tensor([1, 2, 3, 4]), torch.tensor([4]))
    tags = KeyedJaggedTensor(["tags"], torch.tensor([1, 3, 4]), torch.tensor([3]))
    token, common = tables(items, tags, token_lists)
    weight = tables.table_weight("genre").detach()
    reduce = torch.sum if pooling == "sum" else torch.mean
    expected = torch.stack([reduce(weight[b], 0) if b else torch.zeros(6) for b in bags])
    torch.testing.assert_close(token["genres"], expected, rtol=0, atol=1e-6)
    assert token["item_id"].shape == (4, 8)
    tag_rows = tables.table_weight("tag").detach()[[1, 3, 4]]
    torch.testing.assert_close(common["tags"], reduce(tag_rows, 0, keepdim=True), rtol=0, atol=1e-6)


def test_both_backends_lay_token_bag_tables_out_alike():
    states = []
    for backend in ("torch", "torchrec"):
        torch.manual_seed(0)
        states.append(SparseEmbeddings(_bag_tables("mean"), backend=backend).state_dict())
    assert list(states[0]) == list(states[1])
    assert "token_bags.embedding_bags.genre.weight" in states[0]
    for name in states[0]:
        torch.testing.assert_close(states[0][name], states[1][name], rtol=0, atol=0)


def test_without_list_features_batches_carry_no_token_lists(tmp_path):
    columns = {"user_features": ["country"]}
    data = SequenceDataModule(_data_config(tmp_path, columns))
    data.setup()
    batch = next(iter(data.train_dataloader()))
    assert batch.token_lists is None
    assert batch.common_ids.lengths().eq(1).all()  # one id per user, as before lists existed


# ---- end to end ------------------------------------------------------------------------------


def _data_config(root: Path, columns: dict) -> dict:
    values = copy.deepcopy(RANKING["data"])
    values.pop("synthetic")
    values.update(source="csv", path=str(_events(root / "events.csv")), columns=columns)
    return values


@pytest.fixture(scope="module")
def list_run(tmp_path_factory):
    """A tiny ranking model on the CSV: genres (item list, mean), moods (row list, sum), tags (user
    list, mean), trained 1 epoch and exported."""
    root = tmp_path_factory.mktemp("lists")
    values = copy.deepcopy(RANKING)
    values["data"] = _data_config(root, COLUMNS)
    values["model"]["tables"] = [
        values["model"]["tables"][0],
        {"name": "genre", "embedding_dim": 4, "features": ["genres"], "kind": "token_bag", "pooling": "mean"},
        {"name": "mood", "embedding_dim": 4, "features": ["moods"], "kind": "token_bag"},
        {"name": "tag", "embedding_dim": 4, "features": ["tags"], "kind": "common", "pooling": "mean"},
        {"name": "country", "embedding_dim": 4, "features": ["country"], "kind": "common"},
    ]
    values["trainer"]["max_epochs"] = 1
    train(TrainConfig.from_dict(values), root / "run")
    export_run(root / "run", root / "export")
    return root / "run", root / "export"


def test_list_features_are_token_bags_in_the_export(list_run):
    _, export = list_run
    assert check_export(export) == []
    manifest = open_export(export)
    request = {t.name: t for t in manifest.graph.request}
    assert (request["genres"].shape, request["genres"].candidates) == (("tokens", "bag"), None)
    assert (request["moods"].shape, request["moods"].candidates) == (("tokens", "bag"), "optional")
    assert request["tags"].shape == ("bag",)
    kinds = {name: (f.kind, f.pooling) for name, f in manifest.sparse.features.items()}
    assert kinds["genres"] == ("token_bag", "mean") and kinds["moods"] == ("token_bag", "sum")
    assert kinds["tags"] == ("common", "mean")


def test_the_item_store_holds_each_item_s_list(list_run):
    _, export = list_run
    ranker = Ranker.load(export)
    store, maps = ranker.model.sparse.items, ranker.model.id_maps.maps
    assert sorted(store.features) == ["genres"]
    for item in (1, 2, 3):  # 0, 1 and 2 genres
        model_id = maps["item_id"].encode(np.asarray([item]))
        stored = store.lookup("genres", model_id)
        assert sorted(maps["genres"].decode(stored.values).tolist()) == sorted(
            filter(None, _item_genres(item).split("|"))
        )
    assert (export / ITEM_STORE).is_file()


def _request(**changes) -> dict:
    items, candidates = [3, 7, 11], [5, 13]
    history = {
        "item_id": items,
        "timestamps": [1000, 1060, 1120],
        "genres": [_item_genres(i).split("|") if i % 3 else [] for i in items],
        "moods": [["calm"], [], ["calm", "tense"]],
    }
    request = {
        "history": history,
        "candidates": {"item_id": candidates, "genres": [_item_genres(i).split("|") for i in candidates]},
        "common_features": {"tags": ["a", "b"], "country": "fr"},
    }
    request.update(changes)
    return request


def test_ids_only_requests_take_lists_from_the_item_store(list_run):
    ranker = Ranker.load(list_run[1])
    full = _request()
    by_id = _request(
        history={k: v for k, v in full["history"].items() if k != "genres"},
        candidates={"item_id": full["candidates"]["item_id"]},
    )
    raw = IdOptions("raw")
    written, stored = (ranker.rank("u", **r, id_options=raw, use_cache=False) for r in (full, by_id))
    np.testing.assert_allclose(stored.scores["watch"], written.scores["watch"], rtol=0, atol=1e-6)
    other = ranker.rank("u", **_request(common_features={"tags": ["d"], "country": "fr"}), id_options=raw)
    assert not np.allclose(other.scores["watch_logit"], written.scores["watch_logit"])  # the user's list counts


def test_an_unknown_value_in_a_served_list_names_the_feature(list_run):
    ranker = Ranker.load(list_run[1])
    bad = _request()
    bad["history"]["genres"] = [["Action"], ["Western"], []]
    with pytest.raises(Exception, match=r"history\.genres.*Western"):
        ranker.rank("u", **bad, id_options=IdOptions("raw"))


def test_the_run_and_its_export_evaluate_alike(list_run):
    run, export = list_run
    trained, served = evaluate_run(run), evaluate_export(export, run / "config.yaml")
    assert served["auc"] == pytest.approx(trained["auc"], abs=1e-6)
    assert served["logloss"] == pytest.approx(trained["logloss"], abs=1e-6)


def test_predict_reads_stored_item_features_for_an_ids_only_parquet(list_run, tmp_path):
    _, export = list_run
    full = _request()
    users = {
        "user_id": ["u1"],
        "history.item_id": [full["history"]["item_id"]],
        "history.timestamps": [full["history"]["timestamps"]],
        "history.moods": pa.array([full["history"]["moods"]], pa.list_(pa.list_(pa.string()))),
        "candidates.item_id": [full["candidates"]["item_id"]],
        "common_features.tags": [full["common_features"]["tags"]],
        "common_features.country": ["fr"],
    }
    pq.write_table(pa.table(users), tmp_path / "users.parquet")
    predict(export, tmp_path / "users.parquet", tmp_path / "scores.parquet", progress=False)
    scores = pq.read_table(tmp_path / "scores.parquet").column("scores.watch").to_pylist()[0]
    expected = Ranker.load(export).rank("u1", **full, id_options=IdOptions("raw")).scores["watch"]
    np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-6)


def test_predict_names_required_and_optional_columns_apart(list_run, tmp_path):
    _, export = list_run
    users = {"user_id": ["u1"], "history.item_id": [[3]], "history.timestamps": [[1000]], "candidates.item_id": [[5]]}
    pq.write_table(pa.table(users), tmp_path / "users.parquet")
    with pytest.raises(ValueError) as error:
        predict(export, tmp_path / "users.parquet", tmp_path / "scores.parquet", progress=False)
    message = str(error.value)
    assert "missing column(s) ['history.moods']" in message  # the user features have an unknown id: optional
    required, optional = message.split("the export requires ")[1].split(" and reads the optional ")
    assert "'history.genres'" in optional and "'candidates.genres'" in optional and "'request_time'" in optional
    assert "'common_features.country'" in optional and "'common_features.tags'" in optional
    assert "'history.genres'" not in required and "'history.moods'" in required
