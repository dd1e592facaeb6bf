"""The torch backend's embedding optimizers: FBGEMM's fused update rules, on the rows a batch looked up.

A table's ``RowOptimizer`` receives, in the lookup's backward (``gr.sparse.torch_tables``), the
ids and their gradients, sums the gradients of repeated ids (one row gradient ``g`` per distinct
id, as FBGEMM's backward does) and updates those rows of the weight and of its state in place;
the weight never holds a gradient and rows not looked up are left alone (lazy, like FBGEMM).
With ``w`` a row (stored width ``D``, padding columns included), ``t`` the step:

    sgd                   w -= lr g
    adagrad               m += g^2;                                 w -= lr g / (sqrt(m) + eps)
    rowwise_adagrad       g' = g + wd w;  m += mean_D(g'^2) [row];  w -= lr g' / (sqrt(m) + eps)
    adam                  m1 = b1 m1 + (1 - b1) g;  m2 = b2 m2 + (1 - b2) g^2
                          w -= lr (m1 / (1 - b1^t) / (sqrt(m2 / (1 - b2^t)) + eps) + wd w)
    partial_rowwise_adam  as adam, m2 one value per row: b2 m2 + (1 - b2) mean_D(g^2)

``TableOptimizers`` holds every table's and reads and writes their state in the layout of
TorchRec's fused optimizer (``{"state": {weight name: {"<table>.momentum1": ..., "<table>.exp_avg_sq":
...}}}``, same shapes), so a checkpoint's ``sparse_optimizer`` loads under either backend.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from gr.sparse.dedup import unique_ids
from gr.sparse.optimizer import EmbeddingOptimizerConfig

# State tensors per optimizer type, named as TorchRec's fused optimizer names them; True: one value per row.
STATE: Dict[str, Tuple[Tuple[str, bool], ...]] = {
    "sgd": (),
    "adagrad": (("momentum1", False),),
    "rowwise_adagrad": (("momentum1", True),),
    "adam": (("momentum1", False), ("exp_avg_sq", False)),
    "partial_rowwise_adam": (("momentum1", False), ("exp_avg_sq", True)),
}


class RowOptimizer:
    """One table's optimizer. weight: [rows, D] float, updated in place; its state lives beside it.

    ``step`` counts updates (Adam's bias correction); ``TableOptimizers.resume_at`` sets it on resume.
    ``updated``: None, or a list each update appends the rows it wrote to ([n] int64, distinct).
    """

    def __init__(self, config: EmbeddingOptimizerConfig, weight: Tensor) -> None:
        self.config = config
        self.weight = weight
        self.step = 0
        self.updated: Optional[List[Tensor]] = None
        rows = weight.shape[0]
        self.state = {
            name: torch.zeros(rows if per_row else weight.shape, dtype=torch.float32, device=weight.device)
            for name, per_row in STATE[config.type]
        }

    @torch.no_grad()
    def update(self, ids: Tensor, grad: Tensor) -> None:
        """ids: [N] int64 rows looked up (repeats allowed); grad: [N, D] float, the loss's gradient per id."""
        rows, inverse = unique_ids(ids, self.weight.shape[0])
        g = grad.new_zeros(rows.numel(), grad.shape[1]).index_add_(0, inverse, grad).to(self.weight.dtype)
        self.step += 1
        w = self.weight.index_select(0, rows)
        self.weight.index_copy_(0, rows, getattr(self, f"_{self.config.type}")(rows, w, g))
        if self.updated is not None:
            self.updated.append(rows)

    def _sgd(self, rows: Tensor, w: Tensor, g: Tensor) -> Tensor:
        return w - self.config.lr * g

    def _adagrad(self, rows: Tensor, w: Tensor, g: Tensor) -> Tensor:
        c = self.config
        m = self._advance("momentum1", rows, g.square(), 1.0, 1.0)
        return w - c.lr * g / (m.sqrt() + c.eps)

    def _rowwise_adagrad(self, rows: Tensor, w: Tensor, g: Tensor) -> Tensor:
        c = self.config
        g = g + c.weight_decay * w if c.weight_decay else g
        m = self._advance("momentum1", rows, g.square().mean(1), 1.0, 1.0)
        return w - (c.lr / (m.sqrt() + c.eps)).unsqueeze(1) * g

    def _adam(self, rows: Tensor, w: Tensor, g: Tensor) -> Tensor:
        return self._adam_update(rows, w, g, g.square())

    def _partial_rowwise_adam(self, rows: Tensor, w: Tensor, g: Tensor) -> Tensor:
        return self._adam_update(rows, w, g, g.square().mean(1))

    def _adam_update(self, rows: Tensor, w: Tensor, g: Tensor, g2: Tensor) -> Tensor:
        """g2: [U, D] or [U] (one second moment per row)."""
        c = self.config
        b1, b2 = c.betas
        m1 = self._advance("momentum1", rows, g, b1, 1.0 - b1)
        m2 = self._advance("exp_avg_sq", rows, g2, b2, 1.0 - b2)
        m2_hat = (m2 / (1.0 - math.pow(b2, self.step))).reshape(rows.numel(), -1)
        direction = m1 / (1.0 - math.pow(b1, self.step)) / (m2_hat.sqrt() + c.eps)
        return w - c.lr * (direction + c.weight_decay * w)

    def _advance(self, name: str, rows: Tensor, value: Tensor, decay: float, scale: float) -> Tensor:
        """state[name][rows] = decay * state[name][rows] + scale * value; returns the new rows."""
        state = self.state[name]
        new = state.index_select(0, rows).mul_(decay).add_(value, alpha=scale)
        state.index_copy_(0, rows, new)
        return new


class TableOptimizers:
    """Every table's RowOptimizer: {name of the table's weight in the model: (table name, optimizer)}."""

    def __init__(self, optimizers: Mapping[str, Tuple[str, RowOptimizer]]) -> None:
        self.optimizers = dict(optimizers)

    def state_dict(self) -> Dict[str, Any]:
        """TorchRec's fused-optimizer layout; the tensors are the live state (loading into them restores it)."""
        return {
            "state": {
                weight: {f"{table}.{name}": value for name, value in optimizer.state.items()}
                for weight, (table, optimizer) in self.optimizers.items()
            }
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy the state of ``state_dict`` (``state_dict()``'s layout) into every table's."""
        state = state_dict.get("state", {})
        for weight, (table, optimizer) in self.optimizers.items():
            saved = state.get(weight, {})
            for name, value in optimizer.state.items():
                key = f"{table}.{name}"
                if key not in saved:
                    raise KeyError(f"sparse_optimizer: no state {key!r} for {weight} (has {sorted(saved)})")
                if value.data_ptr() != saved[key].data_ptr():
                    value.copy_(saved[key])

    def resume_at(self, step: int) -> None:
        """Continue counting steps from ``step`` (the training step a checkpoint was taken at)."""
        for _, optimizer in self.optimizers.values():
            optimizer.step = step
