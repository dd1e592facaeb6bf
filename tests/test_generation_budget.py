"""The adaptive draft budget: deeper after fully accepted drafts, back to just past the accepted
prefix after a partial one, and drafting paused (with a growing pause) while nothing is accepted."""

import pytest

from gr.generation.budget import AdaptiveBudget


def test_depth_grows_on_full_acceptance_and_falls_back_past_the_accepted_prefix():
    tracker = AdaptiveBudget(start_depth=2, max_depth=6, nodes_per_level=3, grow=2).tracker()
    assert tracker.next(room=10) == (2, 6)
    tracker.observe(tree_depth=2, accepted=2)
    assert tracker.next(room=10) == (4, 12)
    tracker.observe(tree_depth=4, accepted=4)
    assert tracker.next(room=10) == (6, 18), "bounded by max_depth"
    assert tracker.next(room=3) == (3, 9), "never deeper than the items still to generate"
    tracker.observe(tree_depth=6, accepted=1)
    assert tracker.next(room=10) == (2, 6)


def test_drafting_pauses_while_nothing_is_accepted_and_each_pause_doubles():
    tracker = AdaptiveBudget(start_depth=3, patience=2, pause=2, max_pause=4).tracker()
    tracker.observe(tree_depth=3, accepted=0)
    assert tracker.next(room=10) == (2, 8)
    tracker.observe(tree_depth=0, accepted=0)  # an empty tree counts as a miss too
    assert [tracker.next(room=10) for _ in range(2)] == [(0, 0), (0, 0)]
    assert tracker.next(room=10) == (1, 4), "probes again with one level"
    tracker.observe(tree_depth=1, accepted=0)
    tracker.next(room=10)
    tracker.observe(tree_depth=1, accepted=0)
    assert [tracker.next(room=10)[0] for _ in range(5)] == [0, 0, 0, 0, 1], "the second pause is twice as long"
    tracker.observe(tree_depth=1, accepted=1)
    assert tracker.next(room=10) == (3, 12)


def test_bad_budget_bounds_are_refused():
    with pytest.raises(ValueError, match="start_depth"):
        AdaptiveBudget(start_depth=5, max_depth=4)
    with pytest.raises(ValueError, match="pause"):
        AdaptiveBudget(pause=8, max_pause=4)


def drafted_share(budget: AdaptiveBudget, passes: int = 200) -> float:
    """Share of passes that draft when one drafted pass in four accepts a single item."""
    tracker, drafted = budget.tracker(), 0
    for _ in range(passes):
        depth, _ = tracker.next(room=50)
        if depth:
            drafted += 1
            tracker.observe(tree_depth=depth, accepted=1 if drafted % 4 == 0 else 0)
    return drafted / passes


def test_rare_accepted_drafts_below_break_even_no_longer_reset_the_pause():
    free = drafted_share(AdaptiveBudget(patience=2, pause=2, max_pause=16, break_even=0.0))
    costed = drafted_share(AdaptiveBudget(patience=2, pause=2, max_pause=16, break_even=0.5))
    assert costed < free / 2, (costed, free)
