"""Draft sources for speculative generation: retrieval pools (DARE) and a smaller draft model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, List, Optional, Protocol, Sequence, Set, Union

import torch
from torch import Tensor

from gr.generation.decoding import DecodeState, Drafter, GenerativeModel, advance, start, truncate
from gr.generation.draft_tree import DraftTree, tree_from_paths
from gr.generation.index import ItemIndex, exclusion_mask
from gr.generation.pools import GroupedPools, SequencePool


class PoolDrafter:
    """Draft trees from a ``SequencePool`` (the request's group pool), looked up by the last n items
    of the current sequence (n backs off while nothing matches); the request's own sequence is
    searched as a temporary branch. Paths stop before the first banned or repeated item."""

    def __init__(self, pool: SequencePool, max_depth: int = 8, max_nodes: int = 32) -> None:
        if max_depth < 1 or max_nodes < 1:
            raise ValueError("PoolDrafter: max_depth and max_nodes must be >= 1")
        self.pool, self.max_depth, self.max_nodes = pool, max_depth, max_nodes

    def propose(self, sequence: Sequence[int], depth: int, banned: Set[int]) -> DraftTree:
        found = self.pool.continuations(sequence, min(depth, self.max_depth), extra=[sequence])
        return tree_from_paths([_allowed_prefix(path, banned) for path, _ in found], self.max_nodes)


def _allowed_prefix(path: Sequence[int], banned: Set[int]) -> List[int]:
    out: List[int] = []
    for item in path:
        if item in banned or item in out:
            break
        out.append(item)
    return out


class ModelDrafter:
    """A smaller GR model proposes one branch greedily; it keeps its own KV cache of the request.

    items: [L] int64 history; timestamps: [L] int64; generated tokens get ``request_time``.
    """

    def __init__(
        self, model: GenerativeModel, index: ItemIndex, items: Tensor, timestamps: Tensor, request_time: int,
        max_depth: int = 8,
    ) -> None:
        if max_depth < 1:
            raise ValueError("ModelDrafter.max_depth must be >= 1")
        self.model, self.index, self.max_depth = model, index, max_depth
        self.history_timestamps, self.request_time = timestamps.to(torch.long), int(request_time)
        self.state = start(model, items, timestamps)

    def propose(self, sequence: Sequence[int], depth: int, banned: Set[int]) -> DraftTree:
        state = self._sync(list(sequence))
        branch: List[int] = []
        for _ in range(min(depth, self.max_depth)):
            _, ids = self.index.search(state.query.view(1, -1), exclusion_mask(self.index.num_items, 1, banned | set(branch)), 1)
            branch.append(int(ids[0, 0]))
            if len(branch) < min(depth, self.max_depth):
                state = self._extend(state, branch[-1:], len(state.items))
        self.state = state
        return tree_from_paths([_allowed_prefix(branch, banned)], self.max_depth)

    def _sync(self, sequence: List[int]) -> DecodeState:
        """The draft state of exactly ``sequence``: keep the common prefix, run the rest."""
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
        ts = torch.where(positions < history.numel(), history[positions.clamp(max=history.numel() - 1)],
                         torch.tensor(self.request_time))
        return advance(self.model, state, ids, self.model.item_tokens(ids), ts)


class DraftSource(Protocol):
    """Makes the drafter of one request."""

    def drafter(
        self, items: Tensor, timestamps: Tensor, request_time: int, user_query: Tensor, attribute: Optional[Hashable]
    ) -> Drafter:
        """items: [L] int64 history; timestamps: [L] int64; user_query: [d] float, the query at the
        last history token (the user embedding pools are grouped by); attribute: a cold user's key."""


@dataclass
class PoolDrafts:
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
class ModelDrafts:
    """Drafts from a smaller generative model over the same catalogue (assisted generation)."""

    model: GenerativeModel
    index: ItemIndex
    max_depth: int = 8

    def drafter(
        self, items: Tensor, timestamps: Tensor, request_time: int, user_query: Tensor, attribute: Optional[Hashable]
    ) -> ModelDrafter:
        return ModelDrafter(self.model, self.index, items, timestamps, request_time, self.max_depth)
