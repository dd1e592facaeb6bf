"""Rank requests: validated candidates scored against each user's encoded history, several users as
one batch. A ranking export scores every user's candidates against that user's cached history in
shared HSTU passes (``CachedHSTU.score_batch``), a history encoded from scratch running them in its
encoding pass (``CachedHSTU.encode_scored_batch``), and in shared prefix/postfix ONNX runs; a retrieval
export computes every user's query in shared passes (``gr.serving.encode``) and scores the
candidates against them. Without the cache, a ranking export runs one target-aware pass a request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from gr.export.format import TIMESTAMPS
from gr.jagged import offsets_from_lengths
from gr.serving import encode
from gr.serving.errors import RequestError
from gr.serving.fallback import USER_FEATURES
from gr.serving.history import History, Tokens, check_span, empty_history, history_warnings
from gr.serving.limits import RequestLimits
from gr.serving.model import ServingModel, check_finite
from gr.serving.request import RankRequest, check_request_time
from gr.serving.scores import RETRIEVAL, ranking_scores
from gr.serving.user_cache import UserCache

__all__ = ["PreparedRank", "RankResult", "prepare", "run"]


@dataclass(frozen=True)
class RankResult:
    """scores: {name: [N] float32}, candidates in request order: for a ranking export each task's
    probability under its name and its logit under ``<task>_logit`` (``gr.serving.scores``), for
    a retrieval export {"retrieval": the cosine of the query at the last history token and each
    candidate's item vector}.

    history_length: history tokens used; truncated: oldest tokens dropped to fit max_seq_len;
    left_out: tokens of items the model has no row for, left out (``unknown_ids="oov"``);
    cache_status: "miss" (history encoded), "extend" (only new actions encoded),
    "hit" (nothing encoded) or "off" (no history cache used); model_version: the reload
    count of the model that computed every score; fallback: "user_features" when a retrieval
    export scored a new user's candidates against the new-user query (``gr.serving.fallback``).
    """

    scores: Dict[str, np.ndarray]
    history_length: int
    truncated: int
    cache_status: str
    model_version: int = 0
    left_out: int = 0
    fallback: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return {
            "scores": {name: value.tolist() for name, value in self.scores.items()},
            "history_length": self.history_length,
            "cache_status": self.cache_status,
            "cache": self.cache_status,
            "model_version": self.model_version,
            **({"fallback": self.fallback} if self.fallback else {}),
            **history_warnings(self.truncated, self.left_out),
        }


@dataclass(frozen=True)
class PreparedRank:
    """A validated rank request: its history (``gr.serving.history.validate``), candidate columns and time."""

    request: RankRequest
    history: History
    candidates: Tokens
    request_time: int


def prepare(h: History, request: RankRequest, limits: RequestLimits) -> PreparedRank:
    """Validate the rest of a rank request whose history is ``h`` (touches no cache): everything a
    request can get wrong is found here, before it joins a batch."""
    if h.model.is_retrieval:
        h.model.catalogue()  # RequestError when the export has none
        if h.length == 0 and not h.from_user_features:
            raise empty_history(
                h,
                "a retrieval model scores items against the query at the last history item, or for a new user "
                "against the new-user query from the user's common_features (exports that store it)",
            )
    elif h.length == 0 and not h.common_given:  # the target-aware pass reads the common features: all required
        h = dataclasses.replace(h, common=h.model.schema.common(None, h.model.sparse))
    return PreparedRank(request, h, *_candidates(h, request.candidates, request.request_time, limits))


def _candidates(
    h: History, candidates: Mapping[str, Any], request_time: Optional[int], limits: RequestLimits
) -> Tuple[Tokens, int]:
    """Validate a request's candidates -> (their token columns, the request time)."""
    check_request_time(request_time)
    default_time = request_time
    if request_time is None:  # candidates without timestamps stand right after the last action
        default_time = int(h.tokens[TIMESTAMPS][-1]) if h.length else 0
    cands = h.model.schema.tokens(
        candidates,
        "candidates",
        h.model.sparse,
        default_timestamp=default_time,
        raw=h.raw,
        unknown_ids=h.unknown_ids,
        candidates=True,
        limits=limits,
    )
    if len(cands[TIMESTAMPS]) == 0:
        raise RequestError("candidates: the list is empty; a ranking request needs at least one candidate")
    if request_time is None:  # the request is when its candidates are shown
        request_time = int(cands[TIMESTAMPS].max())
    check_span(h, {"candidates.timestamps": cands[TIMESTAMPS], "request_time": request_time})
    return cands, request_time


def run(cache: UserCache, prepared: Sequence[PreparedRank], micro_batch: int, use_cache: bool) -> List[RankResult]:
    """Score prepared requests as one batch (equal to each request alone). A ranking export without
    the cache, and a batch that raced a reload, go one by one."""
    if not prepared:
        return []
    model = prepared[0].history.model
    if any(p.history.model is not model for p in prepared):  # a reload raced the batch: one model each
        return [run(cache, [p], micro_batch, use_cache)[0] for p in prepared]
    if model.is_retrieval:
        return _retrieval(cache, prepared, use_cache)
    if not use_cache:
        return [_uncached(p) for p in prepared]
    request_times = [p.request_time for p in prepared]
    counts = [len(p.candidates[TIMESTAMPS]) for p in prepared]
    bounds = np.cumsum([0, *counts])
    joined = {name: np.concatenate([p.candidates[name] for p in prepared]) for name in prepared[0].candidates}
    x, times = model.embed_tokens(joined), torch.from_numpy(joined[TIMESTAMPS])
    targets = [(x[bounds[b] : bounds[b + 1]], times[bounds[b] : bounds[b + 1]]) for b in range(len(prepared))]
    # a history encoded from scratch runs its candidates in that pass (micro_batch of them at most, in all);
    # the others score theirs against their caches
    histories = [p.history for p in prepared]
    encoded = encode.encode(cache, histories, request_times=request_times, targets=targets, max_targets=micro_batch)
    rest = [b for b, e in enumerate(encoded) if e.scored is None]
    outputs = {b: e.scored for b, e in enumerate(encoded) if e.scored is not None}
    if rest:
        rows = torch.from_numpy(np.concatenate([np.arange(bounds[b], bounds[b + 1]) for b in rest]))
        hidden = model.engine.score_batch(
            [settled for settled, _ in encode.settled([encoded[b] for b in rest], [request_times[b] for b in rest])],
            x[rows],
            offsets_from_lengths(torch.tensor([counts[b] for b in rest])),
            times[rows],
            micro_batch,
            [request_times[b] for b in rest],
        )
        outputs.update(zip(rest, torch.split(hidden, [counts[b] for b in rest])))
    hidden = torch.cat([outputs[b] for b in range(len(prepared))])
    scores = ranking_scores(model.heads_batch(hidden, [p.history.common for p in prepared], counts))
    return [
        RankResult(
            {task: value[bounds[b] : bounds[b + 1]] for task, value in scores.items()},
            p.history.length,
            p.history.truncated,
            e.cache_status,
            p.history.model_version,
            p.history.left_out,
        )
        for b, (p, e) in enumerate(zip(prepared, encoded))
    ]


def _uncached(p: PreparedRank) -> RankResult:
    """One request of a ranking export without the cache: one target-aware pass over history + candidates."""
    h, model = p.history, p.history.model
    hidden = _one_pass(model, h.tokens, p.candidates, p.request_time)
    scores = ranking_scores(model.heads(hidden, h.common))
    return RankResult(scores, h.length, h.truncated, "off", h.model_version, h.left_out)


def _retrieval(cache: UserCache, prepared: Sequence[PreparedRank], use_cache: bool) -> List[RankResult]:
    """Requests of a retrieval export: each candidate's cosine with its request's query, the
    queries of the whole batch from shared passes (``gr.serving.encode.queries``)."""
    model = prepared[0].history.model
    catalogue = model.catalogue()
    warm = [b for b, p in enumerate(prepared) if p.history.length]
    cold = [b for b, p in enumerate(prepared) if not p.history.length]  # new users: the new-user query
    warm_times = [prepared[b].request_time for b in warm]
    encoded = dict(zip(warm, encode.encode(cache, [prepared[b].history for b in warm], use_cache, warm_times)))
    queries = torch.zeros(len(prepared), catalogue.vectors.shape[1], dtype=catalogue.vectors.dtype)  # [B, d]
    if warm:
        queries[warm] = encode.queries([encoded[b] for b in warm], warm_times)
    if cold:
        queries[cold] = model.new_user_queries([prepared[b].history.common for b in cold]).to(queries.dtype)
    counts = torch.tensor([len(p.candidates[TIMESTAMPS]) for p in prepared])
    items = torch.from_numpy(np.concatenate([p.candidates[catalogue.item_feature] for p in prepared]))
    rows = torch.repeat_interleave(torch.arange(len(prepared)), counts)
    scores = (queries[rows] * catalogue.vectors[items]).sum(-1).numpy()  # [N]
    bounds = np.cumsum([0, *counts.tolist()])
    out = []
    for b, p in enumerate(prepared):
        h, result = p.history, {RETRIEVAL: scores[bounds[b] : bounds[b + 1]]}
        check_finite(result, "retrieval")
        status, fallback = (encoded[b].cache_status, None) if b in encoded else ("off", USER_FEATURES)
        out.append(RankResult(result, h.length, h.truncated, status, h.model_version, h.left_out, fallback))
    return out


def _one_pass(model: ServingModel, hist: Tokens, cands: Tokens, request_time: int) -> Tensor:
    """HSTU outputs at the candidates from one target-aware pass over history + candidates: [N, D].

    Query times (read by "next_event" models): each history token's is the next one's
    timestamp, the last one's the request time; a candidate's is its own timestamp."""
    tokens = {name: np.concatenate([hist[name], cands[name]]) for name in hist}
    x = model.embed_tokens(tokens)
    length, count = len(hist[TIMESTAMPS]), len(cands[TIMESTAMPS])
    total = length + count
    query_times = np.concatenate([hist[TIMESTAMPS][1:], [request_time], cands[TIMESTAMPS]])[-total:]
    device = model.engine.device
    with torch.inference_mode():
        h = model.engine.hstu(
            x,
            torch.tensor([0, total], device=device),
            total,
            torch.from_numpy(tokens[TIMESTAMPS]).to(device),
            torch.tensor([count], device=device),
            torch.from_numpy(query_times.astype(np.int64)).to(device),
        )
    return h[length:]
