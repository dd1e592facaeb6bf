"""gr's ONNX exports build torch's aten-to-ONNX registry once per process and opset, and leave
torch.onnx.export as it was outside them."""

import pytest
from torch.onnx._internal.exporter import _registration

from gr.export.onnx_registry import registry_built_once


def test_the_registry_is_built_once_per_opset_and_the_constructor_is_restored_after_the_block():
    original = vars(_registration.ONNXRegistry)["from_torchlib"]
    with registry_built_once():
        first = _registration.ONNXRegistry().from_torchlib(opset_version=18)
        assert _registration.ONNXRegistry.from_torchlib(opset_version=18) is first
        assert _registration.ONNXRegistry.from_torchlib(opset_version=20) is not first
    with registry_built_once():
        assert _registration.ONNXRegistry.from_torchlib(opset_version=18) is first
    assert vars(_registration.ONNXRegistry)["from_torchlib"] is original
    assert first.opset_version == 18


def test_the_constructor_is_restored_when_the_export_fails():
    original = vars(_registration.ONNXRegistry)["from_torchlib"]
    with pytest.raises(RuntimeError, match="the exporter failed"), registry_built_once():
        raise RuntimeError("the exporter failed")
    assert vars(_registration.ONNXRegistry)["from_torchlib"] is original
