"""Generation requests in the serving runtime: a validated history and a ``GenerateRequest`` ->
the user's next k items (greedy, beam, sampled; speculative greedy with drafts or speculative
retrieval). ``prepare`` checks a request whose history ``gr.serving.history`` validated; ``run``
encodes the histories through the user cache (``gr.serving.encode``) and decodes. Never uses the
Ranker itself.
Imports no training code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Optional, Sequence, Union

import numpy as np
import torch

from gr.export.format import TIMESTAMPS
from gr.generation.budget import AdaptiveBudget, SharedBudget
from gr.generation.decoding import (
    DecodeState,
    Drafter,
    GenerationStats,
    Relaxed,
    Strict,
    beam_search,
    greedy,
    sample,
    slate_log_probs,
    speculative_greedy,
)
from gr.generation.drafts import DraftSource
from gr.generation.speculative_retrieval import (
    SpeculativeRetrieval,
    greedy_speculative_retrieval,
)
from gr.serving import encode
from gr.serving.catalogue import Catalogue, ServingGenerativeModel
from gr.serving.errors import RequestError
from gr.serving.fallback import POPULARITY, USER_FEATURES, cold_apart, log_probabilities, most_popular
from gr.serving.history import History, empty_history, history_warnings, last_token_state, new_user_state
from gr.serving.request import GenerateRequest, check_request_time, check_sampling
from gr.serving.user_cache import UserCache

STRICT = Strict()  # the default verification: greedy's exact output

STRATEGIES = ("greedy", "beam", "sample")
__all__ = ["GenerateResult", "PreparedGenerate", "ServingGenerativeModel", "check_k", "prepare", "run"]


@dataclass(frozen=True)
class GenerateResult:
    """items: the generated slate (in the request's id space), in order; scores: [k] each item's
    log-probability at its step (``slate_log_probs``: log softmax of the catalogue scores / the
    request's temperature over the items allowed there); stats: passes, drafts, timings; drafted:
    whether a draft source proposed items (speculative greedy). The JSON form reports ``passes`` and
    ``accepted`` only then: without drafts they say nothing about the request. fallback: for an empty
    history (``gr.serving.fallback``), "user_features" when decoded from the new-user query (scores as
    above), "popularity" for the most popular items (scores: popularity log-probabilities)."""

    items: List[Any]
    scores: List[float]
    stats: GenerationStats
    history_length: int
    truncated: int
    cache_status: str
    model_version: int = 0
    drafted: bool = False
    fallback: Optional[str] = None
    left_out: int = 0

    def to_json(self) -> Dict[str, Any]:
        speculative = {"passes": self.stats.passes, "accepted": self.stats.accepted} if self.drafted else {}
        return {
            "items": self.items,
            "scores": self.scores,
            "history_length": self.history_length,
            "cache_status": self.cache_status,
            "cache": self.cache_status,
            "model_version": self.model_version,
            **({"fallback": self.fallback} if self.fallback else {}),
            **speculative,
            **history_warnings(self.truncated, self.left_out),
        }


@dataclass(frozen=True)
class PreparedGenerate:
    """A checked generation request: what ``run`` decodes once the history is encoded."""

    history: History
    catalogue: Catalogue
    request: GenerateRequest
    request_time: int
    draft: Optional[DraftSource]
    verification: Union[Strict, Relaxed]
    budget: Union[AdaptiveBudget, SharedBudget, None]
    attribute: Optional[Hashable]
    speculative_retrieval: Optional[SpeculativeRetrieval]


def check_k(k: Any) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise RequestError(f"k: expected an integer >= 1, got {k!r}")


def prepare(
    h: History,
    catalogue: Catalogue,
    request: GenerateRequest,
    *,
    draft: Optional[DraftSource] = None,
    verification: Union[Strict, Relaxed] = STRICT,
    budget: Union[AdaptiveBudget, SharedBudget, None] = None,
    attribute: Optional[Hashable] = None,
    speculative_retrieval: Optional[SpeculativeRetrieval] = None,
) -> PreparedGenerate:
    """Check everything about a generation request before any cache is touched.

    draft (a ``DraftSource``) turns greedy speculative: drafts verified in one HSTU pass each,
    ``verification`` ``Strict()`` (the greedy items exactly) or ``Relaxed``; budget (an
    ``AdaptiveBudget``) sizes each draft tree from the request's acceptance so far, a
    ``SharedBudget`` (one per draft source, kept by the caller across requests, thread-safe) also
    from the source's earlier requests and stops drafting while it does not pay; speculative_retrieval
    answers greedy's searches from a local cache checked in batches against the exact index;
    attribute routes a cold user to a pool. Strategies: "greedy" (lowest item id on ties),
    "beam" (``beam_width``, ``temperature``), "sample" (``temperature``, ``seed``); a ``beam_width``
    other than the default with another strategy is refused (it would be ignored).
    """
    strategy = request.strategy
    if strategy not in STRATEGIES:
        raise RequestError(f"strategy: expected one of {list(STRATEGIES)}, got {strategy!r}")
    if strategy != "beam" and request.beam_width != GenerateRequest.beam_width:  # the field's default
        raise RequestError(
            f"beam_width: {request.beam_width} given, but strategy {strategy!r} does not use it (only 'beam' does)"
        )
    if (draft is not None or speculative_retrieval is not None) and strategy != "greedy":
        raise RequestError(
            f"draft / speculative_retrieval: both verify greedy choices; strategy {strategy!r} takes neither"
        )
    if draft is not None and speculative_retrieval is not None:
        raise RequestError("draft and speculative_retrieval: choose one")
    if budget is not None and draft is None:
        raise RequestError("budget: sizes draft trees; it needs a draft source (draft=...)")
    if h.length == 0 and h.model.popularity is None and not h.from_user_features:
        raise empty_history(
            h, "generation starts from at least one item (this export stores no item popularity to fall back on)"
        )
    seen = set(h.tokens[catalogue.item_feature].tolist()) if request.exclude_seen else set()
    available = catalogue.index.num_items - len(seen)
    if request.k > available:
        raise RequestError(
            f"k: {request.k} items requested but only {available} catalogue items are not in the history"
        )
    check_request_time(request.request_time)
    check_sampling(request.temperature, request.seed)
    request_time = request.request_time
    if request_time is None:  # an empty history's is never read: the fallback runs no model
        request_time = int(h.tokens[TIMESTAMPS][-1]) if h.length else 0
    return PreparedGenerate(
        h, catalogue, request, request_time, draft, verification, budget, attribute, speculative_retrieval
    )


def run(cache: UserCache, prepared: Sequence[PreparedGenerate]) -> List[GenerateResult]:
    """Generate for prepared requests: their histories encoded together through the user cache
    (``gr.serving.encode``), then each request decoded on its own; requests with an empty history get
    the cold-start answer (``gr.serving.fallback``)."""
    return cold_apart(prepared, lambda modelled: _run_modelled(cache, modelled), _cold)


def _run_modelled(cache: UserCache, prepared: List[PreparedGenerate]) -> List[GenerateResult]:
    if not prepared:
        return []
    model = prepared[0].history.model
    if any(p.history.model is not model for p in prepared):  # a reload raced the batch: one model each
        return [_run_modelled(cache, [p])[0] for p in prepared]
    encoded = encode.encode(cache, [p.history for p in prepared])
    return [
        decode(p, last_token_state(e, p.catalogue, p.request_time), e.cache_status) for p, e in zip(prepared, encoded)
    ]


def decode(
    p: PreparedGenerate, state: DecodeState, cache_status: str, fallback: Optional[str] = None
) -> GenerateResult:
    """Decode the request's k items from ``state`` (its encoded history's last token, or a new user's:
    ``new_user_state``, which no draft source drafts for)."""
    request, catalogue, request_time = p.request, p.catalogue, p.request_time
    k, exclude_seen, index = request.k, request.exclude_seen, catalogue.index
    lm = ServingGenerativeModel(catalogue, p.history.common)
    if request.strategy == "beam":
        out = beam_search(lm, index, state, k, request_time, exclude_seen, request.beam_width, request.temperature)
    elif request.strategy == "sample":
        generator = None if request.seed is None else torch.Generator().manual_seed(request.seed)
        out = sample(lm, index, state, k, request_time, exclude_seen, request.temperature, generator)
    elif p.speculative_retrieval is not None:
        out = greedy_speculative_retrieval(lm, index, state, k, request_time, p.speculative_retrieval, exclude_seen)
    elif p.draft is None or p.history.length == 0:
        out = greedy(lm, index, state, k, request_time, exclude_seen)
    else:
        items = torch.from_numpy(p.history.tokens[catalogue.item_feature])
        drafter: Drafter = p.draft.drafter(
            items, torch.from_numpy(p.history.tokens[TIMESTAMPS]), request_time, state.query, p.attribute
        )
        out = speculative_greedy(lm, index, state, k, request_time, drafter, exclude_seen, p.verification, p.budget)
    decoded = p.history.decode_items(catalogue.item_feature, torch.tensor(out.items, dtype=torch.long).numpy())
    scores = slate_log_probs(lm, index, state, out.items, request_time, exclude_seen, request.temperature)
    return GenerateResult(
        decoded,
        scores,
        out.stats,
        p.history.length,
        p.history.truncated,
        cache_status,
        p.history.model_version,
        drafted=p.draft is not None and p.history.length > 0,
        fallback=fallback,
        left_out=p.history.left_out,
    )


def _cold(p: PreparedGenerate) -> GenerateResult:
    """The answer to a request with an empty history: decoded from the new-user query when the request
    gives the user's features and the export stores the new-user state, else the k most popular items,
    none twice."""
    h = p.history
    if h.from_user_features:
        return decode(p, new_user_state(h, p.catalogue), "off", USER_FEATURES)
    assert h.model.popularity is not None  # prepare refuses an empty history without it
    items, _ = most_popular(h.model.popularity, np.zeros(0, np.int64), p.request.k)
    scores = log_probabilities(h.model.popularity, items).tolist()
    decoded = h.decode_items(p.catalogue.item_feature, items)
    stats = GenerationStats()
    return GenerateResult(decoded, scores, stats, 0, h.truncated, "off", h.model_version, False, POPULARITY, h.left_out)
