"""Delta exports (``gr export RUN OUT --base PREV``, ``gr check`` of a chain, ``gr export --squash``):
a delta holds the rows that changed, the new rows of a grown vocabulary, the id-map additions and
the dense slices; base + delta squashes into the full export bit for bit, on either sparse backend;
a tampered, missing or out-of-order delta is refused by name, and so is a delta of another model."""

import filecmp
import itertools
import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from gr import GRModel, HSTUConfig, TableConfig
from gr.commands.export import main as export_main
from gr.data.mappings import IdMap, save_mappings
from gr.export.delta import (
    APPEND,
    DELTA,
    WHOLE,
    check_chain,
    export_identity,
    patched,
    read_sparse_manifest,
    squash,
    write_delta,
)
from gr.export.format import ExportFormatError
from gr.export.manifest import MANIFEST, write_manifest
from gr.export.popularity import write_popularity
from gr.export.writer import check_lineage, export_model
from gr.postfix_dnn import RetrievalHead
from gr.prefix_dnn import MLPTokenEncoder
from gr.serving import Ranker
from gr.serving.request import RankRequest, RecommendRequest
from gr.serving.sparse_store import PatchedTable, patch_table
from gr.sparse.tables import sparse_backend
from gr.train.config import TrainConfig, save_config
from helpers.models import HSTU_KW, perturb
from helpers.runs import RETRIEVAL

DAY0_ITEMS, DAY1_ITEMS = 50, 60
CHANGED = [3, 7]  # the known rows day 1 trains


def _model(backend: str, items: int, hidden: int = 16) -> GRModel:
    with sparse_backend(backend):
        cfg = HSTUConfig(**{**HSTU_KW, "hidden_dim": hidden, "time_buckets": 0})
        tables = [TableConfig("item", items, 16, ("item_id",))]
        return GRModel(cfg, MLPTokenEncoder({"item_id": 16}, hidden), RetrievalHead(hidden, 16), tables).eval()


def _maps(directory: Path, items: int) -> Path:
    save_mappings(str(directory), {"items": IdMap(np.arange(1000, 1000 + items))}, {})
    return directory


def _day1(day0: GRModel, backend: str) -> GRModel:
    """Day 0's model warm-started: its rows and dense weights, rows CHANGED and the dense part
    trained a little, DAY1_ITEMS - DAY0_ITEMS new rows."""
    model = _model(backend, DAY1_ITEMS)
    dense = {k: v for k, v in day0.state_dict().items() if not k.startswith("embeddings.")}
    model.load_state_dict(dense, strict=False)
    perturb(model.hstu, seed=5, std=0.01)
    (weight,) = model.embeddings.parameters()
    old = day0.embeddings.table_weight("item")
    with torch.no_grad():
        weight[:DAY0_ITEMS, :16] = old
        weight[CHANGED] += 0.5
    return model


@pytest.fixture(scope="module")
def day0(tmp_path_factory):
    root = tmp_path_factory.mktemp("day0")
    model = perturb(_model("torch", DAY0_ITEMS), seed=2)
    export_model(model, root / "export", id_mappings_dir=_maps(root / "maps", DAY0_ITEMS))
    return model, root / "export"


@pytest.fixture(scope="module", params=["torch", "torchrec"])
def day1(request, day0, tmp_path_factory):
    """(day 1's full export, its delta from day 0's export) with tables of ``request.param``."""
    root = tmp_path_factory.mktemp(f"day1-{request.param}")
    model, maps = _day1(day0[0], request.param), _maps(root / "maps", DAY1_ITEMS)
    export_model(model, root / "full", id_mappings_dir=maps)
    export_model(model, root / "delta", id_mappings_dir=maps, base=day0[1])
    return root / "full", root / "delta"


def _same_files(left: Path, right: Path) -> bool:
    files = sorted(p.relative_to(left) for p in left.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(right) for p in right.rglob("*") if p.is_file())
    return all(filecmp.cmp(left / f, right / f, shallow=False) for f in files)


def test_a_squashed_chain_is_bit_identical_to_the_full_export_on_either_sparse_backend(day0, day1, tmp_path):
    full, delta = day1
    assert export_main(["--squash", str(day0[1]), str(delta), str(tmp_path / "squashed")]) == 0
    assert _same_files(tmp_path / "squashed", full)


def test_a_delta_holds_the_changed_and_new_rows_the_id_map_additions_and_names_its_base(day0, day1):
    full, delta = day1
    summary = json.loads((delta / DELTA).read_text())
    assert summary["base"] == export_identity(day0[1])
    tensors = load_file(str(delta / "sparse/item.delta.safetensors"))
    assert tensors["ids"].tolist() == CHANGED + list(range(DAY0_ITEMS, DAY1_ITEMS))
    assert np.array_equal(tensors["rows"], load_file(str(full / "sparse/item.safetensors"))["weight"][tensors["ids"]])
    assert summary["files"]["sparse/id_maps/items.tsv"] == APPEND
    added = (delta / "sparse/id_maps/items.tsv").read_text().splitlines()
    assert added == [f"{i}\t{1000 + i}" for i in range(DAY0_ITEMS, DAY1_ITEMS)]
    assert summary["files"]["hstu/model.safetensors"] == WHOLE
    assert not (delta / "sparse/item.safetensors").exists() and not (delta / "prefix_dnn/model.onnx").exists()


def _next_day(full: Path, out: Path) -> Path:
    """A copy of export ``full`` whose item row 0 changed (a valid export of a later day)."""
    shutil.copytree(full, out)
    table = load_file(str(out / "sparse/item.safetensors"))
    table["weight"][0] += 1.0
    save_file(table, str(out / "sparse/item.safetensors"))
    (out / MANIFEST).unlink()
    write_manifest(out)
    return out


@pytest.fixture
def chain(day0, day1, tmp_path):
    """[day 0's export, day 1's delta, day 2's delta]."""
    full, delta = day1
    (tmp_path / "d2").mkdir()
    write_delta(full, _next_day(full, tmp_path / "day2"), tmp_path / "d2")
    return [day0[1], delta, tmp_path / "d2"]


def test_check_accepts_a_chain_in_order_and_refuses_a_missing_or_out_of_order_delta_by_name(chain, capsys):
    base, d1, d2 = chain
    assert export_main(["check", str(base), str(d1), str(d2)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(": OK")
    assert [(p.file, p.key) for p in check_chain([base, d2])] == [(f"{d2}/{DELTA}", "base")]
    assert "a delta missing before it, deltas out of order" in str(check_chain([base, d2, d1])[0])
    assert [p.file for p in check_chain([base, d2, d1])] == [f"{d2}/{DELTA}", f"{d1}/{DELTA}"]
    assert "the chain starts with a delta" in str(check_chain([d1, d2])[0])
    assert export_main(["check", str(base), str(d2)]) == 1
    assert f"ERROR {d2}/{DELTA} [base]: applies to the export" in capsys.readouterr().out


def test_check_and_squash_refuse_a_tampered_delta_naming_its_file(chain, tmp_path, capsys):
    base, _, d2 = chain
    d1 = shutil.copytree(chain[1], tmp_path / "d1")
    rows = d1 / "sparse/item.delta.safetensors"
    data = bytearray(rows.read_bytes())
    data[-1] ^= 1
    rows.write_bytes(bytes(data))
    assert [(p.file, p.message.split(":")[0]) for p in check_chain([base, d1, d2])] == [
        (f"{d1}/sparse/item.delta.safetensors", "sha256 differs from MANIFEST")
    ]
    assert export_main(["--squash", str(base), str(d1), str(d2), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gr export: error: invalid export") and "item.delta.safetensors" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_delta_of_a_run_whose_id_maps_renumber_the_bases_is_refused(day0, day1, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(day1[0], other)
    ids = np.arange(1000, 1000 + DAY1_ITEMS)
    save_mappings(str(other / "sparse/id_maps"), {"items": IdMap(ids[::-1].copy())}, {})
    (other / MANIFEST).unlink()
    write_manifest(other)
    (tmp_path / "d").mkdir()
    with pytest.raises(
        ValueError, match=r"items\.tsv: this id map does not extend .*items\.tsv \(known ids renumbered"
    ):
        write_delta(day0[1], other, tmp_path / "d")


def test_a_delta_of_another_model_shape_is_refused_naming_what_differs(day0, tmp_path):
    maps = _maps(tmp_path / "maps", DAY0_ITEMS)
    export_model(perturb(_model("torch", DAY0_ITEMS, hidden=8)), tmp_path / "small", id_mappings_dir=maps)
    (tmp_path / "d").mkdir()
    with pytest.raises(
        ValueError, match=r"is another model than the base export .*hstu/config\.json: .*hidden_size 8 here, 16"
    ):
        write_delta(day0[1], tmp_path / "small", tmp_path / "d")


def _run(directory: Path, init_from=None) -> Path:
    values = json.loads(json.dumps(RETRIEVAL))
    if init_from is not None:
        values["trainer"]["init_from"] = str(init_from)
    directory.mkdir()
    save_config(TrainConfig.from_dict(values), directory / "config.yaml")
    return directory


def test_base_must_be_an_export_of_the_run_or_of_one_it_was_warm_started_from(tmp_path):
    day0 = _run(tmp_path / "day0")
    day2 = _run(tmp_path / "day2", init_from=_run(tmp_path / "day1", init_from=day0))
    (tmp_path / "export").mkdir()
    (tmp_path / "export/source.json").write_text(json.dumps({"run": str(day0)}))
    check_lineage(day2, tmp_path / "export")
    with pytest.raises(ValueError, match=r"^--base .*export: an export of the run .*day0, which is neither .*other"):
        check_lineage(_run(tmp_path / "other"), tmp_path / "export")


HISTORY = {"item_id": [3, 12, 7, 20], "timestamps": [100, 200, 300, 400]}
KNOWN = {"item_id": [3, 7, 10, 20]}  # two rows day 1 trained, two it did not
CANDIDATES = {"item_id": [3, 7, 10, 52, 58]}  # and two of its new items


def _answers(ranker: Ranker, user: str = "u", candidates: dict = CANDIDATES) -> tuple:
    rank = ranker.rank(RankRequest(user, HISTORY, candidates))
    top = ranker.recommend(RecommendRequest(user, HISTORY, k=5))
    return rank.scores["retrieval"], top.items, top.scores


def test_a_delta_applied_to_a_serving_model_answers_bit_for_bit_like_the_full_export(day0, day1):
    full, delta = day1
    ranker = Ranker.load(day0[1])
    before = _answers(ranker, candidates=KNOWN)
    ranker.reload(delta)
    served, expected = _answers(ranker, "v"), _answers(Ranker.load(full), "v")
    assert np.array_equal(served[0], expected[0]) and served[1] == expected[1]
    assert np.array_equal(served[2], expected[2]) and not np.allclose(before[0][:2], served[0][:2])
    assert ranker.cache.model_version == 1 and ranker.cache.users() == ["v"]  # u's history was day 0's
    assert ranker.model.identity == export_identity(full)


def test_a_delta_that_does_not_follow_the_serving_model_is_refused_and_the_old_model_serves(chain):
    base, _, d2 = chain
    ranker = Ranker.load(base)
    with pytest.raises(ExportFormatError, match=rf"{d2}/{DELTA} \[base\]: applies to the export"):
        ranker.reload(d2)
    assert ranker.model.identity == export_identity(base) and ranker.cache.model_version == 0


def test_a_delta_that_changes_nothing_a_history_is_encoded_from_keeps_the_user_cache(day1, tmp_path):
    full, _ = day1
    counted = tmp_path / "counted"
    shutil.copytree(full, counted)
    write_popularity(counted, np.arange(DAY1_ITEMS), read_sparse_manifest(counted))
    (counted / MANIFEST).unlink()
    write_manifest(counted)
    (tmp_path / "d").mkdir()
    write_delta(full, counted, tmp_path / "d")
    ranker = Ranker.load(full)
    _answers(ranker)
    ranker.reload(tmp_path / "d")
    assert ranker.cache.users() == ["u"] and ranker.cache.model_version == 1
    assert ranker.model.popularity.tolist() == list(range(DAY1_ITEMS))
    assert _answers(ranker)[0].tolist() == _answers(Ranker.load(counted), "w")[0].tolist()


def test_sixteen_clients_during_an_apply_never_see_an_answer_that_mixes_versions(day0, day1):
    full, delta = day1
    expected = {
        0: _answers(Ranker.load(day0[1]), candidates=KNOWN)[0],
        1: _answers(Ranker.load(full), candidates=KNOWN)[0],
    }
    assert not np.allclose(expected[0], expected[1], atol=1e-3)
    ranker = Ranker.load(day0[1])
    seen: list = []
    applied = threading.Event()

    def client(number: int) -> None:
        after = 0  # answers asked for once the apply returned
        for turn in itertools.count():
            asked_after = applied.is_set()
            result = ranker.rank(RankRequest(f"user{number}-{turn % 3}", HISTORY, KNOWN))
            seen.append((result.model_version, result.scores["retrieval"], asked_after))
            after += asked_after
            if after == 3:
                return

    with ThreadPoolExecutor(16) as pool:
        clients = [pool.submit(client, n) for n in range(16)]
        ranker.reload(delta)
        applied.set()
        for done in clients:
            done.result()
    assert {version for version, _, _ in seen} == {0, 1}
    assert {version for version, _, asked_after in seen if asked_after} == {1}
    mixed = [v for v, scores, _ in seen if not np.allclose(scores, expected[v], rtol=0, atol=1e-5)]
    assert mixed == []


def test_a_patched_table_gathers_the_rows_of_its_merged_array_and_never_writes_its_base():
    rng = np.random.default_rng(0)
    base = rng.standard_normal((100, 4)).astype(np.float32)
    kept = base.copy()
    first = patch_table(base, 103, np.array([5, 40, 100, 101, 102]), rng.standard_normal((5, 4)).astype(np.float32))
    second = patch_table(first, 104, np.array([40, 77, 103]), rng.standard_normal((3, 4)).astype(np.float32))
    assert (
        isinstance(second, PatchedTable)
        and second.shape == (104, 4)
        and second.ids.tolist() == [5, 40, 77, 100, 101, 102, 103]
    )
    merged = patched(
        patched(base, 103, first.ids, first.values), 104, np.array([40, 77, 103]), second.values[[1, 2, 6]]
    )
    rows = rng.integers(0, 104, 500)
    assert np.array_equal(second[rows], merged[rows]) and np.array_equal(second.array(), merged)
    assert np.array_equal(base, kept)
    many = patch_table(base, 100, np.arange(0, 100, 5), np.zeros((20, 4), np.float32))  # 20% of the rows: one array
    assert isinstance(many, np.ndarray) and not many[::5].any() and np.array_equal(many[1::5], base[1::5])


def _with_users(export: Path, out: Path, items: int, users: list) -> Path:
    shutil.copytree(export, out)
    maps = {"items": IdMap(np.arange(1000, 1000 + items)), "users": IdMap(np.array(users))}
    save_mappings(str(out / "sparse/id_maps"), maps, {})
    (out / MANIFEST).unlink()
    write_manifest(out)
    return out


def test_a_map_that_names_no_table_rows_may_be_rewritten_whole_while_the_items_map_extends(day0, day1, tmp_path):
    base = _with_users(day0[1], tmp_path / "base", DAY0_ITEMS, ["b", "d"])
    full = _with_users(day1[0], tmp_path / "full", DAY1_ITEMS, ["a", "b", "c", "d"])  # renumbered users
    (tmp_path / "d").mkdir()
    files = write_delta(base, full, tmp_path / "d")["files"]
    assert files["sparse/id_maps/users.tsv"] == WHOLE and files["sparse/id_maps/items.tsv"] == APPEND
    squash([base, tmp_path / "d"], tmp_path / "squashed")
    assert _same_files(tmp_path / "squashed", full)
