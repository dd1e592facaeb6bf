"""``catalogue_ranks`` and ``shared_ranks`` in PyTorch ops, any device."""

from __future__ import annotations

import torch
from torch import Tensor

from gr.jagged import token_seq_ids

INT16_COLUMNS = (1 << 15) - 1  # columns a row's int16 count can hold


def _row_counts(mask: Tensor) -> Tensor:
    """[R, I] bool -> [R] int64 the true entries of each row, summed in int16 a block of columns at a
    time (a bool tensor's int64 sum is several times slower)."""
    counts = torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    for column in range(0, mask.shape[1], INT16_COLUMNS):
        counts += mask[:, column : column + INT16_COLUMNS].sum(1, dtype=torch.int16)
    return counts


def catalogue_ranks(
    scores: Tensor, targets: Tensor, exclude_offsets: Tensor, exclude_items: Tensor, distinct: bool = False
) -> Tensor:
    """``gr.ops.catalogue_rank.catalogue_ranks``: count the items above each target (and those tying it
    with a smaller id), then take the excluded ones among them back."""
    rows, items = scores.shape
    target_scores = scores[torch.arange(rows, device=scores.device), targets].unsqueeze(1)
    ranks = _row_counts(scores > target_scores)
    tied = torch.nonzero(_row_counts(scores >= target_scores) - ranks > 1).flatten()  # another item ties it
    if tied.numel():
        ids = torch.arange(items, device=scores.device)
        ties = (scores[tied] == target_scores[tied]) & (ids < targets[tied].unsqueeze(1))
        ranks[tied] += _row_counts(ties)
    row, item = _excluded_pairs(exclude_offsets, exclude_items, items, distinct)
    excluded, target = scores[row, item], target_scores[row, 0]
    counted = (excluded > target) | ((excluded == target) & (item < targets[row]))
    return ranks - torch.bincount(row[counted], minlength=rows)


def place_ranks(
    place: Tensor, targets: Tensor, exclude_offsets: Tensor, exclude_items: Tensor, distinct: bool = False
) -> Tensor:
    """``gr.ops.catalogue_rank.shared_ranks`` from place: [I] int64, each item's position in the shared
    (-score, id) order."""
    row, item = _excluded_pairs(exclude_offsets, exclude_items, place.numel(), distinct)
    before = place[item] < place[targets[row]]
    return place[targets] - torch.bincount(row[before], minlength=targets.numel())


def _excluded_pairs(
    exclude_offsets: Tensor, exclude_items: Tensor, items: int, distinct: bool
) -> tuple[Tensor, Tensor]:
    """-> (row, item): [P] int64 each exclusion's row and item, an item listed twice for a row once."""
    start, stop = int(exclude_offsets[0]), int(exclude_offsets[-1])
    pairs = token_seq_ids(exclude_offsets - start, stop - start) * items + exclude_items[start:stop]
    pairs = pairs if distinct else torch.unique(pairs)
    return pairs // items, pairs % items
