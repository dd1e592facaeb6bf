"""Lightning on Ascend NPUs: a small Accelerator for the ``npu`` device of torch_npu.

No maintained Lightning accelerator for Ascend is on the package index (checked 2026-11:
Lightning ships CPU, CUDA, MPS and XLA ones), so this registers its own. torch_npu is
imported by ``gr.utils.devices.load_torch_npu`` when ``trainer.accelerator: npu`` is asked for,
never on import of this module. Dense modules run on the NPU; embedding tables stay in host
memory (``sparse.placement: host``: FBGEMM has no NPU kernels), DDP talks over HCCL.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Union

import torch
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from gr.utils.devices import load_torch_npu

NPU_PROCESS_GROUP_BACKEND = "hccl"


class NPUAccelerator(Accelerator):
    """Lightning Accelerator for ``torch.device("npu", i)`` (torch_npu must be loaded)."""

    def setup_device(self, device: torch.device) -> None:
        if device.type != "npu":
            raise ValueError(f"NPUAccelerator: expected an npu device, got {device}")
        torch.npu.set_device(device)  # type: ignore[attr-defined]  # torch_npu adds torch.npu at run time

    def teardown(self) -> None:
        torch.npu.empty_cache()  # type: ignore[attr-defined]

    def get_device_stats(self, device: Union[torch.device, str, int]) -> Dict[str, Any]:
        return torch.npu.memory_stats(device)  # type: ignore[attr-defined]

    @staticmethod
    def parse_devices(devices: Union[int, str, List[int]]) -> List[int]:
        """trainer.devices -> NPU indices: n -> [0, n), "auto" -> all, a list as is."""
        if devices == "auto" or devices == -1:
            return list(range(NPUAccelerator.auto_device_count()))
        if isinstance(devices, int):
            return list(range(devices))
        return [int(i) for i in devices]

    @staticmethod
    def get_parallel_devices(devices: List[int]) -> List[torch.device]:
        return [torch.device("npu", i) for i in devices]

    @staticmethod
    def auto_device_count() -> int:
        return torch.npu.device_count() if NPUAccelerator.is_available() else 0  # type: ignore[attr-defined]

    @staticmethod
    def is_available() -> bool:
        """True once torch_npu is loaded and sees an NPU (never imports it)."""
        return "torch_npu" in sys.modules and hasattr(torch, "npu") and torch.npu.is_available()

    @staticmethod
    def name() -> str:
        return "npu"

    @classmethod
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        accelerator_registry.register("npu", cls, description="Ascend NPU through torch_npu (gr.train.npu)")


def npu_trainer_args(precision: str) -> Dict[str, Any]:
    """The Trainer arguments of an NPU run: loads torch_npu (a clear error naming what is
    missing when it or CANN is absent), the accelerator, and a precision plugin whose autocast
    targets the npu device (Lightning's own would pick cuda for a custom accelerator)."""
    load_torch_npu("trainer.accelerator")
    # Lightning types MixedPrecision's precision by its literal names; trainer.precision is one of PRECISIONS
    plugin: Optional[Precision] = (
        MixedPrecision(precision, "npu")  # type: ignore[arg-type]
        if precision.endswith("-mixed")
        else None
    )
    return dict(
        accelerator=NPUAccelerator(), plugins=[plugin] if plugin else None, precision=None if plugin else precision
    )
