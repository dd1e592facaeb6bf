"""A user's cached serving state and every operation on it, in one place.

``UserState``: the history tokens a cache was built from, its K/V (``gr.hstu.cache.HistoryCache``),
the model version that computed them and the HSTU output at the last history token. Operations:
match a request's history against it (``UserState.continued_by``, ``is_prefix``), the tokens it
does not hold yet (``tokens_after``), encode or extend several users' states in shared passes
(``encode_states``: the prefix-cache policy, "hit" / "extend" / "miss" / "off"), truncate and
append K/V rows (``truncate``, ``append``: generation's decoding states), drop a long history's
oldest tokens in sliding-window blocks (``evict``) and count the bytes it keeps (``nbytes``).

Imports only numpy, torch, gr.hstu, gr.jagged_rows and gr.timestamps (the timestamps column's name): the serving
runtime and generation both build on it, neither through the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from gr.hstu.cache import CachedHSTU, HistoryCache
from gr.jagged_rows import evicted_prefix
from gr.timestamps import TIMESTAMPS

Tokens = Dict[str, np.ndarray]
# A cache settled at a request's time (nothing pending) and the outputs of the tokens settled [p, D]
Settled = Tuple[HistoryCache, Tensor]

__all__ = [
    "Encoded",
    "Settled",
    "Tokens",
    "UserState",
    "append",
    "encode_states",
    "evict",
    "is_prefix",
    "tokens_after",
    "truncate",
]


@dataclass(frozen=True)
class UserState:
    """One user's cached serving state: the history tokens the cache was built from, its K/V, the
    model version that computed them, and last_hidden: [D] the HSTU output at the last history token
    (None when the engine defers it to the request's time, or the history is empty)."""

    tokens: Tokens
    cache: HistoryCache
    model_version: int
    last_hidden: Optional[Tensor] = None

    @property
    def length(self) -> int:
        """History tokens held (pending ones included)."""
        return self.cache.length

    @property
    def nbytes(self) -> int:
        """Bytes of everything the state keeps: K/V, timestamps, pending inputs, tokens, last output."""
        last = 0 if self.last_hidden is None else self.last_hidden.numel() * self.last_hidden.element_size()
        return self.cache.nbytes + sum(a.nbytes for a in self.tokens.values()) + last

    def continued_by(self, tokens: Tokens, model_version: int) -> bool:
        """Whether a history of ``tokens`` (under ``model_version``) starts with this state's history."""
        return self.model_version == model_version and is_prefix(self.tokens, tokens)


def is_prefix(cached: Tokens, tokens: Tokens) -> bool:
    """Whether the cached history's tokens are the first tokens of ``tokens``, feature by feature."""
    length = len(cached[TIMESTAMPS])
    if length > len(tokens[TIMESTAMPS]) or set(cached) != set(tokens):
        return False
    return all(np.array_equal(cached[name], tokens[name][:length]) for name in cached)


def tokens_after(tokens: Tokens, state: Optional[UserState]) -> Tokens:
    """The history tokens that ``state`` (a cached prefix, or None) does not hold."""
    known = 0 if state is None else state.length
    return {name: value[known:] for name, value in tokens.items()}


def _match(
    state: Optional[UserState], tokens: Tokens, model_version: int, engine: CachedHSTU, use_cache: bool
) -> Tuple[Optional[UserState], str]:
    """(the state to build on, status): "hit" (it holds the whole history), "extend" (a prefix the
    engine can extend), else (None, "miss"), or (None, "off") without the cache."""
    if isinstance(state, UserState) and state.continued_by(tokens, model_version):
        if state.length == len(tokens[TIMESTAMPS]):
            return state, "hit"
        if engine.can_extend(state.cache):
            return state, "extend"
    return None, "miss" if use_cache else "off"


class Encoded(NamedTuple):
    """One user's ``encode_states`` result: its state and status ("hit", "extend", "miss", "off");
    settled: the state's cache settled at the request's time and the settled tokens' outputs, when
    the pass that encoded or extended it settled it; scored: its targets' HSTU outputs [N, D], when
    that pass ran them."""

    state: UserState
    status: str
    settled: Optional[Settled] = None
    scored: Optional[Tensor] = None


def encode_states(
    engine: CachedHSTU,
    embed: Callable[[Tokens], Tensor],
    histories: Sequence[Tokens],
    model_versions: Sequence[int],
    found: Sequence[Optional[UserState]],
    use_cache: bool = True,
    request_times: Optional[Sequence[int]] = None,
    targets: Optional[Sequence[Tuple[Tensor, Tensor]]] = None,
    max_targets: int = 0,
) -> List[Encoded]:
    """Several distinct users' states for their ``histories`` (one model's, computed under
    ``model_versions``, a version each): each user's ``found``
    state reused ("hit"), extended with its new tokens ("extend") or replaced by a fresh encoding
    ("miss"; "off" when use_cache is False and found is ignored). The new tokens of every user go
    through ``embed`` (the PrefixDNN) in one run, the histories to encode in one HSTU pass and those
    to extend in another. With ``request_times`` (seconds, a user each) a state encoded or extended
    is settled at its user's request time in the pass that encodes or extends it
    (``CachedHSTU.encode_settled_batch``, ``extend_settled_batch``), and with ``targets`` (a user's
    candidates: HSTU inputs [N, D] and timestamps [N]) histories encoded from scratch run theirs in
    their pass (``CachedHSTU.encode_scored_batch``), at most ``max_targets`` candidates in all (the
    users first in order whose candidates fit). -> per user its ``Encoded``."""
    matched = [
        _match(s if use_cache else None, t, v, engine, use_cache) for s, t, v in zip(found, histories, model_versions)
    ]
    runs = [i for i, (_, status) in enumerate(matched) if status != "hit"]
    new = {i: tokens_after(histories[i], matched[i][0]) for i in runs}
    xs: Dict[int, Tensor] = {}
    if runs:
        x = embed({name: np.concatenate([new[i][name] for i in runs]) for name in new[runs[0]]})
        xs = dict(zip(runs, torch.split(x, [len(new[i][TIMESTAMPS]) for i in runs])))
    times = {i: torch.from_numpy(new[i][TIMESTAMPS]) for i in runs}
    misses = [i for i in runs if matched[i][0] is None]
    extends = {i: state for i in runs if (state := matched[i][0]) is not None}  # i -> the state it extends
    bases = [state.cache for state in extends.values()]
    ran: Dict[int, Tuple[HistoryCache, Tensor]] = {}
    settled: Dict[int, Settled] = {}
    scored: Dict[int, Tensor] = {}
    if request_times is None:
        ran.update(zip(misses, engine.encode_batch([xs[i] for i in misses], [times[i] for i in misses])))
        ran.update(zip(extends, engine.extend_batch(bases, [xs[i] for i in extends], [times[i] for i in extends])))
    else:
        miss_args = ([xs[i] for i in misses], [times[i] for i in misses], [request_times[i] for i in misses])
        if targets is None:
            for i, (one, at_request) in zip(misses, engine.encode_settled_batch(*miss_args)):
                ran[i], settled[i] = one, at_request
        else:
            miss_targets: List[Optional[Tuple[Tensor, Optional[Tensor]]]] = []
            room = max_targets
            for i in misses:  # the pass's candidates within its budget
                fits = len(targets[i][1]) <= room
                miss_targets.append(targets[i] if fits else None)
                room -= len(targets[i][1]) if fits else 0
            for i, (one, at_request, scores) in zip(misses, engine.encode_scored_batch(*miss_args, miss_targets)):
                ran[i], settled[i] = one, at_request
                if scores is not None:
                    scored[i] = scores
        extended = engine.extend_settled_batch(
            bases, [xs[i] for i in extends], [times[i] for i in extends], [request_times[i] for i in extends]
        )
        for i, (one, at_request) in zip(extends, extended):
            ran[i], settled[i] = one, at_request
    out: List[Encoded] = []
    for i, (tokens, version, (base, status)) in enumerate(zip(histories, model_versions, matched)):
        if status == "hit":
            assert base is not None  # _match: a hit comes with its state
            out.append(Encoded(base, status))
            continue
        cache, hidden = ran[i]
        if engine.defers_last or len(tokens[TIMESTAMPS]) == 0:
            last = None
        elif len(hidden):
            last = hidden[-1]
        else:  # no token committed now: the cached state's last output still holds
            assert base is not None  # a fresh encoding commits every token
            last = base.last_hidden
        out.append(Encoded(UserState(tokens, cache, version, last), status, settled.get(i), scored.get(i)))
    return out


def evict(tokens: Tokens, limit: int, block: int = 1) -> Tuple[Tokens, int]:
    """Drop a history's oldest tokens to fit ``limit`` -> (tokens, tokens dropped).

    Tokens are dropped in whole blocks of ``block`` (``gr.jagged_rows.evicted_prefix``,
    ``HSTUConfig.eviction_block``), as training windows are, so a growing history keeps its window
    start (and its cache) for a block of actions."""
    length = len(tokens[TIMESTAMPS])
    if length <= limit:
        return tokens, 0
    dropped = min(evicted_prefix(length, limit, block), length)
    return {name: value[dropped:].copy() for name, value in tokens.items()}, dropped


def truncate(cache: HistoryCache, length: int) -> HistoryCache:
    """The cache of the first ``length`` tokens (of a cache with nothing pending): a paged cache's
    first pages, shared (``PagePool.truncated``), else views of its own tensors."""
    if cache.paged is not None:
        paged = cache.paged.pool.truncated(cache.paged, length)
        return HistoryCache((), (), cache.timestamps[:length], None, paged)
    return HistoryCache(
        tuple(k[:, :length] for k in cache.keys), tuple(v[:, :length] for v in cache.values), cache.timestamps[:length]
    )


def append(
    cache: HistoryCache, keys: List[Tensor], values: List[Tensor], timestamps: Tensor, rows: Tensor
) -> HistoryCache:
    """Commit ``rows`` of a ``CachedHSTU.run_block`` result. keys/values: per layer [H, n, *];
    timestamps: [n]; rows: [r] int64. A paged cache gets the new tokens written into its pool
    (``PagePool.append``: the prefix is not copied); otherwise, or when the pool is full, the
    result keeps its K/V in its own tensors."""
    times = torch.cat([cache.timestamps, timestamps[rows].to(torch.long)])
    new_keys, new_values = [k[:, rows] for k in keys], [v[:, rows] for v in values]
    if cache.paged is not None:
        paged = cache.paged.pool.append(cache.paged, new_keys, new_values)
        if paged is not None:
            return HistoryCache((), (), times, None, paged)
    cache = cache.unpaged()
    return HistoryCache(
        tuple(torch.cat([old, new], dim=1) for old, new in zip(cache.keys, new_keys)),
        tuple(torch.cat([old, new], dim=1) for old, new in zip(cache.values, new_values)),
        times,
    )
