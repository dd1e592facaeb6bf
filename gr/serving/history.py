"""The one history-preparation path of rank, recommend and generate: a validated history (of one
model version, nothing cached yet), then the encoded one (the user's cache reused, extended or
built), then the decoding state at its last token (the retrieval query)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, Optional, Tuple

import numpy as np
import torch

from gr.export.format import TIMESTAMPS
from gr.generation.decoding import DecodeState, start
from gr.hstu.cache import HistoryCache
from gr.jagged import evicted_prefix
from gr.serving.catalogue import Catalogue, ServingGenerativeModel
from gr.serving.errors import RequestError
from gr.serving.id_maps import IdMaps
from gr.serving.model import ServingModel

Tokens = Dict[str, np.ndarray]
LONG_HISTORY = ("truncate", "refuse")


@dataclass(frozen=True)
class History:
    """A validated request history, not yet encoded.

    tokens: {feature: [L] int64 | [L, d] float32, "timestamps": [L] int64}, model ids, at most
        max_seq_len - reserve tokens; truncated: oldest tokens dropped to fit
    common: validated common features; raw: the id maps of raw-id requests (None: model ids)
    """

    model: ServingModel
    model_version: int
    user_id: Hashable
    tokens: Tokens
    common: Tokens
    truncated: int
    raw: Optional[IdMaps]
    unknown_ids: str

    @property
    def length(self) -> int:
        return len(self.tokens[TIMESTAMPS])

    def decode_items(self, feature: str, ids: np.ndarray) -> list:
        """[n] model ids -> n ids in the request's id space (JSON-ready)."""
        return np.asarray(ids).tolist() if self.raw is None else self.raw.decode(feature, ids)


@dataclass(frozen=True)
class EncodedHistory:
    """A History with the user's encoded history: cache_status "hit" | "extend" | "miss" | "off"
    ("off": encoded for this request alone, the user cache left as it was); last_hidden: [D] the
    HSTU output at the last token when the engine does not defer it (see ``CachedUser``)."""

    history: History
    cache: HistoryCache
    cache_status: str
    last_hidden: Optional[torch.Tensor] = None


def fit(
    tokens: Tokens, max_seq_len: int, reserve: int, long_history: str, eviction_block: int = 1
) -> Tuple[Tokens, int]:
    """Drop the oldest tokens to fit ``max_seq_len - reserve`` (or refuse) -> (tokens, tokens dropped).

    reserve: tokens kept free for generated items. eviction_block: tokens are dropped in whole
    blocks (``gr.jagged.evicted_prefix``, ``HSTUConfig.eviction_block``), as training windows
    are, so a growing history keeps its window start (and its cache) for a block of actions."""
    length, limit = len(tokens[TIMESTAMPS]), max_seq_len - reserve
    if length <= limit:
        return tokens, 0
    if long_history == "refuse":
        generated = f" + {reserve} generated" if reserve else ""
        raise RequestError(
            f"history: {length} tokens{generated} exceed the model's max_seq_len {max_seq_len} "
            "(long_history='refuse'; use 'truncate' to keep the most recent ones)"
        )
    dropped = min(evicted_prefix(length, limit, eviction_block), length)
    return {name: value[dropped:].copy() for name, value in tokens.items()}, dropped


def last_token_state(encoded: EncodedHistory, catalogue: Catalogue, request_time: int) -> DecodeState:
    """The decoding state after the history: its cache and the retrieval query [d] at the last token."""
    h = encoded.history
    if h.length == 0:
        raise RequestError("history: empty; a retrieval query needs at least one item")
    lm = ServingGenerativeModel(catalogue, h.common)
    items = torch.from_numpy(h.tokens[catalogue.item_feature])
    # Tokens with more features than the item: the history's own inputs, not the catalogue's.
    tokens = None if catalogue.item_only else h.model.embed_tokens(h.tokens)
    return start(lm, items, torch.from_numpy(h.tokens[TIMESTAMPS]), request_time, encoded.cache, tokens)
