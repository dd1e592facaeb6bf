"""Embedding optimizers, fused into the backward pass of the TorchRec tables.

Each table gets its optimizer through ``apply_optimizer_in_backward`` before
``DistributedModelParallel`` shards it; the sharded FBGEMM kernel then updates the
rows it looked up during backward, so embedding weights never reach the dense
(Lightning) optimizer and their gradients are never materialised.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, dataclass
from typing import Any, Dict, Mapping, Tuple, Type

import torch
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
from torchrec import optim as trec_optim

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
class EmbeddingOptimizerConfig:
    """One table's optimizer, run inside the embedding kernel's backward.

    type: "sgd" | "adagrad" | "rowwise_adagrad" (one accumulator per row) | "adam" |
    "partial_rowwise_adam" (second moment per row). Adam variants use decoupled
    weight decay (AdamW); the Adagrad variants add it to the gradient (L2).
    """

    type: str = "rowwise_adagrad"
    lr: float = 0.01
    eps: float = 1e-8
    betas: Tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    where: InitVar[str] = "optimizer"

    def __post_init__(self, where: str) -> None:
        if self.type not in OPTIMIZER_TYPES:
            raise ValueError(f"{where}.type: expected one of {list(OPTIMIZER_TYPES)}, got {self.type!r}")
        for name in ("lr", "eps", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{where}.{name}: expected a finite number >= 0, got {value!r}")
        betas = self.betas
        if (
            not isinstance(betas, (list, tuple))
            or len(betas) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
        ):
            raise ValueError(f"{where}.betas: expected two numbers in [0, 1), got {betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))

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

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str) -> "EmbeddingOptimizerConfig":
        return cls(**known_keys(cls, values, where), where=where)


def known_keys(cls: type, values: Any, where: str, ignore: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """``values`` as a dict, refusing anything but a mapping of ``cls``'s dataclass fields
    (minus ``ignore``) with an error naming ``where``. None reads as an empty mapping."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: expected a mapping of keys to values, got {values!r}")
    known = {f.name for f in dataclasses.fields(cls)} - set(ignore)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(known)}")
    return dict(values)
