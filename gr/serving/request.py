"""Rank, recommend and generate requests: what they hold, and their validation against what an
export reads.

A request carries token features column by column::

    {"user_id": "u1",
     "history":    {"item_id": [3, 8, 1], "timestamps": [100, 160, 200], <dense>: [[...], ...]},
     "candidates": {"item_id": [5, 9]},              # timestamps optional: default request_time
     "common_features": {"user_age": 2, <dense>: [0.1, 0.3]},
     "request_time": 260}                            # optional: default the latest candidate
                                                     # timestamp, else the last history one

Ids are raw ids ("ids": "raw", the HTTP and CLI default: the dataset's ids, through the
export's ``sparse/id_maps``) or model ids ("ids": "model", the in-process default: rows of the
tables); a pooled common feature takes one id or a list of ids. The request time is when the last history action's
next event happens, for models whose ``HSTUConfig.query_time`` is "next_event".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Mapping, Optional, Tuple

import numpy as np

from gr.export.format import BAG, BATCH, TIMESTAMPS, TOKENS
from gr.export.slice_graph import CANDIDATES_OPTIONAL, SliceGraph
from gr.serving.errors import RequestError
from gr.serving.id_maps import ID_SPACES, UNKNOWN_IDS, IdMaps
from gr.serving.sparse_store import SparseStore

ID_OPTIONS = ("ids", "unknown_ids")
REQUEST_KEYS = ("user_id", "history", "candidates", "common_features", "request_time", *ID_OPTIONS)
GENERATE_KEYS = (
    "user_id",
    "history",
    "k",
    "common_features",
    "request_time",
    "strategy",
    "exclude_seen",
    "beam_width",
    "temperature",
    "seed",
    *ID_OPTIONS,
)
RECOMMEND_KEYS = ("user_id", "history", "k", "common_features", "request_time", "exclude_seen", *ID_OPTIONS)


@dataclass(frozen=True)
class IdOptions:
    """ids: "raw" (the dataset's ids, through the export's id maps) or "model" (table rows);
    unknown_ids: "error" (a RequestError naming the id) or "oov" (see ``gr.serving.id_maps``)."""

    ids: str = "model"
    unknown_ids: str = "error"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str, default_ids: str) -> "IdOptions":
        ids, unknown = data.get("ids", default_ids), data.get("unknown_ids", "error")
        if ids not in ID_SPACES:
            raise RequestError(f"{where}.ids: expected one of {list(ID_SPACES)}, got {ids!r}")
        if unknown not in UNKNOWN_IDS:
            raise RequestError(f"{where}.unknown_ids: expected one of {list(UNKNOWN_IDS)}, got {unknown!r}")
        return cls(ids, unknown)


MODEL_IDS = IdOptions()  # the in-process default: model ids, unknown ids an error


def _object(data: Any, where: str, keys: Tuple[str, ...], required: Tuple[str, ...]) -> Mapping[str, Any]:
    """Check a request object's keys and its user_id."""
    if not isinstance(data, Mapping):
        raise RequestError(f"{where}: expected an object with keys {list(keys)}, got {type(data).__name__}")
    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise RequestError(f"{where}: unknown key(s) {unknown}; expected some of {list(keys)}")
    for key in required:
        if key not in data:
            raise RequestError(f"{where}.{key}: missing")
    user = data["user_id"]
    if not isinstance(user, (str, int)) or isinstance(user, bool):
        raise RequestError(f"{where}.user_id: expected a string or an integer, got {user!r}")
    return data


def _int(data: Mapping[str, Any], key: str, where: str, default: Any, low: Optional[int] = None) -> Any:
    value = data.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        bound = "" if low is None else f" >= {low}"
        raise RequestError(f"{where}.{key}: expected an integer{bound}, got {value!r}")
    return value


def _flag(data: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise RequestError(f"{where}.{key}: expected true or false, got {value!r}")
    return value


@dataclass
class RankRequest:
    """One user's ranking request; see the module docstring for the column layout."""

    user_id: Hashable
    history: Mapping[str, Any]
    candidates: Mapping[str, Any]
    common_features: Optional[Mapping[str, Any]] = None
    request_time: Optional[int] = None
    id_options: IdOptions = MODEL_IDS

    @classmethod
    def from_dict(cls, data: Any, where: str = "request", default_ids: str = "model") -> "RankRequest":
        data = _object(data, where, REQUEST_KEYS, ("user_id", "history", "candidates"))
        return cls(
            data["user_id"],
            data["history"],
            data["candidates"],
            data.get("common_features"),
            data.get("request_time"),
            IdOptions.from_dict(data, where, default_ids),
        )


@dataclass
class RecommendRequest:
    """The top ``k`` catalogue items for a user (retrieval exports); seen items excluded by default."""

    user_id: Hashable
    history: Mapping[str, Any]
    k: int = 10
    common_features: Optional[Mapping[str, Any]] = None
    request_time: Optional[int] = None
    exclude_seen: bool = True
    id_options: IdOptions = MODEL_IDS

    @classmethod
    def from_dict(cls, data: Any, where: str = "request", default_ids: str = "model") -> "RecommendRequest":
        data = _object(data, where, RECOMMEND_KEYS, ("user_id", "history"))
        return cls(
            data["user_id"],
            data["history"],
            _int(data, "k", where, 10, 1),
            data.get("common_features"),
            data.get("request_time"),
            _flag(data, "exclude_seen", where, True),
            IdOptions.from_dict(data, where, default_ids),
        )


@dataclass
class GenerateRequest:
    """A user's next ``k`` items (``gr.serving.generate``): no candidates, a decoding strategy."""

    user_id: Hashable
    history: Mapping[str, Any]
    k: int = 10
    common_features: Optional[Mapping[str, Any]] = None
    request_time: Optional[int] = None
    strategy: str = "greedy"
    exclude_seen: bool = True
    beam_width: int = 4
    temperature: float = 1.0
    seed: Optional[int] = None
    id_options: IdOptions = MODEL_IDS

    @classmethod
    def from_dict(cls, data: Any, where: str = "request", default_ids: str = "model") -> "GenerateRequest":
        data = _object(data, where, GENERATE_KEYS, ("user_id", "history"))
        temperature = data.get("temperature", 1.0)
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not temperature > 0
            or temperature == float("inf")
        ):
            raise RequestError(f"{where}.temperature: expected a finite number > 0, got {temperature!r}")
        strategy = data.get("strategy", "greedy")
        if not isinstance(strategy, str):
            raise RequestError(f"{where}.strategy: expected a string, got {strategy!r}")
        return cls(
            data["user_id"],
            data["history"],
            _int(data, "k", where, 10, 1),
            data.get("common_features"),
            data.get("request_time"),
            strategy,
            _flag(data, "exclude_seen", where, True),
            _int(data, "beam_width", where, 4, 1),
            float(temperature),
            _int(data, "seed", where, None),
            IdOptions.from_dict(data, where, default_ids),
        )


@dataclass(frozen=True)
class RequestSchema:
    """The request tensors an export reads (``[request]`` of slice_graph.ini), and their validation.

    candidate_optional: token features of the interaction itself (``candidates = optional``):
    candidates may leave them out and then take id 0 (unknown) or zeros, as in training."""

    token_ids: Tuple[str, ...]
    token_dense: Dict[str, int]
    common_ids: Tuple[str, ...]
    common_dense: Dict[str, int] = field(default_factory=dict)
    candidate_optional: Tuple[str, ...] = ()

    @classmethod
    def from_graph(cls, graph: SliceGraph) -> "RequestSchema":
        token_ids, common_ids, token_dense, common_dense = [], [], {}, {}
        optional = tuple(t.name for t in graph.request if t.candidates == CANDIDATES_OPTIONAL)
        for t in graph.request:
            if t.name == TIMESTAMPS or t.shape[0] not in (TOKENS, BAG, BATCH):
                continue
            if t.shape == (TOKENS,):
                token_ids.append(t.name)
            elif t.shape == (BAG,):
                common_ids.append(t.name)
            elif t.shape[0] == TOKENS:
                token_dense[t.name] = int(t.shape[1])
            elif len(t.shape) == 2:
                common_dense[t.name] = int(t.shape[1])
        return cls(tuple(token_ids), token_dense, tuple(common_ids), common_dense, optional)

    def tokens(
        self,
        columns: Any,
        where: str,
        store: SparseStore,
        default_timestamp: Optional[int] = None,
        raw: Optional[IdMaps] = None,
        unknown_ids: str = "error",
        candidates: bool = False,
    ) -> Dict[str, np.ndarray]:
        """Columns -> {feature: [n] int64 | [n, d] float32, "timestamps": [n] int64}.

        ``default_timestamp`` fills missing timestamps (candidates); without it they are required.
        An empty mapping is zero tokens. raw: the id maps that turn raw ids into model ids (None:
        the ids are model ids). candidates: the ``candidate_optional`` features may be left out
        (id 0 / zeros).
        """
        if columns is None or (isinstance(columns, Mapping) and not columns):
            columns = {name: [] for name in (*self.token_ids, *self.token_dense)}
        if not isinstance(columns, Mapping):
            raise RequestError(
                f"{where}: expected an object {{feature: [one value per token]}}, got {type(columns).__name__}"
            )
        optional = self.candidate_optional if candidates else ()
        required = tuple(name for name in (*self.token_ids, *self.token_dense) if name not in optional)
        _check_features(columns, required, where, optional=(TIMESTAMPS, *optional))
        out: Dict[str, np.ndarray] = {}
        for name in self.token_ids:
            if name not in columns:
                continue
            values = columns[name] if raw is None else raw.encode(name, columns[name], f"{where}.{name}", unknown_ids)
            out[name] = _ids(values, f"{where}.{name}")
            store.check_ids(name, out[name], where)
        for name, dim in self.token_dense.items():
            if name in columns:
                out[name] = _dense(columns[name], dim, f"{where}.{name}")
        lengths = {name: len(a) for name, a in out.items()}
        count = next(iter(lengths.values()), 0)
        for name in self.token_ids:
            out.setdefault(name, np.zeros(count, dtype=np.int64))
        for name, dim in self.token_dense.items():
            out.setdefault(name, np.zeros((count, dim), dtype=np.float32))
        if TIMESTAMPS in columns:
            out[TIMESTAMPS] = _ids(columns[TIMESTAMPS], f"{where}.{TIMESTAMPS}")
            lengths[TIMESTAMPS] = len(out[TIMESTAMPS])
        elif default_timestamp is not None or count == 0:
            out[TIMESTAMPS] = np.full(count, default_timestamp or 0, dtype=np.int64)
        else:
            raise RequestError(f"{where}.{TIMESTAMPS}: missing (one int per token, seconds)")
        if len(set(lengths.values())) > 1:
            raise RequestError(f"{where}: features have different lengths {lengths}")
        return out

    def common(
        self, values: Any, store: SparseStore, raw: Optional[IdMaps] = None, unknown_ids: str = "error"
    ) -> Dict[str, np.ndarray]:
        """{feature: id | [ids] | [d floats]} -> {feature: [n] int64 bag | [1, d] float32} (raw: as in ``tokens``)."""
        values = {} if values is None else values
        if not isinstance(values, Mapping):
            raise RequestError(f"common_features: expected an object, got {type(values).__name__}")
        _check_features(values, (*self.common_ids, *self.common_dense), "common_features")
        out: Dict[str, np.ndarray] = {}
        for name in self.common_ids:
            value = [values[name]] if np.isscalar(values[name]) else values[name]
            if raw is not None:
                value = raw.encode(name, value, f"common_features.{name}", unknown_ids)
            out[name] = _ids(value, f"common_features.{name}")
            store.check_ids(name, out[name], "common_features")
        for name, dim in self.common_dense.items():
            out[name] = _dense([values[name]], dim, f"common_features.{name}")
        return out


def _check_features(
    given: Mapping[str, Any], expected: Tuple[str, ...], where: str, optional: Tuple[str, ...] = ()
) -> None:
    unknown = sorted(set(given) - set(expected) - set(optional))
    if unknown:
        raise RequestError(f"{where}: unknown feature(s) {unknown}; the model reads {[*expected, *optional]}")
    missing = [name for name in expected if name not in given]
    if missing:
        raise RequestError(f"{where}: missing feature(s) {missing}")


def _ids(values: Any, where: str) -> np.ndarray:
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise RequestError(f"{where}: expected a list of integers, got {array.dtype} with shape {list(array.shape)}")
    return array.astype(np.int64)


def _dense(values: Any, dim: int, where: str) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"{where}: expected numbers: {exc}") from None
    if array.size == 0:
        return np.zeros((0, dim), dtype=np.float32)
    if array.ndim != 2 or array.shape[1] != dim:
        raise RequestError(f"{where}: expected {dim} floats per row, got shape {list(array.shape)}")
    if not np.isfinite(array).all():
        raise RequestError(f"{where}: values must be finite")
    return array
