"""The serving runtime: rank, recommend and generate over an export, with prefix caching.

Per request: the history is validated (``Ranker.history``), then its tokens go sparse ->
prefix_dnn -> HSTU once (or only the new ones, when the user's cached history is a prefix of
the request's: ``Ranker.encode``). Ranking exports then run the candidates against the cached
K/V (in micro-batches) -> postfix_dnn; retrieval exports score items against the query at the
last history token. Several requests run as one batch (``rank_batch``, ``recommend_batch``): the
users' new history tokens in shared HSTU passes, their queries or candidates in shared passes
and ONNX runs, recommend's catalogue search in one matrix product (or one batched index search);
each answer equals the request's own. Imports no training code.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from gr.export.format import TIMESTAMPS
from gr.hstu.cache import HistoryCache
from gr.jagged import offsets_from_lengths
from gr.serving import generate as generation
from gr.serving.catalogue import QUERY, Catalogue
from gr.serving.errors import RequestError
from gr.serving.history import (
    LONG_HISTORY,
    EncodedHistory,
    History,
    Tokens,
    fit,
)
from gr.serving.limits import DEFAULT_LIMITS, RequestLimits
from gr.serving.model import ServingModel, check_finite
from gr.serving.request import (
    MODEL_IDS,
    GenerateRequest,
    IdOptions,
    RankRequest,
    RecommendRequest,
    check_request_time,
)
from gr.serving.scores import RETRIEVAL, ranking_scores
from gr.serving.user_cache import UserCache
from gr.timestamps import TimestampError, check_time_span

DEFAULT_CACHE_BYTES = 256 * 2**20
DEFAULT_MICRO_BATCH = 256
WARM_UP_USER = ("gr", "warm-up")  # a key no request can send (user ids are strings or integers)

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_MICRO_BATCH",
    "LONG_HISTORY",
    "Ranker",
    "RankResult",
    "RecommendResult",
    "ServingModel",
]


def _warnings(truncated: int) -> Dict[str, Any]:
    if not truncated:
        return {}
    return {"warnings": [f"history truncated: dropped the {truncated} oldest token(s) to fit max_seq_len"]}


@dataclass(frozen=True)
class RankResult:
    """scores: {name: [N] float32}, candidates in request order: for a ranking export each task's
    probability under its name and its logit under ``<task>_logit`` (``gr.serving.scores``), for
    a retrieval export {"retrieval": the cosine of the query at the last history token and each
    candidate's item vector}.

    history_length: history tokens used; truncated: oldest tokens dropped to fit
    max_seq_len; cache_status: "miss" (history encoded), "extend" (only new actions encoded),
    "hit" (nothing encoded) or "off" (no history cache used); model_version: the reload
    count of the model that computed every score.
    """

    scores: Dict[str, np.ndarray]
    history_length: int
    truncated: int
    cache_status: str
    model_version: int = 0

    def to_json(self) -> Dict[str, Any]:
        return {
            "scores": {name: value.tolist() for name, value in self.scores.items()},
            "history_length": self.history_length,
            "cache_status": self.cache_status,
            "cache": self.cache_status,
            "model_version": self.model_version,
            **_warnings(self.truncated),
        }


@dataclass(frozen=True)
class RecommendResult:
    """items: the top k catalogue items (in the request's id space), best first; scores: [k]
    their cosines with the query (see RankResult); other fields as in RankResult."""

    items: List[Any]
    scores: np.ndarray
    history_length: int
    truncated: int
    cache_status: str
    model_version: int

    def to_json(self) -> Dict[str, Any]:
        return {
            "items": self.items,
            "scores": self.scores.tolist(),
            "history_length": self.history_length,
            "cache_status": self.cache_status,
            "cache": self.cache_status,
            "model_version": self.model_version,
            **_warnings(self.truncated),
        }


@dataclass(frozen=True)
class CachedUser:
    """A user-cache entry: the history tokens the cache was built from, its K/V, the model
    version that computed them, and last_hidden: [D] the HSTU output at the last history token
    (None when the engine defers it to the request's time, or the history is empty)."""

    tokens: Tokens
    history: HistoryCache
    model_version: int
    last_hidden: Optional[Tensor] = None

    @property
    def nbytes(self) -> int:
        last = 0 if self.last_hidden is None else self.last_hidden.numel() * self.last_hidden.element_size()
        return self.history.nbytes + sum(a.nbytes for a in self.tokens.values()) + last


@dataclass(frozen=True)
class PreparedRank:
    """A validated rank request: its history (``Ranker.history``), candidate columns and time."""

    request: RankRequest
    history: History
    candidates: Tokens
    request_time: int


@dataclass(frozen=True)
class PreparedRecommend:
    """A validated recommend request: its history, time and the items it excludes ([s] int64)."""

    request: RecommendRequest
    history: History
    request_time: int
    excluded: np.ndarray


class Ranker:
    """Ranks, recommends and generates for users from an export, caching each user's encoded history.

    cache_bytes: bound of the user cache (LRU by bytes)
    micro_batch: candidates per HSTU pass (results do not depend on it)
    long_history: "truncate" (keep the most recent max_seq_len tokens, reported in the
        result) or "refuse" (a RequestError)
    threads: intra-op threads of each ONNX Runtime session (None: its default)
    index: the catalogue's item index for recommend and generation: "exact" or "hnsw"
    device: where ``load`` and ``reload`` put a model: "cpu", "cuda" or "npu" (None: the
        given model's device; a different one is refused)
    limits: bounds on one request's size and work (``gr.serving.limits``)
    Thread-safe: concurrent calls share the cache; ``reload`` swaps the model and invalidates
    the cache, and every result comes from one model (its ``model_version``).
    """

    def __init__(
        self,
        model: ServingModel,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        micro_batch: int = DEFAULT_MICRO_BATCH,
        long_history: str = "truncate",
        threads: Optional[int] = None,
        index: str = "exact",
        device: Optional[str] = None,
        limits: RequestLimits = DEFAULT_LIMITS,
    ) -> None:
        if device is not None and device != model.device:
            raise ValueError(f"Ranker.device: {device!r}, but the model was loaded on {model.device!r}")
        if long_history not in LONG_HISTORY:
            raise ValueError(f"Ranker.long_history: expected one of {list(LONG_HISTORY)}, got {long_history!r}")
        if micro_batch < 1:
            raise ValueError(f"Ranker.micro_batch: expected >= 1, got {micro_batch}")
        self.micro_batch = micro_batch
        self.long_history = long_history
        self.threads = threads
        self.index = index
        self.device = model.device
        self.limits = limits
        self.cache = UserCache(cache_bytes)
        self._model = model
        self._lock = threading.Lock()

    @classmethod
    def load(cls, export_dir: Union[str, Path], **options: Any) -> "Ranker":
        """Load and validate an export directory; ``options`` as in the constructor."""
        model = ServingModel(
            export_dir, options.get("threads"), options.get("index", "exact"), options.get("device", "cpu")
        )
        return cls(model, **options)

    @property
    def model(self) -> ServingModel:
        return self._model

    def reload(self, export_dir: Union[str, Path], model_version: Optional[int] = None) -> None:
        """Load another export (e.g. a newer model), warm it up (``warm_up``) while the old one
        serves, then swap it in and invalidate every cached history. model_version: the version
        the new model takes (default: one more than the current one)."""
        model = ServingModel(export_dir, self.threads, self.index, self.device)
        Ranker(model, micro_batch=self.micro_batch, long_history=self.long_history, limits=self.limits).warm_up()
        with self._lock:
            self._model = model
            self.cache.invalidate(model_version)

    def warm_up(self) -> None:
        """Answer one small request of each kind the current model serves (rank; recommend and
        generate for a retrieval export), so that the first real one is fast: the fused CPU kernels
        (built on first use), the ONNX Runtime sessions and the catalogue are loaded. Leaves the
        user cache as it was."""
        model = self.model
        history, candidates, common = (
            model.schema.example(model.sparse, 2),
            model.schema.example(model.sparse, 2),
            model.schema.example_common(model.sparse),
        )
        try:
            self.rank(WARM_UP_USER, history, candidates, common)
            if model.is_retrieval:
                self.recommend(RecommendRequest(WARM_UP_USER, history, 1, common, exclude_seen=False))
                if model.catalogue().tokens is not None:
                    self.generate(WARM_UP_USER, history, 1, "greedy", False, common_features=common)
                    self.generate(WARM_UP_USER, history, 1, "beam", False, common_features=common, beam_width=2)
        finally:
            self.cache.discard(WARM_UP_USER)

    def catalogue(self) -> Tuple[Catalogue, int]:
        """The current model's item catalogue (built on first use) and its model version."""
        with self._lock:
            model, model_version = self._model, self.cache.model_version
        return model.catalogue(), model_version

    # ---- the one history path -------------------------------------------------------------
    def history(
        self,
        user_id: Hashable,
        history: Mapping[str, Any],
        common_features: Optional[Mapping[str, Any]] = None,
        *,
        reserve: int = 0,
        id_options: IdOptions = MODEL_IDS,
    ) -> History:
        """Validate a history (and common features) against the current model; touches no cache.

        reserve: tokens to keep free of max_seq_len (generated items)."""
        with self._lock:
            model, model_version = self._model, self.cache.model_version
        self.limits.check_user_id(user_id)
        if reserve >= model.config.max_seq_len:
            raise RequestError(f"k: {reserve} items do not fit the model's max_seq_len {model.config.max_seq_len}")
        raw = model.id_maps if id_options.ids == "raw" else None
        unknown, limits = id_options.unknown_ids, self.limits
        tokens = model.schema.tokens(history, "history", model.sparse, raw=raw, unknown_ids=unknown, limits=limits)
        common = model.schema.common(common_features, model.sparse, raw=raw, unknown_ids=unknown, limits=limits)
        tokens, truncated = fit(
            tokens, model.config.max_seq_len, reserve, self.long_history, model.config.eviction_block
        )
        return History(model, model_version, user_id, tokens, common, truncated, raw, id_options.unknown_ids)

    def encode(self, h: History, use_cache: bool = True) -> EncodedHistory:
        """The user's encoded history: reused, extended with the new tokens, or encoded (and stored).

        Only a cache entry of ``h``'s model version is used or stored (a reload may race the request).
        use_cache=False encodes the history and leaves the cache alone (status "off")."""
        return self.encode_batch([h], use_cache)[0]

    def encode_batch(self, histories: Sequence[History], use_cache: bool = True) -> List[EncodedHistory]:
        """``encode`` of several histories (one model's): the new tokens of every user in one
        prefix_dnn run, the histories to encode in one HSTU pass and those to extend in another.
        A user met twice waits for the next round, as if its requests came one after the other."""
        out: List[Optional[EncodedHistory]] = [None] * len(histories)
        waiting = list(range(len(histories)))
        while waiting:
            users: set = set()
            now, later = [], []
            for i in waiting:
                (later if histories[i].user_id in users else now).append(i)
                users.add(histories[i].user_id)
            for i, encoded in zip(now, self._encode_round([histories[i] for i in now], use_cache)):
                out[i] = encoded
            waiting = later
        return out

    def _encode_round(self, histories: Sequence[History], use_cache: bool) -> List[EncodedHistory]:
        """``encode_batch`` of histories of distinct users."""
        if not histories:
            return []
        model = histories[0].model
        engine = model.engine
        found: List[Tuple[Optional[CachedUser], str]] = []  # (the cache entry to build on, status)
        for h in histories:
            entry = self.cache.get(h.user_id) if use_cache else None
            if (
                isinstance(entry, CachedUser)
                and entry.model_version == h.model_version
                and _is_prefix(entry.tokens, h.tokens)
            ):
                if entry.history.length == h.length:
                    found.append((entry, "hit"))
                    continue
                if engine.can_extend(entry.history):
                    found.append((entry, "extend"))
                    continue
            found.append((None, "miss" if use_cache else "off"))
        runs = [i for i, (_, status) in enumerate(found) if status != "hit"]
        new = {i: _tokens_after(histories[i].tokens, found[i][0]) for i in runs}
        xs: Dict[int, Tensor] = {}
        if runs:
            x = model.embed_tokens({name: np.concatenate([new[i][name] for i in runs]) for name in new[runs[0]]})
            xs = dict(zip(runs, torch.split(x, [len(new[i][TIMESTAMPS]) for i in runs])))
        times = {i: torch.from_numpy(new[i][TIMESTAMPS]) for i in runs}
        misses = [i for i in runs if found[i][0] is None]
        extends = [i for i in runs if found[i][0] is not None]
        ran = dict(zip(misses, engine.encode_batch([xs[i] for i in misses], [times[i] for i in misses])))
        caches = [found[i][0].history for i in extends]
        ran.update(zip(extends, engine.extend_batch(caches, [xs[i] for i in extends], [times[i] for i in extends])))
        out = []
        for i, (h, (entry, status)) in enumerate(zip(histories, found)):
            if status == "hit":
                cached = entry
            else:
                cache, hidden = ran[i]
                if engine.defers_last or h.length == 0:
                    last = None
                elif len(hidden):
                    last = hidden[-1]
                else:  # no token committed now: the cached entry's last output still holds
                    last = entry.last_hidden
                cached = CachedUser(h.tokens, cache, h.model_version, last)
                if use_cache:
                    self.cache.put(h.user_id, cached, h.model_version)
            out.append(EncodedHistory(h, cached.history, status, cached.last_hidden))
        return out

    def queries(self, histories: Sequence[History], request_times: Sequence[int], use_cache: bool = True) -> Tensor:
        """[B, d] the retrieval query at the last token of each history (``history``; one model's,
        each non-empty), all from shared passes (``encode_batch``, ``_queries``); request_times:
        seconds, when each user's next event happens (read by "next_event" models)."""
        return self._queries(self.encode_batch(histories, use_cache), request_times)

    def _queries(self, encoded: Sequence[EncodedHistory], request_times: Sequence[int]) -> Tensor:
        """[B, d] the retrieval query at the last token of each encoded history (one model's, each
        non-empty): the HSTU outputs there (settled at the request's time when the engine defers
        the last token: one pass for all) through one postfix_dnn run."""
        model = encoded[0].history.model
        if model.engine.defers_last:
            settled = model.engine.settle_batch([e.cache for e in encoded], list(request_times))
            hidden = torch.cat([outputs[-1:] for _, outputs in settled])
        else:
            hidden = torch.stack([e.last_hidden for e in encoded])
        commons = [e.history.common for e in encoded]
        return torch.from_numpy(model.heads_batch(hidden, commons, [1] * len(encoded))[QUERY])

    # ---- rank -------------------------------------------------------------------------------
    def rank(
        self,
        user_id: Hashable,
        history: Mapping[str, Any],
        candidates: Mapping[str, Any],
        common_features: Optional[Mapping[str, Any]] = None,
        *,
        request_time: Optional[int] = None,
        use_cache: bool = True,
        id_options: IdOptions = MODEL_IDS,
    ) -> RankResult:
        """Score ``candidates`` for a user with ``history`` (columns as in ``gr.serving.request``).

        use_cache=False runs without the history cache (one target-aware pass for a ranking export).
        request_time: seconds (see ``gr.serving.request``); "next_event" models read it.
        """
        request = RankRequest(user_id, history, candidates, common_features, request_time, id_options)
        return self.rank_request(request, use_cache)

    def _rank_one_pass(self, p: PreparedRank) -> RankResult:
        """One request of a ranking export without the cache: one target-aware pass over history + candidates."""
        h, model = p.history, p.history.model
        hidden = _one_pass(model, h.tokens, p.candidates, p.request_time)
        return RankResult(ranking_scores(model.heads(hidden, h.common)), h.length, h.truncated, "off", h.model_version)

    def _rank_retrieval(self, prepared: Sequence[PreparedRank], use_cache: bool) -> List[RankResult]:
        """Requests of a retrieval export: each candidate's cosine with its request's query, the
        queries of the whole batch from shared passes (``_queries``)."""
        catalogue = prepared[0].history.model.catalogue()
        encoded = self.encode_batch([p.history for p in prepared], use_cache)
        queries = self._queries(encoded, [p.request_time for p in prepared])  # [B, d]
        counts = torch.tensor([len(p.candidates[TIMESTAMPS]) for p in prepared])
        items = torch.from_numpy(np.concatenate([p.candidates[catalogue.item_feature] for p in prepared]))
        rows = torch.repeat_interleave(torch.arange(len(prepared)), counts)
        scores = (queries[rows] * catalogue.vectors[items]).sum(-1).numpy()  # [N]
        bounds = np.cumsum([0, *counts.tolist()])
        out = []
        for b, (p, e) in enumerate(zip(prepared, encoded)):
            h, result = p.history, {RETRIEVAL: scores[bounds[b] : bounds[b + 1]]}
            check_finite(result, "retrieval")
            out.append(RankResult(result, h.length, h.truncated, e.cache_status, h.model_version))
        return out

    def _candidates(self, h: History, candidates: Mapping[str, Any], request_time: Optional[int]) -> Tuple[Tokens, int]:
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
            limits=self.limits,
        )
        if len(cands[TIMESTAMPS]) == 0:
            raise RequestError("candidates: the list is empty; a ranking request needs at least one candidate")
        if request_time is None:  # the request is when its candidates are shown
            request_time = int(cands[TIMESTAMPS].max())
        _check_span(h, {"candidates.timestamps": cands[TIMESTAMPS], "request_time": request_time})
        return cands, request_time

    def rank_request(self, request: RankRequest, use_cache: bool = True) -> RankResult:
        return self.rank_prepared([self.prepare_rank(request)], use_cache=use_cache)[0]

    def rank_batch(self, requests: Sequence[RankRequest], *, use_cache: bool = True) -> List[RankResult]:
        """Rank several users' requests as one batch; a bad one raises RequestError naming its index.

        A ranking export scores every user's candidates against that user's cached history in
        shared HSTU passes (``CachedHSTU.score_batch``: up to ``micro_batch`` candidates a pass,
        users packed together) and shared prefix/postfix ONNX runs; a retrieval export computes
        every user's query in shared passes (``encode_batch``, then one settle pass and one
        postfix_dnn run) and scores the candidates against them. Scores equal ``rank`` user by
        user. A ranking export without the cache, and a batch that raced a reload, go one by one."""
        return self.rank_prepared(_prepare_each(self.prepare_rank, requests), use_cache=use_cache)

    def prepare_rank(self, request: RankRequest) -> PreparedRank:
        """Validate one rank request against the current model (touches no cache): everything a
        request can get wrong is found here, before it joins a batch."""
        h = self.history(request.user_id, request.history, request.common_features, id_options=request.id_options)
        if h.model.is_retrieval:
            h.model.catalogue()  # RequestError when the export has none
            if h.length == 0:
                raise RequestError(
                    "history: empty; a retrieval model scores items against the query at the last history item"
                )
        return PreparedRank(request, h, *self._candidates(h, request.candidates, request.request_time))

    def rank_prepared(self, prepared: Sequence[PreparedRank], *, use_cache: bool = True) -> List[RankResult]:
        """``rank_batch`` of requests already validated by ``prepare_rank``."""
        if not prepared:
            return []
        model = prepared[0].history.model
        if any(p.history.model is not model for p in prepared):  # a reload raced the batch: one model each
            return [self.rank_prepared([p], use_cache=use_cache)[0] for p in prepared]
        if model.is_retrieval:
            return self._rank_retrieval(prepared, use_cache)
        if not use_cache:
            return [self._rank_one_pass(p) for p in prepared]
        encoded = self.encode_batch([p.history for p in prepared])
        counts = [len(p.candidates[TIMESTAMPS]) for p in prepared]
        joined = {name: np.concatenate([p.candidates[name] for p in prepared]) for name in prepared[0].candidates}
        hidden = model.engine.score_batch(
            [e.cache for e in encoded],
            model.embed_tokens(joined),
            offsets_from_lengths(torch.tensor(counts)),
            torch.from_numpy(joined[TIMESTAMPS]),
            self.micro_batch,
            [p.request_time for p in prepared],
        )
        scores = ranking_scores(model.heads_batch(hidden, [p.history.common for p in prepared], counts))
        bounds = np.cumsum([0, *counts])
        return [
            RankResult(
                {task: value[bounds[b] : bounds[b + 1]] for task, value in scores.items()},
                p.history.length,
                p.history.truncated,
                e.cache_status,
                p.history.model_version,
            )
            for b, (p, e) in enumerate(zip(prepared, encoded))
        ]

    # ---- recommend --------------------------------------------------------------------------
    def recommend(self, request: RecommendRequest) -> RecommendResult:
        """The top ``request.k`` items of the whole catalogue for a user, through the catalogue's item index."""
        return self.recommend_prepared([self.prepare_recommend(request)])[0]

    def recommend_batch(self, requests: Sequence[RecommendRequest]) -> List[RecommendResult]:
        """Recommend for several users as one batch (``recommend_prepared``); a bad request raises
        RequestError naming its index."""
        return self.recommend_prepared(_prepare_each(self.prepare_recommend, requests))

    def prepare_recommend(self, request: RecommendRequest) -> PreparedRecommend:
        """Validate one recommend request against the current model (touches no cache), before it joins a batch."""
        self.limits.check_count(request.k, "max_k", "k", "items")
        h = self.history(request.user_id, request.history, request.common_features, id_options=request.id_options)
        check_request_time(request.request_time)
        if not h.model.is_retrieval:
            raise RequestError(
                f"model: recommend needs a retrieval export (a {QUERY!r} output); this one "
                f"outputs {h.model.postfix.output_names}: use rank"
            )
        catalogue = h.model.catalogue()
        if h.length == 0:
            raise RequestError("history: empty; recommend needs at least one item")
        excluded = np.unique(h.tokens[catalogue.item_feature]) if request.exclude_seen else np.zeros(0, np.int64)
        available = catalogue.index.num_items - len(excluded)
        if request.k > available:
            raise RequestError(f"k: {request.k} items requested but only {available} catalogue items are eligible")
        request_time = int(h.tokens[TIMESTAMPS][-1]) if request.request_time is None else request.request_time
        _check_span(h, {"request_time": request_time})
        return PreparedRecommend(request, h, request_time, excluded)

    def recommend_prepared(self, prepared: Sequence[PreparedRecommend]) -> List[RecommendResult]:
        """Recommend for requests validated by ``prepare_recommend``: every user's query from shared
        passes (``_queries``), then one search of the catalogue's index for all the queries that
        ask for the same k (the exact index: one matrix product). Equals ``recommend`` one by one."""
        if not prepared:
            return []
        model = prepared[0].history.model
        if any(p.history.model is not model for p in prepared):  # a reload raced the batch: one model each
            return [self.recommend_prepared([p])[0] for p in prepared]
        index = model.catalogue().index
        encoded = self.encode_batch([p.history for p in prepared])
        queries = self._queries(encoded, [p.request_time for p in prepared])  # [B, d]
        found: Dict[int, Tuple[Tensor, Tensor]] = {}
        for k in sorted({p.request.k for p in prepared}):
            rows = [b for b, p in enumerate(prepared) if p.request.k == k]
            exclude = torch.zeros(len(rows), index.num_items, dtype=torch.bool)
            for r, b in enumerate(rows):
                exclude[r, torch.from_numpy(prepared[b].excluded)] = True
            scores, items = index.search(queries[rows], exclude, k)
            found.update((b, (scores[r], items[r])) for r, b in enumerate(rows))
        item_feature, out = model.catalogue().item_feature, []
        for b, (p, e) in enumerate(zip(prepared, encoded)):
            (scores, items), h = found[b], p.history
            check_finite({"scores": scores.numpy()}, "recommend")
            items = h.decode_items(item_feature, items.numpy())
            out.append(RecommendResult(items, scores.numpy(), h.length, h.truncated, e.cache_status, h.model_version))
        return out

    # ---- generate ---------------------------------------------------------------------------
    def generate(
        self,
        request: Union[GenerateRequest, Hashable],
        history: Optional[Mapping[str, Any]] = None,
        k: Optional[int] = None,
        strategy: str = "greedy",
        exclude_seen: bool = True,
        **options: Any,
    ) -> generation.GenerateResult:
        """Generate a user's next items: ``generate(GenerateRequest)``, or the keyword form
        ``generate(user_id, history, k, strategy, exclude_seen, **options)`` whose options are
        those of ``gr.serving.generate.run`` plus ``common_features``, ``request_time``, ``id_options``.

        The user's cached history is used and updated as in ``rank``."""
        if not isinstance(request, GenerateRequest):
            fields = {
                key: options.pop(key)
                for key in ("common_features", "request_time", "beam_width", "temperature", "seed", "id_options")
                if key in options
            }
            request = GenerateRequest(request, history, k, strategy=strategy, exclude_seen=exclude_seen, **fields)
        generation.check_k(request.k)
        self.limits.check_count(request.k, "max_k", "k", "items")
        if request.strategy == "beam":
            self.limits.check_count(request.beam_width, "max_beam_width", "beam_width", "beams")
        h = self.history(
            request.user_id, request.history, request.common_features, reserve=request.k, id_options=request.id_options
        )
        _check_span(h, {"request_time": request.request_time})
        catalogue = h.model.catalogue()
        plan = generation.plan(h, catalogue, request, **options)
        return generation.run(plan, self.encode(h))


def _check_span(h: History, times: Dict[str, Any]) -> None:
    """RequestError when the history's times and ``times`` ({field: int or [n] ints}) lie 2^63 s apart."""
    try:
        check_time_span({"history.timestamps": h.tokens[TIMESTAMPS], **times})
    except TimestampError as exc:
        raise RequestError(str(exc)) from None


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


def _prepare_each(prepare: Callable[[Any], Any], requests: Sequence[Any]) -> List[Any]:
    """``prepare`` of every request; a RequestError names the request's index."""
    prepared = []
    for i, request in enumerate(requests):
        try:
            prepared.append(prepare(request))
        except RequestError as exc:
            raise RequestError(f"requests[{i}]: {exc}") from exc
    return prepared


def _tokens_after(tokens: Tokens, entry: Optional[CachedUser]) -> Tokens:
    """The history tokens that ``entry`` (a cached prefix, or None) does not hold."""
    known = 0 if entry is None else entry.history.length
    return {name: value[known:] for name, value in tokens.items()}


def _is_prefix(cached: Tokens, tokens: Tokens) -> bool:
    """Whether the cached history's tokens are the first tokens of ``tokens``, feature by feature."""
    length = len(cached[TIMESTAMPS])
    if length > len(tokens[TIMESTAMPS]) or set(cached) != set(tokens):
        return False
    return all(np.array_equal(cached[name], tokens[name][:length]) for name in cached)
