"""Adaptive draft-tree budget for speculative decoding: draft deeper while drafts are accepted,
shallower when they are not, and pause drafting (plain greedy passes, no draft lookup) while
nothing is accepted, so poor drafts cost little more than plain greedy decoding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


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
    """One request's budget: ``next`` sizes a pass's tree, ``observe`` learns from its result."""

    def __init__(self, budget: AdaptiveBudget) -> None:
        self.budget = budget
        self.depth = budget.start_depth
        self.misses = 0
        self.paused = 0
        self.next_pause = budget.pause
        self.gain = 1.0  # running mean of accepted items per drafted pass (optimistic start)

    def next(self, room: int) -> Tuple[int, int]:
        """-> (depth, max nodes) of the next tree, at most ``room`` levels; (0, 0): do not draft."""
        if self.paused:
            self.paused -= 1
            return 0, 0
        depth = min(self.depth, room)
        return depth, depth * self.budget.nodes_per_level

    def observe(self, tree_depth: int, accepted: int) -> None:
        """After a drafted pass: the depth of the tree verified (0 if empty) and the items accepted."""
        b = self.budget
        self.gain += b.smoothing * (accepted - self.gain)
        if accepted == 0:
            self.misses += 1
            self.depth = max(1, self.depth - 1)
            if self.misses >= b.patience:
                self.paused, self.misses = self.next_pause, 0
                self.next_pause = min(2 * self.next_pause, b.max_pause)
            return
        self.misses = 0
        if self.gain >= b.break_even:
            self.next_pause = b.pause
        self.depth = min(b.max_depth, self.depth + b.grow) if accepted >= tree_depth else max(1, accepted + 1)
