"""The IVF index: exact when every list is probed, high recall on clustered items when few are,
the same tie order as the exact index; speculative retrieval over it returns its greedy slate;
top_items (a top-k, not a sort) orders like a stable sort of the catalogue."""

import pytest
import torch
import torch.nn.functional as F

from gr.generation.decoding import greedy
from gr.generation.speculative_retrieval import SpeculativeRetrieval, greedy_speculative_retrieval
from gr.index.exact import ExactIndex, top_items
from gr.index.ivf import IVFIndex
from helpers.generation import REQUEST_TIME, TableModel, begin, make_model

pytestmark = pytest.mark.usefixtures("single_thread")


def clustered(num_items: int, dim: int, clusters: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, dim, generator=g)
    return F.normalize(
        centres[torch.randint(0, clusters, (num_items,), generator=g)] + 0.3 * torch.randn(num_items, dim, generator=g),
        dim=1,
    )


def test_top_items_orders_like_a_stable_sort_of_the_whole_catalogue():
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        m = int(torch.randint(1, 30, (1,), generator=g))
        scores = torch.randint(0, 4, (3, m), generator=g).float()  # many ties
        exclude = torch.rand(3, m, generator=g) < 0.3
        k = int(torch.randint(1, m + 1, (1,), generator=g))
        want = torch.sort(scores.masked_fill(exclude, float("-inf")), dim=1, descending=True, stable=True)
        got = top_items(scores, exclude, k)
        assert torch.equal(got[1], want.indices[:, :k]) and torch.equal(got[0], want.values[:, :k])


def test_probing_every_list_is_exact_and_few_lists_keep_high_recall():
    items = clustered(4000, 16, 40)
    queries = F.normalize(torch.randn(30, 16, generator=torch.Generator().manual_seed(1)), dim=1)
    exclude = torch.rand(30, 4000, generator=torch.Generator().manual_seed(2)) < 0.1
    exact = ExactIndex(items).search(queries, exclude, 10)
    full = IVFIndex(items, num_lists=32, probes=32, train_size=2000).search(queries, exclude, 10)
    assert torch.equal(full[1], exact[1]) and torch.allclose(full[0], exact[0])
    few = IVFIndex(items, num_lists=32, probes=4, train_size=2000)
    assert few.candidates(queries[0]).numel() < 4000 // 2
    _, found = few.search(queries, exclude, 10)
    recall = sum(len(set(a) & set(b)) for a, b in zip(found.tolist(), exact[1].tolist())) / exact[1].numel()
    assert recall > 0.8, recall
    assert not exclude.gather(1, found).any(), "excluded items are never returned"


def test_speculative_retrieval_over_an_ivf_index_returns_its_greedy_slate():
    base = make_model()
    items = clustered(3000, base.table.shape[1], 30)
    model = TableModel(base.engine, items)
    index = IVFIndex(items, num_lists=24, probes=3, train_size=3000)
    rollbacks = 0
    for seed in range(3):
        history = torch.randperm(3000, generator=torch.Generator().manual_seed(seed))[:12]
        ts = torch.arange(12) * 1000
        want = greedy(model, index, begin(model, history, ts), 8, REQUEST_TIME).items
        got = greedy_speculative_retrieval(
            model, index, begin(model, history, ts), 8, REQUEST_TIME, SpeculativeRetrieval(cache_size=4, stride=3)
        )
        assert got.items == want
        rollbacks += got.stats.rollbacks
    assert rollbacks > 0, "a 4-item local cache must miss sometimes: the batched check rolls back"
