"""``python -m gr.export RUN_DIR EXPORT_DIR`` on a real (tiny) training run: ML-100K ranking with
side features (an item table of dim 18, stored 20 wide by FBGEMM); the export alone reproduces
the run's predictions on its test users."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from gr.commands.export import main as export_main
from gr.data.datamodule import SequenceDataModule
from gr.export import check_export, open_export
from gr.serving import Ranker
from gr.train import load_trained_model
from helpers.models import as_served, rank_all, requests_from_batch

ROOT = Path(__file__).resolve().parents[1]
TABLES = (
    "[{name: item, embedding_dim: 18, features: [item_id], init_std: 0.05},"
    " {name: age, embedding_dim: 4, features: [user_age], kind: common},"
    " {name: gender, embedding_dim: 4, features: [user_gender], kind: common},"
    " {name: occupation, embedding_dim: 4, features: [user_occupation], kind: common, pooling: mean}]"
)
OVERRIDES = [
    "--data.task=ranking",
    "--data.item_features=true",
    "--data.user_features=true",
    "--data.max_seq_len=30",
    "--data.ranking.eval_num_negatives=7",
    "--data.eval_batch_size=512",
    "--model.hstu.hidden_dim=16",
    "--model.hstu.attention_dim=8",
    "--model.hstu.linear_dim=8",
    "--model.hstu.num_heads=2",
    "--model.hstu.max_seq_len=30",
    f"--model.tables={TABLES}",
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=3",
    "--trainer.early_stopping_patience=0",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, ml_100k, warm_python):
    """``train.py`` of the recipe in a process of its own (``helpers.warm``)."""
    out = tmp_path_factory.mktemp("run") / "ml100k-ranking"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    recipe = ["--config", "configs/ml100k_hstu.yaml", f"--data.path={ml_100k}"]
    run = warm_python.run(["train.py", *recipe, "--out", str(out), *OVERRIDES], cwd=ROOT, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    target = tmp_path_factory.mktemp("export") / "export"
    assert export_main([str(run_dir), str(target)]) == 0
    return target


def test_export_cli_writes_a_valid_export_of_the_run_and_refuses_to_overwrite(run_dir, exported, capsys):
    assert check_export(exported) == []
    manifest = open_export(exported)
    assert [t.name for t in manifest.graph.slice("prefix_dnn").inputs] == ["item_id", "item_genres"]
    assert {t.name for t in manifest.graph.slice("postfix_dnn").inputs} == {
        "hidden",
        "user_age",
        "user_gender",
        "user_occupation",
    }
    assert manifest.sparse.features["item_id"].id_mapping == "id_maps/items.tsv"
    assert manifest.sparse.features["user_age"].id_mapping == "id_maps/user_age.tsv"
    source = json.loads((exported / "source.json").read_text())
    trained = json.loads((run_dir / "metrics.json").read_text())
    assert source["run"] == str(run_dir.resolve()) and source["checkpoint"] == trained["best_checkpoint"]
    assert source["epoch"] >= 0 and source["global_step"] > 0
    assert "  source.json\n" in (exported / "MANIFEST").read_text()  # hashed like every other file
    capsys.readouterr()
    assert export_main([str(run_dir), str(exported)]) == 2  # bad input: one line, exit status 2
    assert "--overwrite" in capsys.readouterr().err
    assert check_export(exported) == []


def test_export_of_the_run_reproduces_its_predictions_on_test_users(run_dir, exported):
    model, config = load_trained_model(run_dir)
    data = SequenceDataModule(config.data)
    data.setup()
    batch = next(iter(data.test_dataloader()))
    with torch.no_grad():
        out = model(batch)
    users = 24
    requests = requests_from_batch(batch)[:users]
    got = rank_all(Ranker.load(exported, micro_batch=5), requests)
    rows = int(out.row_offsets[users])
    want = as_served({task: value[:rows].numpy() for task, value in out.predictions.items()})
    assert set(got) == set(want)
    for task, value in want.items():
        assert got[task].shape == (rows,)
        np.testing.assert_allclose(got[task], value, rtol=0, atol=1e-5)
