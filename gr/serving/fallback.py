"""Cold start: the answer to a recommend or generate request with an empty history. With the user's
common features and an export that stores the new-user state (``gr.export.new_user``), the model's
new-user query answers, marked ``"fallback": "user_features"`` (``History.from_user_features``;
recommend's scores are cosines, generate decodes from that query on); otherwise the export's item
popularity (``gr.export.popularity``; an export without it refuses such a request), as follows.

The answer is the k most popular items (training counts, most first, the lowest id on ties) that the
request does not exclude, marked ``"fallback": "popularity"``. Its scores keep each verb's meaning as
far as popularity has one: recommend's are the items' training counts; generate's are log-probabilities
under the popularity distribution, add-one smoothed (log((count + 1) / (total + items))) so that every
item's is finite. A generated slate never repeats an item. No model pass runs and no cache is touched
(the answer's ``cache_status`` is ``"off"``).
"""

from __future__ import annotations

from typing import Any, Callable, List, Protocol, Sequence, Tuple, TypeVar

import numpy as np

POPULARITY = "popularity"  # the fallback's name in answers and in the gr_fallback_total metric
USER_FEATURES = "user_features"  # the new-user query's, likewise


class _Prepared(Protocol):
    @property
    def history(self) -> Any: ...


PreparedT = TypeVar("PreparedT", bound=_Prepared)
ResultT = TypeVar("ResultT")


def cold_apart(
    prepared: Sequence[PreparedT],
    modelled: Callable[[List[PreparedT]], List[ResultT]],
    popular: Callable[[PreparedT], ResultT],
) -> List[ResultT]:
    """Answers to ``prepared`` in order: ``popular(p)`` for each request with an empty history (the
    cold-start answer, from popularity or the user's features), the others' from one ``modelled``
    call over them all."""
    if all(p.history.length for p in prepared):
        return modelled(list(prepared))
    answers = iter(modelled([p for p in prepared if p.history.length]))
    return [next(answers) if p.history.length else popular(p) for p in prepared]


def most_popular(counts: np.ndarray, excluded: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
    """counts: [M] int64 training counts; excluded: [s] int64 items never answered -> (items [k'] int64,
    their counts [k'] int64), most popular first, lowest id on ties; k' = min(k, eligible items)."""
    order = np.lexsort((np.arange(len(counts)), -counts))  # count descending, then id ascending
    allowed = np.ones(len(counts), dtype=bool)
    allowed[excluded] = False
    items = order[allowed[order]][:k]
    return items, counts[items]


def log_probabilities(counts: np.ndarray, items: np.ndarray) -> np.ndarray:
    """[k] float64: log((count + 1) / (total + M)) of ``items`` under the smoothed popularity distribution."""
    return np.log((counts[items] + 1.0) / (float(counts.sum()) + len(counts)))
