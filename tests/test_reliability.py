"""Failure modes of training, checkpoints and ranking, one test each (crashes at checkpoint phases: test_faults.py)."""

import hashlib
import sys
from pathlib import Path

import pytest
import torch

from gr.data.datamodule import SequenceDataModule
from gr.train import train
from gr.train.checkpoint import read_meta, save_checkpoint
from gr.train.config import TrainConfig
from gr.train.metrics import retrieval_metrics, target_ranks
from gr.utils.finite import NonFiniteError
from helpers.runs import ratings_csv, recipe


def tree_digest(root: Path) -> dict:
    """{relative path: sha256} of every file under ``root`` but TensorBoard event files."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "tfevents" not in p.name
    }


@pytest.fixture(scope="module")
def one_epoch_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train(TrainConfig.from_dict(recipe(("trainer.max_epochs", 1))), out)
    return out


# ---- 1. a diverged run reports perfect metrics and ships -------------------------------------
def test_nan_scores_rank_last_so_a_nan_model_scores_zero():
    queries, items = torch.full((4, 3), float("nan")), torch.randn(10, 3)
    targets, offsets = torch.tensor([0, 3, 5, 9]), torch.zeros(5, dtype=torch.long)
    ranks = target_ranks(queries, items, targets, offsets, torch.zeros(0, dtype=torch.long))
    assert ranks.tolist() == [10, 10, 10, 10]
    assert retrieval_metrics(ranks, (10,))["hr@10"] == 0.0


def test_nan_item_scores_never_rank_above_a_finite_target():
    queries, items = torch.ones(1, 2), torch.tensor([[1.0, 0.0], [float("nan"), 0.0], [float("inf"), 0.0]])
    ranks = target_ranks(
        queries, items, torch.tensor([0]), torch.zeros(2, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    )
    assert ranks.tolist() == [0]


def test_diverging_run_stops_with_a_named_error_and_saves_no_checkpoint(tmp_path, caplog):
    config = TrainConfig.from_dict(
        recipe(("optimizer.lr", 1e6), ("sparse.optimizer.lr", 1e6), ("trainer.max_epochs", 2))
    )
    with pytest.raises(NonFiniteError, match=r"training diverged at step \d+ \(epoch \d+, batch \d+"):
        train(config, tmp_path)
    assert "training diverged at step" in caplog.text
    assert not any((tmp_path / "checkpoints").glob("*"))
    assert not (tmp_path / "metrics.json").exists()


def test_checkpoint_with_non_finite_weights_is_refused_before_anything_is_written(tmp_path):
    state = {"state_dict": {"model.w": torch.tensor([1.0, float("nan")])}, "epoch": 0}
    with pytest.raises(NonFiniteError, match=r"model\.w"):
        save_checkpoint(state, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


# ---- 2. a failed --resume breaks the run -----------------------------------------------------
def test_failed_resume_leaves_the_run_directory_unchanged_and_resumable(one_epoch_run):
    before = tree_digest(one_epoch_run)
    misfit = TrainConfig.from_dict(
        recipe(
            ("trainer.max_epochs", 2),
            ("model.hstu.hidden_dim", 64),
            ("model.tables", [{"name": "item", "embedding_dim": 64, "features": ["item_id"], "init_std": 0.02}]),
        )
    )
    with pytest.raises(ValueError, match=r"does not fit this model and config \(rank 0: \w+: ") as error:
        train(misfit, one_epoch_run, resume=True)
    assert "FrameSummary" not in str(error.value) and "\n" not in str(error.value)  # readable, one line
    assert tree_digest(one_epoch_run) == before
    resumed = train(TrainConfig.from_dict(recipe(("trainer.max_epochs", 2))), one_epoch_run, resume=True)
    assert resumed["epochs"] == 2


# ---- 3. loading a run directory executes code in it ------------------------------------------
class Planted:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path(PLANTED_MARKER).write_text('ran')",))


def test_checkpoint_metadata_is_json_and_a_planted_pickle_never_runs(one_epoch_run, tmp_path):
    last = one_epoch_run / "checkpoints" / "last"
    assert (last / "meta.json").is_file() and not (last / "meta.pt").exists()
    assert read_meta(last)["epoch"] >= 0
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    marker = tmp_path / "marker"
    torch.save({"x": Planted()}, legacy / "meta.pt")
    with pytest.raises(ValueError, match="meta.pt: refused"):
        read_meta(legacy)
    assert not marker.exists()


def test_config_class_path_is_not_imported_when_another_key_is_invalid(tmp_path, monkeypatch):
    (tmp_path / "planted_prefix.py").write_text("import pathlib\npathlib.Path(__file__).with_name('ran').touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    values = recipe()
    values["model"]["prefix_dnn"] = {"class": "planted_prefix.Anything"}
    values["trainer"]["max_epochs"] = -1
    with pytest.raises(ValueError, match="trainer.max_epochs"):
        TrainConfig.from_dict(values)
    assert "planted_prefix" not in sys.modules and not (tmp_path / "ran").exists()


# ---- 5. resume deletes training history ------------------------------------------------------
def test_resume_appends_to_metrics_csv_and_replaces_the_test_row_of_the_run_it_extends(tmp_path):
    train(TrainConfig.from_dict(recipe(("trainer.max_epochs", 1))), tmp_path)
    first = (tmp_path / "logs" / "metrics.csv").read_text().splitlines()
    trained, tested = first[:-1], first[-1]  # the test of the best checkpoint is logged last
    train(TrainConfig.from_dict(recipe(("trainer.max_epochs", 2))), tmp_path, resume=True)
    after = (tmp_path / "logs" / "metrics.csv").read_text().splitlines()
    assert after[: len(trained)] == trained and len(after) > len(first)
    assert tested not in after and after[-1].startswith("2,")  # one test row: the extended run's


# ---- 6. duplicate data inflates metrics silently -----------------------------------------------
def csv_recipe(path: Path, *overrides) -> TrainConfig:
    return TrainConfig.from_dict(
        recipe(
            ("data.source", "csv"),
            ("data.path", str(path)),
            ("data.columns.rating", "rating"),
            ("trainer.max_epochs", 1),
            *overrides,
        )
    )


def test_every_row_duplicated_trains_to_the_clean_metrics_and_the_count_is_reported(tmp_path, caplog):
    clean = train(csv_recipe(ratings_csv(tmp_path / "clean.csv", 1)), tmp_path / "clean")
    doubled = train(csv_recipe(ratings_csv(tmp_path / "doubled.csv", 2)), tmp_path / "doubled")
    rows = clean["data"]["rows_read"]
    assert clean["data"]["duplicates_dropped"] == 0
    assert doubled["data"] == {
        **clean["data"],
        "source": str(tmp_path / "doubled.csv"),
        "rows_read": 2 * rows,
        "duplicates_dropped": rows,
    }
    scores = ("hr@5", "hr@10", "ndcg@10", "mrr", "popularity", "best_val")
    assert {k: doubled[k] for k in scores} == {k: clean[k] for k in scores}
    assert f"dropped {rows} duplicate interactions" in caplog.text
    assert '"duplicates_dropped": %d' % rows in (tmp_path / "doubled" / "metrics.json").read_text()


def test_keep_duplicates_keeps_every_repeated_row(tmp_path):
    config = csv_recipe(ratings_csv(tmp_path / "doubled.csv", 2), ("data.keep_duplicates", True))
    datamodule = SequenceDataModule(config.data)
    datamodule.setup()
    rows = datamodule.summary["rows_read"] // 2
    assert datamodule.summary["duplicates_kept"] == rows and datamodule.summary["duplicates_dropped"] == 0
    assert datamodule.summary["interactions"] == 2 * rows
