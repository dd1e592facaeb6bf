"""An ONNX Runtime session for one DNN slice, fed by name as ``slice_graph.ini`` declares."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import numpy as np
import onnxruntime as ort

from gr.export.slice_graph import SliceSpec


class OnnxSlice:
    """Runs ``spec``'s ONNX model; inputs and outputs are keyed by the slice's tensor names."""

    def __init__(self, path: Path, spec: SliceSpec, threads: Optional[int] = None) -> None:
        options = ort.SessionOptions()
        # No busy-waiting between runs: the HSTU engine (torch) needs the same cores right after.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if threads is not None:
            options.intra_op_num_threads = threads
        self.spec = spec
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.output_names = [t.name for t in spec.outputs]

    def run(self, inputs: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """inputs: {input name: array with the slice's declared dtype} -> {output name: array}."""
        feed = {t.name: np.ascontiguousarray(inputs[t.name]) for t in self.spec.inputs}
        return dict(zip(self.output_names, self.session.run(self.output_names, feed)))
