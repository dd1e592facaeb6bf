"""Retrieval pools for draft proposals (DARE): n-gram-indexed item sequences per user group."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from gr.generation.draft_tree import DraftTree, tree_from_counted_paths


class SequencePool:
    """Item sequences indexed by their n-grams (n = 1..max_ngram).

    ``propose(context, depth)`` finds the longest suffix of ``context`` (at most
    ``max_ngram`` items, shrinking while nothing matches) that occurs in the pool and
    returns what followed it, most frequent continuation first.
    """

    def __init__(self, max_ngram: int = 3, max_occurrences: int = 256) -> None:
        if max_ngram < 1 or max_occurrences < 1:
            raise ValueError("SequencePool: max_ngram and max_occurrences must be >= 1")
        self.max_ngram = max_ngram
        self.max_occurrences = max_occurrences
        self.sequences: List[Tuple[int, ...]] = []
        self._index: Dict[Tuple[int, ...], List[Tuple[int, int]]] = defaultdict(list)

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, sequence: Sequence[int]) -> int:
        """Index one item sequence (a user's history, or a generated slate) -> its sequence id."""
        self.sequences.append(())
        self.extend(len(self.sequences) - 1, sequence)
        return len(self.sequences) - 1

    def extend(self, sid: int, items: Sequence[int]) -> None:
        """Append items to sequence ``sid``, indexing only the n-grams the new items complete
        (a request's own growing sequence is kept this way)."""
        old = self.sequences[sid]
        seq = old + tuple(int(i) for i in items)
        self.sequences[sid] = seq
        for end in range(max(len(old), 1), len(seq)):  # an n-gram ending at `end` - 1, continued from `end`
            for n in range(1, min(self.max_ngram, end) + 1):
                hits = self._index[seq[end - n : end]]
                if len(hits) < self.max_occurrences:
                    hits.append((sid, end))

    def continuations(
        self, context: Sequence[int], depth: int, extra: Sequence["SequencePool"] = ()
    ) -> List[Tuple[Tuple[int, ...], int]]:
        """-> [(continuation of up to ``depth`` items, count)], most frequent first.

        extra: pools searched too, e.g. the request's own sequence (a temporary branch, never kept here).
        """
        context = tuple(int(i) for i in context[-self.max_ngram :])
        pools = (self, *extra)
        for n in range(len(context), 0, -1):
            key = context[-n:]
            found: Counter = Counter()
            for pool in pools:
                for sid, end in pool._index.get(key, ()):
                    cont = pool.sequences[sid][end : end + depth]
                    if cont:
                        found[cont] += 1
            if found:
                return found.most_common()
        return []

    def propose(
        self, context: Sequence[int], depth: int, max_nodes: int, extra: Sequence["SequencePool"] = ()
    ) -> DraftTree:
        """A draft tree of the ``max_nodes`` most frequent continuation prefixes, at most ``depth``
        levels (empty if nothing matches)."""
        return tree_from_counted_paths(self.continuations(context, depth, extra), max_nodes)


def kmeans(points: Tensor, k: int, iters: int = 25, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """points: [U, d] float -> (centroids [k', d], assignment [U] int64), k' = min(k, U)."""
    k = min(k, points.shape[0])
    g = torch.Generator().manual_seed(seed)
    centroids = points[torch.randperm(points.shape[0], generator=g)[:k]].clone()
    assign = torch.zeros(points.shape[0], dtype=torch.long)
    for _ in range(iters):
        assign = torch.cdist(points, centroids).argmin(dim=1)
        for c in range(k):
            members = points[assign == c]
            if members.numel():
                centroids[c] = members.mean(0)
    return centroids, assign


@dataclass
class GroupedPools:
    """One ``SequencePool`` per user group, and the router that picks a user's group.

    Users with enough history are grouped by clustering their embeddings (the
    model's representation of the user); a cold user is routed by attributes (the
    group most common among clustered users sharing the attribute key), else to the
    pool of everyone.
    """

    centroids: Tensor  # [G, d]
    pools: List[SequencePool]  # G group pools
    everyone: SequencePool
    attribute_groups: Dict[Hashable, int] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        sequences: Sequence[Sequence[int]],
        user_embeddings: Tensor,
        num_groups: int,
        attributes: Optional[Sequence[Hashable]] = None,
        max_ngram: int = 3,
        seed: int = 0,
    ) -> "GroupedPools":
        """sequences: U item sequences; user_embeddings: [U, d]; attributes: U keys or None."""
        if len(sequences) != user_embeddings.shape[0]:
            raise ValueError("GroupedPools.build: one embedding per sequence expected")
        centroids, assign = kmeans(user_embeddings.float(), num_groups, seed=seed)
        pools = [SequencePool(max_ngram) for _ in range(centroids.shape[0])]
        everyone = SequencePool(max_ngram)
        for seq, group in zip(sequences, assign.tolist()):
            pools[group].add(seq)
            everyone.add(seq)
        votes: Dict[Hashable, Counter] = defaultdict(Counter)
        for key, group in zip(attributes or (), assign.tolist()):
            votes[key][group] += 1
        attribute_groups = {key: counter.most_common(1)[0][0] for key, counter in votes.items()}
        return cls(centroids, pools, everyone, attribute_groups)

    def route(self, user_embedding: Optional[Tensor] = None, attribute: Optional[Hashable] = None) -> SequencePool:
        """user_embedding: [d] (users with history) or attribute (cold users) -> their pool."""
        if user_embedding is not None:
            return self.pools[int(torch.cdist(user_embedding.float().view(1, -1), self.centroids).argmin())]
        if attribute is not None and attribute in self.attribute_groups:
            return self.pools[self.attribute_groups[attribute]]
        return self.everyone
