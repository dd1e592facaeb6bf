"""gr: train and serve generative recommenders built on HSTU.

Public names load lazily, so ``import gr.hstu`` (serving) does not pull in TorchRec.
"""

from gr.utils.lazy import lazy_getattr

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

__getattr__ = lazy_getattr(__name__, _EXPORTS)
