"""Recommend requests: the top k items of the whole catalogue for each user, several users as one
batch: every user's query from shared passes (``gr.serving.encode``), then one search of the
catalogue's index for all the queries that ask for the same k (the exact index: one matrix
product). Each answer equals the request's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from gr.export.format import TIMESTAMPS
from gr.index.exact import ItemIndex
from gr.serving import encode
from gr.serving.catalogue import QUERY
from gr.serving.errors import RequestError
from gr.serving.fallback import POPULARITY, USER_FEATURES, cold_apart, most_popular
from gr.serving.history import History, check_span, empty_history, history_warnings
from gr.serving.model import check_finite
from gr.serving.request import RecommendRequest, check_request_time
from gr.serving.user_cache import UserCache

__all__ = ["PreparedRecommend", "RecommendResult", "prepare", "run"]


@dataclass(frozen=True)
class RecommendResult:
    """items: the top k catalogue items (in the request's id space), best first; scores: [k]
    their cosines with the query (see ``RankResult``); fallback: "popularity" when the history was
    empty and the items are the most popular ones, their scores training counts, "user_features"
    when they are the new-user query's, their scores cosines (``gr.serving.fallback``); other fields
    as in ``RankResult``."""

    items: List[Any]
    scores: np.ndarray
    history_length: int
    truncated: int
    cache_status: str
    model_version: int
    fallback: Optional[str] = None
    left_out: int = 0

    def to_json(self) -> Dict[str, Any]:
        return {
            "items": self.items,
            "scores": self.scores.tolist(),
            "history_length": self.history_length,
            "cache_status": self.cache_status,
            "cache": self.cache_status,
            "model_version": self.model_version,
            **({"fallback": self.fallback} if self.fallback else {}),
            **history_warnings(self.truncated, self.left_out),
        }


@dataclass(frozen=True)
class PreparedRecommend:
    """A validated recommend request: its history, time and the items it excludes ([s] int64)."""

    request: RecommendRequest
    history: History
    request_time: int
    excluded: np.ndarray


def prepare(h: History, request: RecommendRequest) -> PreparedRecommend:
    """Validate the rest of a recommend request whose history is ``h`` (touches no cache)."""
    check_request_time(request.request_time)
    if not h.model.is_retrieval:
        raise RequestError(
            f"model: recommend needs a retrieval export (a {QUERY!r} output); this one "
            f"outputs {h.model.postfix.output_names}: use rank"
        )
    catalogue = h.model.catalogue()
    if h.length == 0 and h.model.popularity is None and not h.from_user_features:
        raise empty_history(
            h, "recommend needs at least one item (this export stores no item popularity to fall back on)"
        )
    excluded = np.unique(h.tokens[catalogue.item_feature]) if request.exclude_seen else np.zeros(0, np.int64)
    available = catalogue.index.num_items - len(excluded)
    if request.k > available:
        raise RequestError(f"k: {request.k} items requested but only {available} catalogue items are eligible")
    if h.length == 0:  # answered from popularity: no time is read
        return PreparedRecommend(request, h, 0, excluded)
    request_time = int(h.tokens[TIMESTAMPS][-1]) if request.request_time is None else request.request_time
    check_span(h, {"request_time": request_time})
    return PreparedRecommend(request, h, request_time, excluded)


def run(cache: UserCache, prepared: Sequence[PreparedRecommend]) -> List[RecommendResult]:
    """Recommend for prepared requests as one batch; a batch that raced a reload goes one by one;
    requests with an empty history get the cold-start answer (``gr.serving.fallback``)."""
    return cold_apart(prepared, lambda modelled: _run_modelled(cache, modelled), _cold)


def _run_modelled(cache: UserCache, prepared: List[PreparedRecommend]) -> List[RecommendResult]:
    if not prepared:
        return []
    model = prepared[0].history.model
    if any(p.history.model is not model for p in prepared):  # a reload raced the batch: one model each
        return [_run_modelled(cache, [p])[0] for p in prepared]
    request_times = [p.request_time for p in prepared]
    encoded = encode.encode(cache, [p.history for p in prepared], request_times=request_times)
    queries = encode.queries(encoded, request_times)  # [B, d]
    found = _search(model.catalogue().index, prepared, queries)
    item_feature, out = model.catalogue().item_feature, []
    for b, (p, e) in enumerate(zip(prepared, encoded)):
        (scores, items), h = found[b], p.history
        check_finite({"scores": scores.numpy()}, "recommend")
        decoded = h.decode_items(item_feature, items.numpy())
        out.append(
            RecommendResult(
                decoded, scores.numpy(), h.length, h.truncated, e.cache_status, h.model_version, left_out=h.left_out
            )
        )
    return out


def _search(
    index: ItemIndex, prepared: Sequence[PreparedRecommend], queries: Tensor
) -> Dict[int, Tuple[Tensor, Tensor]]:
    """{b: (scores [k], items [k])} the top k items of each request b for its query ``queries[b]``,
    one search for all the requests that ask for the same k."""
    found: Dict[int, Tuple[Tensor, Tensor]] = {}
    for k in sorted({p.request.k for p in prepared}):
        rows = [b for b, p in enumerate(prepared) if p.request.k == k]
        exclude = torch.zeros(len(rows), index.num_items, dtype=torch.bool)
        for r, b in enumerate(rows):
            exclude[r, torch.from_numpy(prepared[b].excluded)] = True
        scores, items = index.search(queries[rows], exclude, k)
        found.update((b, (scores[r], items[r])) for r, b in enumerate(rows))
    return found


def _cold(p: PreparedRecommend) -> RecommendResult:
    """The answer to a request with an empty history: the new-user query's top k when the request
    gives the user's features and the export stores the new-user state, else the k most popular
    eligible items."""
    h = p.history
    if h.from_user_features:
        found, top = _search(h.model.catalogue().index, [p], h.model.new_user_queries([h.common]))[0]
        check_finite({"scores": found.numpy()}, "recommend")
        decoded = h.decode_items(h.model.catalogue().item_feature, top.numpy())
        return RecommendResult(
            decoded, found.numpy(), 0, h.truncated, "off", h.model_version, USER_FEATURES, h.left_out
        )
    assert h.model.popularity is not None  # prepare refuses an empty history without it
    items, counts = most_popular(h.model.popularity, p.excluded, p.request.k)
    decoded = h.decode_items(h.model.catalogue().item_feature, items)
    counts = counts.astype(np.float32)
    return RecommendResult(decoded, counts, 0, h.truncated, "off", h.model_version, POPULARITY, h.left_out)
