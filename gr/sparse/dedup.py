"""Distinct ids of a batch and where each id went: the "unique before lookup" step."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

# Up to this many table rows per id, a presence mask over the table beats sorting the ids.
MASK_ROWS_PER_ID = 64


def unique_ids(ids: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    """ids: [N] int64 in [0, num_rows) -> (distinct: [U] int64 ascending, inverse: [N] int64)
    with ``distinct[inverse] == ids``.

    Tables of at most ``MASK_ROWS_PER_ID * N`` rows mark the ids present in a mask over the
    rows (linear time); larger ones sort the ids (``torch.unique``).
    """
    if num_rows > MASK_ROWS_PER_ID * max(ids.numel(), 1):
        return torch.unique(ids, return_inverse=True)
    present = torch.zeros(num_rows, dtype=torch.bool, device=ids.device)
    present[ids] = True
    distinct = present.nonzero().squeeze(1)
    position = torch.cumsum(present, 0) - 1
    return distinct, position[ids]
