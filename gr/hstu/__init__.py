"""HSTU: config, stack, layers and attention kernels. Imports no training code.

Public names load lazily, so reading an ``HSTUConfig`` (a recipe's ``model.hstu``) does not import torch.
"""

from typing import TYPE_CHECKING

from gr.utils.lazy import lazy_getattr

if TYPE_CHECKING:
    from gr.hstu.config import HSTUConfig as HSTUConfig
    from gr.hstu.layer import HSTULayer as HSTULayer
    from gr.hstu.stack import HSTU as HSTU

_EXPORTS = {"HSTU": "gr.hstu.stack", "HSTUConfig": "gr.hstu.config", "HSTULayer": "gr.hstu.layer"}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
