"""Train -> export -> serve on the test suite's device (``GR_TEST_DEVICE``, else detected): a
tiny synthetic ranking run trained with ``trainer.accelerator`` set to that device (tables in host
memory on an NPU, FBGEMM having no NPU kernels; plain torch tables, ``sparse.backend: torch``, on a
host without TorchRec), exported with ``python -m gr.export``, checked,
and served on that device too (``Ranker.load(..., device=...)``: ONNX Runtime with the device's
execution provider, the HSTU engine and its caches on the device): the export alone reproduces
the run's predictions on its test users."""

import copy
import importlib.util

import numpy as np
import pytest
import torch

from gr.commands.export import main as export_main
from gr.data.datamodule import SequenceDataModule
from gr.export import check_export
from gr.serving import Ranker
from gr.train import load_trained_model, train
from gr.utils.devices import suite_device
from helpers.models import as_served, rank_all, requests_from_batch
from helpers.runs import RANKING, config

DEVICE = suite_device()


def ranking_recipe(device: str) -> dict:
    """The tiny one-task ranking recipe (``helpers.runs.RANKING``) on ``device``, one short epoch."""
    values = copy.deepcopy(RANKING)
    values["trainer"].update(accelerator=device, max_epochs=1, limit_train_batches=3)
    if device == "npu":
        values["sparse"]["placement"] = "host"
    if importlib.util.find_spec("torchrec") is None:
        values["sparse"]["backend"] = "torch"
    return values


@pytest.fixture(scope="module")
def device_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("device-run") / "run"
    metrics = train(config(ranking_recipe(DEVICE)), run_dir)
    export_dir = tmp_path_factory.mktemp("device-export") / "export"
    assert export_main([str(run_dir), str(export_dir)]) == 0
    return run_dir, export_dir, metrics


def test_the_run_trains_on_the_suite_device_and_its_export_is_valid(device_run):
    run_dir, export_dir, metrics = device_run
    assert metrics["config"]["trainer"]["accelerator"] == DEVICE
    assert np.isfinite(metrics["logloss"]) and 0.0 <= metrics["auc"] <= 1.0
    assert check_export(export_dir) == []


def test_the_export_served_reproduces_the_device_run_on_its_test_users(device_run):
    run_dir, export_dir, _ = device_run
    model, run_config = load_trained_model(run_dir)
    data = SequenceDataModule(run_config.data)
    data.setup()
    batch = next(iter(data.test_dataloader()))
    with torch.no_grad():
        out = model(batch)
    users = 12
    got = rank_all(Ranker.load(export_dir, micro_batch=4, device=DEVICE), requests_from_batch(batch)[:users])
    rows = int(out.row_offsets[users])
    want = as_served({task: value[:rows].numpy() for task, value in out.predictions.items()})
    assert set(got) == set(want) == {"watch", "watch_logit"}
    for task, value in want.items():
        assert got[task].shape == (rows,)
        np.testing.assert_allclose(got[task], value, rtol=0, atol=1e-5)
