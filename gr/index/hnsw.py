"""An approximate ``ItemIndex`` behind the same calls as ``ExactIndex``: FAISS HNSW graph search
(inner product) for ``search``; ``scores`` and ``scores_of`` stay exact.

Optional: needs the ``faiss-cpu`` package (``pip install 'gr[faiss]'``), imported only when an
index is built. A search asks the graph for ``k`` plus the row's excluded count, drops excluded
items, and falls back to exact search for a row left with fewer than ``k``. Several queries go
to FAISS in one call, and each row's answer is the one it gets alone: while FAISS is asked for
at most ``ef_search`` items its graph walk does not depend on how many, so rows asking for up to
``ef_search`` share a call and keep their own count; rows asking for more share a call with
rows asking for as many.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch
from torch import Tensor

from gr.index.exact import ItemMatrix, top_items


class HNSWIndex(ItemMatrix):
    """Approximate inner-product search over ``items: [M, d] float`` (rows already normalised).

    neighbours: HNSW graph degree (M in FAISS); ef_search: candidate list size at query time
    (larger: closer to exact, slower)."""

    def __init__(self, items: Tensor, neighbours: int = 32, ef_search: int = 128) -> None:
        try:
            import faiss
        except ImportError:
            raise ImportError("HNSWIndex needs the faiss-cpu package: pip install faiss-cpu") from None
        super().__init__(items)
        self._index = faiss.IndexHNSWFlat(int(items.shape[1]), neighbours, faiss.METRIC_INNER_PRODUCT)
        self._index.hnsw.efSearch = ef_search
        self.ef_search = ef_search
        self._index.add(self.items.numpy())

    def search(self, queries: Tensor, exclude: Tensor, k: int) -> Tuple[Tensor, Tensor]:
        """queries: [Q, d]; exclude: [Q, M] bool -> (scores [Q, k], ids [Q, k]), best first (lower id on ties)."""
        if exclude.shape != (queries.shape[0], self.num_items):
            raise ValueError(
                f"exclude: expected shape {(queries.shape[0], self.num_items)}, got {tuple(exclude.shape)}"
            )
        wanted = (k + exclude.sum(1)).clamp(max=self.num_items).tolist()  # per row: k + its excluded items
        found = self._found(queries.float().contiguous().numpy(), wanted)
        out_scores, out_ids = [], []
        for row in range(queries.shape[0]):
            ids = torch.from_numpy(found[row][found[row] >= 0].astype(np.int64))
            ids = ids[~exclude[row, ids]]
            if ids.numel() < k:  # the graph returned too few eligible items: exact search for this row
                scores, best = top_items(self.scores(queries[row : row + 1]), exclude[row : row + 1], k)
                out_scores.append(scores[0])
                out_ids.append(best[0])
                continue
            ids, _ = torch.sort(ids)
            scores = self.scores_of(queries[row : row + 1], ids)[0]
            order = torch.sort(scores, descending=True, stable=True).indices[:k]
            out_scores.append(scores[order])
            out_ids.append(ids[order])
        return torch.stack(out_scores), torch.stack(out_ids)

    def _found(self, queries: np.ndarray, wanted: List[int]) -> List[np.ndarray]:
        """queries: [Q, d] -> per row, the ids of its ``wanted[row]`` nearest items by the graph."""
        groups: Dict[int, List[int]] = {}
        for row, count in enumerate(wanted):
            groups.setdefault(max(count, self.ef_search), []).append(row)
        found: List[np.ndarray] = [np.zeros(0, dtype=np.int64)] * len(wanted)
        for rows in groups.values():
            _, ids = self._index.search(queries[rows], max(wanted[row] for row in rows))
            for i, row in enumerate(rows):
                found[row] = ids[i, : wanted[row]]
        return found
