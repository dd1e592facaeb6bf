"""Adaptive draft-tree budget for speculative decoding: draft deeper while drafts are accepted,
shallower when they are not, and pause drafting (plain greedy passes, no draft lookup) while
nothing is accepted, so poor drafts cost little more than plain greedy decoding.

``AdaptiveBudget`` learns within one request. ``SharedBudget`` keeps what a draft source has
shown across requests (items and seconds per drafted pass against a plain pass): a source that
does not pay stops drafting from a request's first pass, probing now and then so it can resume.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class AdaptiveBudget:
    """Bounds and rates of the per-request draft budget (the items stay greedy's: only tree sizes change).

    start_depth: levels drafted in the first pass; max_depth: the most levels ever drafted
    nodes_per_level: tree nodes allowed per drafted level (node budget = depth * nodes_per_level)
    grow: levels added after a pass that accepted its whole drafted depth
    patience: consecutive passes that accepted nothing before drafting pauses
    pause, max_pause: passes without drafting after the first pause; each further pause doubles it
    break_even: accepted items per drafted pass below which drafting does not pay (a tree pass and
    its draft lookup cost that much more than a plain pass); while the running mean (``smoothing``
    weight per drafted pass) stays below it, an occasional accepted draft no longer shortens the
    pauses, so rare lucky drafts cannot keep an unprofitable source drafting
    """

    start_depth: int = 2
    max_depth: int = 8
    nodes_per_level: int = 4
    grow: int = 2
    patience: int = 2
    pause: int = 2
    max_pause: int = 16
    break_even: float = 0.3
    smoothing: float = 0.25

    def __post_init__(self) -> None:
        if not 1 <= self.start_depth <= self.max_depth:
            raise ValueError(
                f"AdaptiveBudget: expected 1 <= start_depth <= max_depth, got {self.start_depth}, {self.max_depth}"
            )
        if min(self.nodes_per_level, self.grow, self.patience, self.pause) < 1 or self.max_pause < self.pause:
            raise ValueError(
                "AdaptiveBudget: nodes_per_level, grow, patience and pause must be >= 1, max_pause >= pause"
            )
        if self.break_even < 0 or not 0 < self.smoothing <= 1:
            raise ValueError(
                f"AdaptiveBudget: expected break_even >= 0 and 0 < smoothing <= 1, got "
                f"{self.break_even}, {self.smoothing}"
            )

    def tracker(self) -> "BudgetTracker":
        """A fresh tracker for one request."""
        return BudgetTracker(self)


class BudgetTracker:
    """One request's budget: ``next`` sizes a pass's tree; after (0, 0) ``plain_run`` says how many
    passes in a row go without drafting; ``observe`` learns from a drafted pass and ``plain`` from
    plain passes (``seconds``: wall time, draft lookup included; only a shared budget uses it)."""

    def __init__(self, budget: AdaptiveBudget, shared: Optional["SharedBudget"] = None) -> None:
        self.budget = budget
        self.shared = shared
        self.depth = budget.start_depth if shared is None else shared.depth
        self.misses = 0
        self.paused = 0
        self.next_pause = budget.pause
        self.gain = 1.0  # running mean of accepted items per drafted pass (optimistic start)
        self.refused = 0  # plain passes the shared budget asked for at the last ``next``

    def next(self, room: int) -> Tuple[int, int]:
        """-> (depth, max nodes) of the next tree, at most ``room`` levels; (0, 0): do not draft."""
        if self.shared is not None:
            self.refused = self.shared.skip()
            if self.refused:
                return 0, 0
        if self.paused and (self.shared is None or not self.shared.learning):
            self.paused -= 1
            return 0, 0
        depth = min(self.depth, room)
        return depth, depth * self.budget.nodes_per_level

    def plain_run(self) -> int:
        """After ``next`` returned (0, 0): passes from this one on that go without drafting (the
        caller runs them, and may stop early); the tracker counts them as done."""
        if self.refused:
            return self.refused
        run, self.paused = 1 + self.paused, 0
        return run

    def observe(self, tree_depth: int, accepted: int, seconds: float = 0.0) -> None:
        """After a drafted pass: the depth of the tree verified (0 if empty) and the items accepted."""
        b = self.budget
        self.gain += b.smoothing * (accepted - self.gain)
        if accepted == 0:
            self.misses += 1
            self.depth = max(1, self.depth - 1)
            if self.misses >= b.patience:
                self.paused, self.misses = self.next_pause, 0
                self.next_pause = min(2 * self.next_pause, b.max_pause)
        else:
            self.misses = 0
            if self.gain >= b.break_even:
                self.next_pause = b.pause
            self.depth = min(b.max_depth, self.depth + b.grow) if accepted >= tree_depth else max(1, accepted + 1)
        if self.shared is not None:
            self.shared.record_drafted(accepted, seconds, self.depth)

    def plain(self, seconds: float, passes: int = 1) -> None:
        """After ``passes`` passes in a row that drafted nothing, taking ``seconds`` in all."""
        if self.shared is not None:
            self.shared.record_plain(seconds, passes)


class SharedBudget:
    """A draft source's budget across requests: one per draft source, owned by whoever owns the
    source and passed with each of its requests (``budget=``). Thread-safe: its statistics change
    under a lock, so concurrent requests (the HTTP server's threads) may share it.

    It keeps running means (weight ``smoothing`` per sample, a time sample clipped at twice the
    mean) of the seconds of a plain pass, and of the items (1 + accepted) and seconds of a drafted
    pass, draft lookup included. Drafting pays while a drafted pass yields items at least as fast
    as plain passes; it is assumed to until ``min_drafted`` drafted passes and a plain one are
    measured (a few unlucky drafts must not stop a source: once stopped, it is probed rarely).
    While it does not pay, requests decode runs of plain passes (greedy's loop: no draft lookup,
    one lock per run) up to a probe: one drafted pass once the plain passes since the last drafted
    one have taken ``1 / probe_share`` times what a drafted pass loses (its seconds less its
    items' seconds in plain passes). Probing thus loses at most about ``probe_share`` of the time
    however costly a drafted pass is, and a source near break-even is probed often (it loses
    little), so a passing run of bad drafts does not keep a paying source stopped for long.
    Within a request drafting is sized and paused by ``budget`` (an ``AdaptiveBudget``) as without
    sharing, starting at the depth the last drafted pass left.
    """

    def __init__(
        self,
        budget: AdaptiveBudget = AdaptiveBudget(),
        smoothing: float = 0.05,
        probe_share: float = 0.005,
        min_drafted: int = 32,
    ) -> None:
        if not 0 < smoothing <= 1 or not 0 < probe_share <= 1 or min_drafted < 1:
            raise ValueError(
                "SharedBudget: expected 0 < smoothing <= 1, 0 < probe_share <= 1 and min_drafted >= 1, got "
                f"{smoothing}, {probe_share}, {min_drafted}"
            )
        self.budget, self.smoothing, self.probe_share, self.min_drafted = budget, smoothing, probe_share, min_drafted
        self.depth = budget.start_depth
        self.plain_seconds: Optional[float] = None  # mean seconds of a plain pass
        self.drafted_seconds: Optional[float] = None  # mean seconds of a drafted pass
        self.drafted_items: Optional[float] = None  # mean items (1 + accepted) of a drafted pass
        self.since_drafted = 0.0  # seconds of plain passes since the last drafted pass
        self.drafted_passes = 0
        self.plain_passes = 0
        self._lock = threading.Lock()

    def tracker(self) -> BudgetTracker:
        """A tracker for one request that learns from, and into, the shared statistics."""
        return BudgetTracker(self.budget, self)

    @property
    def learning(self) -> bool:
        """Whether fewer than ``min_drafted`` drafted passes are measured: until then every pass
        drafts (no pauses within a request), so the learning takes a few requests, not dozens."""
        return self.drafted_passes < self.min_drafted

    def pays(self) -> bool:
        """Whether drafting yields items at least as fast as plain passes (True until measured)."""
        with self._lock:
            return self._pays()

    def _pays(self) -> bool:
        if self.learning or self.plain_seconds is None:
            return True
        assert self.drafted_seconds is not None and self.drafted_items is not None  # measured with the passes
        return self.drafted_items * self.plain_seconds >= self.drafted_seconds

    def skip(self) -> int:
        """0: the next pass may draft (drafting pays, or a probe is due: then taken, so concurrent
        requests do not all probe at once); else how many plain passes until a probe is due."""
        with self._lock:
            if self._pays():
                return 0
            assert self.plain_seconds is not None and self.drafted_seconds is not None  # _pays measured them
            assert self.drafted_items is not None
            loss = self.drafted_seconds - self.drafted_items * self.plain_seconds  # > 0: it does not pay
            wait = loss / self.probe_share - self.since_drafted
            if wait <= 0:
                self.since_drafted = 0.0
                return 0
            return max(1, math.ceil(wait / max(self.plain_seconds, 1e-9)))

    def record_drafted(self, accepted: int, seconds: float, depth: int) -> None:
        """A drafted pass: items accepted, its seconds (draft lookup included), the depth it leaves."""
        with self._lock:
            self.drafted_items = self._mean(self.drafted_items, 1.0 + accepted)
            self.drafted_seconds = self._mean_seconds(self.drafted_seconds, seconds)
            self.depth, self.since_drafted = depth, 0.0
            self.drafted_passes += 1

    def record_plain(self, seconds: float, passes: int = 1) -> None:
        """``passes`` passes in a row that drafted nothing, and their seconds in all."""
        with self._lock:
            self.plain_seconds = self._mean_seconds(self.plain_seconds, seconds / passes)
            self.since_drafted += seconds
            self.plain_passes += passes

    def _mean(self, mean: Optional[float], value: float) -> float:
        return value if mean is None else mean + self.smoothing * (value - mean)

    def _mean_seconds(self, mean: Optional[float], seconds: float) -> float:
        """A time sample counts at most twice the mean: a pass stalled by another process must not
        stop, or start, drafting on its own."""
        return self._mean(mean, seconds if mean is None else min(seconds, 2 * mean))
