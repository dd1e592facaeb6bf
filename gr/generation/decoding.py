"""Generating a user's next K items with a KV-cached HSTU: greedy, beam, sampling, speculative greedy.

Every generated item is appended as a history token (timestamp = the request time); the
query at the last token (the retrieval head's output) picks the next item by maximum inner
product over the catalogue. Speculative greedy verifies a draft token tree in one HSTU pass
(``CachedHSTU.run_block``) and, with strict verification, returns exactly the greedy items.

Imports only torch, gr.hstu and gr.generation: the serving runtime uses it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence, Set, Tuple

import torch
from torch import Tensor

from gr.generation.budget import AdaptiveBudget, SharedBudget
from gr.generation.draft_tree import DraftTree
from gr.hstu.cache import CachedHSTU, HistoryCache
from gr.hstu.user_state import append, truncate
from gr.index.exact import Exclusions, ItemIndex, exclusion_mask, top_items


class GenerativeModel(Protocol):
    """What generation needs from a model: the cached HSTU engine, item tokens and retrieval queries."""

    @property
    def engine(self) -> CachedHSTU: ...

    def item_tokens(self, items: Tensor) -> Tensor:
        """items: [n] int64 -> [n, D] float HSTU input (the PrefixDNN output of each item as a token)."""

    def queries(self, hidden: Tensor) -> Tensor:
        """hidden: [n, D] float HSTU outputs -> [n, d] float retrieval queries."""


class Drafter(Protocol):
    """Proposes future items for one request."""

    def propose(
        self,
        sequence: Sequence[int],
        depth: int,
        banned: Set[int],
        max_nodes: Optional[int] = None,
        query: Optional[Tensor] = None,
    ) -> DraftTree:
        """A tree of continuations of ``sequence`` (history + generated), at most ``depth`` levels and
        ``max_nodes`` nodes (None: the drafter's own limit), without ``banned`` items (they could never
        be accepted). query: [d] float, the target's query that picked the sequence's last item."""


@dataclass
class DecodeState:
    """A sequence being generated: its committed tokens' cache, items, and the query at the last one.

    query: [d] float, what the model retrieves next
    """

    cache: HistoryCache
    items: List[int]
    query: Tensor


@dataclass
class GenerationStats:
    """passes: HSTU passes after the history (one per step); drafted/accepted: draft tokens
    verified / accepted; draft_seconds and total_seconds: wall time of draft lookup and of the whole."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class Generation:
    items: List[int]
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass(frozen=True)
class Strict:
    """Accept a draft item only when it is the model's greedy choice (output = plain greedy)."""


@dataclass(frozen=True)
class Relaxed:
    """Accept a draft item when it is among the model's ``top_k`` and its probability
    (softmax of the scores / ``temperature`` over the allowed items) is at least ``min_prob``."""

    top_k: int = 5
    min_prob: float = 0.05
    temperature: float = 0.05

    def __post_init__(self) -> None:
        if self.top_k < 1 or not 0.0 <= self.min_prob <= 1.0 or self.temperature <= 0:
            raise ValueError("Relaxed: expected top_k >= 1, 0 <= min_prob <= 1, temperature > 0")


def chain_mask(n: int) -> Tensor:
    """[n, n] bool causal mask of a plain chain of new tokens."""
    return torch.ones(n, n, dtype=torch.bool).tril()


def start(
    model: GenerativeModel,
    items: Tensor,
    timestamps: Tensor,
    request_time: int,
    cached: Optional[HistoryCache] = None,
    tokens: Optional[Tensor] = None,
) -> DecodeState:
    """Encode a history and compute the query at its last token.

    items: [L] int64 history items (L >= 1); timestamps: [L] int64
    request_time: seconds, when the generated items happen (the event after the history)
    cached: the cache of exactly this history, if known (only its last token is recomputed)
    tokens: [L, D] float the history's HSTU inputs, when they are not ``model.item_tokens(items)``
        (tokens with features besides the item, e.g. genres or the action type)
    """
    length = int(items.numel())
    if length == 0:
        raise ValueError("generate: the history is empty; generation needs at least one item to start from")
    x = model.item_tokens(items) if tokens is None else tokens
    engine = model.engine
    if cached is None or cached.length != length:
        cached = engine.encode(x, timestamps) if engine.defers_last else engine.encode(x[:-1], timestamps[:-1])
    if engine.defers_last:
        cache, hidden = engine.settle(cached, request_time)
        return DecodeState(cache, items.tolist(), model.queries(hidden[-1:])[0])
    base = truncate(cached, length - 1) if cached.length == length else cached
    return advance(model, DecodeState(base, items[:-1].tolist(), torch.empty(0)), items[-1:], x[-1:], timestamps[-1:])


def advance(model: GenerativeModel, state: DecodeState, items: Tensor, x: Tensor, timestamps: Tensor) -> DecodeState:
    """Append a chain of tokens (items: [n], x: [n, D], timestamps: [n]) -> the new state."""
    n = int(items.numel())
    hidden, keys, values = model.engine.run_block(state.cache, x, timestamps, torch.arange(1, n + 1), chain_mask(n))
    cache = append(state.cache, keys, values, timestamps, torch.arange(n))
    return DecodeState(cache, state.items + items.tolist(), model.queries(hidden[-1:])[0])


def slate_log_probs(
    model: GenerativeModel,
    index: ItemIndex,
    state: DecodeState,
    items: Sequence[int],
    request_time: int,
    exclude_seen: bool = True,
    temperature: float = 1.0,
) -> List[float]:
    """Each generated item's log-probability at its step: log softmax(scores / temperature) over the
    items allowed there (with exclude_seen, the history's and the earlier steps' items are not), the
    distribution sampling draws from and beam search sums. items: the slate generated from ``state``;
    the queries after items[:-1] come from one HSTU pass over that chain (the state is not changed)."""
    queries = state.query.view(1, -1)
    if len(items) > 1:
        chain, n = torch.tensor(list(items[:-1])), len(items) - 1
        timestamps = torch.full((n,), request_time, dtype=torch.long)
        hidden, _, _ = model.engine.run_block(
            state.cache, model.item_tokens(chain), timestamps, torch.arange(1, n + 1), chain_mask(n)
        )
        queries = torch.cat([queries, model.queries(hidden).to(queries.device)])
    scores = index.scores(queries)  # [k, M]
    banned, out = _banned(state, exclude_seen), []
    for row, item in enumerate(items):
        masked = scores[row : row + 1].masked_fill(exclusion_mask(index.num_items, 1, banned), float("-inf"))
        out.append(float(torch.log_softmax(masked / temperature, 1)[0, item]))
        if exclude_seen:
            banned.add(item)
    return out


def _banned(state: DecodeState, exclude_seen: bool) -> Set[int]:
    return set(state.items) if exclude_seen else set()


def step(model: GenerativeModel, state: DecodeState, item: int, request_time: int) -> DecodeState:
    """Append one generated item (timestamp ``request_time``) -> the new state."""
    items = torch.tensor([item])
    return advance(model, state, items, model.item_tokens(items), torch.tensor([request_time]))


def greedy(
    model: GenerativeModel, index: ItemIndex, state: DecodeState, k: int, request_time: int, exclude_seen: bool = True
) -> Generation:
    """Plain greedy: k items, one HSTU pass per item after the first. Ties -> lowest item id."""
    began, stats = time.perf_counter(), GenerationStats()
    exclusions, out = _exclusions(index, state, exclude_seen), []
    while True:
        out.append(_best(index, state.query, exclusions))
        if exclude_seen:
            exclusions.add(out[-1:])
        if len(out) >= k:
            break
        state = step(model, state, out[-1], request_time)
        stats.passes += 1
    stats.total_seconds = time.perf_counter() - began
    return Generation(out, stats)


def _exclusions(index: ItemIndex, state: DecodeState, exclude_seen: bool) -> Exclusions:
    return Exclusions(index.num_items, state.items if exclude_seen else ())


def _plain_pass(
    model: GenerativeModel,
    index: ItemIndex,
    state: DecodeState,
    pending: int,
    request_time: int,
    exclusions: Exclusions,
) -> Tuple[DecodeState, int]:
    """One greedy pass: append ``pending`` to the history, then the best allowed item after it."""
    state = step(model, state, pending, request_time)
    return state, _best(index, state.query, exclusions)


def _best(index: ItemIndex, query: Tensor, exclusions: Exclusions) -> int:
    """The greedy item for ``query: [d]``: the best allowed item, lowest id on ties."""
    return int(index.search(query.view(1, -1), exclusions.rows(1), 1)[1][0, 0])


def sample(
    model: GenerativeModel,
    index: ItemIndex,
    state: DecodeState,
    k: int,
    request_time: int,
    exclude_seen: bool = True,
    temperature: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> Generation:
    """Ancestral sampling from softmax(scores / temperature) over the allowed items."""
    if temperature <= 0:
        raise ValueError(f"generate: temperature must be > 0, got {temperature}")
    began, stats = time.perf_counter(), GenerationStats()
    banned, out = _banned(state, exclude_seen), []
    while True:
        scores = index.scores(state.query.view(1, -1)).masked_fill(
            exclusion_mask(index.num_items, 1, banned), float("-inf")
        )
        item = int(torch.multinomial(torch.softmax(scores / temperature, dim=1), 1, generator=generator)[0, 0])
        out.append(item)
        if exclude_seen:
            banned.add(item)
        if len(out) >= k:
            break
        state = step(model, state, item, request_time)
        stats.passes += 1
    stats.total_seconds = time.perf_counter() - began
    return Generation(out, stats)


def beam_search(
    model: GenerativeModel,
    index: ItemIndex,
    state: DecodeState,
    k: int,
    request_time: int,
    exclude_seen: bool = True,
    width: int = 4,
    temperature: float = 1.0,
) -> Generation:
    """The most likely slate under sum of log softmax(scores / temperature), ``width`` beams kept."""
    if width < 1 or temperature <= 0:
        raise ValueError(f"generate: beam width must be >= 1 and temperature > 0, got {width}, {temperature}")
    began, stats = time.perf_counter(), GenerationStats()
    base = _banned(state, exclude_seen)
    beams: List[Tuple[float, DecodeState, List[int]]] = [(0.0, state, [])]
    while True:
        expansions = []
        for b, (logp, beam, out) in enumerate(beams):
            banned = base | set(out) if exclude_seen else base
            scores = index.scores(beam.query.view(1, -1))
            logprobs = torch.log_softmax(
                scores.masked_fill(exclusion_mask(index.num_items, 1, banned), float("-inf")) / temperature, 1
            )
            values, ids = top_items(logprobs, exclusion_mask(index.num_items, 1, banned), width)
            expansions += [(logp + float(v), b, int(i)) for v, i in zip(values[0], ids[0]) if v > float("-inf")]
        expansions.sort(key=lambda e: -e[0])  # stable: earlier beams and lower ids win ties
        chosen = expansions[:width]
        done = len(beams[0][2]) + 1 >= k
        next_beams = []
        for logp, b, item in chosen:
            beam, out = beams[b][1], beams[b][2] + [item]
            if not done:
                beam = step(model, beam, item, request_time)
                stats.passes += 1
            next_beams.append((logp, beam, out))
        beams = next_beams
        if done:
            break
    stats.total_seconds = time.perf_counter() - began
    return Generation(beams[0][2], stats)


def speculative_greedy(
    model: GenerativeModel,
    index: ItemIndex,
    state: DecodeState,
    k: int,
    request_time: int,
    drafter: Drafter,
    exclude_seen: bool = True,
    verification: Strict | Relaxed = Strict(),
    budget: AdaptiveBudget | SharedBudget | None = None,
) -> Generation:
    """Greedy generation verifying drafts: each pass runs the pending item plus a draft tree, accepts
    the longest branch prefix the verification allows, then the model's own choice after it.

    budget: sizes each tree from the acceptance so far (None: the drafter's own limits every pass):
    this request's (``AdaptiveBudget``) or also the source's earlier requests' (``SharedBudget``,
    which may skip drafting altogether: then the drafter is never called).
    With ``Strict`` the items equal ``greedy``'s (same exclusions, same tie-breaking).
    """
    began, stats = time.perf_counter(), GenerationStats()
    exclusions = _exclusions(index, state, exclude_seen)
    out = [_best(index, state.query, exclusions)]
    if exclude_seen:
        exclusions.add(out)
    tracker = budget.tracker() if budget is not None else None
    while len(out) < k:
        room = k - len(out)
        depth, max_nodes = tracker.next(room) if tracker is not None else (room, None)
        began_pass = time.perf_counter()
        if tracker is not None and not depth:  # greedy's own loop, no draft lookup
            passes = min(tracker.plain_run(), room)
            for _ in range(passes):
                state, best = _plain_pass(model, index, state, out[-1], request_time, exclusions)
                out.append(best)
                if exclude_seen:
                    exclusions.add(out[-1:])
            stats.passes += passes
            tracker.plain(time.perf_counter() - began_pass, passes)
            continue
        tree = drafter.propose(state.items + out[-1:], depth, exclusions.items, max_nodes, state.query)
        stats.draft_seconds += time.perf_counter() - began_pass
        state, accepted, bonus = _verify(
            model, index, state, out[-1], tree, request_time, exclusions, exclude_seen, verification, room
        )
        if tracker is not None:
            tracker.observe(tree.depth, len(accepted), time.perf_counter() - began_pass)
        stats.passes += 1
        stats.drafted += tree.num_nodes
        stats.accepted += len(accepted)
        out += accepted
        if len(out) < k:
            out.append(bonus)
        if exclude_seen:
            exclusions.add(accepted + [bonus])
    stats.total_seconds = time.perf_counter() - began
    return Generation(out[:k], stats)


def _verify(
    model: GenerativeModel,
    index: ItemIndex,
    state: DecodeState,
    pending: int,
    tree: DraftTree,
    request_time: int,
    exclusions: Exclusions,
    exclude_seen: bool,
    verification: Strict | Relaxed,
    room: int,
) -> Tuple[DecodeState, List[int], int]:
    """One pass over [pending item] + tree -> (state with pending + accepted committed, accepted items, next item).

    Block row 0 is the pending item (already excluded), row i + 1 the tree's node i. The HSTU pass and
    the queries cover the whole tree at once; the catalogue is searched only at the rows the walk down
    the accepted branch visits (accepted + 1 rows, not the whole tree). An empty tree is greedy's step.
    """
    m = tree.num_nodes
    if m == 0:
        state, best = _plain_pass(model, index, state, pending, request_time, exclusions)
        return state, [], best
    items = torch.cat([torch.tensor([pending]), tree.items])
    depths = torch.cat([torch.ones(1, dtype=torch.long), tree.depths() + 1])
    visible = torch.zeros(m + 1, m + 1, dtype=torch.bool)
    visible[:, 0] = True
    visible[1:, 1:] = tree.ancestor_mask()
    timestamps = torch.full((m + 1,), request_time, dtype=torch.long)
    hidden, keys, values = model.engine.run_block(state.cache, model.item_tokens(items), timestamps, depths, visible)
    queries = model.queries(hidden)
    item_of = [pending] + tree.items.tolist()
    children: Dict[int, List[int]] = {}
    for child, parent in enumerate(tree.parents.tolist(), start=1):
        children.setdefault(parent + 1, []).append(child)
    path, node = [0], 0
    while True:
        # each node also excludes the items on its own branch
        branch = [item_of[a + 1] for a in tree.ancestors[node - 1]] if node and exclude_seen else []
        scores, exclude = index.scores(queries[node].view(1, -1)), exclusions.rows(1)
        if branch:
            exclude = exclude.clone()
            exclude[0, torch.tensor(branch)] = True
        best = int(top_items(scores, exclude, 1)[1][0, 0])
        kids = [(c, item_of[c]) for c in children.get(node, [])] if len(path) - 1 < room else []
        accepted = _accepted_child(verification, scores, exclude, best, kids) if kids else None
        if accepted is None:
            break
        path.append(accepted)
        node = accepted
    rows = torch.tensor(path)
    committed = [item_of[r] for r in path]
    cache = append(state.cache, keys, values, timestamps, rows)
    return DecodeState(cache, state.items + committed, queries[node]), committed[1:], best


def _accepted_child(
    verification: Strict | Relaxed, scores: Tensor, exclude: Tensor, best: int, kids: List[Tuple[int, int]]
) -> Optional[int]:
    """The child a node accepts, or None. scores, exclude: [1, M] at the node; best: its greedy item;
    kids: [(child row, child item)] in tree order. Relaxed takes the best-scored passing child
    (lowest id on ties)."""
    if isinstance(verification, Strict):
        return next((c for c, item in kids if item == best), None)
    masked = scores[0].masked_fill(exclude[0], float("-inf"))
    probs = torch.softmax(masked / verification.temperature, dim=0)
    allowed = set(top_items(scores, exclude, verification.top_k)[1][0].tolist())
    passing = [
        (float(masked[item]), -item, c)
        for c, item in kids
        if item in allowed and float(probs[item]) >= verification.min_prob and float(masked[item]) > float("-inf")
    ]
    return max(passing)[2] if passing else None
