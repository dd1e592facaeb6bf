"""The ranking runtime: an export's slices chained as slice_graph.ini says, with prefix caching.

Per request: the history's tokens go sparse -> prefix_dnn -> HSTU once (or only the
new ones, when the user's cached history is a prefix of the request's), then the
candidates go sparse -> prefix_dnn -> HSTU against the cached K/V (in micro-batches)
-> postfix_dnn. Imports no training code.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from gr.export.format import (
    BAG,
    HSTU_OUTPUT,
    HSTU_SLICE,
    POSTFIX,
    POSTFIX_ONNX,
    PREFIX,
    PREFIX_ONNX,
    PREFIX_OUTPUT,
    REPEAT_PER_TARGET,
    SPARSE,
    TIMESTAMPS,
    TOKENS,
)
from gr.export.reader import load_hstu, open_export
from gr.export.slice_graph import REQUEST
from gr.hstu.cache import CachedHSTU, HistoryCache
from gr.serving.errors import RequestError
from gr.serving.generate import Catalogue, GenerateResult, generate
from gr.serving.onnx_slice import OnnxSlice
from gr.serving.request import RankRequest, RequestSchema
from gr.serving.sparse_store import SparseStore
from gr.serving.user_cache import UserCache

LONG_HISTORY = ("truncate", "refuse")
DEFAULT_CACHE_BYTES = 256 * 2**20
DEFAULT_MICRO_BATCH = 256

Tokens = Dict[str, np.ndarray]


@dataclass(frozen=True)
class RankResult:
    """scores: {task: [N] (or [N, ...]) float32}, candidates in request order.

    history_length: history tokens used; truncated: oldest tokens dropped to fit
    max_seq_len; cache: "miss" (history encoded), "extend" (only new actions encoded),
    "hit" (nothing encoded) or "off" (one uncached target-aware pass).
    """

    scores: Dict[str, np.ndarray]
    history_length: int
    truncated: int
    cache_status: str

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "scores": {name: value.tolist() for name, value in self.scores.items()},
            "history_length": self.history_length,
            "cache_status": self.cache_status, "cache": self.cache_status,
        }
        if self.truncated:
            out["warnings"] = [f"history truncated: dropped the {self.truncated} oldest token(s) to fit max_seq_len"]
        return out


@dataclass(frozen=True)
class CachedUser:
    """A user-cache entry: the history tokens the cache was built from, its K/V, and the
    model version that computed them."""

    tokens: Tokens
    history: HistoryCache
    model_version: int

    @property
    def nbytes(self) -> int:
        return self.history.nbytes + sum(a.nbytes for a in self.tokens.values())


class ServingModel:
    """One loaded export: sparse store, ONNX Runtime sessions and the HSTU engine, wired by the graph."""

    def __init__(self, export_dir: Union[str, Path], threads: Optional[int] = None) -> None:
        manifest = open_export(export_dir)
        self.graph = manifest.graph
        self.config = manifest.hstu_config
        self.schema = RequestSchema.from_graph(self.graph)
        self.sparse = SparseStore(manifest)
        self.prefix = OnnxSlice(manifest.path(PREFIX_ONNX), self.graph.slice(PREFIX), threads)
        self.engine = CachedHSTU(load_hstu(manifest.root))
        self.postfix = OnnxSlice(manifest.path(POSTFIX_ONNX), self.graph.slice(POSTFIX), threads)

    def embed_tokens(self, tokens: Tokens) -> Tensor:
        """Token columns -> [T, D] HSTU input: sparse lookups, then the prefix_dnn slice."""
        count = len(tokens[TIMESTAMPS])
        if count == 0:
            return torch.zeros(0, self.config.hidden_dim)
        env = {f"{REQUEST}.{name}": value for name, value in tokens.items()}
        for t in self.graph.slice(SPARSE).inputs:
            if t.shape == (TOKENS,):
                env[f"{SPARSE}.{t.name}"] = self.sparse.sequence(t.name, env[t.source])
        out = self.prefix.run({t.name: env[t.source] for t in self.prefix.spec.inputs})
        return torch.from_numpy(out[PREFIX_OUTPUT])

    def heads(self, hidden: Tensor, common: Tokens) -> Dict[str, np.ndarray]:
        """hidden: [N, D] HSTU outputs at the candidates -> {task: [N, ...]} via the postfix_dnn slice."""
        env: Dict[str, np.ndarray] = {f"{REQUEST}.{name}": value for name, value in common.items()}
        for t in self.graph.slice(SPARSE).inputs:
            if t.shape == (BAG,):
                env[f"{SPARSE}.{t.name}"] = self.sparse.pooled(t.name, env[t.source])
        env[f"{HSTU_SLICE}.{HSTU_OUTPUT}"] = hidden.numpy()
        rows = hidden.shape[0]
        inputs = {}
        for t in self.postfix.spec.inputs:
            value = env[t.source]
            inputs[t.name] = np.repeat(value, rows, axis=0) if t.repeat == REPEAT_PER_TARGET else value
        return self.postfix.run(inputs)


class Ranker:
    """Scores candidates for users from an export, caching each user's encoded history.

    cache_bytes: bound of the user cache (LRU by bytes)
    micro_batch: candidates per HSTU pass (results do not depend on it)
    long_history: "truncate" (keep the most recent max_seq_len tokens, reported in the
        result) or "refuse" (a RequestError)
    threads: intra-op threads of each ONNX Runtime session (None: its default)
    Thread-safe: concurrent ``rank`` calls share the cache; ``reload`` swaps the model and
    invalidates the cache.
    """

    def __init__(
        self,
        model: ServingModel,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        micro_batch: int = DEFAULT_MICRO_BATCH,
        long_history: str = "truncate",
        threads: Optional[int] = None,
    ) -> None:
        if long_history not in LONG_HISTORY:
            raise ValueError(f"Ranker.long_history: expected one of {list(LONG_HISTORY)}, got {long_history!r}")
        if micro_batch < 1:
            raise ValueError(f"Ranker.micro_batch: expected >= 1, got {micro_batch}")
        self.micro_batch = micro_batch
        self.long_history = long_history
        self.threads = threads
        self.cache = UserCache(cache_bytes)
        self._model = model
        self._catalogue: Optional[Catalogue] = None
        self._lock = threading.Lock()

    @classmethod
    def load(cls, export_dir: Union[str, Path], **options: Any) -> "Ranker":
        """Load and validate an export directory; ``options`` as in the constructor."""
        return cls(ServingModel(export_dir, options.get("threads")), **options)

    @property
    def model(self) -> ServingModel:
        return self._model

    def reload(self, export_dir: Union[str, Path]) -> None:
        """Load another export (e.g. a newer model) and invalidate every cached history."""
        model = ServingModel(export_dir, self.threads)
        with self._lock:
            self._model = model
            self.cache.invalidate()

    def rank(
        self,
        user_id: Hashable,
        history: Mapping[str, Any],
        candidates: Mapping[str, Any],
        common_features: Optional[Mapping[str, Any]] = None,
        *,
        request_time: Optional[int] = None,
        use_cache: bool = True,
    ) -> RankResult:
        """Score ``candidates`` for a user with ``history`` (columns as in ``gr.serving.request``).

        use_cache=False runs one target-aware pass over history + candidates instead.
        request_time: seconds (see ``gr.serving.request``); "next_event" models read it.
        """
        with self._lock:
            model, model_version = self._model, self.cache.model_version
        hist, cands, common, truncated, request_time = self._validate(model, history, candidates, common_features,
                                                              request_time)
        if not use_cache:
            hidden = self._one_pass(model, hist, cands, request_time)
            return RankResult(model.heads(hidden, common), len(hist[TIMESTAMPS]), truncated, "off")
        cached, status = self._history(model, model_version, user_id, hist)
        x = model.embed_tokens(cands)
        hidden = model.engine.score(cached.history, x, torch.from_numpy(cands[TIMESTAMPS]), self.micro_batch, request_time)
        if status != "hit":
            self.cache.put(user_id, cached, model_version)
        return RankResult(model.heads(hidden, common), len(hist[TIMESTAMPS]), truncated, status)

    def rank_batch(self, requests: Sequence[RankRequest], *, use_cache: bool = True) -> List[RankResult]:
        """Rank several users' requests; a bad one raises RequestError naming its index."""
        results = []
        for i, request in enumerate(requests):
            try:
                results.append(self.rank(request.user_id, request.history, request.candidates,
                                         request.common_features, request_time=request.request_time,
                                         use_cache=use_cache))
            except RequestError as exc:
                raise RequestError(f"requests[{i}]: {exc}") from exc
        return results

    def generate(self, user_id: Hashable, history: Mapping[str, Any], k: int, strategy: str = "greedy",
                 exclude_seen: bool = True, **options: Any) -> GenerateResult:
        """Generate the user's next ``k`` items after ``history`` (columns as in ``gr.serving.request``).

        strategy: "greedy" (lowest item id on ties), "beam" (``beam_width``, ``temperature``) or
        "sample" (``temperature``, ``seed``); exclude_seen: never repeat a history or generated item.
        ``draft`` (a ``gr.generation.drafts.DraftSource``) turns greedy speculative: drafts verified
        in one HSTU pass each, ``verification`` ``Strict()`` (the greedy items exactly) or ``Relaxed``;
        ``budget`` (a ``gr.generation.budget.AdaptiveBudget``) sizes each draft tree from the acceptance so far.
        ``speculative_retrieval`` (a ``gr.generation.speculative_retrieval.SpeculativeRetrieval``)
        answers greedy's searches from a local cache checked in batches against the exact index.
        Other options: ``common_features``, ``request_time`` (the generated tokens' timestamp,
        default the last history timestamp), ``attribute`` (routes a cold user to a pool).
        The user's cached history is used and updated as in ``rank``. See ``gr.serving.generate``.
        """
        return generate(self, user_id, history, k, strategy, exclude_seen, **options)

    def catalogue(self) -> Tuple[Catalogue, int]:
        """The current model's generation catalogue (built on first use) and its model version."""
        with self._lock:
            model, model_version = self._model, self.cache.model_version
            if self._catalogue is None or self._catalogue.model is not model:
                self._catalogue = Catalogue(model)
            return self._catalogue, model_version

    def cached_history(self, model: ServingModel, model_version: int, user_id: Hashable, hist: Tokens) -> Tuple[HistoryCache, str]:
        """The encoded history ``hist`` of a user (reused, extended or encoded; stored in the user cache)
        -> (cache, "hit" | "extend" | "miss")."""
        cached, status = self._history(model, model_version, user_id, hist)
        if status != "hit":
            self.cache.put(user_id, cached, model_version)
        return cached.history, status

    def _validate(
        self,
        model: ServingModel,
        history: Mapping[str, Any],
        candidates: Mapping[str, Any],
        common_features: Optional[Mapping[str, Any]],
        request_time: Optional[int],
    ) -> Tuple[Tokens, Tokens, Tokens, int, int]:
        """Check the whole request before anything is computed or cached.

        -> (history, candidates, common features, tokens truncated, request time)"""
        hist = model.schema.tokens(history, "history", model.sparse)
        if request_time is not None and (isinstance(request_time, bool)
                                         or not isinstance(request_time, (int, np.integer))):
            raise RequestError(f"request_time: expected an integer (seconds), got {request_time!r}")
        default_time = request_time
        if request_time is None:  # candidates without timestamps stand right after the last action
            default_time = int(hist[TIMESTAMPS][-1]) if len(hist[TIMESTAMPS]) else 0
        cands = model.schema.tokens(candidates, "candidates", model.sparse, default_timestamp=default_time)
        if len(cands[TIMESTAMPS]) == 0:
            raise RequestError("candidates: the list is empty; a ranking request needs at least one candidate")
        if request_time is None:  # the request is when its candidates are shown
            request_time = int(cands[TIMESTAMPS].max())
        common = model.schema.common(common_features, model.sparse)
        limit = model.config.max_seq_len
        length = len(hist[TIMESTAMPS])
        if length > limit:
            if self.long_history == "refuse":
                raise RequestError(f"history: {length} tokens exceed the model's max_seq_len {limit} "
                                   "(long_history='refuse'; use 'truncate' to keep the most recent ones)")
            hist = {name: value[length - limit:].copy() for name, value in hist.items()}
        return hist, cands, common, max(length - limit, 0), request_time

    def _history(self, model: ServingModel, model_version: int, user_id: Hashable, hist: Tokens) -> Tuple[CachedUser, str]:
        """The user's cached history for ``hist``: reused, extended with the new tokens, or encoded.

        Only an entry of this request's model version is used (a reload may race the request).
        """
        entry = self.cache.get(user_id)
        length = len(hist[TIMESTAMPS])
        if isinstance(entry, CachedUser) and entry.model_version == model_version and _is_prefix(entry.tokens, hist):
            known = entry.history.length
            if known == length:
                return entry, "hit"
            if model.engine.can_extend(entry.history):
                new = {name: value[known:] for name, value in hist.items()}
                x = model.embed_tokens(new)
                extended = model.engine.extend(entry.history, x, torch.from_numpy(new[TIMESTAMPS]))
                return CachedUser(hist, extended, model_version), "extend"
        x = model.embed_tokens(hist)
        return CachedUser(hist, model.engine.encode(x, torch.from_numpy(hist[TIMESTAMPS])), model_version), "miss"

    def _one_pass(self, model: ServingModel, hist: Tokens, cands: Tokens, request_time: int) -> Tensor:
        """HSTU outputs at the candidates from one target-aware pass over history + candidates: [N, D].

        Query times (read by "next_event" models): each history token's is the next one's
        timestamp, the last one's the request time; a candidate's is its own timestamp."""
        tokens = {name: np.concatenate([hist[name], cands[name]]) for name in hist}
        x = model.embed_tokens(tokens)
        length, count = len(hist[TIMESTAMPS]), len(cands[TIMESTAMPS])
        total = length + count
        query_times = np.concatenate([hist[TIMESTAMPS][1:], [request_time], cands[TIMESTAMPS]])[-total:]
        with torch.inference_mode():
            h = model.engine.hstu(x, torch.tensor([0, total]), total, torch.from_numpy(tokens[TIMESTAMPS]),
                                  torch.tensor([count]), torch.from_numpy(query_times.astype(np.int64)))
        return h[length:]


def _is_prefix(cached: Tokens, tokens: Tokens) -> bool:
    """Whether the cached history's tokens are the first tokens of ``tokens``, feature by feature."""
    length = len(cached[TIMESTAMPS])
    if length > len(tokens[TIMESTAMPS]) or set(cached) != set(tokens):
        return False
    return all(np.array_equal(cached[name], tokens[name][:length]) for name in cached)
