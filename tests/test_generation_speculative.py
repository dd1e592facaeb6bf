"""Generation with the KV-cached HSTU: deterministic greedy, tree attention = separate branches,
speculative greedy (pool and draft-model drafts, with or without a budget shared across requests)
= plain greedy exactly, relaxed verification, beam search and sampling, speculative retrieval =
exact search."""

import pytest
import torch
import torch.nn.functional as F

from gr.generation.budget import AdaptiveBudget, SharedBudget
from gr.generation.decoding import (
    Relaxed,
    beam_search,
    chain_mask,
    greedy,
    sample,
    speculative_greedy,
    step,
)
from gr.generation.draft_tree import DraftTree, tree_from_paths
from gr.generation.drafts import ModelDrafter, PoolDrafter, RankingDrafter
from gr.generation.pools import SequencePool
from gr.generation.speculative_retrieval import SpeculativeRetrieval, greedy_speculative_retrieval
from gr.hstu.cache import CachedHSTU
from gr.hstu.paged import PagePool
from gr.index.exact import ExactIndex, top_items
from helpers.generation import NUM_ITEMS, REQUEST_TIME, TableModel, begin, make_model, random_user

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def index(model):
    return ExactIndex(F.normalize(model.table, dim=-1))


def test_top_items_breaks_ties_towards_the_lowest_id_and_skips_excluded():
    scores = torch.tensor([[0.5, 0.9, 0.9, 0.1, 0.9]])
    exclude = torch.tensor([[False, True, False, False, False]])
    assert top_items(scores, exclude, 1)[1].tolist() == [[2]]
    assert top_items(scores, exclude, 3)[1].tolist() == [[2, 4, 0]]


@pytest.mark.parametrize("query_time", ["token", "next_event"])
def test_greedy_generates_the_argmax_of_a_full_forward_at_every_step(query_time, index):
    model = make_model(query_time=query_time)
    items, ts = random_user(1)
    got = greedy(model, index, begin(model, items, ts), 6, REQUEST_TIME).items
    seq, times = items.tolist(), ts.tolist()
    for item in got:
        x = model.item_tokens(torch.tensor(seq))
        query_times = torch.tensor(times[1:] + [REQUEST_TIME])  # each token's next event; read by "next_event"
        with torch.no_grad():
            h = model.engine.hstu(x, torch.tensor([0, len(seq)]), len(seq), torch.tensor(times), None, query_times)
        scores = index.scores(model.queries(h[-1:]))
        scores[0, torch.tensor(seq)] = float("-inf")
        assert int(scores.argmax()) == item
        seq.append(item)
        times.append(REQUEST_TIME)
    assert len(set(got)) == 6 and not set(got) & set(items.tolist())


def test_tree_attention_equals_running_each_branch_separately(model):
    items, ts = random_user(2)
    state = begin(model, items, ts)
    tree = DraftTree(torch.tensor([3, 7, 9, 11, 13, 5]), torch.tensor([-1, 0, 0, 2, -1, 4]))
    hidden, keys, _ = model.engine.run_block(
        state.cache, model.item_tokens(tree.items), torch.full((6,), REQUEST_TIME), tree.depths(), tree.ancestor_mask()
    )
    for branch in tree.branches():
        nodes = torch.tensor(branch)
        n = len(branch)
        want, want_keys, _ = model.engine.run_block(
            state.cache,
            model.item_tokens(tree.items[nodes]),
            torch.full((n,), REQUEST_TIME),
            torch.arange(1, n + 1),
            chain_mask(n),
        )
        torch.testing.assert_close(hidden[nodes], want, rtol=0, atol=1e-5)
        torch.testing.assert_close(keys[1][:, nodes], want_keys[1], rtol=0, atol=1e-5)
        extended = model.engine.extend(
            state.cache, model.item_tokens(tree.items[nodes]), torch.full((n,), REQUEST_TIME)
        )
        torch.testing.assert_close(extended.keys[1][:, -n:], want_keys[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("max_nodes,budget", [(1, None), (24, None), (24, AdaptiveBudget(start_depth=1))])
def test_speculative_greedy_with_pool_drafts_equals_plain_greedy(model, index, max_nodes, budget):
    pool = SequencePool(max_ngram=2)
    users = [random_user(seed) for seed in range(10, 16)]
    for seed in range(4):  # pools of other users' generated slates and histories
        items, ts = users[seed]
        pool.add(items.tolist() + greedy(model, index, begin(model, items, ts), 10, REQUEST_TIME).items)
    accepted = 0
    for items, ts in users:
        want = greedy(model, index, begin(model, items, ts), 10, REQUEST_TIME)
        got = speculative_greedy(
            model,
            index,
            begin(model, items, ts),
            10,
            REQUEST_TIME,
            PoolDrafter(pool, max_depth=6, max_nodes=max_nodes),
            budget=budget,
        )
        assert got.items == want.items
        # every pass yields its accepted drafts plus one item of its own (none after a full last branch)
        assert got.stats.passes + got.stats.accepted in (want.stats.passes, want.stats.passes + 1)
        accepted += got.stats.accepted
    assert accepted > 0, "the pool holds four of these users' own slates: some drafts must be accepted"


@pytest.mark.parametrize("width,budget", [(1, None), (3, AdaptiveBudget(max_depth=4, nodes_per_level=3))])
def test_speculative_greedy_with_a_draft_model_equals_plain_greedy(model, index, width, budget):
    draft = make_model(num_layers=1, seed=5)
    draft.table = model.table  # same catalogue; a different, smaller network
    accepted = 0
    for seed in range(20, 24):
        items, ts = random_user(seed)
        want = greedy(model, index, begin(model, items, ts), 12, REQUEST_TIME)
        drafter = ModelDrafter(draft, index, items, ts, REQUEST_TIME, max_depth=4, width=width)
        got = speculative_greedy(model, index, begin(model, items, ts), 12, REQUEST_TIME, drafter, budget=budget)
        assert got.items == want.items
        accepted += got.stats.accepted
    self_drafter = ModelDrafter(model, index, items, ts, REQUEST_TIME, max_depth=4)
    got = speculative_greedy(model, index, begin(model, items, ts), 12, REQUEST_TIME, self_drafter)
    assert got.items == want.items and got.stats.acceptance_rate == 1.0, "the target drafting itself is always right"


def test_relaxed_verification_accepts_more_and_keeps_items_within_the_target_top_k(model, index):
    items, ts = random_user(30)
    wrong = SequencePool(max_ngram=1)
    ranked = top_items(
        index.scores(begin(model, items, ts).query.view(1, -1)),
        torch.zeros(1, NUM_ITEMS, dtype=torch.bool).index_fill_(1, items, True),
        3,
    )[1][0].tolist()
    wrong.add([int(items[-1]), ranked[0]])
    strict = speculative_greedy(model, index, begin(model, items, ts), 5, REQUEST_TIME, PoolDrafter(wrong))
    relaxed = speculative_greedy(
        model,
        index,
        begin(model, items, ts),
        5,
        REQUEST_TIME,
        PoolDrafter(wrong),
        verification=Relaxed(top_k=NUM_ITEMS, min_prob=0.0),
    )
    assert relaxed.stats.accepted >= strict.stats.accepted
    assert len(relaxed.items) == 5 and len(set(relaxed.items)) == 5


def test_beam_of_width_one_is_greedy_and_sampling_is_reproducible(model, index):
    items, ts = random_user(40)
    want = greedy(model, index, begin(model, items, ts), 5, REQUEST_TIME).items
    assert beam_search(model, index, begin(model, items, ts), 5, REQUEST_TIME, width=1).items == want
    wide = beam_search(model, index, begin(model, items, ts), 5, REQUEST_TIME, width=3)
    assert len(set(wide.items)) == 5 and not set(wide.items) & set(items.tolist())
    draws = [
        sample(
            model,
            index,
            begin(model, items, ts),
            5,
            REQUEST_TIME,
            temperature=0.5,
            generator=torch.Generator().manual_seed(3),
        ).items
        for _ in range(2)
    ]
    assert draws[0] == draws[1] and not set(draws[0]) & set(items.tolist())


@pytest.mark.parametrize("cache_size,stride", [(1, 3), (8, 2), (NUM_ITEMS, 5)])
def test_speculative_retrieval_equals_exact_search(model, index, cache_size, stride):
    rollbacks = 0
    for seed in (50, 51, 52):
        items, ts = random_user(seed)
        want = greedy(model, index, begin(model, items, ts), 9, REQUEST_TIME).items
        got = greedy_speculative_retrieval(
            model, index, begin(model, items, ts), 9, REQUEST_TIME, SpeculativeRetrieval(cache_size, stride)
        )
        assert got.items == want
        assert got.stats.verifications <= 9
        rollbacks += got.stats.rollbacks
    if cache_size == 1:
        assert rollbacks > 0, "a one-item local cache cannot answer every step: the exact check must roll back"
    if cache_size == NUM_ITEMS:
        assert rollbacks == 0, "a local cache of the whole catalogue is exact"


class FirstTreeDrafter:
    """Proposes ``tree`` in the first pass, nothing afterwards."""

    def __init__(self, tree: DraftTree) -> None:
        self.tree, self.calls = tree, 0

    def propose(self, sequence, depth, banned, max_nodes=None, query=None) -> DraftTree:
        self.calls += 1
        return self.tree if self.calls == 1 else tree_from_paths([], 1)


def test_one_pass_over_a_tree_verifies_like_one_token_steps_and_commits_the_right_cache(model, index):
    items, ts = random_user(60)
    want = greedy(model, index, begin(model, items, ts), 9, REQUEST_TIME).items
    decoys = [i for i in range(NUM_ITEMS) if i not in want and i not in items.tolist()]
    # the greedy continuation after want[0] hidden among decoy siblings and a decoy branch
    tree = tree_from_paths([[decoys[0], want[1]], [want[1], want[2], decoys[1]], want[1:5], [want[1], decoys[2]]], 32)
    got = speculative_greedy(model, index, begin(model, items, ts), 9, REQUEST_TIME, FirstTreeDrafter(tree))
    assert got.items == want, "later one-token passes run on the K/V the tree pass committed"
    assert got.stats.accepted == 4 and got.stats.passes == 1 + (9 - 6)


def test_relaxed_verification_of_a_tree_picks_the_best_scored_child_like_one_token_steps(model, index):
    items, ts = random_user(61)
    seen = set(items.tolist())
    roots, leaves = [3, 8, 21], [5, 13]
    roots, leaves = [i for i in roots if i not in seen], [i for i in leaves if i not in seen]
    tree = tree_from_paths([[r, leaf] for r in roots for leaf in leaves if leaf != r], 32)
    state = begin(model, items, ts)
    first = greedy(model, index, state, 1, REQUEST_TIME).items[0]
    # unbatched: one token at a time, the best-scored child (lowest id on ties) at each level
    expected, current = [first], step(model, state, first, REQUEST_TIME)
    for options in (roots, leaves):
        options = [i for i in options if i not in expected]
        scores = index.scores(current.query.view(1, -1))[0, torch.tensor(options)].tolist()
        chosen = max(zip(scores, [-i for i in options]))[1] * -1
        expected.append(chosen)
        current = step(model, current, chosen, REQUEST_TIME)
    expected.append(greedy(model, index, current, 1, REQUEST_TIME).items[0])  # the model's own item after them
    got = speculative_greedy(
        model,
        index,
        state,
        4,
        REQUEST_TIME,
        FirstTreeDrafter(tree),
        verification=Relaxed(top_k=NUM_ITEMS, min_prob=0.0),
    )
    assert got.items == expected and got.stats.passes == 1


def test_adaptive_budget_stops_drafting_when_drafts_are_always_wrong(model, index):
    items, ts = random_user(62)
    want = greedy(model, index, begin(model, items, ts), 30, REQUEST_TIME).items
    wrong = SequencePool(max_ngram=1)
    allowed = [i for i in range(NUM_ITEMS) if i not in want and i not in items.tolist()]
    for item in want + items.tolist():  # every context continues with items greedy never picks
        wrong.add([item, *allowed[:4]])
    fixed = speculative_greedy(model, index, begin(model, items, ts), 30, REQUEST_TIME, PoolDrafter(wrong, 4, 8))
    adaptive = speculative_greedy(
        model,
        index,
        begin(model, items, ts),
        30,
        REQUEST_TIME,
        PoolDrafter(wrong, 4, 8),
        budget=AdaptiveBudget(patience=1, pause=2, max_pause=8),
    )
    assert fixed.items == adaptive.items == want
    assert fixed.stats.accepted == adaptive.stats.accepted == 0
    assert adaptive.stats.passes == fixed.stats.passes == 29, "one item per pass: greedy's passes"
    assert adaptive.stats.drafted <= fixed.stats.drafted // 4, "paused drafting verifies far fewer draft tokens"


def test_ranking_drafts_are_the_runners_up_of_the_last_query_laid_out_breadth_first(model, index):
    items, ts = random_user(63)
    state = begin(model, items, ts)
    banned = set(items.tolist())
    ranked = top_items(
        index.scores(state.query.view(1, -1)),
        torch.zeros(1, NUM_ITEMS, dtype=torch.bool).index_fill_(1, items, True),
        5,
    )[1][0].tolist()
    tree = RankingDrafter(index, widths=(3, 2), max_nodes=7).propose(items.tolist(), 4, banned, query=state.query)
    assert tree.items[:3].tolist() == ranked[:3] and tree.parents[:3].tolist() == [-1, -1, -1]
    # level 2: under each root child, the best two runners-up not already on the branch; cut at 7 nodes
    assert tree.items[3:].tolist() == [ranked[1], ranked[2], ranked[0], ranked[2]]
    assert tree.parents[3:].tolist() == [0, 0, 1, 1]


def test_speculative_greedy_with_ranking_drafts_equals_plain_greedy(model, index):
    accepted = 0
    for seed in range(70, 74):
        items, ts = random_user(seed)
        want = greedy(model, index, begin(model, items, ts), 12, REQUEST_TIME)
        got = speculative_greedy(model, index, begin(model, items, ts), 12, REQUEST_TIME, RankingDrafter(index))
        assert got.items == want.items
        assert got.stats.passes + got.stats.accepted in (want.stats.passes, want.stats.passes + 1)
        accepted += got.stats.accepted
    assert accepted > 0, "16 runners-up of 60 items at the first level: some must be the next greedy item"


class CountingDrafter:
    """Counts its draft lookups; drafts the next greedy items of ``want`` (right) or nothing useful."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def propose(self, sequence, depth, banned, max_nodes=None, query=None):
        self.calls += 1
        return self.inner.propose(sequence, depth, banned, max_nodes, query)


def test_speculative_greedy_with_a_shared_budget_equals_greedy_and_skips_the_drafter_while_it_does_not_pay(
    model, index
):
    shared = SharedBudget(AdaptiveBudget(start_depth=1))
    for seed in range(80, 84):  # requests of several users learn into one budget
        items, ts = random_user(seed)
        want = greedy(model, index, begin(model, items, ts), 12, REQUEST_TIME).items
        drafter = CountingDrafter(RankingDrafter(index))
        got = speculative_greedy(model, index, begin(model, items, ts), 12, REQUEST_TIME, drafter, budget=shared)
        assert got.items == want
    assert shared.drafted_passes > 0
    # a source measured as not paying: a drafted pass takes 1 s for 1 item, so no probe is due for 100 s
    losing = SharedBudget(AdaptiveBudget(), probe_share=0.01, min_drafted=1)
    losing.record_drafted(accepted=0, seconds=1.0, depth=2)
    losing.record_plain(seconds=1e-3)
    drafter = CountingDrafter(ModelDrafter(model, index, items, ts, REQUEST_TIME))
    got = speculative_greedy(model, index, begin(model, items, ts), 12, REQUEST_TIME, drafter, budget=losing)
    assert got.items == want and drafter.calls == 0 and got.stats.drafted == 0
    assert drafter.inner.state is None, "a request that never drafts never runs the draft model"


def test_generation_on_a_paged_engine_writes_only_new_tokens_and_equals_generation_on_tensors(model, index):
    """Each step's state shares the history's pages (the new token goes into the last page's free
    slots or one new page; a speculative rollback shares the kept pages and copies at most its
    partial last one); greedy, speculative greedy and the queries equal the unpaged engine's."""
    engine = CachedHSTU(model.engine.hstu, PagePool(model.engine.config, 96, 4))
    paged = TableModel(engine, model.table)
    pool = SequencePool(max_ngram=2)
    users = [random_user(seed) for seed in range(20, 24)]
    for items, ts in users[:2]:
        pool.add(items.tolist() + greedy(model, index, begin(model, items, ts), 8, REQUEST_TIME).items)
    for items, ts in users:
        state, plain = begin(paged, items, ts), begin(model, items, ts)
        assert state.cache.paged is not None and not state.cache.keys
        torch.testing.assert_close(state.query, plain.query, rtol=0, atol=0)
        used = engine.pool.used
        after = step(paged, state, 0, REQUEST_TIME)
        assert after.cache.paged.pages[: len(state.cache.paged.pages) - 1] == state.cache.paged.pages[:-1]
        assert engine.pool.used - used <= 1
        torch.testing.assert_close(after.query, step(model, plain, 0, REQUEST_TIME).query, rtol=0, atol=0)
        want = greedy(model, index, plain, 8, REQUEST_TIME)
        assert greedy(paged, index, state, 8, REQUEST_TIME).items == want.items
        drafted = speculative_greedy(paged, index, state, 8, REQUEST_TIME, PoolDrafter(pool, max_depth=4))
        assert drafted.items == want.items
    del state, after
    assert engine.pool.used == 0  # every state's pages came back
