"""Serving on a device: the ONNX Runtime execution providers chosen for --device, a clear
error naming the provider when this onnxruntime build lacks it, the model and its caches on the
chosen device, and one clear refusal (exit 2 for the CLI) when this host cannot serve on it.
Nothing here ran on a GPU/NPU."""

import json

import numpy as np
import pytest
import torch

from gr.commands import cli
from gr.commands.serve import main as serving_main
from gr.export import export_model
from gr.serving import Ranker
from gr.serving.http import OPTIONS_ENV, app_from_environment
from gr.serving.model import ServingModel
from gr.serving.onnx_slice import execution_providers
from gr.utils.devices import npu_present
from helpers.models import DENSE_DIMS, build_ranking_model, random_batch, requests_from_batch

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: cuda is not refused")
no_npu = pytest.mark.skipif(npu_present(), reason="this host looks like an Ascend host: npu may not be refused")
CUDA_MISSING = (
    r"--device: 'cuda' needs a CUDA build of torch.*; --device cuda: ONNX Runtime has no CUDAExecutionProvider"
)
NPU_MISSING = r"--device: 'npu' needs the torch_npu package.*; --device npu: ONNX Runtime has no CANNExecutionProvider"


def test_cpu_uses_the_cpu_provider_of_this_onnxruntime():
    assert execution_providers("cpu") == ["CPUExecutionProvider"]


@pytest.mark.parametrize("device, provider", [("cuda", "CUDAExecutionProvider"), ("npu", "CANNExecutionProvider")])
def test_a_device_gets_its_provider_first_then_cpu_for_missing_ops(device, provider):
    available = ["CANNExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert execution_providers(device, available) == [provider, "CPUExecutionProvider"]


@pytest.mark.parametrize(
    "device, provider, package",
    [("cuda", "CUDAExecutionProvider", "onnxruntime-gpu"), ("npu", "CANNExecutionProvider", "onnxruntime-cann")],
)
def test_a_missing_provider_is_named_with_what_to_install(device, provider, package):
    with pytest.raises(RuntimeError, match=rf"--device {device}: ONNX Runtime has no {provider}.*{package}"):
        execution_providers(device, ["CPUExecutionProvider"])


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match=r"--device: expected one of \['cpu', 'cuda', 'npu'\], got 'tpu'"):
        execution_providers("tpu")


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """A tiny next_event ranking export (its caches hold a pending token too) and one request."""
    model = build_ranking_model(max_seq_len=40, contextual_len=1, query_time="next_event")
    path = export_model(model, tmp_path_factory.mktemp("device") / "export", dense_dims=DENSE_DIMS)
    request = requests_from_batch(random_batch(model, [12], [3], seed=3))[0]
    return path, request


def test_a_cpu_ranker_keeps_the_hstu_and_every_cache_tensor_on_cpu(export_dir):
    path, request = export_dir
    ranker = Ranker.load(path, device="cpu")
    result = ranker.rank(request["user_id"], request["history"], request["candidates"], request["common_features"])
    assert result.cache_status == "miss" and ranker.device == ranker.model.device == "cpu"
    assert ranker.model.engine.device == torch.device("cpu")
    assert {p.device for p in ranker.model.engine.hstu.parameters()} == {torch.device("cpu")}
    cache = ranker.cache.get(request["user_id"]).cache
    assert cache.pending is not None, "a next_event cache holds its last token pending"
    tensors = [*cache.keys, *cache.values, cache.timestamps, cache.pending]
    assert {t.device for t in tensors} == {torch.device("cpu")}


@no_cuda
def test_cuda_without_a_gpu_is_refused_before_the_export_is_read_naming_torch_and_the_provider(tmp_path):
    with pytest.raises(RuntimeError, match=CUDA_MISSING):
        ServingModel(tmp_path / "no-export", device="cuda")


@no_npu
def test_npu_without_torch_npu_is_refused_naming_the_package_and_the_provider(export_dir):
    with pytest.raises(RuntimeError, match=NPU_MISSING):
        Ranker.load(export_dir[0], device="npu")


def test_a_ranker_refuses_a_device_other_than_its_models(export_dir):
    model = ServingModel(export_dir[0])
    with pytest.raises(ValueError, match=r"Ranker.device: 'cuda', but the model was loaded on 'cpu'"):
        Ranker(model, device="cuda")


def test_the_cli_ranks_on_cpu_as_the_runtime_does(export_dir, tmp_path, capsys):
    path, request = export_dir
    want = Ranker.load(path).rank(
        request["user_id"], request["history"], request["candidates"], request["common_features"]
    )
    file = tmp_path / "request.json"
    file.write_text(
        json.dumps({**request, **{k: _lists(request[k]) for k in ("history", "candidates", "common_features")}})
    )
    assert serving_main(["rank", str(path), "--request", str(file), "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out)["scores"]
    assert set(printed) == set(want.scores)
    for task, value in want.scores.items():
        np.testing.assert_allclose(printed[task], value, rtol=0, atol=1e-6)


@no_cuda
@pytest.mark.parametrize(
    "command",
    [["rank", "--request", "r.json"], ["generate", "--request", "r.json"], ["serve"]],
    ids=["rank", "generate", "serve"],
)
def test_the_cli_refuses_cuda_without_a_gpu_with_one_line_and_exit_2(export_dir, command, capsys):
    argv = [command[0], str(export_dir[0]), *command[1:], "--device", "cuda"]
    assert serving_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"{command[0]}: --device: 'cuda' needs")


@no_npu
def test_gr_serve_forwards_the_device_and_refuses_npu_here(export_dir, capsys):
    assert cli.main(["serve", str(export_dir[0]), "--device", "npu"]) == 2
    assert "CANNExecutionProvider" in capsys.readouterr().err


@no_cuda
def test_the_http_app_passes_the_device_to_the_ranker(export_dir, monkeypatch):
    options = {"export_dir": str(export_dir[0]), "admin_token": None, "device": "cuda"}
    monkeypatch.setenv(OPTIONS_ENV, json.dumps(options))
    with pytest.raises(RuntimeError, match=CUDA_MISSING):
        app_from_environment()


def _lists(columns):
    return {name: value.tolist() for name, value in columns.items()}
