"""The adaptive draft budget: deeper after fully accepted drafts, back to just past the accepted
prefix after a partial one, and drafting paused (with a growing pause) while nothing is accepted;
shared across requests, it stops drafting a source that does not pay (probing rarely), resumes one
that starts paying, and serialises concurrent requests' updates."""

import threading

import pytest

from gr.generation.budget import AdaptiveBudget, SharedBudget


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


PLAIN_SECONDS, DRAFTED_SECONDS = 1.0, 2.0  # a drafted pass costs two plain passes: it pays from 1 accepted item


def serve(shared: SharedBudget, requests: int, accepted_of_depth, passes: int = 20) -> float:
    """Decode ``requests`` requests of ``passes`` passes each against ``shared`` (a drafted pass
    accepts ``accepted_of_depth(depth)`` items) -> share of the passes that drafted."""
    drafted = 0
    for _ in range(requests):
        tracker, done = shared.tracker(), 0
        while done < passes:
            depth, _ = tracker.next(room=50)
            if depth:
                drafted += 1
                done += 1
                tracker.observe(tree_depth=depth, accepted=accepted_of_depth(depth), seconds=DRAFTED_SECONDS)
            else:
                run = min(tracker.plain_run(), passes - done)
                done += run
                tracker.plain(PLAIN_SECONDS * run, run)
    return drafted / (requests * passes)


def never(depth: int) -> int:
    return 0


def always(depth: int) -> int:
    return depth


def test_a_shared_budget_learns_across_requests_to_draft_rarely_from_a_source_that_never_pays():
    shared = SharedBudget(AdaptiveBudget(), probe_share=0.01, min_drafted=4)
    learning = serve(shared, 5, never)
    assert not shared.pays()
    assert shared.tracker().next(room=50) == (0, 0), "a new request starts from what earlier ones learned"
    later = serve(shared, 50, never)
    # a drafted pass loses 1 s (2 s for 1 item): a probe once plain passes took 1 / probe_share = 100 s
    assert later <= 0.011 < learning, (later, learning)


def test_a_source_near_break_even_is_probed_more_often_than_one_far_below():
    def share(drafted_seconds: float) -> float:
        shared = SharedBudget(AdaptiveBudget(), probe_share=0.01, min_drafted=4)
        shared.record_drafted(accepted=0, seconds=drafted_seconds, depth=1)  # loses drafted_seconds - 1 s
        shared.record_plain(PLAIN_SECONDS)
        tracker, drafted, passes = shared.tracker(), 0, 0
        while passes < 1000:
            if tracker.next(room=50)[0]:
                drafted += 1
                passes += 1
                tracker.observe(tree_depth=1, accepted=0, seconds=drafted_seconds)
            else:
                run = tracker.plain_run()
                passes += run
                tracker.plain(PLAIN_SECONDS * run, run)
        return drafted / passes

    near, far = share(1.1), share(2.0)  # a probe every 10 or 100 plain passes
    assert near >= 5 * far > 0, (near, far)


def test_a_shared_budget_resumes_drafting_when_its_source_starts_paying():
    shared = SharedBudget(AdaptiveBudget(), probe_share=0.02, min_drafted=4)
    serve(shared, 20, never)
    assert not shared.pays()
    serve(shared, 30, always)  # probes find full acceptance: 1 + depth items for two passes' time
    assert shared.pays()
    assert serve(shared, 10, always) > 0.9


def test_a_shared_budget_keeps_drafting_a_source_that_pays_and_starts_requests_at_its_learned_depth():
    budget = AdaptiveBudget(start_depth=2, max_depth=6, grow=2)
    shared = SharedBudget(budget)
    assert serve(shared, 10, always) == 1.0
    assert shared.pays() and shared.tracker().next(room=50)[0] == 6


def test_a_shared_budgets_updates_wait_for_its_lock():
    shared = SharedBudget()
    updates = [
        threading.Thread(target=shared.record_plain, args=(PLAIN_SECONDS,)),
        threading.Thread(target=shared.record_drafted, args=(1, DRAFTED_SECONDS, 2)),
        threading.Thread(target=shared.skip),
    ]
    with shared._lock:  # another request's update in progress
        for t in updates:
            t.start()
        for t in updates:
            t.join(timeout=0.1)
        assert all(t.is_alive() for t in updates) and shared.plain_passes == shared.drafted_passes == 0
    for t in updates:
        t.join()
    assert shared.plain_passes == shared.drafted_passes == 1


def test_a_shared_budget_drafts_every_pass_until_it_has_measured_min_drafted_passes():
    shared = SharedBudget(AdaptiveBudget(patience=1, pause=4), min_drafted=10)
    tracker = shared.tracker()
    tracker.plain(PLAIN_SECONDS)
    for _ in range(9):
        assert tracker.next(room=50)[0] > 0, "no pause while the source is learning"
        tracker.observe(tree_depth=1, accepted=0, seconds=DRAFTED_SECONDS)
    assert shared.pays(), "nine unlucky drafts do not stop a source"
    tracker.next(room=50)
    tracker.observe(tree_depth=1, accepted=0, seconds=DRAFTED_SECONDS)
    assert not shared.pays() and tracker.next(room=50) == (0, 0)


def test_bad_shared_budget_rates_are_refused():
    with pytest.raises(ValueError, match="probe_share"):
        SharedBudget(probe_share=0.0)
    with pytest.raises(ValueError, match="min_drafted"):
        SharedBudget(min_drafted=0)
