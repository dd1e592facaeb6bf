"""Each evaluation target's rank among the whole catalogue by a score matrix, excluded items left out.

* native (``catalogue_rank.cpp``, namespace ``gr_cpu_rank`` of ``gr.ops.native``): float32 scores on CPU,
  one pass over each row;
* ``pytorch``: any device and dtype: the whole matrix compared with each row's target score, then
  the excluded items taken back.

``shared_ranks`` ranks by one score vector every row shares (item popularity) from one sort of the
catalogue, on the same two backends. Both count the same integers from finite scores (the caller
ranks non-finite ones its own way).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gr.ops.catalogue_rank import pytorch
from gr.ops.native import native_ops

__all__ = ["catalogue_ranks", "shared_ranks"]


def catalogue_ranks(
    scores: Tensor, targets: Tensor, exclude_offsets: Tensor, exclude_items: Tensor, distinct: bool = False
) -> Tensor:
    """0-based place of each target in its row's (-score, id) order, excluded items left out.

    scores: [R, I] float, every score finite; targets: [R] int64 in [0, I)
    exclude_offsets: [R+1] int64 positions into exclude_items (row r's: [offsets[r], offsets[r+1]);
        offsets[0] may be above 0, a chunk of a longer list); exclude_items: [E] int64 in [0, I)
    An item listed twice for a row is taken back once; a target among its own exclusions is still
    ranked. distinct: each row's exclusions are known to be distinct (skips looking for repeats on
    the pytorch path).
    returns: [R] int64
    """
    ops = native_ops("gr_cpu_rank") if scores.device.type == "cpu" and scores.dtype == torch.float32 else None
    if ops is None:
        return pytorch.catalogue_ranks(scores, targets, exclude_offsets, exclude_items, distinct)
    return ops.catalogue_ranks(scores.contiguous(), targets, exclude_offsets, exclude_items)


def shared_ranks(
    scores: Tensor, targets: Tensor, exclude_offsets: Tensor, exclude_items: Tensor, distinct: bool = False
) -> Tensor:
    """``catalogue_ranks`` of one score vector every row shares (scores: [I] float, finite): a target's
    place in the (-score, id) order, less the excluded items placed before it -> [R] int64."""
    count = scores.numel()
    place = torch.empty(count, dtype=torch.long, device=scores.device)
    place[torch.sort(scores, descending=True, stable=True).indices] = torch.arange(count, device=scores.device)
    ops = native_ops("gr_cpu_rank") if scores.device.type == "cpu" else None
    if ops is None:
        return pytorch.place_ranks(place, targets, exclude_offsets, exclude_items, distinct)
    return ops.place_ranks(place, targets, exclude_offsets, exclude_items)
