"""Ranking requests: what they hold, and their validation against what an export reads.

A request carries token features column by column::

    {"user_id": "u1",
     "history":    {"item_id": [3, 8, 1], "timestamps": [100, 160, 200], <dense>: [[...], ...]},
     "candidates": {"item_id": [5, 9]},              # timestamps optional: default request_time
     "common_features": {"user_age": 2, <dense>: [0.1, 0.3]},
     "request_time": 260}                            # optional: default the latest candidate
                                                     # timestamp, else the last history one

Ids are model ids (rows of the tables, as in ``sparse/id_maps``); a pooled common
feature takes one id or a list of ids. The request time is when the last history action's
next event happens, for models whose ``HSTUConfig.query_time`` is "next_event".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Mapping, Optional, Tuple

import numpy as np

from gr.export.format import BAG, BATCH, TIMESTAMPS, TOKENS
from gr.export.slice_graph import SliceGraph
from gr.serving.errors import RequestError
from gr.serving.sparse_store import SparseStore

REQUEST_KEYS = ("user_id", "history", "candidates", "common_features", "request_time")


@dataclass
class RankRequest:
    """One user's ranking request; see the module docstring for the column layout."""

    user_id: Hashable
    history: Mapping[str, Any]
    candidates: Mapping[str, Any]
    common_features: Optional[Mapping[str, Any]] = None
    request_time: Optional[int] = None

    @classmethod
    def from_dict(cls, data: Any, where: str = "request") -> "RankRequest":
        if not isinstance(data, Mapping):
            raise RequestError(f"{where}: expected an object with keys {list(REQUEST_KEYS)}, got {type(data).__name__}")
        unknown = sorted(set(data) - set(REQUEST_KEYS))
        if unknown:
            raise RequestError(f"{where}: unknown key(s) {unknown}; expected some of {list(REQUEST_KEYS)}")
        for key in ("user_id", "history", "candidates"):
            if key not in data:
                raise RequestError(f"{where}.{key}: missing")
        user = data["user_id"]
        if not isinstance(user, (str, int)) or isinstance(user, bool):
            raise RequestError(f"{where}.user_id: expected a string or an integer, got {user!r}")
        return cls(user, data["history"], data["candidates"], data.get("common_features"), data.get("request_time"))


@dataclass(frozen=True)
class RequestSchema:
    """The request tensors an export reads (``[request]`` of slice_graph.ini), and their validation."""

    token_ids: Tuple[str, ...]
    token_dense: Dict[str, int]
    common_ids: Tuple[str, ...]
    common_dense: Dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_graph(cls, graph: SliceGraph) -> "RequestSchema":
        token_ids, common_ids, token_dense, common_dense = [], [], {}, {}
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
        return cls(tuple(token_ids), token_dense, tuple(common_ids), common_dense)

    def tokens(
        self, columns: Any, where: str, store: SparseStore, default_timestamp: Optional[int] = None
    ) -> Dict[str, np.ndarray]:
        """Columns -> {feature: [n] int64 | [n, d] float32, "timestamps": [n] int64}.

        ``default_timestamp`` fills missing timestamps (candidates); without it they are required.
        An empty mapping is zero tokens.
        """
        if columns is None or (isinstance(columns, Mapping) and not columns):
            columns = {name: [] for name in (*self.token_ids, *self.token_dense)}
        if not isinstance(columns, Mapping):
            raise RequestError(f"{where}: expected an object {{feature: [one value per token]}}, "
                               f"got {type(columns).__name__}")
        _check_features(columns, (*self.token_ids, *self.token_dense), where, optional=(TIMESTAMPS,))
        out: Dict[str, np.ndarray] = {}
        for name in self.token_ids:
            out[name] = _ids(columns[name], f"{where}.{name}")
            store.check_ids(name, out[name], where)
        for name, dim in self.token_dense.items():
            out[name] = _dense(columns[name], dim, f"{where}.{name}")
        lengths = {name: len(a) for name, a in out.items()}
        count = next(iter(lengths.values()), 0)
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

    def common(self, values: Any, store: SparseStore) -> Dict[str, np.ndarray]:
        """{feature: id | [ids] | [d floats]} -> {feature: [n] int64 bag | [1, d] float32}."""
        values = {} if values is None else values
        if not isinstance(values, Mapping):
            raise RequestError(f"common_features: expected an object, got {type(values).__name__}")
        _check_features(values, (*self.common_ids, *self.common_dense), "common_features")
        out: Dict[str, np.ndarray] = {}
        for name in self.common_ids:
            value = values[name]
            out[name] = _ids([value] if np.isscalar(value) else value, f"common_features.{name}")
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
