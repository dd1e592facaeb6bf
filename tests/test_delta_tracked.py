"""Rows tracked by training (``trainer.track_rows``): a delta export of a run that recorded the rows
it updated reads only those rows, on either sparse backend, and is bit for bit the delta comparing
whole tables makes; a run without that record falls back to comparing, and says so."""

import copy
import filecmp
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.numpy import load_file

from gr.export import delta as delta_module
from gr.export.delta import IDS, check_chain, read_sparse_manifest, squash, write_delta
from gr.export.publish import published
from gr.export.writer import export_run, tracked_rows
from gr.sparse.touched import NEVER, TouchedRows, rows_since
from gr.train.config import TrainConfig
from gr.train.run import best_checkpoint, train
from helpers.runs import RETRIEVAL, ratings_csv

ITEMS_DAY0 = 80  # items above it are new on day 1
ROOT = Path(__file__).resolve().parents[1]


def _config(path: Path, backend: str = "torch", batch_size: int = 8, **trainer) -> TrainConfig:
    values = copy.deepcopy(RETRIEVAL)
    values["data"].pop("synthetic")
    values["data"].update(source="csv", path=str(path), columns={"rating": "rating"}, batch_size=batch_size)
    values["task"]["retrieval"]["num_negatives"] = 2
    values["sparse"]["backend"] = backend
    values["trainer"].update(max_epochs=1, **trainer)
    return TrainConfig.from_dict(values)


@pytest.fixture(scope="module")
def day0(tmp_path_factory):
    """(the day-0 run, its export, every event): day 0 holds the events before the 70th time
    percentile of the items up to ITEMS_DAY0."""
    root = tmp_path_factory.mktemp("tracked")
    everything = ratings_csv(root / "all.csv")
    lines = everything.read_text().splitlines()
    rows = [line.split(",") for line in lines[1:]]
    cut = np.percentile([int(r[2]) for r in rows], 70)
    kept = [line for line, r in zip(lines[1:], rows) if int(r[2]) < cut and int(r[1]) <= ITEMS_DAY0]
    (root / "day0.csv").write_text("\n".join([lines[0], *kept]) + "\n")
    train(_config(root / "day0.csv"), root / "day0")
    export_run(root / "day0", root / "export0")
    return root / "day0", root / "export0", everything


@pytest.fixture(scope="module", params=["torch", "torchrec"])
def day1(request, day0, tmp_path_factory):
    """(day 1's run, warm-started from day 0 on every event for one batch of two users, rows
    tracked; its full export; the delta comparing whole tables)."""
    root = tmp_path_factory.mktemp(f"day1-{request.param}")
    run, export0, everything = day0
    config = _config(everything, request.param, 2, init_from=str(run), track_rows=True, limit_train_batches=1)
    train(config, root / "run")
    export_run(root / "run", root / "full")
    (root / "compared").mkdir()
    write_delta(export0, root / "full", root / "compared")
    return root / "run", root / "full", root / "compared"


def _same_files(left: Path, right: Path) -> bool:
    files = sorted(p.relative_to(left) for p in left.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(right) for p in right.rglob("*") if p.is_file())
    return all(filecmp.cmp(left / f, right / f, shallow=False) for f in files)


def test_a_delta_of_a_run_that_tracked_its_rows_reads_only_them_and_equals_the_compared_delta(
    day0, day1, tmp_path, monkeypatch, caplog
):
    run, _, compared = day1
    export0 = day0[1]

    def refused(*args):
        raise AssertionError("whole tables compared")

    monkeypatch.setattr(delta_module, "changed_rows", refused)
    with caplog.at_level(logging.INFO, logger="gr.export.writer"):
        export_run(run, tmp_path / "tracked", base=export0)
    assert "delta rows: tracked by training for tables ['item']" in caplog.messages
    assert _same_files(tmp_path / "tracked", compared)
    touched = tracked_rows(run, best_checkpoint(run), export0)[0]["item"]
    known = read_sparse_manifest(export0).tables["item"].rows
    ids = load_file(str(tmp_path / "tracked/sparse/item.delta.safetensors"))[IDS]
    assert 0 < len(ids[ids < known]) and set(ids[ids < known]) <= set(touched)  # rows written: tracked ones
    assert len(touched[touched < known]) < known and np.array_equal(ids[ids >= known], np.arange(known, ids.max() + 1))


def test_a_delta_of_a_run_that_tracked_nothing_compares_whole_tables_and_says_so(day0, tmp_path, caplog):
    run, export0, _ = day0
    with caplog.at_level(logging.INFO, logger="gr.export.writer"):
        export_run(run, tmp_path / "delta", base=export0)
    assert (
        f"delta rows: compared whole tables ({best_checkpoint(run)} holds no record of the rows training updated)"
        in (caplog.messages)
    )
    assert load_file(str(tmp_path / "delta/sparse/item.delta.safetensors"))[IDS].size == 0  # the same model


def test_rows_are_known_from_the_step_tracking_began_at_and_a_base_before_it_is_refused():
    touched = TouchedRows({"item": 6}, since=2)
    touched.record({"item": torch.tensor([1, 4])}, step=2)
    touched.record({"item": torch.tensor([4, 5])}, step=3)
    saved = touched.merged()
    assert saved["tables"]["item"].tolist() == [NEVER, 2, NEVER, NEVER, 3, 3]
    assert rows_since(saved, 3)["item"].tolist() == [4, 5] and rows_since(saved, 2)["item"].tolist() == [1, 4, 5]
    with pytest.raises(ValueError, match="rows were tracked from step 2 on, not from step 1"):
        rows_since(saved, 1)


def test_two_ranks_sharding_the_tables_row_wise_track_their_rows_and_full_equals_base_plus_delta(
    day0, tmp_path, warm_python
):
    """torchrun, 2 CPU processes (gloo), TorchRec's row-wise item table: each rank records its
    shard's rows; the delta from day 0's export reads only the rows the ranks updated, equals the
    compared delta, and squashed onto day 0's export is the run's full export bit for bit. The
    run also publishes (every rank saves its shards, rank 0 exports): a chain ``gr check`` accepts."""
    run, export0, everything = day0
    values = _config(everything, "torchrec", 4, init_from=str(run), limit_train_batches=2).to_dict()
    values["trainer"].update(publish_every=1, publish_dir=str(tmp_path / "live"))
    values["warm_start"]["max_epochs"] = None  # the config's one epoch, not the warm-start recipe's
    recipe = tmp_path / "day1.yaml"
    recipe.write_text(yaml.safe_dump(values))
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"}
    argv = ["train.py", "--config", str(recipe), "--out", str(tmp_path / "run")]
    done = warm_python.torchrun(2, argv, ROOT, env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert [p.name for p in published(tmp_path / "live")] == ["000000", "000001"]
    assert check_chain(published(tmp_path / "live")) == []

    export_run(tmp_path / "run", tmp_path / "full")
    export_run(tmp_path / "run", tmp_path / "tracked", base=export0)
    (tmp_path / "compared").mkdir()
    write_delta(export0, tmp_path / "full", tmp_path / "compared")
    assert _same_files(tmp_path / "tracked", tmp_path / "compared")
    squash([export0, tmp_path / "tracked"], tmp_path / "squashed")
    assert _same_files(tmp_path / "squashed", tmp_path / "full")
    touched = tracked_rows(tmp_path / "run", best_checkpoint(tmp_path / "run"), export0)[0]["item"]
    known = read_sparse_manifest(export0).tables["item"].rows
    half = read_sparse_manifest(tmp_path / "full").tables["item"].rows // 2
    assert (touched < half).any() and ((touched >= half) & (touched < known)).any()  # both ranks' shards
