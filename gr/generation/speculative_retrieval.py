"""Speculative retrieval (RaLMSpec) for greedy generation over a large catalogue.

Each step's nearest-neighbour search is answered from a small local candidate cache (items
the exact index returned for earlier queries of the request); every ``stride`` steps the
pending answers are checked against the full index in one batched query, and generation rolls
back to the first mismatch (replaced by the exact answer). Every returned item has been
confirmed by the exact index with the same exclusions, so the slate equals exact greedy's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Set

import torch

from gr.generation.decoding import DecodeState, Generation, GenerationStats, GenerativeModel, step
from gr.index.exact import ItemIndex, exclusion_mask, top_items


@dataclass(frozen=True)
class SpeculativeRetrieval:
    """cache_size: exact neighbours added to the local cache per verified query; stride: steps
    answered locally between two batched verifications."""

    cache_size: int = 64
    stride: int = 4

    def __post_init__(self) -> None:
        if self.cache_size < 1 or self.stride < 1:
            raise ValueError("SpeculativeRetrieval: cache_size and stride must be >= 1")


@dataclass
class RetrievalStats(GenerationStats):
    """verifications: batched exact queries; rollbacks: mismatches found (each replaced exactly)."""

    verifications: int = 0
    rollbacks: int = 0


def greedy_speculative_retrieval(
    model: GenerativeModel,
    index: ItemIndex,
    state: DecodeState,
    k: int,
    request_time: int,
    options: SpeculativeRetrieval = SpeculativeRetrieval(),
    exclude_seen: bool = True,
) -> Generation:
    """Greedy generation (the items of ``greedy``) with speculative retrieval."""
    began, stats = time.perf_counter(), RetrievalStats()
    base = set(state.items) if exclude_seen else set()
    _, seed_ids = index.search(state.query.view(1, -1), exclusion_mask(index.num_items, 1, base), options.cache_size)
    local = torch.unique(seed_ids[0])  # sorted: the first of equal local scores is the lowest id
    states, pending = [state], []
    out: List[int] = []
    while True:
        i = len(out)
        out.append(_local_best(index, states[i].query, local, _banned(base, out[:i], exclude_seen)))
        pending.append(i)
        full = len(out) == k
        if len(pending) == options.stride or full:
            queries = torch.stack([states[j].query for j in pending])
            masks = torch.cat(
                [exclusion_mask(index.num_items, 1, _banned(base, out[:j], exclude_seen)) for j in pending]
            )
            _, exact = index.search(queries, masks, options.cache_size)
            stats.verifications += 1
            local = torch.unique(torch.cat([local, exact.flatten()]))
            wrong = next((n for n, j in enumerate(pending) if int(exact[n, 0]) != out[j]), None)
            if wrong is not None:
                j = pending[wrong]
                out, states = out[:j] + [int(exact[wrong, 0])], states[: j + 1]
                stats.rollbacks += 1
                full = len(out) == k
            pending = []
        if full:
            break
        states.append(step(model, states[-1], out[-1], request_time))
        stats.passes += 1
    stats.total_seconds = time.perf_counter() - began
    return Generation(out, stats)


def _banned(base: Set[int], generated: List[int], exclude_seen: bool) -> Set[int]:
    return base | set(generated) if exclude_seen else base


def _local_best(index: ItemIndex, query: torch.Tensor, local: torch.Tensor, banned: Set[int]) -> int:
    """The best non-banned item among ``local: [C] int64`` (sorted ids) for ``query: [d]``."""
    allowed = local[~torch.isin(local, torch.tensor(sorted(banned), dtype=torch.long))] if banned else local
    if allowed.numel() == 0:
        return 0  # nothing local is allowed: a placeholder the verification replaces
    scores = index.scores_of(query.view(1, -1), allowed)
    return int(allowed[top_items(scores, torch.zeros_like(scores, dtype=torch.bool), 1)[1][0, 0]])
