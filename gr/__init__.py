"""gr: train and serve generative recommenders built on HSTU.

Public names load lazily, so ``import gr.hstu`` (serving) does not pull in TorchRec; type checkers and
editors see them through the ``TYPE_CHECKING`` imports below.
"""

from typing import TYPE_CHECKING

from gr.utils.lazy import lazy_getattr

__version__ = "0.2.0"  # pyproject.toml reads it (tool.setuptools.dynamic)

if TYPE_CHECKING:
    from gr.hstu.config import HSTUConfig
    from gr.model import GRInput, GRModel, GROutput
    from gr.postfix_dnn.base import PostfixDNN
    from gr.prefix_dnn.base import PrefixDNN
    from gr.sparse.config import TableConfig

_EXPORTS = {
    "GRModel": "gr.model",
    "GRInput": "gr.model",
    "GROutput": "gr.model",
    "HSTUConfig": "gr.hstu.config",
    "PrefixDNN": "gr.prefix_dnn.base",
    "PostfixDNN": "gr.postfix_dnn.base",
    "TableConfig": "gr.sparse.config",
}

__all__ = ["GRInput", "GRModel", "GROutput", "HSTUConfig", "PostfixDNN", "PrefixDNN", "TableConfig"]

__getattr__ = lazy_getattr(__name__, _EXPORTS)
