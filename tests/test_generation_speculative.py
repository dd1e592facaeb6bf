"""Generation with the KV-cached HSTU: deterministic greedy, tree attention = separate branches,
speculative greedy (pool and draft-model drafts) = plain greedy exactly, relaxed verification,
beam search and sampling, speculative retrieval = exact search."""
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from gr.generation.decoding import (
    Relaxed, advance, beam_search, chain_mask, greedy, sample, speculative_greedy, start,
)
from gr.generation.draft_tree import DraftTree
from gr.generation.drafts import ModelDrafter, PoolDrafter
from gr.generation.index import ExactIndex, top_items
from gr.generation.pools import SequencePool
from gr.generation.speculative_retrieval import SpeculativeRetrieval, greedy_speculative_retrieval
from gr.hstu import HSTU, HSTUConfig
from gr.hstu.cache import CachedHSTU

NUM_ITEMS, DIM = 60, 16


@dataclass
class TableModel:
    """A generative model from an HSTU and an item table: token = table row, query = normalised output."""

    engine: CachedHSTU
    table: Tensor

    def item_tokens(self, items: Tensor) -> Tensor:
        return self.table[items]

    def queries(self, hidden: Tensor) -> Tensor:
        return F.normalize(hidden, dim=-1)


def make_model(num_layers: int = 2, seed: int = 0, **overrides) -> TableModel:
    torch.manual_seed(seed)
    cfg = HSTUConfig(**{**dict(hidden_dim=DIM, num_layers=num_layers, num_heads=2, attention_dim=8, linear_dim=8,
                               max_seq_len=64, dropout=0.0, input_dropout=0.0), **overrides})
    hstu = HSTU(cfg)
    with torch.no_grad():
        for p in hstu.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return TableModel(CachedHSTU(hstu), torch.randn(NUM_ITEMS, DIM))


def random_user(seed: int, length: int = 12):
    g = torch.Generator().manual_seed(seed)
    items = torch.randperm(NUM_ITEMS, generator=g)[:length]
    timestamps = torch.sort(torch.randint(0, 10**6, (length,), generator=g)).values
    return items, timestamps


REQUEST_TIME = 2 * 10**6


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


def test_greedy_generates_the_argmax_of_a_full_forward_at_every_step(model, index):
    items, ts = random_user(1)
    got = greedy(model, index, start(model, items, ts), 6, REQUEST_TIME).items
    seq, times = items.tolist(), ts.tolist()
    for item in got:
        x = model.item_tokens(torch.tensor(seq))
        with torch.no_grad():
            h = model.engine.hstu(x, torch.tensor([0, len(seq)]), len(seq), torch.tensor(times))
        scores = index.scores(model.queries(h[-1:]))
        scores[0, torch.tensor(seq)] = float("-inf")
        assert int(scores.argmax()) == item
        seq.append(item)
        times.append(REQUEST_TIME)
    assert len(set(got)) == 6 and not set(got) & set(items.tolist())


def test_tree_attention_equals_running_each_branch_separately(model):
    items, ts = random_user(2)
    state = start(model, items, ts)
    tree = DraftTree(torch.tensor([3, 7, 9, 11, 13, 5]), torch.tensor([-1, 0, 0, 2, -1, 4]))
    hidden, keys, _ = model.engine.run_block(state.cache, model.item_tokens(tree.items),
                                            torch.full((6,), REQUEST_TIME), tree.depths(), tree.ancestor_mask())
    for branch in tree.branches():
        nodes = torch.tensor(branch)
        n = len(branch)
        want, want_keys, _ = model.engine.run_block(state.cache, model.item_tokens(tree.items[nodes]),
                                                    torch.full((n,), REQUEST_TIME), torch.arange(1, n + 1), chain_mask(n))
        torch.testing.assert_close(hidden[nodes], want, rtol=0, atol=1e-5)
        torch.testing.assert_close(keys[1][:, nodes], want_keys[1], rtol=0, atol=1e-5)
        extended = model.engine.extend(state.cache, model.item_tokens(tree.items[nodes]), torch.full((n,), REQUEST_TIME))
        torch.testing.assert_close(extended.keys[1][:, -n:], want_keys[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("max_nodes", [1, 24])
def test_speculative_greedy_with_pool_drafts_equals_plain_greedy(model, index, max_nodes):
    pool = SequencePool(max_ngram=2)
    users = [random_user(seed) for seed in range(10, 16)]
    for seed in range(4):  # pools of other users' generated slates and histories
        items, ts = users[seed]
        pool.add(items.tolist() + greedy(model, index, start(model, items, ts), 10, REQUEST_TIME).items)
    accepted = 0
    for items, ts in users:
        want = greedy(model, index, start(model, items, ts), 10, REQUEST_TIME)
        got = speculative_greedy(model, index, start(model, items, ts), 10, REQUEST_TIME,
                                 PoolDrafter(pool, max_depth=6, max_nodes=max_nodes))
        assert got.items == want.items
        # every pass yields its accepted drafts plus one item of its own (none after a full last branch)
        assert got.stats.passes + got.stats.accepted in (want.stats.passes, want.stats.passes + 1)
        accepted += got.stats.accepted
    assert accepted > 0, "the pool holds four of these users' own slates: some drafts must be accepted"


def test_speculative_greedy_with_a_draft_model_equals_plain_greedy(model, index):
    draft = make_model(num_layers=1, seed=5)
    draft.table = model.table  # same catalogue; a different, smaller network
    accepted = 0
    for seed in range(20, 24):
        items, ts = random_user(seed)
        want = greedy(model, index, start(model, items, ts), 12, REQUEST_TIME)
        drafter = ModelDrafter(draft, index, items, ts, REQUEST_TIME, max_depth=4)
        got = speculative_greedy(model, index, start(model, items, ts), 12, REQUEST_TIME, drafter)
        assert got.items == want.items
        accepted += got.stats.accepted
    self_drafter = ModelDrafter(model, index, items, ts, REQUEST_TIME, max_depth=4)
    got = speculative_greedy(model, index, start(model, items, ts), 12, REQUEST_TIME, self_drafter)
    assert got.items == want.items and got.stats.acceptance_rate == 1.0, "the target drafting itself is always right"


def test_relaxed_verification_accepts_more_and_keeps_items_within_the_target_top_k(model, index):
    items, ts = random_user(30)
    wrong = SequencePool(max_ngram=1)
    ranked = top_items(index.scores(start(model, items, ts).query.view(1, -1)),
                       torch.zeros(1, NUM_ITEMS, dtype=torch.bool).index_fill_(1, items, True), 3)[1][0].tolist()
    wrong.add([int(items[-1]), ranked[0]])
    strict = speculative_greedy(model, index, start(model, items, ts), 5, REQUEST_TIME, PoolDrafter(wrong))
    relaxed = speculative_greedy(model, index, start(model, items, ts), 5, REQUEST_TIME, PoolDrafter(wrong),
                                 verification=Relaxed(top_k=NUM_ITEMS, min_prob=0.0))
    assert relaxed.stats.accepted >= strict.stats.accepted
    assert len(relaxed.items) == 5 and len(set(relaxed.items)) == 5


def test_beam_of_width_one_is_greedy_and_sampling_is_reproducible(model, index):
    items, ts = random_user(40)
    want = greedy(model, index, start(model, items, ts), 5, REQUEST_TIME).items
    assert beam_search(model, index, start(model, items, ts), 5, REQUEST_TIME, width=1).items == want
    wide = beam_search(model, index, start(model, items, ts), 5, REQUEST_TIME, width=3)
    assert len(set(wide.items)) == 5 and not set(wide.items) & set(items.tolist())
    draws = [sample(model, index, start(model, items, ts), 5, REQUEST_TIME, temperature=0.5,
                    generator=torch.Generator().manual_seed(3)).items for _ in range(2)]
    assert draws[0] == draws[1] and not set(draws[0]) & set(items.tolist())


@pytest.mark.parametrize("cache_size,stride", [(1, 3), (8, 2), (NUM_ITEMS, 5)])
def test_speculative_retrieval_equals_exact_search(model, index, cache_size, stride):
    rollbacks = 0
    for seed in (50, 51, 52):
        items, ts = random_user(seed)
        want = greedy(model, index, start(model, items, ts), 9, REQUEST_TIME).items
        got = greedy_speculative_retrieval(model, index, start(model, items, ts), 9, REQUEST_TIME,
                                           SpeculativeRetrieval(cache_size, stride))
        assert got.items == want
        assert got.stats.verifications <= 9
        rollbacks += got.stats.rollbacks
    if cache_size == 1:
        assert rollbacks > 0, "a one-item local cache cannot answer every step: the exact check must roll back"
    if cache_size == NUM_ITEMS:
        assert rollbacks == 0, "a local cache of the whole catalogue is exact"
