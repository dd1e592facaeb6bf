"""The one history-preparation path of rank, recommend and generate: a validated history (of one
model version, nothing cached yet: ``validate``), then the encoded one (the user's state reused,
extended or built: ``gr.serving.encode``), then the decoding state at its last token (the
retrieval query)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from gr.export.format import TIMESTAMPS
from gr.generation.decoding import DecodeState, start
from gr.hstu.cache import HistoryCache
from gr.hstu.user_state import Settled, Tokens, UserState, evict
from gr.serving.catalogue import Catalogue, ServingGenerativeModel
from gr.serving.errors import RequestError
from gr.serving.id_maps import IdMaps
from gr.serving.limits import RequestLimits
from gr.serving.model import ServingModel
from gr.serving.request import MODEL_IDS, IdOptions, timestamp_seconds
from gr.timestamps import TimestampError, check_history_timestamps, check_time_span

COLUMN_TYPES = (list, tuple, np.ndarray)  # a request column: one value per token


@dataclass(frozen=True)
class History:
    """A validated request history, not yet encoded.

    tokens: {feature: [L] int64 | [L, d] float32, "timestamps": [L] int64}, model ids, at most
        max_seq_len - reserve tokens; truncated: oldest tokens dropped to fit
    common: validated common features; raw: the id maps of raw-id requests (None: model ids)
    left_out: tokens of items the model has no row for, left out under ``unknown_ids="oov"``
    common_given: whether the request gave common features (an empty history without them holds none)
    """

    model: ServingModel
    model_version: int
    user_id: Hashable
    tokens: Tokens
    common: Tokens
    truncated: int
    raw: Optional[IdMaps]
    unknown_ids: str
    left_out: int = 0
    common_given: bool = False

    @property
    def length(self) -> int:
        return len(self.tokens[TIMESTAMPS])

    @property
    def from_user_features(self) -> bool:
        """Whether a request with this history is answered by the new-user query (``"fallback":
        "user_features"``): an empty history with the user's common features, from a retrieval export
        that stores ``empty_history`` (``gr.export.new_user``)."""
        model = self.model
        return self.length == 0 and self.common_given and model.empty_history is not None and model.is_retrieval

    def decode_items(self, feature: str, ids: np.ndarray) -> list:
        """[n] model ids -> n ids in the request's id space (JSON-ready)."""
        return np.asarray(ids).tolist() if self.raw is None else self.raw.decode(feature, ids)


@dataclass(frozen=True)
class EncodedHistory:
    """A History with the user's state (``gr.hstu.user_state.UserState``): cache_status "hit" |
    "extend" | "miss" | "off" ("off": encoded for this request alone, the user cache left as it was)."""

    history: History
    state: UserState
    cache_status: str
    settled: Optional[Settled] = None  # the state's cache settled at the request's time, when its encoding did
    scored: Optional[torch.Tensor] = None  # [N, D] the request's candidates' HSTU outputs, when its encoding ran them

    @property
    def cache(self) -> HistoryCache:
        """The encoded history's K/V."""
        return self.state.cache

    @property
    def last_hidden(self) -> Optional[torch.Tensor]:
        """[D] the HSTU output at the last token when the engine does not defer it, else None."""
        return self.state.last_hidden


def validate(
    model: ServingModel,
    model_version: int,
    user_id: Hashable,
    history: Mapping[str, Any],
    common_features: Optional[Mapping[str, Any]],
    limits: RequestLimits,
    long_history: str,
    reserve: int = 0,
    id_options: IdOptions = MODEL_IDS,
) -> History:
    """Validate a history (and common features) against ``model``; touches no cache.

    reserve: tokens to keep free of max_seq_len (generated items)."""
    limits.check_user_id(user_id)
    if reserve >= model.config.max_seq_len:
        raise RequestError(f"k: {reserve} items do not fit the model's max_seq_len {model.config.max_seq_len}")
    raw = model.id_maps if id_options.ids == "raw" else None
    unknown = id_options.unknown_ids
    left_out = 0
    if raw is not None and unknown == "oov":
        history, left_out = without_unknown_items(history, raw, model.schema.token_ids)
    tokens = model.schema.tokens(history, "history", model.sparse, raw=raw, unknown_ids=unknown, limits=limits)
    return _validated(
        model, model_version, user_id, tokens, common_features, limits, long_history, reserve, id_options, left_out
    )


def validate_batch(
    model: ServingModel,
    model_version: int,
    user_ids: Sequence[Hashable],
    histories: Mapping[str, Any],
    offsets: np.ndarray,
    common_features: Sequence[Optional[Mapping[str, Any]]],
    limits: RequestLimits,
    long_history: str,
) -> List[History]:
    """``validate`` of B users' histories in model ids, given back to back: ``histories`` holds a
    history's columns, history b's tokens at [offsets[b], offsets[b+1]) (offsets: [B+1] int64),
    converted and checked in one go (``RequestSchema.tokens``: each history's size and timestamps
    as its own); common_features: each user's. Touches no cache."""
    if not len(user_ids) == len(common_features) == len(offsets) - 1:
        raise ValueError(
            f"validate_batch: {len(user_ids)} users, {len(common_features)} common features and "
            f"{len(offsets) - 1} histories (offsets [B+1]) must agree"
        )
    for user_id in user_ids:
        limits.check_user_id(user_id)
    tokens = model.schema.tokens(histories, "history", model.sparse, limits=limits, offsets=offsets)
    bounds = np.asarray(offsets).tolist()
    return [
        _validated(
            model, model_version, user, {k: v[start:end] for k, v in tokens.items()}, common, limits, long_history
        )
        for user, common, start, end in zip(user_ids, common_features, bounds[:-1], bounds[1:])
    ]


def _validated(
    model: ServingModel,
    model_version: int,
    user_id: Hashable,
    tokens: Tokens,
    common_features: Optional[Mapping[str, Any]],
    limits: RequestLimits,
    long_history: str,
    reserve: int = 0,
    id_options: IdOptions = MODEL_IDS,
    left_out: int = 0,
) -> History:
    """The History of a history's validated ``tokens``: its common features validated, and fit to max_seq_len."""
    raw = model.id_maps if id_options.ids == "raw" else None
    unknown = id_options.unknown_ids
    given = common_features is not None and not (isinstance(common_features, Mapping) and not common_features)
    common: Tokens = {}
    if given or len(tokens[TIMESTAMPS]):  # a new user without features gets the popularity fallback
        common = model.schema.common(common_features, model.sparse, raw=raw, unknown_ids=unknown, limits=limits)
    tokens, truncated = fit(tokens, model.config.max_seq_len, reserve, long_history, model.config.eviction_block)
    return History(model, model_version, user_id, tokens, common, truncated, raw, unknown, left_out, given)


def stored_events(
    model: ServingModel, history: Any, limits: RequestLimits, unknown_ids: str = "error"
) -> List[Dict[str, Any]]:
    """A history to append to the store (raw ids), validated as a request's history is (``validate``:
    features, ids, limits, timestamps in order; under ``unknown_ids="oov"`` the tokens of items the
    model has no row for are kept, for a later export to know) -> one JSON-ready object per event
    ({feature: its value at the token, "timestamps": integer seconds}). RequestError for an empty one."""
    raw = model.id_maps
    checked, _ = without_unknown_items(history, raw, model.schema.token_ids) if unknown_ids == "oov" else (history, 0)
    model.schema.tokens(checked, "history", model.sparse, raw=raw, unknown_ids=unknown_ids, limits=limits)
    times = history.get(TIMESTAMPS) if isinstance(history, Mapping) else None
    if times is None or len(times) == 0:
        raise RequestError("history: empty; expected at least one event to append")
    where = f"history.{TIMESTAMPS}"
    seconds = timestamp_seconds(times, where)
    try:
        check_history_timestamps(seconds, where)  # the tokens left out above were not checked
    except TimestampError as exc:
        raise RequestError(str(exc)) from None
    columns = {name: _json_ready(values) for name, values in history.items() if name != TIMESTAMPS}
    return [
        {**{name: column[i] for name, column in columns.items()}, TIMESTAMPS: int(t)} for i, t in enumerate(seconds)
    ]


def _json_ready(values: Any) -> list:
    """A column as JSON values (numpy arrays and scalars to lists and Python numbers)."""
    return [v.tolist() if isinstance(v, (np.ndarray, np.generic)) else v for v in values]


def without_unknown_items(history: Any, raw: IdMaps, token_ids: Sequence[str]) -> Tuple[Any, int]:
    """A raw-id history less the tokens whose id of a feature without an unknown row (the item)
    its map does not know -> (the history, how many tokens were left out). A history that is not
    well-formed comes back as it is, for ``RequestSchema.tokens`` to refuse it by name."""
    if not isinstance(history, Mapping):
        return history, 0
    keep: Optional[np.ndarray] = None
    for feature in token_ids:
        rowless = raw.rowless(feature, history.get(feature))
        if rowless is None:
            continue
        if keep is not None and len(keep) != len(rowless):  # features of different lengths: refused later
            return history, 0
        keep = ~rowless if keep is None else keep & ~rowless
    if keep is None or keep.all():
        return history, 0
    if any(not isinstance(values, COLUMN_TYPES) or len(values) != len(keep) for values in history.values()):
        return history, 0  # columns of other lengths: no token is left out of a misaligned history
    kept = {name: [v for v, k in zip(values, keep) if k] for name, values in history.items()}
    return kept, int(len(keep) - keep.sum())


def fit(
    tokens: Tokens, max_seq_len: int, reserve: int, long_history: str, eviction_block: int = 1
) -> Tuple[Tokens, int]:
    """Drop the oldest tokens to fit ``max_seq_len - reserve`` (or refuse) -> (tokens, tokens dropped).

    reserve: tokens kept free for generated items. eviction_block: tokens are dropped in whole
    blocks (``gr.hstu.user_state.evict``)."""
    length, limit = len(tokens[TIMESTAMPS]), max_seq_len - reserve
    if length > limit and long_history == "refuse":
        generated = f" + {reserve} generated" if reserve else ""
        raise RequestError(
            f"history: {length} tokens{generated} exceed the model's max_seq_len {max_seq_len} "
            "(long_history='refuse'; use 'truncate' to keep the most recent ones)"
        )
    return evict(tokens, limit, eviction_block)


def check_span(h: History, times: Dict[str, Any]) -> None:
    """RequestError when the history's times and ``times`` ({field: int or [n] ints}) lie 2^63 s apart."""
    try:
        check_time_span({"history.timestamps": h.tokens[TIMESTAMPS], **times})
    except TimestampError as exc:
        raise RequestError(str(exc)) from None


def empty_history(h: History, needs: str) -> RequestError:
    """The error of a request whose history ``h`` holds no token; ``needs``: what the request needs.
    Says how many tokens ``unknown_ids="oov"`` left out when they were all the history held."""
    left = f": its {h.left_out} token(s) were left out as unknown (items the model has no row for; unknown_ids oov)"
    return RequestError(f"history: empty{left if h.left_out else ''}; {needs}")


def last_token_state(encoded: EncodedHistory, catalogue: Catalogue, request_time: int) -> DecodeState:
    """The decoding state after the history: its cache and the retrieval query [d] at the last token."""
    h = encoded.history
    if h.length == 0:
        raise empty_history(h, "a retrieval query needs at least one item")
    lm = ServingGenerativeModel(catalogue, h.common)
    items = torch.from_numpy(h.tokens[catalogue.item_feature])
    # Tokens with more features than the item: the history's own inputs, not the catalogue's.
    tokens = None if catalogue.item_only else h.model.embed_tokens(h.tokens)
    return start(lm, items, torch.from_numpy(h.tokens[TIMESTAMPS]), request_time, encoded.cache, tokens)


def new_user_state(h: History, catalogue: Catalogue) -> DecodeState:
    """The decoding state of a user with no history (``History.from_user_features``): nothing
    encoded, the new-user query from the user's common features."""
    engine, dim = h.model.engine, h.model.config.hidden_dim
    empty = engine.encode(
        torch.zeros(0, dim, device=engine.device), torch.zeros(0, dtype=torch.long, device=engine.device)
    )
    return DecodeState(empty, [], h.model.new_user_queries([h.common])[0].to(catalogue.vectors.device))


def history_warnings(truncated: int, left_out: int = 0) -> Dict[str, Any]:
    """A result's JSON warnings: the history tokens of items the model has no row for, left out
    (``unknown_ids="oov"``; also counted in ``history_left_out``), and the oldest ones dropped to
    fit max_seq_len."""
    warnings = []
    if left_out:
        warnings.append(f"history: left out {left_out} token(s) of items the model has no row for (unknown_ids oov)")
    if truncated:
        warnings.append(f"history truncated: dropped the {truncated} oldest token(s) to fit max_seq_len")
    return {**({"history_left_out": left_out} if left_out else {}), **({"warnings": warnings} if warnings else {})}
