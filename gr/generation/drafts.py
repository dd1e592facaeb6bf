"""Draft sources for speculative generation: retrieval pools (DARE), a smaller draft model, and the
target's own ranking (self-drafting)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, List, Optional, Protocol, Sequence, Set, Tuple, Union

import torch
from torch import Tensor

from gr.generation.decoding import DecodeState, Drafter, GenerativeModel, advance, start
from gr.generation.draft_tree import DraftTree, tree_from_counted_paths
from gr.generation.pools import GroupedPools, SequencePool
from gr.hstu.user_state import truncate
from gr.index.exact import Exclusions, ItemIndex


class PoolDrafter:
    """Draft trees from a ``SequencePool`` (the request's group pool), looked up by the last n items
    of the current sequence (n backs off while nothing matches); the request's own sequence is
    searched as a temporary branch (indexed incrementally as it grows). Paths stop before the first
    banned or repeated item; the tree keeps the most frequent prefixes (``tree_from_counted_paths``)."""

    def __init__(self, pool: SequencePool, max_depth: int = 8, max_nodes: int = 32) -> None:
        if max_depth < 1 or max_nodes < 1:
            raise ValueError("PoolDrafter: max_depth and max_nodes must be >= 1")
        self.pool, self.max_depth, self.max_nodes = pool, max_depth, max_nodes
        self.own = SequencePool(pool.max_ngram, pool.max_occurrences)

    def propose(
        self,
        sequence: Sequence[int],
        depth: int,
        banned: Set[int],
        max_nodes: Optional[int] = None,
        query: Optional[Tensor] = None,
    ) -> DraftTree:
        if not self.own.sequences:
            self.own.add(sequence)
        else:
            known = self.own.sequences[0]
            if tuple(sequence[: len(known)]) != known:  # not a continuation: index it afresh
                self.own = SequencePool(self.pool.max_ngram, self.pool.max_occurrences)
                self.own.add(sequence)
            else:
                self.own.extend(0, sequence[len(known) :])
        found = self.pool.continuations(sequence, min(depth, self.max_depth), extra=[self.own])
        nodes = self.max_nodes if max_nodes is None else min(max_nodes, self.max_nodes)
        return tree_from_counted_paths([(_allowed_prefix(path, banned), count) for path, count in found], nodes)


def _allowed_prefix(path: Sequence[int], banned: Set[int]) -> List[int]:
    out: List[int] = []
    for item in path:
        if item in banned or item in out:
            break
        out.append(item)
    return out


class ModelDrafter:
    """A smaller GR model drafts greedily; it keeps its own KV cache of the request, encoding the
    history on the first ``propose`` (a request that never drafts never runs the draft model).

    Each round drafts one greedy branch of up to ``max_depth`` items (one draft pass per item)
    and, at every level, its next ``width - 1`` best items as extra leaves: the target verifies
    them in the same pass, so a near miss of the draft still advances by one item.
    items: [L] int64 history; timestamps: [L] int64; generated tokens get ``request_time``.
    """

    def __init__(
        self,
        model: GenerativeModel,
        index: ItemIndex,
        items: Tensor,
        timestamps: Tensor,
        request_time: int,
        max_depth: int = 8,
        width: int = 1,
    ) -> None:
        if max_depth < 1 or width < 1:
            raise ValueError("ModelDrafter: max_depth and width must be >= 1")
        self.model, self.index, self.max_depth, self.width = model, index, max_depth, width
        self.history_items, self.request_time = items, int(request_time)
        self.history_timestamps = timestamps.to(torch.long)
        self.state: Optional[DecodeState] = None

    def propose(
        self,
        sequence: Sequence[int],
        depth: int,
        banned: Set[int],
        max_nodes: Optional[int] = None,
        query: Optional[Tensor] = None,
    ) -> DraftTree:
        depth = min(depth, self.max_depth)
        width = self.width if max_nodes is None else max(1, min(self.width, max_nodes // max(depth, 1)))
        state = self._sync(list(sequence))
        items: List[int] = []
        parents: List[int] = []
        chain = -1  # the node of the branch's last item
        exclusions = Exclusions(self.index.num_items, banned)  # and the branch's items
        for level in range(depth):
            scores, ids = self.index.search(state.query.view(1, -1), exclusions.rows(1), width)
            ranked = [int(i) for s, i in zip(scores[0].tolist(), ids[0].tolist()) if s > float("-inf")]
            if not ranked:
                break
            for item in ranked:
                items.append(item)
                parents.append(chain)
            chain = len(items) - len(ranked)  # the greedy item continues the branch
            exclusions.add(ranked[:1])
            if level + 1 < depth:
                state = self._extend(state, [ranked[0]], len(state.items))
        self.state = state
        return DraftTree(torch.tensor(items, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def _sync(self, sequence: List[int]) -> DecodeState:
        """The draft state of exactly ``sequence``: keep the common prefix, run the rest."""
        if self.state is None:
            self.state = start(self.model, self.history_items, self.history_timestamps, self.request_time)
        state, common = self.state, 0
        if state.items == sequence:
            return state
        limit = min(len(state.items), len(sequence) - 1)  # the last token is rerun to get its query
        while common < limit and state.items[common] == sequence[common]:
            common += 1
        kept = DecodeState(truncate(state.cache, common), state.items[:common], state.query)
        return self._extend(kept, sequence[common:], common)

    def _extend(self, state: DecodeState, items: List[int], at: int) -> DecodeState:
        ids = torch.tensor(items)
        positions = torch.arange(at, at + len(items))
        history = self.history_timestamps
        ts = torch.where(
            positions < history.numel(),
            history[positions.clamp(max=history.numel() - 1)],
            torch.tensor(self.request_time),
        )
        return advance(self.model, state, ids, self.model.item_tokens(ids), ts)


class RankingDrafter:
    """Self-drafting from the target's own ranking (no pool, no draft model): appending one item moves
    the query little, so the next greedy items are mostly runners-up of the query that picked the
    last one. The tree's level-d nodes are the best ``widths[d-1]`` runners-up not yet on their
    branch (breadth first, so a node budget keeps the shallow levels).
    """

    def __init__(self, index: ItemIndex, widths: Sequence[int] = (16, 3, 2, 1), max_nodes: int = 32) -> None:
        if not widths or min(widths) < 1 or max_nodes < 1:
            raise ValueError("RankingDrafter: widths must be a non-empty list of ints >= 1, max_nodes >= 1")
        self.index, self.widths, self.max_nodes = index, tuple(widths), max_nodes
        self.exclusions = Exclusions(index.num_items)  # ``banned`` only grows within a request

    def propose(
        self,
        sequence: Sequence[int],
        depth: int,
        banned: Set[int],
        max_nodes: Optional[int] = None,
        query: Optional[Tensor] = None,
    ) -> DraftTree:
        if query is None:
            raise ValueError("RankingDrafter.propose: needs the target's query")
        depth = min(depth, len(self.widths))
        budget = self.max_nodes if max_nodes is None else min(max_nodes, self.max_nodes)
        if not self.exclusions.items <= banned:
            self.exclusions = Exclusions(self.index.num_items)
        self.exclusions.add(banned - self.exclusions.items)
        needed = min(sum(self.widths[:depth]), self.index.num_items)
        # drafts need no tie order: a plain top-k (verification decides)
        scores = self.index.scores(query.view(1, -1))[0].masked_fill(self.exclusions.mask, float("-inf"))
        best, ids = torch.topk(scores, needed)
        ranked = [i for s, i in zip(best.tolist(), ids.tolist()) if s > float("-inf")]
        items: List[int] = []
        parents: List[int] = []
        branches: List[Tuple[int, ...]] = []
        frontier: List[int] = [-1]
        for level in range(depth):
            next_frontier = []
            for node in frontier:
                on_branch = set(branches[node]) if node >= 0 else set()
                for item in [i for i in ranked if i not in on_branch][: self.widths[level]]:
                    if len(items) == budget:
                        return DraftTree(torch.tensor(items, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
                    items.append(item)
                    parents.append(node)
                    branches.append((branches[node] if node >= 0 else ()) + (item,))
                    next_frontier.append(len(items) - 1)
            frontier = next_frontier
        return DraftTree(torch.tensor(items, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


class DraftSource(Protocol):
    """Makes the drafter of one request."""

    def drafter(
        self, items: Tensor, timestamps: Tensor, request_time: int, user_query: Tensor, attribute: Optional[Hashable]
    ) -> Drafter:
        """items: [L] int64 history; timestamps: [L] int64; user_query: [d] float, the query at the
        last history token (the user embedding pools are grouped by); attribute: a cold user's key."""


@dataclass
class PoolDraftSource:
    """Drafts from retrieval pools: one pool for everyone, or ``GroupedPools`` routed per user
    (by the user embedding when the history has at least ``min_history`` items, else by attribute)."""

    pools: Union[SequencePool, GroupedPools]
    max_depth: int = 8
    max_nodes: int = 32
    min_history: int = 1

    def drafter(
        self, items: Tensor, timestamps: Tensor, request_time: int, user_query: Tensor, attribute: Optional[Hashable]
    ) -> PoolDrafter:
        pool = self.pools
        if isinstance(pool, GroupedPools):
            warm = items.numel() >= self.min_history
            pool = pool.route(user_query if warm else None, attribute)
        return PoolDrafter(pool, self.max_depth, self.max_nodes)


@dataclass
class ModelDraftSource:
    """Drafts from a smaller generative model over the same catalogue (assisted generation)."""

    model: GenerativeModel
    index: ItemIndex
    max_depth: int = 8
    width: int = 1

    def drafter(
        self, items: Tensor, timestamps: Tensor, request_time: int, user_query: Tensor, attribute: Optional[Hashable]
    ) -> ModelDrafter:
        return ModelDrafter(self.model, self.index, items, timestamps, request_time, self.max_depth, self.width)


@dataclass
class RankingDraftSource:
    """Self-drafts from the target's own ranking over ``index`` (see ``RankingDrafter``)."""

    index: ItemIndex
    widths: Sequence[int] = (16, 3, 2, 1)
    max_nodes: int = 32

    def drafter(
        self, items: Tensor, timestamps: Tensor, request_time: int, user_query: Tensor, attribute: Optional[Hashable]
    ) -> RankingDrafter:
        return RankingDrafter(self.index, self.widths, self.max_nodes)
