"""Preloaded by the fork server (``helpers.warm``): torch.onnx's exporter imported and its registry
built once (``gr.export.onnx_registry``), so that a child that exports skips the ~3 s of CPU a
process's first export spends on them. The registry is built, not an export run: an export would
start threads in the server (OpenMP's pool among them), and a child forked from a process with
threads can hang on a lock one of them held."""

import torch._functorch.aot_autograd  # noqa: F401 (what torch.export imports as it exports)
import torch.export._trace  # noqa: F401
from torch.onnx._internal.exporter import _compat, _constants, _core, _registration  # noqa: F401

from gr.export.onnx_registry import registry_built_once

with registry_built_once():  # the registry torch.onnx.export asks for (its default opset)
    _registration.ONNXRegistry.from_torchlib(opset_version=_constants.TORCHLIB_OPSET)
