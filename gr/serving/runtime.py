"""The serving runtime: rank, recommend and generate over an export, with prefix caching.

``Ranker`` is a facade with one entry point per verb: ``rank``, ``recommend`` and ``generate``
each take a request (-> its result) or a sequence of requests (-> their results, run as one batch;
a bad request raises RequestError naming its index). A single request goes through the batch path.
The two steps behind every verb are public for the HTTP batcher and ``gr predict``: ``prepare``
(validate one request against the current model, touching no cache -> a Prepared* object) and
``run`` (answer a batch of prepared requests of one kind).

The machinery lives in modules by concept: ``gr.serving.history`` (validate a history),
``gr.serving.encode`` (encode histories through the user cache; retrieval queries),
``gr.serving.rank``, ``gr.serving.recommend`` and ``gr.serving.generate`` (each verb's prepare and
run), ``gr.hstu.user_state`` (a user's cached state and every operation on it). Every answer of a
batch equals the request's own. Imports no training code.
"""

from __future__ import annotations

import copy
import logging
import threading
from pathlib import Path
from typing import (
    Any,
    Callable,
    Dict,
    Hashable,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
    cast,
    overload,
)

import numpy as np

from gr.export.delta import chain_deltas, is_delta
from gr.hstu.paged import PagePool
from gr.serving import generate as generation
from gr.serving import rank as ranking
from gr.serving import recommend as recommendation
from gr.serving.catalogue import Catalogue
from gr.serving.errors import RequestError
from gr.serving.generate import GenerateResult, PreparedGenerate
from gr.serving.history import History, check_span, stored_events, validate, validate_batch
from gr.serving.history_store import HistoryStore
from gr.serving.limits import DEFAULT_LIMITS, RequestLimits
from gr.serving.model import ServingModel
from gr.serving.options import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_MICRO_BATCH,
    DEFAULT_PAGE_SIZE,
    DEFAULT_TIER_MIN_TOKENS,
    LONG_HISTORY,
)
from gr.serving.rank import PreparedRank, RankResult
from gr.serving.recommend import PreparedRecommend, RecommendResult
from gr.serving.request import MODEL_IDS, EventsRequest, GenerateRequest, IdOptions, RankRequest, RecommendRequest
from gr.serving.shared_tier import TieredCache, TierStore, tier_version
from gr.serving.tier_line import TierLine, measure_tier_line

log = logging.getLogger(__name__)

WARM_UP_USER = ("gr", "warm-up")  # a key no request can send (user ids are strings or integers)

Request = Union[RankRequest, RecommendRequest, GenerateRequest]
Prepared = Union[PreparedRank, PreparedRecommend, PreparedGenerate]
R = TypeVar("R")

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_MICRO_BATCH",
    "LONG_HISTORY",
    "GenerateResult",
    "Prepared",
    "PreparedGenerate",
    "PreparedRank",
    "PreparedRecommend",
    "Ranker",
    "RankResult",
    "RecommendResult",
    "ServingModel",
]


class Ranker:
    """Ranks, recommends and generates for users from an export, caching each user's encoded history.

    cache_bytes: bound of the user cache (LRU by bytes); with pages, also the size of the page pool
        that holds every cached history's K/V (``gr.hstu.paged``): a full pool evicts LRU users
    page_size: tokens per K/V page (0: each history's K/V in its own tensors, copied on extension)
    micro_batch: candidates per HSTU pass (results do not depend on it)
    long_history: "truncate" (keep the most recent max_seq_len tokens, reported in the
        result) or "refuse" (a RequestError)
    threads: intra-op threads of each ONNX Runtime session (None: its default)
    index: the catalogue's item index for recommend and generation: "exact" or "hnsw"
    device: where ``load`` and ``reload`` put a model: "cpu", "cuda" or "npu" (None: the
        given model's device; a different one is refused)
    limits: bounds on one request's size and work (``gr.serving.limits``)
    history_store: the users' histories kept by the service (``gr.serving.history_store``):
        ``append`` adds events, and a request without a history is answered from the user's
        stored one (None: every request carries its history); history_events: the events it keeps
        a user, or None: the model's max_seq_len, which a reload to a model of another window
        carries over to the store
    tiers: where encoded histories are shared with other workers and servers, nearest first
        (``gr.serving.shared_tier``: ``SqliteTier``, ``gr.serving.redis_tier.RedisTier``); a user this
        worker's cache cannot serve is fetched from them; tier_min_tokens: histories shorter than
        this are encoded, never fetched nor shared, or "auto": the line where fetching costs less
        than encoding, measured for each model loaded (``gr.serving.tier_line``; ``tier_line``)
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
        history_store: Optional[HistoryStore] = None,
        history_events: Optional[int] = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        tiers: Sequence[TierStore] = (),
        tier_min_tokens: Union[int, str] = "auto",
    ) -> None:
        if tier_min_tokens != "auto" and (not isinstance(tier_min_tokens, int) or tier_min_tokens < 1):
            raise ValueError(f"Ranker.tier_min_tokens: expected an int >= 1 or 'auto', got {tier_min_tokens!r}")
        if page_size < 0:
            raise ValueError(f"Ranker.page_size: expected >= 0, got {page_size}")
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
        self.history_store = history_store
        self.history_events = history_events
        self.page_size = page_size
        fixed = tier_min_tokens if isinstance(tier_min_tokens, int) else DEFAULT_TIER_MIN_TOKENS
        self.cache = TieredCache(cache_bytes, tiers, fixed, tier_version(model.identity, model.engine))
        self.measures_tier_line = tier_min_tokens == "auto" and bool(tiers)
        self.tier_line: Optional[TierLine] = None  # the last line measured (tier_min_tokens "auto")
        self._model = model
        self._lock = threading.Lock()
        self._reloading = threading.Lock()
        self._use_pages(model)
        if self.measures_tier_line:
            self.cache.min_tokens = self._measured_min_tokens(model)

    def _measured_min_tokens(self, model: ServingModel) -> int:
        """The tier line of ``model`` (``tier_line``, logged) -> the tiers' min_tokens: past its
        max_seq_len where fetching never costs less."""
        line = measure_tier_line(model.engine, self.cache.tiers[0], self.page_size)
        self.tier_line = line
        log.info("%s", line.describe())
        return line.tier_min_tokens

    def _use_pages(self, model: ServingModel) -> None:
        """Give ``model``'s engine a page pool of ``cache_bytes`` whose eviction is this cache's LRU."""
        engine = model.engine
        if not self.page_size:
            engine.pool = None
            return
        dtype = next(engine.hstu.parameters()).dtype
        pool = PagePool.of_bytes(engine.config, self.cache.max_bytes, self.page_size, dtype=dtype, device=engine.device)
        pool.on_full = self.cache.evict_oldest
        engine.pool = pool

    def pages(self) -> Tuple[int, int]:
        """(used, free) pages of the current model's K/V page pool; (0, 0) without one."""
        pool = self.model.engine.pool
        return (0, 0) if pool is None else (pool.used, pool.free)

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

    def reload(
        self, export_dir: Union[str, Path, Sequence[Union[str, Path]]], model_version: Optional[int] = None
    ) -> None:
        """Load another export (e.g. a newer model), warm it up (``warm_up``) while the old one
        serves, then swap it in and invalidate every cached history. model_version: the version
        the new model takes (default: one more than the current one).

        A delta export, or a sequence of them (a chain, oldest first), is applied to the current
        model instead (``ServingModel.applied``; ExportFormatError naming the first delta that
        does not follow it): the same answers as the full export of the last delta's run, for the
        time of patching the changed rows. Cached histories, and the K/V pages they hold, are kept
        when the deltas change nothing they are computed from (the token features' tables, the item
        store, the prefix and HSTU slices), and invalidated otherwise: then the shared tiers' entries
        of the old model are purged and new ones are keyed by the new model's identity."""
        paths = [export_dir] if isinstance(export_dir, (str, Path)) else list(export_dir)
        with self._reloading:  # one reload at a time: a delta applies to the model it follows
            cache_holds = False
            if len(paths) != 1 or is_delta(paths[0]):
                model, cache_holds = self.model.applied(chain_deltas(self.model.identity, paths))
            else:
                model = ServingModel(paths[0], self.threads, self.index, self.device)
            pool = self.model.engine.pool
            if model.engine is self.model.engine:  # the HSTU slice is unchanged: the same weights, a pool of its own
                model.engine = copy.copy(model.engine)
            Ranker(
                model, micro_batch=self.micro_batch, long_history=self.long_history, limits=self.limits, page_size=0
            ).warm_up()
            if cache_holds:
                model.engine.pool = pool
            else:
                self._use_pages(model)
            min_tokens = self._measured_min_tokens(model) if self.measures_tier_line and not cache_holds else None
            with self._lock:
                self._model = model
                if cache_holds:
                    self.cache.advance(model_version)
                else:
                    self.cache.invalidate(model_version, tier_version(model.identity, model.engine))
                if min_tokens is not None:
                    self.cache.min_tokens = min_tokens
                if self.history_store is not None and self.history_events is None:
                    self.history_store.max_events = model.config.max_seq_len
            self.cache.purge_retired()  # outside the lock: requests go on meanwhile

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
            self.rank(RankRequest(WARM_UP_USER, history, candidates, common))
            if model.is_retrieval:
                # excluding the example's one item, as requests do by default, leaves an item in any
                # catalogue of two or more; the exclusion's first np.unique imports numpy.ma (~20 ms)
                exclude_seen = model.catalogue().index.num_items > 1
                self.recommend(RecommendRequest(WARM_UP_USER, history, 1, common, exclude_seen=exclude_seen))
                if model.catalogue().tokens is not None:
                    self.generate(GenerateRequest(WARM_UP_USER, history, 1, common, exclude_seen=False))
                    self.generate(
                        GenerateRequest(
                            WARM_UP_USER, history, 1, common, strategy="beam", exclude_seen=False, beam_width=2
                        )
                    )
        finally:
            self.cache.discard(WARM_UP_USER)

    def catalogue(self) -> Tuple[Catalogue, int]:
        """The current model's item catalogue (built on first use) and its model version."""
        with self._lock:
            model, model_version = self._model, self.cache.model_version
        return model.catalogue(), model_version

    # ---- the verbs: one entry point each ---------------------------------------------------
    # (overloads: one request -> its result, a sequence -> a list; the implementations follow them)
    # A sequence of requests (a tuple) is also a Hashable user id: this overload, first, is the one that applies.
    @overload
    def rank(  # type: ignore[overload-overlap]
        self, requests: Sequence[RankRequest], *, use_cache: bool = True
    ) -> List[RankResult]: ...

    @overload
    def rank(
        self,
        requests: Union[RankRequest, Hashable],
        history: Optional[Mapping[str, Any]] = None,
        candidates: Optional[Mapping[str, Any]] = None,
        common_features: Optional[Mapping[str, Any]] = None,
        *,
        request_time: Optional[int] = None,
        use_cache: bool = True,
        id_options: IdOptions = MODEL_IDS,
    ) -> RankResult: ...

    def rank(
        self,
        requests: Union[RankRequest, Sequence[RankRequest], Hashable],
        history: Any = None,  # the keyword form's columns (None: no tokens), checked by prepare
        candidates: Any = None,
        common_features: Optional[Mapping[str, Any]] = None,
        *,
        request_time: Optional[int] = None,
        use_cache: bool = True,
        id_options: IdOptions = MODEL_IDS,
    ) -> Union[RankResult, List[RankResult]]:
        """Score candidates: ``rank(RankRequest)`` -> RankResult, ``rank([RankRequest, ...])`` ->
        [RankResult] as one batch, or the keyword form ``rank(user_id, history, candidates,
        common_features, request_time=..., id_options=...)`` of one request (columns as in
        ``gr.serving.request``).

        A ranking export scores every user's candidates against that user's cached history in
        shared HSTU passes (up to ``micro_batch`` candidates a pass, users packed together); a
        retrieval export scores them against each user's query from shared passes. use_cache=False
        runs without the history cache (one target-aware pass a request for a ranking export).
        request_time: seconds (see ``gr.serving.request``); "next_event" models read it."""
        if history is not None or candidates is not None:
            requests = RankRequest(requests, history, candidates, common_features, request_time, id_options)
        return self._answer(RankRequest, requests, use_cache=use_cache)

    @overload
    def recommend(self, requests: RecommendRequest) -> RecommendResult: ...

    @overload
    def recommend(self, requests: Sequence[RecommendRequest]) -> List[RecommendResult]: ...

    def recommend(
        self, requests: Union[RecommendRequest, Sequence[RecommendRequest]]
    ) -> Union[RecommendResult, List[RecommendResult]]:
        """The top ``request.k`` items of the whole catalogue for a user (through the catalogue's
        item index): ``recommend(RecommendRequest)`` -> RecommendResult, or a sequence -> a list,
        every user's query from shared passes and one index search per k."""
        return self._answer(RecommendRequest, requests)

    @overload
    def generate(self, requests: Sequence[GenerateRequest], **options: Any) -> List[GenerateResult]: ...

    @overload
    def generate(
        self,
        requests: Union[GenerateRequest, Hashable],
        history: Optional[Mapping[str, Any]] = None,
        k: Optional[int] = None,
        strategy: str = "greedy",
        exclude_seen: bool = True,
        **options: Any,
    ) -> GenerateResult: ...

    def generate(
        self,
        requests: Union[GenerateRequest, Sequence[GenerateRequest], Hashable],
        history: Optional[Mapping[str, Any]] = None,
        k: Any = None,  # the keyword form's k, checked by prepare (None: refused there)
        strategy: str = "greedy",
        exclude_seen: bool = True,
        **options: Any,
    ) -> Union[GenerateResult, List[GenerateResult]]:
        """Generate users' next items: ``generate(GenerateRequest, **options)`` -> GenerateResult,
        ``generate([GenerateRequest, ...], **options)`` -> a list, or the keyword form
        ``generate(user_id, history, k, strategy, exclude_seen, **options)`` whose options may also
        hold the request's ``common_features``, ``request_time``, ``beam_width``, ``temperature``,
        ``seed`` and ``id_options``. options: those of ``gr.serving.generate.prepare`` (draft,
        verification, budget, attribute, speculative_retrieval).

        The user's cached history is used and updated as in ``rank``."""
        if history is not None:
            fields = {
                key: options.pop(key)
                for key in ("common_features", "request_time", "beam_width", "temperature", "seed", "id_options")
                if key in options
            }
            requests = GenerateRequest(requests, history, k, strategy=strategy, exclude_seen=exclude_seen, **fields)
        return self._answer(GenerateRequest, requests, options=options)

    def _answer(
        self, kind: type[Request], requests: Any, use_cache: bool = True, options: Optional[dict] = None
    ) -> Any:
        """One request (-> its result) or a sequence of them (-> their results), through ``prepare``
        and ``run`` as one batch; a bad request of a sequence raises RequestError naming its index."""
        options = options or {}
        if isinstance(requests, kind):
            return self.run([self.prepare(requests, **options)], use_cache=use_cache)[0]
        requests = list(requests)
        for request in requests:
            if not isinstance(request, kind):
                raise TypeError(f"expected {kind.__name__} objects, got {type(request).__name__}")
        return self.run(_prepare_each(lambda r: self.prepare(r, **options), requests), use_cache=use_cache)

    # ---- the two steps behind every verb ---------------------------------------------------
    @overload
    def prepare(self, request: RankRequest) -> PreparedRank: ...

    @overload
    def prepare(self, request: RecommendRequest) -> PreparedRecommend: ...

    @overload
    def prepare(self, request: Request, **options: Any) -> Prepared: ...

    def prepare(self, request: Request, **options: Any) -> Prepared:
        """Validate one request against the current model (touches no cache): everything a request
        can get wrong is found here, before it joins a batch. -> PreparedRank, PreparedRecommend or
        PreparedGenerate. options: a generate request's (see ``generate``)."""
        if options and not isinstance(request, GenerateRequest):
            raise TypeError(f"Ranker.prepare: options {sorted(options)} apply to generate requests only")
        if isinstance(request, RankRequest):
            h = self.history(request.user_id, request.history, request.common_features, id_options=request.id_options)
            return ranking.prepare(h, request, self.limits)
        if isinstance(request, RecommendRequest):
            self.limits.check_count(request.k, "max_k", "k", "items")
            h = self.history(request.user_id, request.history, request.common_features, id_options=request.id_options)
            return recommendation.prepare(h, request)
        if isinstance(request, GenerateRequest):
            generation.check_k(request.k)
            self.limits.check_count(request.k, "max_k", "k", "items")
            if request.strategy == "beam":
                self.limits.check_count(request.beam_width, "max_beam_width", "beam_width", "beams")
            h = self.history(
                request.user_id,
                request.history,
                request.common_features,
                reserve=request.k,
                id_options=request.id_options,
            )
            check_span(h, {"request_time": request.request_time})
            return generation.prepare(h, h.model.catalogue(), request, **options)
        raise TypeError(f"Ranker.prepare: expected a RankRequest, RecommendRequest or GenerateRequest, got {request!r}")

    def run(
        self, prepared: Sequence[Prepared], *, use_cache: bool = True
    ) -> Union[List[RankResult], List[RecommendResult], List[GenerateResult]]:
        """Answer requests validated by ``prepare``, all of one kind, as one batch (each answer
        equals the request's own; a batch that raced a reload goes one by one). use_cache=False
        (rank only) leaves the user cache alone."""
        if not prepared:
            return []
        kind = type(prepared[0])
        if any(type(p) is not kind for p in prepared):
            raise TypeError("Ranker.run: a batch holds prepared requests of one kind")
        # cast: each branch's requests are all of its kind (checked above), which types cannot follow
        if kind is PreparedRank:
            return ranking.run(self.cache, cast(Sequence[PreparedRank], prepared), self.micro_batch, use_cache)
        if not use_cache:
            raise ValueError("Ranker.run: use_cache=False applies to rank only")
        if kind is PreparedRecommend:
            return recommendation.run(self.cache, cast(Sequence[PreparedRecommend], prepared))
        return generation.run(self.cache, cast(Sequence[PreparedGenerate], prepared))

    def append(self, request: EventsRequest) -> Dict[str, Any]:
        """Append a user's events to the history store, validated against the current model
        (``gr.serving.history.stored_events``) -> {"user_id", "appended": events, "stored": events
        now held for the user}. RequestError without a store, for a bad history, or for events
        earlier than the user's last stored one."""
        if self.history_store is None:
            raise RequestError("user_id: this service keeps no histories (no history store): send them with requests")
        self.limits.check_user_id(request.user_id)
        events = stored_events(self.model, request.history, self.limits, request.unknown_ids)
        held = self.history_store.append(request.user_id, events)
        return {"user_id": request.user_id, "appended": len(events), "stored": held}

    def history(
        self,
        user_id: Hashable,
        history: Optional[Mapping[str, Any]],
        common_features: Optional[Mapping[str, Any]] = None,
        *,
        reserve: int = 0,
        id_options: IdOptions = MODEL_IDS,
    ) -> History:
        """Validate a history (and common features) against the current model (``gr.serving.history.validate``);
        touches no cache. reserve: tokens to keep free of max_seq_len (generated items). history
        None: the user's stored one (raw ids; its most recent tokens that fit, whatever
        ``long_history`` says; none for a user the store does not know)."""
        with self._lock:
            model, model_version = self._model, self.cache.model_version
        long_history = self.long_history
        if history is None:
            history, long_history = self._stored(user_id, id_options), "truncate"
        return validate(
            model, model_version, user_id, history, common_features, self.limits, long_history, reserve, id_options
        )

    def histories(
        self,
        user_ids: Sequence[Hashable],
        histories: Mapping[str, Any],
        offsets: np.ndarray,
        common_features: Sequence[Optional[Mapping[str, Any]]],
    ) -> List[History]:
        """``history`` of B users at once, in model ids, their histories back to back (history b's
        tokens at [offsets[b], offsets[b+1]) of the columns; offsets: [B+1] int64), converted and
        checked in one go (``gr.serving.history.validate_batch``); touches no cache."""
        with self._lock:
            model, model_version = self._model, self.cache.model_version
        return validate_batch(
            model, model_version, user_ids, histories, offsets, common_features, self.limits, self.long_history
        )

    def _stored(self, user_id: Hashable, id_options: IdOptions) -> Dict[str, list]:
        """The user's stored history for a request that sent none; RequestError without a store or
        for a request in model ids (the store keeps raw ids)."""
        if self.history_store is None:
            raise RequestError("history: missing (this service keeps no histories, so a request carries its own)")
        if id_options.ids != "raw":
            raise RequestError(
                "ids: a request without a history reads the stored one, which holds raw ids: send raw ids "
                f'(got "ids": "{id_options.ids}")'
            )
        self.limits.check_user_id(user_id)
        return self.history_store.read(user_id, self.limits.max_history_tokens)


def _prepare_each(prepare: Callable[[Any], R], requests: Sequence[Any]) -> List[R]:
    """``prepare`` of every request; a RequestError names the request's index."""
    prepared = []
    for i, request in enumerate(requests):
        try:
            prepared.append(prepare(request))
        except RequestError as exc:
            raise RequestError(f"requests[{i}]: {exc}") from exc
    return prepared
