"""Encoding validated histories through the user cache, several users at once, and their queries.

``encode``: each user's cached state (``gr.hstu.user_state``) reused, extended with the new
tokens, or encoded and stored, in rounds of distinct users (a user met twice waits for the next
round, as if its requests came one after the other); a user the worker's cache cannot serve is
looked up in the tiers behind it (``gr.serving.shared_tier.TieredCache``). ``queries``: the
retrieval query at the last token of each encoded history, all from shared passes.
``token_queries``: the query at chosen tokens of each history (offline evaluation: every target of
a user from one encoding).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from gr.hstu.user_state import Settled, UserState, encode_states, tokens_after
from gr.jagged import offsets_from_lengths
from gr.serving.catalogue import QUERY
from gr.serving.history import EncodedHistory, History
from gr.serving.shared_tier import TieredCache
from gr.serving.user_cache import UserCache
from gr.timestamps import TIMESTAMPS

__all__ = ["encode", "queries", "settled", "token_queries"]


def encode(
    cache: UserCache[UserState],
    histories: Sequence[History],
    use_cache: bool = True,
    request_times: Optional[Sequence[int]] = None,
    targets: Optional[Sequence[Tuple[Tensor, Tensor]]] = None,
    max_targets: int = 0,
) -> List[EncodedHistory]:
    """The users' encoded histories (one model's): the new tokens of every user in one prefix_dnn
    run, the histories to encode in one HSTU pass and those to extend in another.

    Only a cache entry of a history's model version is used or stored (a reload may race the
    request). use_cache=False encodes the histories and leaves the cache alone (status "off").
    request_times: seconds, a history each: a history encoded or extended is settled at its
    request's time in that pass (``EncodedHistory.settled``; ``settled`` settles the others).
    targets: a history each, its request's candidates (HSTU inputs [N, D], timestamps [N]): a
    history encoded from scratch runs them in its pass (``EncodedHistory.scored``), at most
    ``max_targets`` candidates a pass."""
    out: Dict[int, EncodedHistory] = {}
    waiting = list(range(len(histories)))
    while waiting:
        users: set = set()
        now: List[int] = []
        later: List[int] = []
        for i in waiting:
            (later if histories[i].user_id in users else now).append(i)
            users.add(histories[i].user_id)
        times = None if request_times is None else [request_times[i] for i in now]
        aims = None if targets is None else [targets[i] for i in now]
        round_ = _encode_round(cache, [histories[i] for i in now], use_cache, times, aims, max_targets)
        for i, encoded in zip(now, round_):
            out[i] = encoded
        waiting = later
    return [out[i] for i in range(len(histories))]


def _encode_round(
    cache: UserCache[UserState],
    histories: Sequence[History],
    use_cache: bool,
    request_times: Optional[Sequence[int]],
    targets: Optional[Sequence[Tuple[Tensor, Tensor]]],
    max_targets: int,
) -> List[EncodedHistory]:
    """``encode`` of histories of distinct users."""
    if not histories:
        return []
    model = histories[0].model
    found: List[Optional[UserState]] = [cache.get(h.user_id) if use_cache else None for h in histories]
    tiers: List[Optional[str]] = [None] * len(histories)  # where each found state comes from
    for i, (h, state) in enumerate(zip(histories, found)):
        if state is not None and state.continued_by(h.tokens, h.model_version):
            tiers[i] = "local"
        elif use_cache and isinstance(cache, TieredCache):
            fetched = cache.fetch(h.user_id, h.tokens, h.model_version, model.engine)
            if fetched is not None:
                found[i], tiers[i] = fetched
    tokens, versions = [h.tokens for h in histories], [h.model_version for h in histories]
    engine, embed = model.engine, model.embed_tokens
    states = encode_states(engine, embed, tokens, versions, found, use_cache, request_times, targets, max_targets)
    out = []
    for h, base, tier, (state, status, at_request, scored) in zip(histories, found, tiers, states):
        tier = tier if status in ("hit", "extend") else None
        if use_cache and (status != "hit" or tier != "local"):
            cache.put(h.user_id, state, h.model_version)
        if isinstance(cache, TieredCache):
            if status == "miss":
                cache.share(h.user_id, state, fresh=True)
            new = 0 if status == "hit" else len(tokens_after(h.tokens, base if tier else None)[TIMESTAMPS])
            cache.encoded(tier, new)
        out.append(EncodedHistory(h, state, status, at_request, scored))
    return out


def settled(encoded: Sequence[EncodedHistory], request_times: Sequence[int]) -> List[Settled]:
    """Each encoded history's cache settled at its request's time (seconds; nothing pending) and the
    outputs of the tokens settled [p, D]: the one its encoding settled, the others in one pass."""
    engine = encoded[0].history.model.engine
    alone = [b for b, e in enumerate(encoded) if e.settled is None]
    found = dict(zip(alone, engine.settle_batch([encoded[b].cache for b in alone], [request_times[b] for b in alone])))
    return [e.settled if e.settled is not None else found[b] for b, e in enumerate(encoded)]


def queries(encoded: Sequence[EncodedHistory], request_times: Sequence[int]) -> Tensor:
    """[B, d] the retrieval query at the last token of each encoded history (one model's, each
    non-empty): the HSTU outputs there (settled at the request's time when the engine defers the
    last token: one pass for all) through one postfix_dnn run. request_times: seconds, when each
    user's next event happens (read by "next_event" models)."""
    model = encoded[0].history.model
    if model.engine.defers_last:
        hidden = torch.cat([outputs[-1:] for _, outputs in settled(encoded, request_times)])
    else:
        last: List[Tensor] = []
        for e in encoded:
            assert e.last_hidden is not None  # kept for a non-empty history when the engine does not defer it
            last.append(e.last_hidden)
        hidden = torch.stack(last)
    commons = [e.history.common for e in encoded]
    return torch.from_numpy(model.heads_batch(hidden, commons, [1] * len(encoded))[QUERY])


def token_queries(
    histories: Sequence[History], positions: Sequence[np.ndarray], request_times: Sequence[int]
) -> Tensor:
    """[sum P_b, d] the retrieval query at tokens ``positions[b]`` ([P_b] int64, of the validated
    tokens) of each history (one model's, each non-empty), from one pass that builds no user's cache
    and leaves the user cache alone (``CachedHSTU.outputs_batch``). The query at token i is the one a
    request with tokens 0..i as its history gets when it comes at token i+1's time (HSTU is causal:
    later tokens change nothing before them); at the last token, at ``request_times[b]`` (seconds,
    read by "next_event" models)."""
    model = histories[0].model
    tokens = [h.tokens for h in histories]
    columns = {name: np.concatenate([t[name] for t in tokens]) for name in tokens[0]}
    offsets = offsets_from_lengths(torch.tensor([h.length for h in histories], dtype=torch.long))
    hidden = model.engine.outputs_batch(
        model.embed_tokens(columns),
        offsets,
        torch.from_numpy(columns[TIMESTAMPS]),
        torch.tensor(list(request_times), dtype=torch.long),
    )
    rows = np.concatenate([np.asarray(p, dtype=np.int64) + start for p, start in zip(positions, offsets.tolist())])
    commons = [h.common for h in histories]
    return torch.from_numpy(
        model.heads_batch(hidden[torch.from_numpy(rows)], commons, [len(p) for p in positions])[QUERY]
    )
