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
tables); a pooled common feature takes one id or a list of ids; a list-valued token feature
(``[tokens, bag]`` in the schema) a list of ids per token (``"genres": [["Action", "Comedy"],
[]]``), pooled through its table when the request is validated. The request time is when the last history action's
next event happens, for models whose ``HSTUConfig.query_time`` is "next_event".

A request without "history" (or with ``"history": null``) is answered from the user's history kept
by the service (``gr.serving.history_store``; raw ids), which ``POST /v1/events`` appends to with an
``EventsRequest`` ({"user_id", "history"}, its history validated as a request's); a request that
sends a history is answered from it alone (the stored one is neither read nor changed).

Every integer (ids, timestamps, request_time, seed) must fit int64: larger ones are refused, never
wrapped. History timestamps follow ``gr.timestamps`` (oldest first, ties allowed, negatives allowed).
Timestamps and request_time may also be ISO 8601 texts (``timestamp_seconds``).
Sizes are bounded by the service's ``gr.serving.limits.RequestLimits``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Mapping, Optional, Tuple

import numpy as np

from gr.export.format import BAG, BATCH, SPARSE, TIMESTAMPS, TOKEN_BAGS, TOKENS
from gr.export.slice_graph import CANDIDATES_OPTIONAL, SliceGraph
from gr.jagged_rows import JaggedRows
from gr.serving.errors import RequestError
from gr.serving.id_maps import IdMaps
from gr.serving.limits import DEFAULT_LIMITS, RequestLimits
from gr.serving.options import ID_SPACES, UNKNOWN_IDS
from gr.serving.sparse_store import SparseStore
from gr.timestamps import INT64_MAX, INT64_MIN, TimestampError, check_history_timestamps, iso_text_seconds

TEMPERATURE_RANGE = (0.01, 100.0)  # sampling and beam temperatures: softmax(scores / t) stays finite
SEED_RANGE = (0, INT64_MAX)

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
EVENTS_KEYS = ("user_id", "history", "unknown_ids")


@dataclass(frozen=True)
class IdOptions:
    """ids: "raw" (the dataset's ids, through the export's id maps) or "model" (table rows);
    unknown_ids: "error" (a RequestError naming the id) or "oov" (see ``gr.serving.id_maps``)."""

    ids: str = "model"
    unknown_ids: str = "error"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str, defaults: "IdOptions") -> "IdOptions":
        """The request's "ids" and "unknown_ids", each ``defaults``' where the request does not say."""
        ids, unknown = data.get("ids", defaults.ids), data.get("unknown_ids", defaults.unknown_ids)
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


def _int(data: Mapping[str, Any], key: str, where: str, default: Any, low: int = INT64_MIN) -> Any:
    """data[key] (or default): an integer in [low, 2^63 - 1]; None stays None where the default is None."""
    value = data.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= INT64_MAX:
        bound = "in int64" if low == INT64_MIN else f"in [{low}, 2^63 - 1]"
        raise RequestError(f"{where + '.' if where else ''}{key}: expected an integer {bound}, got {value!r}")
    return value


def _request_time(data: Mapping[str, Any], where: str) -> Optional[int]:
    """data["request_time"]: None, integer seconds in int64, or an ISO 8601 text (``timestamp_seconds``)."""
    value = data.get("request_time")
    if isinstance(value, str):
        return int(timestamp_seconds([value], f"{where}.request_time")[0])
    return _int(data, "request_time", where, None)


def check_sampling(temperature: Any, seed: Any, prefix: str = "") -> None:
    """temperature: a number in TEMPERATURE_RANGE; seed: None or an integer in SEED_RANGE."""
    low, high = TEMPERATURE_RANGE
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not low <= temperature <= high:
        raise RequestError(f"{prefix}temperature: expected a number in [{low}, {high}], got {temperature!r}")
    if seed is not None:
        _int({"seed": seed}, "seed", prefix.rstrip("."), None, SEED_RANGE[0])


def check_request_time(request_time: Any) -> None:
    """request_time: None (derived from the request) or an integer in int64 (seconds)."""
    if request_time is not None and (
        isinstance(request_time, bool)
        or not isinstance(request_time, (int, np.integer))
        or not INT64_MIN <= int(request_time) <= INT64_MAX
    ):
        raise RequestError(f"request_time: expected an integer in int64 (seconds), got {request_time!r}")


def _flag(data: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise RequestError(f"{where}.{key}: expected true or false, got {value!r}")
    return value


@dataclass
class RankRequest:
    """One user's ranking request; see the module docstring for the column layout (history None:
    the stored one)."""

    user_id: Hashable
    history: Optional[Mapping[str, Any]]
    candidates: Mapping[str, Any]
    common_features: Optional[Mapping[str, Any]] = None
    request_time: Optional[int] = None
    id_options: IdOptions = MODEL_IDS

    @classmethod
    def from_dict(cls, data: Any, where: str = "request", defaults: IdOptions = MODEL_IDS) -> "RankRequest":
        data = _object(data, where, REQUEST_KEYS, ("user_id", "candidates"))
        return cls(
            data["user_id"],
            data.get("history"),
            data["candidates"],
            data.get("common_features"),
            _request_time(data, where),
            IdOptions.from_dict(data, where, defaults),
        )


@dataclass
class RecommendRequest:
    """The top ``k`` catalogue items for a user (retrieval exports); seen items excluded by default
    (history None: the stored one)."""

    user_id: Hashable
    history: Optional[Mapping[str, Any]]
    k: int = 10
    common_features: Optional[Mapping[str, Any]] = None
    request_time: Optional[int] = None
    exclude_seen: bool = True
    id_options: IdOptions = MODEL_IDS

    @classmethod
    def from_dict(cls, data: Any, where: str = "request", defaults: IdOptions = MODEL_IDS) -> "RecommendRequest":
        data = _object(data, where, RECOMMEND_KEYS, ("user_id",))
        return cls(
            data["user_id"],
            data.get("history"),
            _int(data, "k", where, 10, 1),
            data.get("common_features"),
            _request_time(data, where),
            _flag(data, "exclude_seen", where, True),
            IdOptions.from_dict(data, where, defaults),
        )


@dataclass
class GenerateRequest:
    """A user's next ``k`` items (``gr.serving.generate``): no candidates, a decoding strategy
    (history None: the stored one)."""

    user_id: Hashable
    history: Optional[Mapping[str, Any]]
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
    def from_dict(cls, data: Any, where: str = "request", defaults: IdOptions = MODEL_IDS) -> "GenerateRequest":
        data = _object(data, where, GENERATE_KEYS, ("user_id",))
        temperature = data.get("temperature", 1.0)
        check_sampling(temperature, None, f"{where}.")
        strategy = data.get("strategy", "greedy")
        if not isinstance(strategy, str):
            raise RequestError(f"{where}.strategy: expected a string, got {strategy!r}")
        return cls(
            data["user_id"],
            data.get("history"),
            _int(data, "k", where, 10, 1),
            data.get("common_features"),
            _request_time(data, where),
            strategy,
            _flag(data, "exclude_seen", where, True),
            _int(data, "beam_width", where, 4, 1),
            float(temperature),
            _int(data, "seed", where, None, SEED_RANGE[0]),
            IdOptions.from_dict(data, where, defaults),
        )


@dataclass
class EventsRequest:
    """Events to append to a user's stored history (``POST /v1/events``): a history object in raw
    ids, validated as a request's; unknown_ids as a request's."""

    user_id: Hashable
    history: Mapping[str, Any]
    unknown_ids: str = "error"

    @classmethod
    def from_dict(cls, data: Any, where: str = "request", defaults: IdOptions = MODEL_IDS) -> "EventsRequest":
        data = _object(data, where, EVENTS_KEYS, ("user_id", "history"))
        return cls(data["user_id"], data["history"], IdOptions.from_dict(data, where, defaults).unknown_ids)


@dataclass(frozen=True)
class RequestSchema:
    """The request tensors an export reads (``[request]`` of slice_graph.ini), and their validation.

    candidate_optional: token features of the interaction itself (``candidates = optional``):
    candidates may leave them out and then take id 0 (unknown) or zeros, as in training.
    stored: token features of the item that the export's item store holds (``gr.export.item_store``):
    history and candidates may leave them out and then take the item's stored value.
    token_lists: {list-valued token feature: dim}: a bag of ids per token, held in validated
    tokens as its pooled rows [n, dim] (an empty bag: zeros).
    omittable: common id features whose id map reserves model id 0 for unknown values: a request
    may leave them out, and they then hold that id (as training's users without the value); every
    other common feature is required."""

    token_ids: Tuple[str, ...]
    token_dense: Dict[str, int]
    common_ids: Tuple[str, ...]
    common_dense: Dict[str, int] = field(default_factory=dict)
    candidate_optional: Tuple[str, ...] = ()
    stored: Tuple[str, ...] = ()
    token_lists: Dict[str, int] = field(default_factory=dict)
    omittable: Tuple[str, ...] = ()

    @property
    def token_features(self) -> Tuple[str, ...]:
        """Every token feature a request carries (ids, lists of ids, dense)."""
        return (*self.token_ids, *self.token_lists, *self.token_dense)

    @classmethod
    def from_graph(
        cls, graph: SliceGraph, stored: Tuple[str, ...] = (), unknown_row: Callable[[str], bool] = lambda name: False
    ) -> "RequestSchema":
        """The schema of ``graph``'s request; unknown_row: whether a common id feature's map reserves
        id 0 for unknown values (it is then ``omittable``)."""
        token_ids, common_ids, token_dense, common_dense, token_lists = [], [], {}, {}, {}
        optional = tuple(t.name for t in graph.request if t.candidates == CANDIDATES_OPTIONAL)
        for t in graph.request:
            if t.name == TIMESTAMPS or t.shape[0] not in (TOKENS, BAG, BATCH):
                continue
            if t.shape == TOKEN_BAGS:
                token_lists[t.name] = int(graph.slice(SPARSE).output(t.name).shape[1])
            elif t.shape == (TOKENS,):
                token_ids.append(t.name)
            elif t.shape == (BAG,):
                common_ids.append(t.name)
            elif t.shape[0] == TOKENS:
                token_dense[t.name] = int(t.shape[1])
            elif len(t.shape) == 2:
                common_dense[t.name] = int(t.shape[1])
        omittable = tuple(name for name in common_ids if unknown_row(name))
        return cls(
            tuple(token_ids), token_dense, tuple(common_ids), common_dense, optional, stored, token_lists, omittable
        )

    def tokens(
        self,
        columns: Any,
        where: str,
        store: SparseStore,
        default_timestamp: Optional[int] = None,
        raw: Optional[IdMaps] = None,
        unknown_ids: str = "error",
        candidates: bool = False,
        limits: RequestLimits = DEFAULT_LIMITS,
        offsets: Optional[np.ndarray] = None,
    ) -> Dict[str, np.ndarray]:
        """Columns -> {feature: [n] int64 | [n, d] float32, "timestamps": [n] int64}; a list feature
        gives its pooled rows [n, d] float32 (``store.bags``).

        ``default_timestamp`` fills missing timestamps (candidates); without it they are required.
        An empty mapping is zero tokens. raw: the id maps that turn raw ids into model ids (None:
        the ids are model ids). candidates: the ``candidate_optional`` features may be left out
        (id 0 / zeros), at most ``limits.max_candidates`` tokens (a history: at most
        ``limits.max_history_tokens``, timestamps as ``gr.timestamps`` says). A ``stored``
        feature left out takes each token's item's value from ``store.items``.
        offsets: [B+1] int64: the columns hold B histories back to back (history b's tokens at
        [offsets[b], offsets[b+1]), named ``where[b]`` in errors), converted at once, each history's
        size and timestamps checked as a history's alone.
        """
        if columns is None or (isinstance(columns, Mapping) and not columns):
            columns = {name: [] for name in self.token_features}
        if not isinstance(columns, Mapping):
            raise RequestError(
                f"{where}: expected an object {{feature: [one value per token]}}, got {type(columns).__name__}"
            )
        optional = (*(self.candidate_optional if candidates else ()), *self.stored)
        required = tuple(name for name in self.token_features if name not in optional)
        _check_features(columns, required, where, optional=(TIMESTAMPS, *optional))
        limit, what = ("max_candidates", "candidates") if candidates else ("max_history_tokens", "tokens")
        for name, values in columns.items():
            count = _length(values, f"{where}.{name}")
            if offsets is None:
                limits.check_count(count, limit, f"{where}.{name}", what)
            elif count != offsets[-1]:
                raise RequestError(f"{where}.{name}: {count} values for {int(offsets[-1])} tokens (offsets)")
        if offsets is not None and len(offsets) > 1:
            longest = int(np.argmax(np.diff(offsets)))
            limits.check_count(int(offsets[longest + 1] - offsets[longest]), limit, f"{where}[{longest}]", what)
        out: Dict[str, np.ndarray] = {}
        for name in self.token_ids:
            if name not in columns:
                continue
            out[name] = _model_ids(columns[name], f"{where}.{name}", name, raw, unknown_ids)
            store.check_ids(name, out[name], where)
        for name in self.token_lists:
            if name in columns:
                bags = _model_id_lists(columns[name], f"{where}.{name}", name, raw, unknown_ids)
                store.check_ids(name, bags.values, where)
                out[name] = store.bags(name, bags)
        for name, dim in self.token_dense.items():
            if name in columns:
                out[name] = _dense(columns[name], dim, f"{where}.{name}")
        items = None if store.items is None else out.get(store.items.item_feature)
        for name in self.stored:
            if name not in columns and items is not None:
                out[name] = store.stored(name, items)
        lengths = {name: len(a) for name, a in out.items()}
        count = next(iter(lengths.values()), 0)
        for name in self.token_features:
            out.setdefault(name, self.unknown(name, count))
        if TIMESTAMPS in columns:
            out[TIMESTAMPS] = timestamp_seconds(columns[TIMESTAMPS], f"{where}.{TIMESTAMPS}")
            lengths[TIMESTAMPS] = len(out[TIMESTAMPS])
            if not candidates:
                _check_order(out[TIMESTAMPS], where, offsets)
        elif default_timestamp is not None or count == 0:
            out[TIMESTAMPS] = np.full(count, default_timestamp or 0, dtype=np.int64)
        else:
            raise RequestError(f"{where}.{TIMESTAMPS}: missing (one int per token, seconds)")
        if len(set(lengths.values())) > 1:
            raise RequestError(f"{where}: features have different lengths {lengths}")
        return out

    def unknown(self, name: str, count: int) -> np.ndarray:
        """What ``count`` tokens without token feature ``name`` hold: id 0 (unknown), or zeros for a
        dense feature and a list feature's pooled rows (an empty bag)."""
        dim = self.token_dense.get(name, self.token_lists.get(name))
        return np.zeros(count, dtype=np.int64) if dim is None else np.zeros((count, dim), dtype=np.float32)

    def example(self, store: SparseStore, count: int) -> Dict[str, list]:
        """``count`` valid tokens in the request's column form (model ids; row 1 of each table,
        or row 0 of a one-row table, a bag of it for a list feature; zeros for dense features;
        timestamps 0, 1, ...): warm-up input."""
        columns: Dict[str, list] = {name: [min(1, store.rows(name) - 1)] * count for name in self.token_ids}
        columns.update({name: [[min(1, store.rows(name) - 1)]] * count for name in self.token_lists})
        columns.update({name: [[0.0] * dim] * count for name, dim in self.token_dense.items()})
        columns[TIMESTAMPS] = list(range(count))
        return columns

    def example_common(self, store: SparseStore) -> Dict[str, Any]:
        """Valid common features, as ``example`` chooses them."""
        values: Dict[str, Any] = {name: min(1, store.rows(name) - 1) for name in self.common_ids}
        values.update({name: [0.0] * dim for name, dim in self.common_dense.items()})
        return values

    def common(
        self,
        values: Any,
        store: SparseStore,
        raw: Optional[IdMaps] = None,
        unknown_ids: str = "error",
        limits: RequestLimits = DEFAULT_LIMITS,
    ) -> Dict[str, np.ndarray]:
        """{feature: id | [ids] | [d floats]} -> {feature: [n] int64 bag | [1, d] float32} (raw: as in
        ``tokens``); an ``omittable`` feature left out is [0], the unknown id."""
        values = {} if values is None else values
        if not isinstance(values, Mapping):
            raise RequestError(f"common_features: expected an object, got {type(values).__name__}")
        required = tuple(name for name in (*self.common_ids, *self.common_dense) if name not in self.omittable)
        _check_features(values, required, "common_features", optional=self.omittable)
        out: Dict[str, np.ndarray] = {}
        for name in self.common_ids:
            if name not in values:
                out[name] = np.zeros(1, dtype=np.int64)
                continue
            value = [values[name]] if np.isscalar(values[name]) else values[name]
            where = f"common_features.{name}"
            limits.check_count(_length(value, where), "max_history_tokens", where, "ids")
            out[name] = _model_ids(value, where, name, raw, unknown_ids)
            store.check_ids(name, out[name], "common_features")
        for name, dim in self.common_dense.items():
            out[name] = _dense([values[name]], dim, f"common_features.{name}")
        return out


def _check_order(ts: np.ndarray, where: str, offsets: Optional[np.ndarray]) -> None:
    """RequestError unless the history's timestamps [n] int64 (each of B histories' when ``offsets``
    [B+1] int64 gives them back to back) are oldest first (``check_history_timestamps``)."""
    if offsets is not None:
        back = np.flatnonzero(ts[1:] < ts[:-1]) + 1  # tokens earlier than the one before them
        back = back[~np.isin(back, offsets)]  # a history's first token follows another history's last
        if not back.size:
            return
        b = int(np.searchsorted(offsets, back[0], side="right")) - 1
        ts, where = ts[offsets[b] : offsets[b + 1]], f"{where}[{b}]"
    try:
        check_history_timestamps(ts, f"{where}.{TIMESTAMPS}")
    except TimestampError as exc:
        raise RequestError(str(exc)) from None


def _check_features(
    given: Mapping[str, Any], expected: Tuple[str, ...], where: str, optional: Tuple[str, ...] = ()
) -> None:
    unknown = sorted(set(given) - set(expected) - set(optional))
    if unknown:
        raise RequestError(f"{where}: unknown feature(s) {unknown}; the model reads {[*expected, *optional]}")
    missing = [name for name in expected if name not in given]
    if missing:
        raise RequestError(f"{where}: missing feature(s) {missing}")


def _length(values: Any, where: str) -> int:
    """The number of values of a column (checked against the limits before anything is converted)."""
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise RequestError(f"{where}: expected a list (one value per token), got {type(values).__name__}")
    return len(values)


def _flat(values: Any, where: str, strings: bool = True) -> np.ndarray:
    """A list of scalars (integers in int64, or raw string ids when ``strings``) -> [n] array;
    nested or ragged lists are refused."""
    noun = "ids" if strings else "integers"
    try:
        array = np.asarray(values)
    except (ValueError, TypeError, OverflowError) as exc:
        raise RequestError(f"{where}: expected a flat list of {noun}: {' '.join(str(exc).split())}"[:300]) from None
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1:
        raise RequestError(f"{where}: expected a flat list of {noun}, got a nested list of shape {list(array.shape)}")
    if array.dtype.kind == "u" and int(array.max()) > INT64_MAX:
        raise RequestError(f"{where}: {int(array.max())} does not fit int64 (at most {INT64_MAX})")
    if array.dtype.kind not in ("iuU" if strings else "iu"):
        expected = "integers in int64" + (" (or strings, for raw string ids)" if strings else "")
        got = f"{array.dtype} values such as {array[:3].tolist()}"
        raise RequestError(f"{where}: expected {expected}, got {got}"[:300])
    return array


def _ids(values: Any, where: str) -> np.ndarray:
    """A list of integers in int64 (model ids, timestamps) -> [n] int64."""
    return _flat(values, where, strings=False).astype(np.int64)


def timestamp_seconds(values: Any, where: str) -> np.ndarray:
    """A list of timestamps, each integer seconds in int64 or an ISO 8601 text (``2024-01-05T10:00:00Z``,
    ``gr.timestamps.iso_text_seconds``: UTC unless it has an offset, floored to the second) -> [n] int64."""
    if isinstance(values, np.ndarray):
        texts = values.dtype.kind in "OUS"  # a numeric array holds no text: no look at each value
    else:
        texts = isinstance(values, (list, tuple)) and any(isinstance(v, str) for v in values)
    if texts:
        seconds = [iso_text_seconds(v) if isinstance(v, str) else v for v in values]
        bad = next((k for k, (v, s) in enumerate(zip(values, seconds)) if isinstance(v, str) and s is None), None)
        if bad is not None:
            raise RequestError(
                f"{where}: [{bad}] = {str(values[bad])!r} is not an ISO 8601 date or time (such as "
                "2024-01-05T10:00:00Z) nor an integer (seconds)"[:300]
            )
        values = seconds
    return _ids(values, where)


def _model_ids(values: Any, where: str, feature: str, raw: Optional[IdMaps], unknown_ids: str) -> np.ndarray:
    """A feature's ids as sent -> [n] int64 model ids (through the id maps for raw ids)."""
    if raw is None:
        return _ids(values, where)
    return _ids(raw.encode(feature, _flat(values, where), where, unknown_ids), where)


def _model_id_lists(values: Any, where: str, feature: str, raw: Optional[IdMaps], unknown_ids: str) -> JaggedRows:
    """A list feature's column as sent, a list of ids per token -> its rows of model ids."""
    lists = list(values)
    for i, bag in enumerate(lists):
        if not isinstance(bag, (list, tuple, np.ndarray)):
            raise RequestError(f"{where}: expected a list of ids per token, got {type(bag).__name__} at token {i}")
    flat = [v for bag in lists for v in (bag.tolist() if isinstance(bag, np.ndarray) else bag)]
    return JaggedRows.from_lengths([len(bag) for bag in lists], _model_ids(flat, where, feature, raw, unknown_ids))


def _dense(values: Any, dim: int, where: str) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RequestError(f"{where}: expected numbers: {exc}") from None
    if array.size == 0:
        return np.zeros((0, dim), dtype=np.float32)
    if array.ndim != 2 or array.shape[1] != dim:
        raise RequestError(f"{where}: expected {dim} floats per row, got shape {list(array.shape)}")
    if not np.isfinite(array).all():
        raise RequestError(f"{where}: values must be finite")
    return array
