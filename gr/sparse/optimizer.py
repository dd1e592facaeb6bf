"""Embedding optimizers, fused into the backward pass of the TorchRec tables.

Each table gets its optimizer through ``apply_optimizer_in_backward`` before
``DistributedModelParallel`` shards it; the sharded FBGEMM kernel then updates the
rows it looked up during backward, so embedding weights never reach the dense
(Lightning) optimizer and their gradients are never materialised.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass
from typing import Any, Dict, Tuple, Type

import torch
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
from torchrec import optim as trec_optim

from gr.config_checks import BETAS, Section, checked, number_in, one_of

# FBGEMM's table-batched embedding kernels: which optimizers they fuse, per device type.
# fbgemm-gpu-cpu (1.8) builds only the first three; the CUDA build has all of them.
FUSED_OPTIMIZERS_BY_DEVICE: Dict[str, Tuple[str, ...]] = {
    "cpu": ("sgd", "adagrad", "rowwise_adagrad"),
    "cuda": ("sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam"),
}
OPTIMIZER_TYPES = FUSED_OPTIMIZERS_BY_DEVICE["cuda"]

# TorchRec's optimizer classes that ``apply_optimizer_in_backward`` maps to FBGEMM optimizer types.
_OPTIMIZER_CLASSES: Dict[str, Type[torch.optim.Optimizer]] = {
    "sgd": trec_optim.SGD,
    "adagrad": trec_optim.Adagrad,
    "rowwise_adagrad": trec_optim.RowWiseAdagrad,
    "adam": trec_optim.Adam,
    "partial_rowwise_adam": trec_optim.PartialRowWiseAdam,
}


@dataclass(frozen=True)
class EmbeddingOptimizerConfig(Section):
    """One table's optimizer, run inside the embedding kernel's backward.

    type: "sgd" | "adagrad" | "rowwise_adagrad" (one accumulator per row) | "adam" |
    "partial_rowwise_adam" (second moment per row). Adam variants use decoupled
    weight decay (AdamW); the Adagrad variants add it to the gradient (L2).
    """

    type: str = checked("rowwise_adagrad", one_of(*OPTIMIZER_TYPES))
    lr: float = checked(0.01, number_in(0.0))
    eps: float = checked(1e-8, number_in(0.0))
    betas: Tuple[float, float] = checked((0.9, 0.999), BETAS)
    weight_decay: float = checked(0.0, number_in(0.0))
    where: InitVar[str] = "optimizer"

    def __post_init__(self, where: str) -> None:
        self.validate(where)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))

    def check_device(self, device_type: str, where: str) -> None:
        """Raise unless FBGEMM fuses this optimizer on ``device_type`` ("cpu", "cuda")."""
        supported = FUSED_OPTIMIZERS_BY_DEVICE.get(device_type, FUSED_OPTIMIZERS_BY_DEVICE["cpu"])
        if self.type not in supported:
            raise ValueError(
                f"{where}.type: {self.type!r} has no fused embedding kernel on {device_type} (FBGEMM fuses "
                f"{list(supported)} there); pick one of those, or keep the tables on a CUDA device"
            )

    def optimizer_class(self) -> Type[torch.optim.Optimizer]:
        return _OPTIMIZER_CLASSES[self.type]

    def fused_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments FBGEMM's kernel takes for this optimizer."""
        kwargs: Dict[str, Any] = {"lr": float(self.lr)}
        if self.type == "sgd":
            return kwargs
        kwargs["eps"] = float(self.eps)
        if "adam" in self.type:
            kwargs["beta1"], kwargs["beta2"] = self.betas
        if self.weight_decay > 0:
            kwargs["weight_decay"] = float(self.weight_decay)
            kwargs["weight_decay_mode"] = WeightDecayMode.DECOUPLE if "adam" in self.type else WeightDecayMode.L2
        return kwargs

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["betas"] = list(self.betas)
        return out
