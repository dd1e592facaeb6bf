"""HSTU: config, stack, layers and attention kernels. Imports no training code."""

from gr.hstu.config import HSTUConfig
from gr.hstu.layer import HSTULayer
from gr.hstu.stack import HSTU

__all__ = ["HSTU", "HSTUConfig", "HSTULayer"]
