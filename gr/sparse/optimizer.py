"""Embedding optimizers, fused into the backward pass of the tables.

With TorchRec, each table gets its optimizer through ``apply_optimizer_in_backward`` before
``DistributedModelParallel`` shards it; the sharded FBGEMM kernel then updates the rows it
looked up during backward. The torch backend applies the same update rules to the rows in the
lookup's backward (``gr.sparse.row_optimizers``). Either way embedding weights never reach the
dense (Lightning) optimizer and their gradients are never materialised. TorchRec and FBGEMM are
imported only when their optimizers are asked for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING, Any, Dict, Tuple, Type

from gr.utils.config_checks import BETAS, Section, checked, number_in, one_of

if TYPE_CHECKING:
    import torch

# FBGEMM's table-batched embedding kernels: which optimizers they fuse, per device type.
# fbgemm-gpu-cpu (1.8) builds only the first three; the CUDA build has all of them.
FUSED_OPTIMIZERS_BY_DEVICE: Dict[str, Tuple[str, ...]] = {
    "cpu": ("sgd", "adagrad", "rowwise_adagrad"),
    "cuda": ("sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam"),
}
OPTIMIZER_TYPES = FUSED_OPTIMIZERS_BY_DEVICE["cuda"]

# TorchRec's optimizer classes (in ``torchrec.optim``) that ``apply_optimizer_in_backward`` maps to FBGEMM types.
_OPTIMIZER_CLASSES: Dict[str, str] = {
    "sgd": "SGD",
    "adagrad": "Adagrad",
    "rowwise_adagrad": "RowWiseAdagrad",
    "adam": "Adam",
    "partial_rowwise_adam": "PartialRowWiseAdam",
}


@dataclass(frozen=True)
class EmbeddingOptimizerConfig(Section):
    """One table's optimizer, run inside the embedding kernel's backward.

    type: "sgd" | "adagrad" | "rowwise_adagrad" (one accumulator per row) | "adam" |
    "partial_rowwise_adam" (second moment per row). Adam variants use decoupled
    weight decay (AdamW); row-wise Adagrad adds it to the gradient (L2); FBGEMM's sgd and
    adagrad take none.
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
        if self.weight_decay and self.type in ("sgd", "adagrad"):
            raise ValueError(
                f"{where}.weight_decay: FBGEMM's {self.type} takes no weight decay; set it to 0 or use "
                "rowwise_adagrad or an Adam variant"
            )

    def check_device(self, device_type: str, where: str) -> None:
        """Raise unless FBGEMM fuses this optimizer on ``device_type`` ("cpu", "cuda")."""
        supported = FUSED_OPTIMIZERS_BY_DEVICE.get(device_type, FUSED_OPTIMIZERS_BY_DEVICE["cpu"])
        if self.type not in supported:
            raise ValueError(
                f"{where}.type: {self.type!r} has no fused embedding kernel on {device_type} (FBGEMM fuses "
                f"{list(supported)} there); pick one of those, or keep the tables on a CUDA device"
            )

    def optimizer_class(self) -> Type[torch.optim.Optimizer]:
        from torchrec import optim as trec_optim

        return getattr(trec_optim, _OPTIMIZER_CLASSES[self.type])

    def fused_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments FBGEMM's kernel takes for this optimizer."""
        kwargs: Dict[str, Any] = {"lr": float(self.lr)}
        if self.type == "sgd":
            return kwargs
        kwargs["eps"] = float(self.eps)
        if "adam" in self.type:
            kwargs["beta1"], kwargs["beta2"] = self.betas
        if self.weight_decay > 0:
            from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

            kwargs["weight_decay"] = float(self.weight_decay)
            kwargs["weight_decay_mode"] = WeightDecayMode.DECOUPLE if "adam" in self.type else WeightDecayMode.L2
        return kwargs

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["betas"] = list(self.betas)
        return out
