"""Generation over a KV-cached HSTU (docs/design.md §8): greedy, beam and sampled decoding, speculative
greedy with draft token trees (retrieval pools or a draft model; strict or relaxed verification)
and speculative retrieval. Imports only torch, gr.hstu and the item indexes (gr.index), so the serving
runtime uses it."""

from gr.generation.budget import AdaptiveBudget, SharedBudget
from gr.generation.decoding import (
    Generation,
    GenerationStats,
    Relaxed,
    Strict,
    beam_search,
    greedy,
    sample,
    speculative_greedy,
    start,
)
from gr.generation.draft_tree import DraftTree, tree_from_counted_paths, tree_from_paths
from gr.generation.drafts import (
    ModelDrafter,
    ModelDraftSource,
    PoolDrafter,
    PoolDraftSource,
    RankingDrafter,
    RankingDraftSource,
)
from gr.generation.pools import GroupedPools, SequencePool
from gr.generation.speculative_retrieval import SpeculativeRetrieval, greedy_speculative_retrieval

__all__ = [
    "AdaptiveBudget",
    "DraftTree",
    "Generation",
    "GenerationStats",
    "GroupedPools",
    "ModelDrafter",
    "ModelDraftSource",
    "PoolDrafter",
    "PoolDraftSource",
    "RankingDrafter",
    "RankingDraftSource",
    "Relaxed",
    "SequencePool",
    "SharedBudget",
    "SpeculativeRetrieval",
    "Strict",
    "beam_search",
    "greedy",
    "greedy_speculative_retrieval",
    "sample",
    "speculative_greedy",
    "start",
    "tree_from_counted_paths",
    "tree_from_paths",
]
