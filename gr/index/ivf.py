"""An inverted-file (IVF) approximate inner-product index over a large catalogue.

Items are clustered by spherical k-means (on a sample) into ``num_lists`` lists; a query scores
the list centroids, searches only the items of its ``probes`` best lists, and ranks those
exactly (lowest id first on ties, like ``ExactIndex``). With ``probes == num_lists`` it is exact.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from gr.index.exact import ItemMatrix, top_items


class IVFIndex(ItemMatrix):
    """Approximate ``ItemIndex`` over ``items: [M, d] float`` (rows already normalised).

    num_lists: clusters; probes: lists searched per query; train_size: items sampled for k-means
    """

    def __init__(
        self,
        items: Tensor,
        num_lists: int = 1024,
        probes: int = 16,
        train_size: int = 65536,
        iters: int = 10,
        seed: int = 0,
    ) -> None:
        super().__init__(items)
        if not 1 <= probes <= num_lists <= items.shape[0]:
            raise ValueError(
                f"IVFIndex: expected 1 <= probes <= num_lists <= items, got probes {probes}, "
                f"num_lists {num_lists}, {items.shape[0]} items"
            )
        self.probes = probes
        self.centroids = spherical_kmeans(self.items, num_lists, train_size, iters, seed)  # [C, d]
        lists = assign(self.items, self.centroids)  # [M]
        self.order = torch.argsort(lists, stable=True)  # item ids grouped by list, ascending within a list
        sizes = torch.bincount(lists, minlength=num_lists)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
        self.grouped = self.items[self.order]  # [M, d] rows in list order

    def candidates(self, query: Tensor) -> Tensor:
        """query: [d] -> [C] int64 ids of the items in its ``probes`` best lists (ascending)."""
        bounds = self.offsets.tolist()
        lists = self._lists(query.view(1, -1))[0].tolist()
        return torch.sort(torch.cat([self.order[bounds[c] : bounds[c + 1]] for c in lists])).values

    def search(self, queries: Tensor, exclude: Tensor, k: int) -> Tuple[Tensor, Tensor]:
        """queries: [Q, d]; exclude: [Q, M] bool -> (scores [Q, k], ids [Q, k]) among each query's probed
        lists; fewer than k allowed candidates pad with score -inf. The queries share one pass over the
        union of their lists (a batch of queries costs little more than one)."""
        probed = self._lists(queries)
        bounds = self.offsets.tolist()
        lists = torch.unique(probed).tolist()
        block = torch.cat([self.grouped[bounds[c] : bounds[c + 1]] for c in lists])  # [C, d], C = union size
        scores = queries.float() @ block.T  # [Q, C]
        member = torch.cat(
            [(probed == c).any(1, keepdim=True).expand(-1, bounds[c + 1] - bounds[c]) for c in lists], dim=1
        )  # [Q, C]: the item's list was probed by the query
        ids = torch.cat([self.order[bounds[c] : bounds[c + 1]] for c in lists])
        ids, by_id = torch.sort(ids)  # ascending ids: top_items breaks ties towards the lowest id
        scores, member = scores[:, by_id], member[:, by_id]
        best, at = top_items(scores, exclude[:, ids] | ~member, min(k, ids.numel()))
        out_scores = torch.full((queries.shape[0], k), float("-inf"))
        out_ids = torch.zeros(queries.shape[0], k, dtype=torch.long)
        out_scores[:, : best.shape[1]] = best
        out_ids[:, : best.shape[1]] = ids[at]
        return out_scores, out_ids

    def _lists(self, queries: Tensor) -> Tensor:
        """queries: [Q, d] -> [Q, probes] int64, each query's best lists."""
        return torch.topk(queries.float() @ self.centroids.T, self.probes, dim=1).indices


def assign(points: Tensor, centroids: Tensor, block: int = 65536) -> Tensor:
    """points: [N, d]; centroids: [C, d] -> [N] int64, the centroid of largest inner product."""
    return torch.cat([(points[i : i + block] @ centroids.T).argmax(1) for i in range(0, points.shape[0], block)])


def spherical_kmeans(points: Tensor, k: int, sample: int, iters: int, seed: int) -> Tensor:
    """points: [N, d] -> [k, d] unit centroids, fitted on at most ``sample`` points."""
    g = torch.Generator().manual_seed(seed)
    train = points[torch.randperm(points.shape[0], generator=g)[: max(sample, k)]]
    centroids = train[:k].clone()
    for _ in range(iters):
        lists = assign(train, centroids)
        sums = torch.zeros_like(centroids).index_add_(0, lists, train)
        empty = sums.norm(dim=1) == 0
        sums[empty] = centroids[empty]  # an empty list keeps its centroid
        centroids = torch.nn.functional.normalize(sums, dim=1)
    return centroids
