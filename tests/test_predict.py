"""``gr predict EXPORT --input users.parquet --output scores.parquet``: each row's scores equal
``Ranker.rank``'s for that user alone, top-k rows equal ``Ranker.recommend``, struct columns read
as dotted ones, and bad input is one error naming the file, row and column, with no output."""

import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gr.commands.cli import main as gr_main
from gr.commands.predict import predict, predict_events
from gr.data.config import ColumnConfig, DataConfig
from gr.data.interactions import DataFormatError
from gr.data.mappings import IdMap, save_mappings
from gr.data.prepared.duckdb_append import append_with_duckdb
from gr.data.prepared.duckdb_engine import prepare_with_duckdb
from gr.data.readers import read_table_parquet
from gr.export import export_model
from gr.serving import IdOptions, Ranker, RecommendRequest
from gr.serving.history_store import SqliteHistoryStore
from gr.serving.request import EventsRequest
from gr.train.config import read_yaml
from helpers.corrupt_parquet import write_corrupt_parquet
from helpers.instants import SECONDS, TEXTS, timestamps
from helpers.models import (
    DENSE_DIMS,
    build_ranking_model,
    build_retrieval_model,
    random_batch,
    requests_from_batch,
)

ATOL = 1e-5
RAW = IdOptions("raw")
RAW_ITEMS = np.array([f"m{i:02d}" for i in range(50)])  # the retrieval export's raw item ids (strings)


@pytest.fixture(scope="module")
def ranking(tmp_path_factory):
    """A two-task ranking export (sequence ids, a dense token feature, pooled and dense common
    features) and five users' requests (model ids)."""
    model = build_ranking_model()
    path = export_model(model, tmp_path_factory.mktemp("predict") / "export", dense_dims=DENSE_DIMS)
    return path, requests_from_batch(random_batch(model, [30, 17, 8, 22, 12], [5, 9, 1, 3, 4], seed=3))


@pytest.fixture(scope="module")
def retrieval(tmp_path_factory):
    """A retrieval export whose item ids are raw strings (through its id map), and four users'
    requests in raw ids."""
    root = tmp_path_factory.mktemp("predict")
    model = build_retrieval_model()
    save_mappings(str(root / "maps"), {"items": IdMap.of(RAW_ITEMS)}, {})
    path = export_model(model, root / "export", id_mappings_dir=root / "maps")
    requests = requests_from_batch(random_batch(model, [12, 7, 20, 9], [3, 2, 4, 1], seed=5))
    for r in requests:
        for part in ("history", "candidates"):
            r[part]["item_id"] = RAW_ITEMS[r[part]["item_id"]]
    return path, requests


def as_table(requests: List[Dict[str, Any]], parts=("history", "candidates", "common_features")) -> pa.Table:
    """One row per request, nested keys joined by '.' (``gr.commands.predict``'s input layout)."""
    columns: Dict[str, list] = {"user_id": [r["user_id"] for r in requests]}
    for part in parts:
        for name in requests[0][part]:
            columns[f"{part}.{name}"] = [np.asarray(r[part][name]).tolist() for r in requests]
    return pa.table(columns)


def write(table: pa.Table, path: Path) -> Path:
    pq.write_table(table, path)
    return path


def test_scores_equal_ranking_each_user_alone_across_batches(ranking, tmp_path):
    path, requests = ranking
    users = write(as_table(requests), tmp_path / "users.parquet")
    summary = predict(path, users, tmp_path / "scores.parquet", batch_size=2, micro_batch=4, ids="model")
    assert summary["rows"] == 5 and summary["mode"] == "rank"
    out = pq.read_table(tmp_path / "scores.parquet")
    assert out.column_names == [
        "user_id",
        *(f"candidates.{f}" for f in ("item_id", "genre", "age", "timestamps")),
        *(f"scores.{s}" for s in ("click", "click_logit", "like", "like_logit")),
        "history_length",
        "truncated",
        "left_out",
        "fallback",
    ]
    alone = Ranker.load(path)
    for row, r in zip(out.to_pylist(), requests):
        want = alone.rank(r["user_id"], r["history"], r["candidates"], r["common_features"])
        assert row["user_id"] == r["user_id"] and row["history_length"] == len(r["history"]["timestamps"])
        assert row["candidates.item_id"] == r["candidates"]["item_id"].tolist()
        for name, value in want.scores.items():
            np.testing.assert_allclose(row[f"scores.{name}"], value, rtol=0, atol=ATOL)


def test_top_k_equals_recommend_and_candidates_equal_rank_in_raw_ids(retrieval, tmp_path):
    path, requests = retrieval
    alone = Ranker.load(path)
    top = write(as_table(requests, ("history",)), tmp_path / "users.parquet")
    assert predict(path, top, tmp_path / "top.parquet", k=7, batch_size=3)["mode"] == "top-7"
    for row, r in zip(pq.read_table(tmp_path / "top.parquet").to_pylist(), requests):
        want = alone.recommend(RecommendRequest(r["user_id"], r["history"], 7, id_options=RAW))
        assert row["items"] == want.items and all(i.startswith("m") for i in row["items"])
        np.testing.assert_allclose(row["scores"], want.scores, rtol=0, atol=ATOL)

    first = requests[0]["history"]  # an item the export has no row for, second in the history: left out under oov
    mixed = {"item_id": [first["item_id"][0], "m-new", *first["item_id"][1:]]}
    mixed["timestamps"] = [first["timestamps"][0], first["timestamps"][0], *first["timestamps"][1:]]
    users = pa.table({"user_id": [requests[0]["user_id"]], **{f"history.{k}": [list(v)] for k, v in mixed.items()}})
    predict(path, write(users, tmp_path / "mixed.parquet"), tmp_path / "left.parquet", k=7, unknown_ids="oov")
    [row] = pq.read_table(tmp_path / "left.parquet").to_pylist()
    want = alone.recommend(RecommendRequest(requests[0]["user_id"], first, 7, id_options=RAW))
    assert row["left_out"] == 1 and row["items"] == want.items and row["history_length"] == len(first["timestamps"])

    ranked = write(as_table(requests, ("history", "candidates")), tmp_path / "ranked.parquet")
    predict(path, ranked, tmp_path / "scores.parquet")
    for row, r in zip(pq.read_table(tmp_path / "scores.parquet").to_pylist(), requests):
        want = alone.rank(r["user_id"], r["history"], r["candidates"], id_options=RAW)
        np.testing.assert_allclose(row["scores.retrieval"], want.scores["retrieval"], rtol=0, atol=ATOL)


def test_struct_columns_read_as_dotted_columns(retrieval, tmp_path):
    path, requests = retrieval
    dotted = as_table(requests, ("history",))
    history = pa.StructArray.from_arrays(
        [dotted.column("history.item_id").combine_chunks(), dotted.column("history.timestamps").combine_chunks()],
        ["item_id", "timestamps"],
    )
    nested = write(pa.table({"user_id": dotted.column("user_id"), "history": history}), tmp_path / "nested.parquet")
    predict(path, write(dotted, tmp_path / "dotted.parquet"), tmp_path / "a.parquet", k=3)
    predict(path, nested, tmp_path / "b.parquet", k=3)
    assert pq.read_table(tmp_path / "a.parquet").equals(pq.read_table(tmp_path / "b.parquet"))


def test_the_cli_writes_the_output_and_reports_progress(ranking, tmp_path, capsys):
    path, requests = ranking
    users = write(as_table(requests), tmp_path / "users.parquet")
    argv = ["predict", str(path), "--input", str(users), "--output", str(tmp_path / "out.parquet")]
    assert gr_main([*argv, "--ids", "model", "--batch-size", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"wrote {tmp_path / 'out.parquet'}: 5 rows (rank)")
    assert captured.err.splitlines()[-1].startswith("predict: 5/5 rows (100%")
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 5


def _drop(table: pa.Table, name: str) -> pa.Table:
    return table.drop_columns([name])


def _set(table: pa.Table, name: str, row: int, value: Any, kind: Any = None) -> pa.Table:
    """``table`` with ``name``'s cell ``row`` set to ``value`` (the column typed ``kind`` if given)."""
    values = table.column(name).to_pylist()
    values[row] = value
    kind = kind or table.schema.field(name).type
    return table.set_column(table.column_names.index(name), name, pa.array(values, kind))


@pytest.mark.parametrize(
    "which, edit, expected",
    [
        ("retrieval", lambda t: _drop(t, "history.timestamps"), "missing column(s) ['history.timestamps']"),
        ("retrieval", lambda t: t.append_column("histroy.item_id", t.column("history.item_id")), "unknown column"),
        (
            "retrieval",
            lambda t: _set(t, "history.item_id", 2, ["m01", "nope", "m03"]),
            "row 3, column history.item_id: unknown raw id(s) ['nope']",
        ),
        ("retrieval", lambda t: _set(t, "history.timestamps", 1, None), "row 2, column history.timestamps: null"),
        (
            "retrieval",
            lambda t: _set(t, "history.timestamps", 1, [1, 2, 3, 4, 2**64 - 1], pa.list_(pa.uint64())),
            "row 2, column history.timestamps: 18446744073709551615 does not fit int64",
        ),
        (
            "retrieval",
            lambda t: _set(t, "history.timestamps", 2, [5] * 15 + [4]),
            "row 3, column history.timestamps: out of order: [15] = 4 is earlier than [14] = 5",
        ),
        (
            "ranking",
            lambda t: _set(t, "history.age", 3, [[0.5]] * 18 + [[float("nan")]]),
            "row 4, column history.age: non-finite value nan",
        ),
        (
            "ranking",
            lambda t: _set(t, "common_features.user_score", 4, [0.1, float("inf")]),
            "row 5, column common_features.user_score: non-finite value inf",
        ),
        ("ranking", lambda t: _drop(t, "candidates.item_id"), "missing column(s) ['candidates.item_id']"),
        (
            "retrieval",
            lambda t: _set(t, "history.timestamps", 0, [0.5] * 12, pa.list_(pa.float64())),
            "row 1, column history.timestamps: expected integers in int64, got float64 values such as [0.5, 0.5, 0.5]",
        ),
    ],
)
def test_bad_input_is_one_line_naming_file_row_and_column(which, edit, expected, request, tmp_path, capsys):
    path, requests = request.getfixturevalue(which)
    users = write(edit(as_table(requests)), tmp_path / "users.parquet")
    output = tmp_path / "out.parquet"
    assert gr_main(["predict", str(path), "--input", str(users), "--output", str(output)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"gr predict: error: {users}: ") and expected in line, line
    assert not output.exists() and list(tmp_path.iterdir()) == [users]


def test_a_timestamp_list_is_read_as_seconds_floored_as_training_reads_one(retrieval, tmp_path):
    path, requests = retrieval
    seconds = as_table(requests, ("history",))
    times = seconds.column("history.timestamps").combine_chunks()
    millis = pa.ListArray.from_arrays(times.offsets, pa.array(times.values.to_numpy() * 1000 + 999, pa.timestamp("ms")))
    stamped = seconds.set_column(seconds.column_names.index("history.timestamps"), "history.timestamps", millis)
    predict(path, write(seconds, tmp_path / "seconds.parquet"), tmp_path / "a.parquet", k=3)
    predict(path, write(stamped, tmp_path / "stamped.parquet"), tmp_path / "b.parquet", k=3)
    assert pq.read_table(tmp_path / "a.parquet").equals(pq.read_table(tmp_path / "b.parquet"))


def test_iso_texts_and_zoned_timestamps_are_read_as_the_seconds_training_reads(retrieval, tmp_path):
    """Each history at the instants of helpers.instants: their seconds, ISO 8601 texts, TIMESTAMP(us) in a zone."""
    path, requests = retrieval
    table = as_table(requests, ("history",))
    lengths = [len(times) for times in table.column("history.timestamps").to_pylist()]
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    picks = [k % len(TEXTS) for k in range(sum(lengths))]
    picks = [p for length, start in zip(lengths, offsets.to_pylist()) for p in sorted(picks[start : start + length])]
    columns = {
        "seconds": pa.array([SECONDS[p] for p in picks]),
        "texts": pa.array([TEXTS[p] for p in picks]),
        "zoned": timestamps([SECONDS[p] for p in picks], "us", "Asia/Kolkata"),
    }
    outputs = []
    for name, values in columns.items():
        times = pa.ListArray.from_arrays(offsets, values)
        column = table.column_names.index("history.timestamps")
        predict(
            path,
            write(table.set_column(column, "history.timestamps", times), tmp_path / f"{name}.parquet"),
            tmp_path / f"{name}.out.parquet",
            k=3,
        )
        outputs.append(pq.read_table(tmp_path / f"{name}.out.parquet"))
    assert outputs[1].equals(outputs[0]) and outputs[2].equals(outputs[0])
    bad = pa.ListArray.from_arrays(offsets, pa.array(["2024-02-30"] * sum(lengths)))
    users = write(table.set_column(column, "history.timestamps", bad), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=rf"^{users}: row 1, column history.timestamps: \[0\] = '2024-02-30' is not"):
        predict(path, users, tmp_path / "bad.out.parquet", k=3)


def test_a_corrupt_parquet_page_is_one_line_naming_the_input(retrieval, tmp_path, capsys):
    path, requests = retrieval
    users = write_corrupt_parquet(as_table(requests * 50, ("history",)), tmp_path / "users.parquet")
    output = tmp_path / "out.parquet"
    assert gr_main(["predict", str(path), "--input", str(users), "--output", str(output)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"gr predict: error: --input {users}: not a readable Parquet file ("), line
    assert not output.exists()


def test_a_ranking_export_without_candidates_asks_for_them(ranking, tmp_path):
    path, requests = ranking
    users = write(as_table(requests, ("history", "common_features")), tmp_path / "users.parquet")
    with pytest.raises(ValueError, match=r"ranking export: give candidates\.item_id"):
        predict(path, users, tmp_path / "out.parquet")


def test_parquet_rows_count_from_1_in_predict_as_in_training(retrieval, tmp_path, capsys):
    path, requests = retrieval
    users = write(_set(as_table(requests, ("history",)), "history.timestamps", 1, None), tmp_path / "users.parquet")
    assert gr_main(["predict", str(path), "--input", str(users), "--output", str(tmp_path / "out.parquet")]) == 2
    assert f"{users}: row 2, column history.timestamps: null value" in capsys.readouterr().err
    events = write(pa.table({"u": [1, None], "i": [3, 4], "t": [5, 6]}), tmp_path / "events.parquet")
    with pytest.raises(DataFormatError, match=rf"{events}: row 2: column 'u' is null"):
        read_table_parquet(str(events), ColumnConfig(user="u", item="i", timestamp="t"))


@pytest.mark.parametrize("spelling", ["same", "other spelling", "symlink"])
def test_an_output_that_is_the_input_is_refused_before_anything_runs(retrieval, tmp_path, capsys, spelling):
    _, requests = retrieval
    users = write(as_table(requests, ("history",)), tmp_path / "users.parquet")
    before = users.read_bytes()
    (tmp_path / "sub").mkdir()
    os.symlink(users, tmp_path / "link.parquet")
    output = {"same": users, "other spelling": tmp_path / "sub/../users.parquet", "symlink": tmp_path / "link.parquet"}
    missing_export = tmp_path / "no-export"  # never opened: the refusal comes first
    argv = ["predict", str(missing_export), "--input", str(users), "--output", str(output[spelling])]
    assert gr_main(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"gr predict: error: --output {output[spelling]}: is the --input file {users}; write elsewhere"
    assert users.read_bytes() == before


def test_an_output_directory_or_one_in_a_missing_directory_is_a_one_line_error(retrieval, tmp_path, capsys):
    path, requests = retrieval
    users = write(as_table(requests, ("history",)), tmp_path / "users.parquet")
    for output, reason in (
        (tmp_path, "is a directory; expected a Parquet file to write"),
        (tmp_path / "nowhere/out.parquet", f"its directory {tmp_path / 'nowhere'} does not exist"),
    ):
        assert gr_main(["predict", str(path), "--input", str(users), "--output", str(output)]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line == f"gr predict: error: --output {output}: {reason}"


def test_rows_without_history_columns_read_their_users_stored_histories(retrieval, tmp_path):
    path, requests = retrieval
    spec = tmp_path / "histories.sqlite"
    serving = Ranker.load(path, history_store=SqliteHistoryStore(spec, 100))
    for r in requests:
        serving.append(EventsRequest(r["user_id"], r["history"]))
    users = write(pa.table({"user_id": [r["user_id"] for r in requests]}), tmp_path / "users.parquet")
    predict(path, users, tmp_path / "stored.parquet", k=5, batch_size=3, history_store=str(spec))
    sent = write(as_table(requests, ("history",)), tmp_path / "sent.parquet")
    predict(path, sent, tmp_path / "sent_top.parquet", k=5, batch_size=3)
    stored, given = (pq.read_table(tmp_path / name).to_pylist() for name in ("stored.parquet", "sent_top.parquet"))
    assert stored == given and [row["history_length"] for row in stored] == [
        len(r["history"]["timestamps"]) for r in requests
    ]
    with pytest.raises(ValueError, match=r"^--ids model: the rows read their users' stored histories"):
        predict(path, users, tmp_path / "model.parquet", ids="model", history_store=str(spec))
    with pytest.raises(FileNotFoundError, match=r"^--history-store \S+typo.sqlite: no such file"):
        predict(path, users, tmp_path / "typo.parquet", history_store=str(tmp_path / "typo.sqlite"))


def _event_log(root: Path) -> Tuple[Path, Path, Dict[int, Tuple[List[str], List[int]]]]:
    """A small event log of the retrieval export's items in two Parquet partitions (user 3 has more
    events than the model's window of 40; user 2's last events tie in time across the partitions),
    a recipe naming its columns, and each user's history built by hand: {user: (items, times)}."""
    rng = np.random.default_rng(11)
    counts = {1: 6, 2: 9, 3: 45, 4: 1}
    rows = [
        (u, str(RAW_ITEMS[rng.integers(50)]), int(rng.integers(1000, 2000)))
        for u, n in counts.items()
        for _ in range(n)
    ]
    rows[10], rows[11] = (2, "m08", 3000), (2, "m07", 3000)  # read in this order, not sorted by item
    order = rng.permutation(len(rows))
    halves = [[rows[i] for i in order if i != 11], [rows[11]]]  # the tie's second event is read last
    for n, (folder, part) in enumerate(zip(("month=1", "month=2"), halves)):
        (root / "events" / folder).mkdir(parents=True)
        users, items, times = zip(*part)
        table = pa.table({"uid": list(users), "movie": list(items), "ts": list(times)})
        pq.write_table(table, root / "events" / folder / f"part-{n}.parquet")
    (root / "recipe.yaml").write_text("data:\n  source: parquet\n  columns: {user: uid, item: movie, timestamp: ts}\n")
    by_hand = {}
    for user in counts:  # sorted() is stable: equal times keep the order read (partition, then row)
        read = [r for part in halves for r in part if r[0] == user]
        events = sorted(read, key=lambda r: r[2])
        by_hand[user] = ([r[1] for r in events], [r[2] for r in events])
    return root / "events", root / "recipe.yaml", by_hand


def test_predict_from_the_event_log_equals_hand_built_histories(retrieval, tmp_path):
    path, _ = retrieval
    events, recipe, by_hand = _event_log(tmp_path)
    users = pa.table(
        {
            "user_id": list(by_hand),
            "history.item_id": [items for items, _ in by_hand.values()],
            "history.timestamps": [times for _, times in by_hand.values()],
        }
    )
    predict(path, write(users, tmp_path / "users.parquet"), tmp_path / "want.parquet", k=5, batch_size=3)
    assert predict_events(path, events, tmp_path / "got.parquet", recipe, k=5, batch_size=3)["rows"] == 4
    got, want = pq.read_table(tmp_path / "got.parquet"), pq.read_table(tmp_path / "want.parquet")
    assert got.equals(want)
    assert got.column("truncated").to_pylist() == [0, 0, 5, 0]  # user 3's 45 events cut to the window of 40

    (tmp_path / "users.txt").write_text("4\n\n2\n")  # a listed user's row follows the list's order
    argv = [
        "predict",
        str(path),
        "--events",
        str(events),
        "--config",
        str(recipe),
        "--users",
        str(tmp_path / "users.txt"),
    ]
    assert gr_main([*argv, "--k", "5", "--output", str(tmp_path / "two.parquet")]) == 0
    two = pq.read_table(tmp_path / "two.parquet").to_pylist()
    assert [row["user_id"] for row in two] == [4, 2]
    for row, alone in zip(two, [want.to_pylist()[3], want.to_pylist()[1]]):  # batched apart: float noise
        np.testing.assert_allclose(row.pop("scores"), alone.pop("scores"), rtol=0, atol=ATOL)
        assert row == alone


def test_predict_from_a_prepared_dataset_equals_predict_from_its_event_log(retrieval, tmp_path, capsys):
    """The log prepared (users with two events or more: user 4 is left out), with an append of later
    events: each user's row is the raw log's, with and without the recipe."""
    path, _ = retrieval
    events, recipe, _ = _event_log(tmp_path)
    section = read_yaml(recipe.read_text())["data"]
    config = DataConfig.from_dict({**section, "path": str(events), "split": "none", "min_seq_len": 2})
    prepared = prepare_with_duckdb(config, tmp_path / "prepared", threads=1).directory
    later = pa.table({"uid": [1, 1, 2, 5, 5], "movie": ["m01", "m02", "m03", "m04", "m05"], "ts": [4000] * 5})
    append_with_duckdb(prepared, write(later, tmp_path / "later.parquet"), threads=1)
    log = tmp_path / "log"
    shutil.copytree(events, log)
    pq.write_table(later, log / "month=3.parquet")
    predict_events(path, log, tmp_path / "want.parquet", recipe, k=5, users=["1", "2", "3", "5"])
    assert predict_events(path, prepared, tmp_path / "got.parquet", None, k=5)["rows"] == 4
    want = pq.read_table(tmp_path / "want.parquet")
    assert pq.read_table(tmp_path / "got.parquet").equals(want)
    argv = ["predict", str(path), "--events", str(prepared), "--config", str(recipe), "--k", "5"]
    assert gr_main([*argv, "--output", str(tmp_path / "cli.parquet")]) == 2
    assert "prepared for another data config (data.min_seq_len differs: prepared with 2" in capsys.readouterr().err
    recipe.write_text(recipe.read_text().replace("data:\n", "data:\n  split: none\n  min_seq_len: 2\n"))
    assert gr_main([*argv, "--output", str(tmp_path / "cli.parquet")]) == 0
    assert pq.read_table(tmp_path / "cli.parquet").equals(want)


def test_predict_from_the_event_log_refuses_a_ranking_export_in_one_line(ranking, tmp_path):
    events, recipe, _ = _event_log(tmp_path)
    with pytest.raises(ValueError, match="is a ranking export, which scores candidates: give them with --input"):
        predict_events(ranking[0], events, tmp_path / "out.parquet", recipe)
    assert not (tmp_path / "out.parquet").exists()


@pytest.mark.parametrize(
    "edit, expected",
    [
        (["--users", "2,9"], "gr predict: error: --users: user(s) ['9'] have no event in "),
        (["--users", "two"], "gr predict: error: --users: ['two']: expected integers"),
        (["--config", "item: film"], "lacks column(s) ['film']"),
    ],
)
def test_bad_event_input_is_one_line(retrieval, tmp_path, capsys, edit, expected):
    path, _ = retrieval
    events, recipe, _ = _event_log(tmp_path)
    if edit[0] == "--config":
        recipe.write_text(recipe.read_text().replace("item: movie", edit[1]))
        edit = []
    argv = ["predict", str(path), "--events", str(events), "--config", str(recipe), *edit]
    assert gr_main([*argv, "--output", str(tmp_path / "out.parquet")]) != 0
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("gr predict: error: ") and expected in line
    assert not (tmp_path / "out.parquet").exists()
