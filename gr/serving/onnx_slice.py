"""An ONNX Runtime session for one DNN slice, fed by name as ``slice_graph.ini`` declares."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import onnxruntime as ort

from gr.export.slice_graph import SliceSpec

# --device -> the ONNX Runtime execution provider that runs the DNN slices there
DEVICE_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "npu": "CANNExecutionProvider"}
PROVIDER_PACKAGES = {"cuda": "onnxruntime-gpu", "npu": "an onnxruntime build with CANN (onnxruntime-cann)"}


def execution_providers(device: str, available: Optional[Sequence[str]] = None) -> List[str]:
    """ONNX Runtime providers for ``--device`` cpu|cuda|npu: the device's provider, then CPU
    for any op it lacks. ``available``: ``ort.get_available_providers()`` unless given.
    Raises ValueError for an unknown device, RuntimeError naming the provider when this
    onnxruntime build lacks it."""
    if device not in DEVICE_PROVIDERS:
        raise ValueError(f"--device: expected one of {list(DEVICE_PROVIDERS)}, got {device!r}")
    available = list(ort.get_available_providers() if available is None else available)
    provider = DEVICE_PROVIDERS[device]
    if provider not in available:
        raise RuntimeError(
            f"--device {device}: ONNX Runtime has no {provider} (available: {available}); "
            f"install {PROVIDER_PACKAGES[device]} in place of onnxruntime"
        )
    return [provider] if device == "cpu" else [provider, DEVICE_PROVIDERS["cpu"]]


class OnnxSlice:
    """Runs ``spec``'s ONNX model; inputs and outputs are keyed by the slice's tensor names."""

    def __init__(self, path: Path, spec: SliceSpec, threads: Optional[int] = None, device: str = "cpu") -> None:
        options = ort.SessionOptions()
        # No busy-waiting between runs: the HSTU engine (torch) needs the same cores right after.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if threads is not None:
            options.intra_op_num_threads = threads
        self.spec = spec
        self.session = ort.InferenceSession(str(path), options, providers=execution_providers(device))
        self.output_names = [t.name for t in spec.outputs]

    def run(self, inputs: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """inputs: {input name: array with the slice's declared dtype} -> {output name: array}."""
        feed = {t.name: np.ascontiguousarray(inputs[t.name]) for t in self.spec.inputs}
        return dict(zip(self.output_names, self.session.run(self.output_names, feed)))
