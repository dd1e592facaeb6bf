"""Draft tokens laid out as a tree (speculative decoding): branches causal, invisible to each other."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftTree:
    """Nodes in topological order (a parent always before its children).

    items: [M] int64, the draft item of each node
    parents: [M] int64, parent node index; -1 for children of the root (the sequence end)
    """

    items: Tensor
    parents: Tensor

    def __post_init__(self) -> None:
        if self.items.shape != self.parents.shape or self.items.dim() != 1:
            raise ValueError("DraftTree: items and parents must both be [M]")
        if bool((self.parents >= torch.arange(self.parents.numel())).any()):
            raise ValueError("DraftTree.parents: every parent must come before its child")

    @property
    def num_nodes(self) -> int:
        return int(self.items.numel())

    @cached_property
    def ancestors(self) -> List[List[int]]:
        """Per node: itself and its ancestors, nearest first."""
        out: List[List[int]] = []
        for i, p in enumerate(self.parents.tolist()):
            out.append([i] + (out[p] if p >= 0 else []))
        return out

    @property
    def depth(self) -> int:
        """Levels of the tree (0 when empty)."""
        return max((len(a) for a in self.ancestors), default=0)

    def depths(self) -> Tensor:
        """[M] int64, 1 for children of the root."""
        return torch.tensor([len(a) for a in self.ancestors], dtype=torch.long)

    def ancestor_mask(self) -> Tensor:
        """[M, M] bool: node i may attend to node j iff j is i or an ancestor of i."""
        rows = [i for i, a in enumerate(self.ancestors) for _ in a]
        cols = [j for a in self.ancestors for j in a]
        mask = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool)
        mask[torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)] = True
        return mask

    def children(self) -> Dict[int, List[int]]:
        """{node (-1 = root): child nodes in order}."""
        out: Dict[int, List[int]] = {-1: []}
        for i, p in enumerate(self.parents.tolist()):
            out.setdefault(p, []).append(i)
            out.setdefault(i, [])
        return out

    def branches(self) -> List[List[int]]:
        """Root-to-leaf node paths."""
        kids = self.children()
        paths: List[List[int]] = []
        stack: List[Tuple[int, List[int]]] = [(c, [c]) for c in reversed(kids[-1])]
        while stack:
            node, path = stack.pop()
            if not kids[node]:
                paths.append(path)
            stack.extend((c, path + [c]) for c in reversed(kids[node]))
        return paths


def tree_from_paths(paths: Sequence[Sequence[int]], max_nodes: int) -> DraftTree:
    """Merge item paths (most useful first) into a prefix tree of at most ``max_nodes`` nodes.

    Shared prefixes become shared nodes; a path is cut where the node budget ends.
    """
    items: List[int] = []
    parents: List[int] = []
    index: Dict[Tuple[int, ...], int] = {}
    for path in paths:
        parent = -1
        for depth in range(1, len(path) + 1):
            key = tuple(path[:depth])
            if key not in index:
                if len(items) >= max_nodes:
                    break
                index[key] = len(items)
                items.append(int(path[depth - 1]))
                parents.append(parent)
            parent = index[key]
    return DraftTree(torch.tensor(items, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def tree_from_counted_paths(paths: Sequence[Tuple[Sequence[int], int]], max_nodes: int) -> DraftTree:
    """Merge (item path, count) pairs into a prefix tree of the ``max_nodes`` most frequent prefixes.

    A prefix's weight is the total count of the paths through it; nodes are taken best first (a
    child only after its parent; equal weights: the earlier path first), so a small budget keeps
    the likeliest next items and the likeliest continuations of them (DARE's frequency trie),
    not the first few whole paths. Paths are grouped lazily: only taken nodes split their group.
    """
    items: List[int] = []
    parents: List[int] = []
    # (-weight, first path, item, parent node, level of the item, paths through it)
    frontier: List[Tuple[int, int, int, int, int, List[Tuple[int, Sequence[int], int]]]] = []

    def split(group: List[Tuple[int, Sequence[int], int]], level: int, parent: int) -> None:
        """Push the items at ``level`` of the paths in ``group`` (all sharing the parent's prefix)."""
        by_item: Dict[int, list] = {}
        for order, path, count in group:
            if len(path) > level:
                entry = by_item.get(int(path[level]))
                if entry is None:
                    entry = by_item[int(path[level])] = [0, order, []]
                entry[0] += count
                entry[2].append((order, path, count))
        for item, (weight, order, members) in by_item.items():
            heapq.heappush(frontier, (-weight, order, item, parent, level, members))

    split([(order, path, count) for order, (path, count) in enumerate(paths)], 0, -1)
    while frontier and len(items) < max_nodes:
        _, _, item, parent, level, members = heapq.heappop(frontier)
        items.append(item)
        parents.append(parent)
        split(members, level + 1, len(items) - 1)
    return DraftTree(torch.tensor(items, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
