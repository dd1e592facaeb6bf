"""Serving on a device: the ONNX Runtime execution providers chosen for --device, and a clear
error naming the provider when this onnxruntime build lacks it. Nothing here ran on a GPU/NPU."""

import pytest

from gr.serving.onnx_slice import execution_providers


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
