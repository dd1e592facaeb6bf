"""Rows touched by training: per table, the training step that last updated each row.

A delta export (``gr.export.delta``) of a run that tracked its rows reads only the rows updated
since its base was taken (``since``), not whole tables. Both sparse backends follow one rule, the
rows each training batch looks up, which are the rows its optimizer updates (lazy, row by row):
the torch backend's ``RowOptimizer`` hands them over as it updates them
(``gr.sparse.torch_tables.track_updated_rows``), TorchRec's ``ModelDeltaTracker`` records the ids
of each lookup of the sharded tables (``gr.sparse.torchrec_sharding.track_updated_rows``; a rank
records the rows of its own shards, merged by ``merged``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

NEVER = -1  # a row no training step of this run updated
Drain = Callable[[], Dict[str, Tensor]]  # -> {table: [n] int64 global row ids} looked up since the last call


class TouchedRows:
    """rows: {table: row count}. ``last[table]``: [rows] int64, the global step whose update last
    wrote each row (``NEVER``); ``since``: the step tracking began at (rows updated before it are
    not known: a run resumed from a checkpoint that tracked nothing)."""

    def __init__(self, rows: Mapping[str, int], since: int = 0) -> None:
        self.since = since
        self.last = {name: torch.full((count,), NEVER, dtype=torch.int64) for name, count in rows.items()}

    def record(self, touched: Mapping[str, Tensor], step: int) -> None:
        """touched: {table: [n] int64 row ids} the update of global step ``step`` wrote."""
        for name, ids in touched.items():
            if ids.numel():
                self.last[name].index_fill_(0, ids.to("cpu", torch.int64), step)

    def merged(self) -> Dict[str, Any]:
        """{"since", "tables": {table: [rows] int64}}: every rank's records together (a collective
        when torch.distributed runs: call on every rank), as a checkpoint keeps them."""
        tables = {}
        for name, last in self.last.items():
            last = last.clone()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(last, op=dist.ReduceOp.MAX)
            tables[name] = last
        return {"since": self.since, "tables": tables}

    def load(self, saved: Mapping[str, Any]) -> None:
        """Continue from ``merged()``'s dict (a resumed run); tables it lacks keep ``NEVER``."""
        self.since = int(saved["since"])
        for name, last in saved["tables"].items():
            if name in self.last and last.shape == self.last[name].shape:
                self.last[name].copy_(last)


def rows_since(saved: Mapping[str, Any], step: int) -> Dict[str, np.ndarray]:
    """saved: ``TouchedRows.merged()``'s dict (from a checkpoint) -> {table: [n] int64 ascending},
    the rows updated at global step ``step`` or later. ValueError when tracking began after ``step``."""
    since = int(saved["since"])
    if since > step:
        raise ValueError(f"rows were tracked from step {since} on, not from step {step}")
    return {name: np.flatnonzero(np.asarray(last) >= step).astype(np.int64) for name, last in saved["tables"].items()}
