"""gr: train and serve generative recommenders built on HSTU.

Public names load lazily, so ``import gr.hstu`` (serving) does not pull in TorchRec.
"""
from importlib import import_module
from typing import Any

_EXPORTS = {
    "GRModel": "gr.model",
    "GRInput": "gr.model",
    "GROutput": "gr.model",
    "HSTUConfig": "gr.hstu.config",
    "PrefixDNN": "gr.prefix_dnn.base",
    "PostfixDNN": "gr.postfix_dnn.base",
    "TableConfig": "gr.sparse.tables",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gr' has no attribute {name!r}")
