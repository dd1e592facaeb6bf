"""Generation requests in the serving runtime: an export as a ``GenerativeModel`` and ``generate``.

The item feature's token is the PrefixDNN output of its table row (computed once for the whole
catalogue: the PrefixDNN is token-wise); the query is the postfix_dnn output ``query``; items
are scored against the L2-normalised rows of the item table, as the retrieval head defines.
Imports no training code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Hashable, List, Mapping, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gr.export.format import TIMESTAMPS
from gr.generation.budget import AdaptiveBudget
from gr.generation.decoding import (
    DecodeState, Drafter, GenerationStats, Relaxed, Strict, beam_search, greedy, sample, speculative_greedy, start,
)
from gr.generation.drafts import DraftSource
from gr.generation.index import ExactIndex, ItemIndex
from gr.generation.speculative_retrieval import SpeculativeRetrieval, greedy_speculative_retrieval
from gr.hstu.cache import CachedHSTU
from gr.serving.errors import RequestError

if TYPE_CHECKING:
    from gr.serving.runtime import Ranker, ServingModel

STRATEGIES = ("greedy", "beam", "sample")
QUERY = "query"


class Catalogue:
    """One export's items for model_version: token inputs of every item, and the exact item index.

    item_feature: the token id feature that holds the item (its table is the catalogue)
    """

    def __init__(self, model: "ServingModel", item_feature: str = "item_id") -> None:
        schema = model.schema
        if item_feature not in schema.token_ids:
            raise RequestError(f"generate: the export has no token feature {item_feature!r} "
                               f"(token features: {list(schema.token_ids)})")
        others = [f for f in (*schema.token_ids, *schema.token_dense) if f != item_feature]
        if others:
            raise RequestError(f"generate: a generated token has only {item_feature!r}; the export also reads "
                               f"token features {others}")
        if QUERY not in model.postfix.output_names:
            raise RequestError(f"generate: the postfix_dnn has no {QUERY!r} output (a retrieval head is needed); "
                               f"outputs: {model.postfix.output_names}")
        rows = model.sparse.rows(item_feature)
        self.model = model
        self.item_feature = item_feature
        self.tokens = model.embed_tokens({item_feature: np.arange(rows, dtype=np.int64),
                                          TIMESTAMPS: np.zeros(rows, dtype=np.int64)})  # [M, D]
        table = model.sparse.tables[model.sparse.features[item_feature].table]
        self.index: ItemIndex = ExactIndex(F.normalize(torch.from_numpy(table), dim=-1))


@dataclass
class ServingGenerativeModel:
    """``GenerativeModel`` over a loaded export for one request's common features."""

    catalogue: Catalogue
    common: Dict[str, np.ndarray]

    @property
    def engine(self) -> CachedHSTU:
        return self.catalogue.model.engine

    def item_tokens(self, items: Tensor) -> Tensor:
        """items: [n] int64 -> [n, D] float."""
        return self.catalogue.tokens[items]

    def queries(self, hidden: Tensor) -> Tensor:
        """hidden: [n, D] float -> [n, d] float (L2-normalised by the head)."""
        return torch.from_numpy(self.catalogue.model.heads(hidden, self.common)[QUERY])


@dataclass(frozen=True)
class GenerateResult:
    """items: the generated slate (model item ids), in order; stats: passes, drafts, timings."""

    items: List[int]
    stats: GenerationStats
    history_length: int
    truncated: int
    cache_status: str

    def to_json(self) -> Dict[str, Any]:
        return {"items": self.items, "history_length": self.history_length, "cache_status": self.cache_status, "cache": self.cache_status,
                "passes": self.stats.passes, "accepted": self.stats.accepted}


@dataclass
class _Prepared:
    model: ServingGenerativeModel
    state: DecodeState
    items: Tensor  # [L] int64 history items used
    timestamps: Tensor  # [L] int64
    request_time: int
    truncated: int
    cache_status: str


def _prepare(
    ranker: "Ranker", user_id: Hashable, history: Mapping[str, Any], k: int,
    common_features: Optional[Mapping[str, Any]], request_time: Optional[int],
) -> _Prepared:
    """Validate a request, get the user's cached history and the query at its last token."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise RequestError(f"k: expected an integer >= 1, got {k!r}")
    catalogue, model_version = ranker.catalogue()
    model = catalogue.model
    hist = model.schema.tokens(history, "history", model.sparse)
    length = len(hist[TIMESTAMPS])
    if length == 0:
        raise RequestError("history: empty; generation starts from at least one item")
    if k >= model.config.max_seq_len:
        raise RequestError(f"k: {k} items do not fit the model's max_seq_len {model.config.max_seq_len}")
    limit = model.config.max_seq_len - k  # room for the generated tokens (and a draft tree's last level)
    if length > limit:
        if ranker.long_history == "refuse":
            raise RequestError(f"history: {length} tokens + {k} generated exceed the model's max_seq_len "
                               f"{model.config.max_seq_len} (long_history='refuse')")
        hist = {name: value[length - limit:].copy() for name, value in hist.items()}
    common = model.schema.common(common_features, model.sparse)
    cached, status = ranker.cached_history(model, model_version, user_id, hist)
    lm = ServingGenerativeModel(catalogue, common)
    items = torch.from_numpy(hist[catalogue.item_feature])
    timestamps = torch.from_numpy(hist[TIMESTAMPS])
    request_time = int(hist[TIMESTAMPS][-1]) if request_time is None else int(request_time)
    return _Prepared(lm, start(lm, items, timestamps, request_time, cached), items, timestamps, request_time, max(length - limit, 0),
                     status)


def user_embedding(
    ranker: "Ranker", user_id: Hashable, history: Mapping[str, Any],
    common_features: Optional[Mapping[str, Any]] = None,
) -> Tensor:
    """The retrieval query at the user's last history token: [d] float (what pools group users by)."""
    return _prepare(ranker, user_id, history, 1, common_features, None).state.query


def generate(
    ranker: "Ranker",
    user_id: Hashable,
    history: Mapping[str, Any],
    k: int,
    strategy: str = "greedy",
    exclude_seen: bool = True,
    *,
    common_features: Optional[Mapping[str, Any]] = None,
    request_time: Optional[int] = None,
    draft: Optional[DraftSource] = None,
    verification: Union[Strict, Relaxed] = Strict(),
    budget: Optional[AdaptiveBudget] = None,
    beam_width: int = 4,
    temperature: float = 1.0,
    seed: Optional[int] = None,
    attribute: Optional[Hashable] = None,
    speculative_retrieval: Optional[SpeculativeRetrieval] = None,
) -> GenerateResult:
    """Generate ``k`` next items for a user (see ``Ranker.generate``)."""
    if strategy not in STRATEGIES:
        raise RequestError(f"strategy: expected one of {list(STRATEGIES)}, got {strategy!r}")
    if (draft is not None or speculative_retrieval is not None) and strategy != "greedy":
        raise RequestError(f"draft / speculative_retrieval: both verify greedy choices; strategy {strategy!r} "
                           "takes neither")
    if draft is not None and speculative_retrieval is not None:
        raise RequestError("draft and speculative_retrieval: choose one")
    if budget is not None and draft is None:
        raise RequestError("budget: sizes draft trees; it needs a draft source (draft=...)")
    p = _prepare(ranker, user_id, history, k, common_features, request_time)
    lm, state, index, request_time = p.model, p.state, p.model.catalogue.index, p.request_time
    available = index.num_items - (len(set(state.items)) if exclude_seen else 0)
    if k > available:
        raise RequestError(f"k: {k} items requested but only {available} catalogue items are not in the history")
    if strategy == "beam":
        out = beam_search(lm, index, state, k, request_time, exclude_seen, beam_width, temperature)
    elif strategy == "sample":
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        out = sample(lm, index, state, k, request_time, exclude_seen, temperature, generator)
    elif speculative_retrieval is not None:
        out = greedy_speculative_retrieval(lm, index, state, k, request_time, speculative_retrieval, exclude_seen)
    elif draft is None:
        out = greedy(lm, index, state, k, request_time, exclude_seen)
    else:
        drafter: Drafter = draft.drafter(p.items, p.timestamps, request_time, state.query, attribute)
        out = speculative_greedy(lm, index, state, k, request_time, drafter, exclude_seen, verification, budget)
    return GenerateResult(out.items, out.stats, int(p.items.numel()), p.truncated, p.cache_status)
