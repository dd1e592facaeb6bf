"""End-to-end runs on tiny synthetic data: in this process (one rank) the run directory,
load_trained_model, exact resume, the most-popular baseline and the ranking task; then the
same recipe under torchrun on two ranks."""

import copy
import csv
import json
import os
from pathlib import Path

import pytest
import yaml

from gr.train import read_run, train
from gr.train.run import best_checkpoint
from helpers.runs import RANKING, RETRIEVAL, config, evaluate_loaded, ratings_csv

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def retrieval_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("retrieval")
    return out, train(config(RETRIEVAL), out)


def test_run_directory_holds_config_metrics_mappings_checkpoints_and_logs(retrieval_run):
    out, metrics = retrieval_run
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    for key in ("hr@5", "ndcg@5", "hr@10", "ndcg@10", "mrr"):
        assert 0.0 <= on_disk[key] <= 1.0
    assert set(on_disk["popularity"]) == {"hr@5", "ndcg@5", "hr@10", "ndcg@10", "mrr"}
    assert on_disk["epochs"] == 3 and on_disk["world_size"] == 1
    saved, spec, tasks = read_run(out)
    items = spec.sequence["item_id"]
    assert on_disk["table_rows_per_rank"] == {"item": [items]}
    assert saved.to_dict() == on_disk["config"]
    assert saved.model.tables[0]["num_embeddings"] == items  # resolved from the data
    assert list(spec.sequence) == ["item_id"] and tasks == ()
    assert (out / "mappings").is_dir() and any((out / "mappings").iterdir())
    assert (out / on_disk["best_checkpoint"] / "meta.json").is_file()
    assert best_checkpoint(out) == out / on_disk["best_checkpoint"]  # what evaluate, export and --init-from load
    assert (out / "checkpoints" / "last" / ".metadata").is_file()
    assert "val/ndcg@5" in (out / "logs" / "metrics.csv").read_text().splitlines()[0]
    assert list((out / "logs").glob("events.out.tfevents.*"))


def test_learning_beats_the_most_popular_baseline(retrieval_run):
    _, metrics = retrieval_run
    assert metrics["hr@10"] > metrics["popularity"]["hr@10"] + 0.1
    assert metrics["ndcg@10"] > metrics["popularity"]["ndcg@10"] + 0.05


def test_loaded_model_scores_the_test_set_like_the_run(retrieval_run):
    out, metrics = retrieval_run
    _, again = evaluate_loaded(out)
    for key in ("hr@5", "ndcg@10", "mrr"):
        assert again[key] == pytest.approx(metrics[key], abs=1e-6)


def test_resumed_run_ends_like_the_uninterrupted_one(retrieval_run, tmp_path):
    _, uninterrupted = retrieval_run
    stopped = config(RETRIEVAL, ("trainer.max_epochs", 2))
    train(stopped, tmp_path)
    resumed = train(config(RETRIEVAL), tmp_path, resume=True)
    assert resumed["epochs"] == 3
    for key in ("hr@5", "ndcg@5", "hr@10", "ndcg@10", "mrr"):
        assert resumed[key] == uninterrupted[key], key
    assert resumed["best_val"] == uninterrupted["best_val"]


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(config(RETRIEVAL), tmp_path, resume=True)


def test_ranking_run_with_host_placed_tables_reports_auc_logloss_positive_rates_and_a_baseline_per_task(tmp_path):
    """Also the host-placement path (tables in host memory, looked-up vectors moved to the
    dense model's device), which on this CPU-only machine is the same device."""
    ranking = copy.deepcopy(RANKING)
    ranking["sparse"]["placement"] = "host"
    metrics = train(config(ranking, ("trainer.max_epochs", 2)), tmp_path)
    assert set(metrics) >= {"auc", "gauc", "logloss", "auc/watch", "gauc/watch", "logloss/watch", "positive_rate/watch"}
    assert 0 < metrics["positive_rate/watch"] < 1 and 0 <= metrics["popularity"]["auc/watch"] <= 1
    assert 0 <= metrics["gauc/watch"] <= 1 and 0 <= metrics["popularity"]["gauc/watch"] <= 1
    with open(tmp_path / "logs" / "metrics.csv", newline="") as handle:
        logged = [row for row in csv.DictReader(handle)]
    for name in ("train/positive_rate/watch", "val/positive_rate/watch"):
        assert any(row.get(name) for row in logged), name
    assert set(metrics["table_rows_per_rank"]) == {"item", "category", "age", "gender"}
    assert metrics["auc"] > 0.5
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["data"]["task"] == "ranking" and saved["sparse"]["placement"] == "host"


def test_two_rank_torchrun_shards_tables_and_matches_one_rank(retrieval_run, tmp_path, warm_python):
    """torchrun, 2 CPU processes (gloo): the item table is split row-wise, each rank writes its
    own checkpoint shard, the merged model reproduces the run's metrics, and the metrics are
    close to the one-process run's (the same steps: each rank takes half of each global batch)."""
    _, one_rank = retrieval_run
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(RETRIEVAL))
    out = tmp_path / "run"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"}
    run = warm_python.torchrun(2, ["train.py", "--config", str(recipe), "--out", str(out)], ROOT, env, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count(f"wrote {out / 'metrics.json'}") == 1  # rank 0 prints the summary, once
    two_ranks = json.loads((out / "metrics.json").read_text())
    assert two_ranks["world_size"] == 2
    items = read_run(out)[1].sequence["item_id"]
    rows = two_ranks["table_rows_per_rank"]["item"]
    assert len(rows) == 2 and sum(rows) == items and abs(rows[0] - rows[1]) <= 1  # row-wise halves
    best = out / two_ranks["best_checkpoint"]
    assert sorted(p.name for p in best.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    model, merged = evaluate_loaded(out)  # both shards merged into one table
    assert model.embeddings.table_weight("item").shape[0] == items
    assert merged["ndcg@10"] == pytest.approx(two_ranks["ndcg@10"], abs=1e-6)
    for key in ("hr@10", "ndcg@10"):
        assert abs(two_ranks[key] - one_rank[key]) < 0.1, key
        assert two_ranks[key] > one_rank["popularity"][key]


def test_resuming_a_finished_run_is_one_line_and_rewrites_nothing(retrieval_run, capsys):
    from gr.commands.train import main

    out, _ = retrieval_run
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert main(["--resume", str(out)]) == 0
    last = out / "checkpoints" / "last"
    assert capsys.readouterr().out.strip().splitlines() == [
        f"gr train: run already at epoch 3 of 3 ({last}); raise --trainer.max_epochs to train more"
    ]
    assert main(["--resume", str(out), "--trainer.max_epochs", "2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "trainer.max_epochs: 2, but the run to resume is already at epoch 3" in line
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


PROJECT_MODULE = '''
from gr.model import GRModel


class ProjectModel(GRModel):
    """A GRModel subclass of the user's project (behaviour of the built-in one)."""
'''


def test_a_run_reads_its_data_and_imports_its_classes_from_any_working_directory(tmp_path, monkeypatch, warm_python):
    project = tmp_path / "project"
    (project / "myproj").mkdir(parents=True)
    (project / "myproj" / "__init__.py").write_text("")
    (project / "myproj" / "models.py").write_text(PROJECT_MODULE)
    ratings_csv(project / "events.csv", 1)
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))  # what `gr` does for the working directory
    values = copy.deepcopy(RETRIEVAL)
    values["data"].update(source="csv", path="events.csv", columns={"rating": "rating"})
    values["model"]["class"] = "myproj.models.ProjectModel"
    values["trainer"]["max_epochs"] = 1
    train(config(values), project / "runs" / "r")
    saved = yaml.safe_load((project / "runs" / "r" / "config.yaml").read_text())
    assert saved["data"]["path"] == str(project / "events.csv")
    assert saved["model"]["code_path"] == [str(project)]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = elsewhere / "load_run.py"
    script.write_text(LOAD_RUN)
    # a process of its own that never imported the project (helpers.warm), another working directory: only the
    # run tells where
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    loaded = warm_python.run([str(script), str(project / "runs" / "r")], cwd=elsewhere, env=env, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split() == ["ProjectModel", str(project / "events.csv")]


LOAD_RUN = """
import sys
from gr.train import load_trained_model
model, config = load_trained_model(sys.argv[1])
print(type(model).__name__, config.data.path)
"""
