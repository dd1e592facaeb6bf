"""Maximum-inner-product search over the item catalogue, with per-query exclusions.

Ties are broken towards the lowest item id everywhere, so greedy generation is
deterministic and speculative verification can reproduce it exactly.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Set, Tuple

import torch
from torch import Tensor


class ItemIndex(Protocol):
    """A nearest-neighbour index over the catalogue (exact, or approximate behind the same calls)."""

    @property
    def num_items(self) -> int: ...

    def scores(self, queries: Tensor) -> Tensor:
        """queries: [Q, d] float -> [Q, M] inner products with every item."""

    def scores_of(self, queries: Tensor, items: Tensor) -> Tensor:
        """queries: [Q, d] float; items: [C] int64 -> [Q, C] inner products with those items only."""

    def search(self, queries: Tensor, exclude: Tensor, k: int) -> Tuple[Tensor, Tensor]:
        """queries: [Q, d] float; exclude: [Q, M] bool -> (scores [Q, k], item ids [Q, k] int64), best first."""


class ItemMatrix:
    """The catalogue's ``items: [M, d] float`` (rows already normalised) and exact inner products with it:
    what every index shares, whatever its ``search``."""

    def __init__(self, items: Tensor) -> None:
        if items.dim() != 2 or items.shape[0] == 0:
            raise ValueError(
                f"{type(self).__name__}.items: expected a non-empty [M, d] matrix, got {tuple(items.shape)}"
            )
        self.items = items.float().contiguous()

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])

    def scores(self, queries: Tensor) -> Tensor:
        """queries: [Q, d] -> exact [Q, M] inner products (what relaxed verification and sampling read)."""
        return queries.float() @ self.items.T

    def scores_of(self, queries: Tensor, items: Tensor) -> Tensor:
        return queries.float() @ self.items[items].T


class ExactIndex(ItemMatrix):
    """Exact, batched inner-product search over ``items: [M, d] float`` (rows already normalised)."""

    def search(self, queries: Tensor, exclude: Tensor, k: int) -> Tuple[Tensor, Tensor]:
        return top_items(self.scores(queries), exclude, k)


def top_items(scores: Tensor, exclude: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """scores: [Q, M] float; exclude: [Q, M] bool -> the k best non-excluded (scores [Q, k], ids [Q, k]).

    Equal scores rank the lower id first; excluded items come out with score -inf only when
    fewer than k items remain.
    """
    if scores.shape != exclude.shape:
        raise ValueError(f"exclude: expected shape {tuple(scores.shape)}, got {tuple(exclude.shape)}")
    masked = scores.masked_fill(exclude, float("-inf"))
    if k == 1:  # argmax returns the first (lowest-id) maximum
        ids = masked.argmax(dim=1, keepdim=True)
        return masked.gather(1, ids), ids
    k = min(k, masked.shape[1])
    # a top-k, not a sort of the catalogue: one extra item shows whether ties cross the k-th place;
    # if they do, every item tied with the k-th is a candidate. Then order by score, lowest id first.
    values, ids = torch.topk(masked, min(k + 1, masked.shape[1]), dim=1)
    if values.shape[1] > k and bool((values[:, k] == values[:, k - 1]).any()):
        wide = int((masked >= values[:, k - 1 : k]).sum(1).max())
        values, ids = torch.topk(masked, wide, dim=1)
    by_id = torch.argsort(ids, dim=1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :k]
    return values.gather(1, order), ids.gather(1, order)


def exclusion_mask(num_items: int, rows: int, banned: Set[int]) -> Tensor:
    """[rows, num_items] bool with every ``banned`` item excluded on every row."""
    mask = torch.zeros(rows, num_items, dtype=torch.bool)
    if banned:
        mask[:, torch.tensor(sorted(banned))] = True
    return mask


class Exclusions:
    """The items a request may no longer generate: a set and its [M] bool mask, updated together."""

    def __init__(self, num_items: int, items: Iterable[int] = ()) -> None:
        self.items: Set[int] = set()
        self.mask = torch.zeros(num_items, dtype=torch.bool)
        self.add(items)

    def add(self, items: Iterable[int]) -> None:
        new = [int(i) for i in items if int(i) not in self.items]
        if new:
            self.items.update(new)
            self.mask[torch.tensor(new, dtype=torch.long)] = True

    def rows(self, n: int) -> Tensor:
        """[n, M] bool read-only view: the mask on every row."""
        return self.mask.expand(n, -1)
