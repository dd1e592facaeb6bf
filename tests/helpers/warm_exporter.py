"""Preloaded by the fork server (``helpers.warm``): torch.onnx's exporter imported and its registry
built once (``gr.export.onnx_registry``), by the export of a one-layer module, so that a child that
exports skips the ~4 s of CPU a process's first export spends on them."""

import torch

from gr.export.onnx_registry import registry_built_once

with torch.no_grad(), registry_built_once():
    torch.onnx.export(torch.nn.Linear(2, 2).eval(), (torch.zeros(1, 2),), dynamo=True, verbose=False)
