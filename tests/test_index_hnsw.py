"""The approximate item index (FAISS HNSW) behind the ItemIndex calls: near-exact recall,
exclusions honoured, exact scores, and recommend through it equal to exact search on a small
catalogue."""

import pytest
import torch
import torch.nn.functional as F

from gr.index.exact import ExactIndex, exclusion_mask

pytest.importorskip("faiss")
from gr.index.hnsw import HNSWIndex  # noqa: E402


def test_hnsw_search_recalls_the_exact_top_items_and_never_returns_an_excluded_one():
    g = torch.Generator().manual_seed(0)
    items = F.normalize(torch.randn(3000, 32, generator=g), dim=-1)
    queries = F.normalize(torch.randn(40, 32, generator=g), dim=-1)
    exact, approx = ExactIndex(items), HNSWIndex(items)
    banned = set(range(0, 3000, 7))
    exclude = exclusion_mask(3000, 40, banned)
    _, want = exact.search(queries, exclude, 10)
    got_scores, got = approx.search(queries, exclude, 10)
    recall = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got, want, strict=True)) / want.numel()
    assert recall >= 0.95
    assert not set(got.flatten().tolist()) & banned
    torch.testing.assert_close(got_scores, (queries.unsqueeze(1) * items[got]).sum(-1))  # exact scores of its ids
    assert bool((got_scores[:, :-1] >= got_scores[:, 1:]).all())
    torch.testing.assert_close(approx.scores_of(queries, got[0]), exact.scores_of(queries, got[0]))


def test_hnsw_falls_back_to_exact_search_when_too_few_eligible_items_are_found():
    items = F.normalize(torch.randn(50, 8, generator=torch.Generator().manual_seed(1)), dim=-1)
    exclude = torch.ones(1, 50, dtype=torch.bool)
    exclude[0, [3, 41]] = False
    _, ids = HNSWIndex(items).search(items[:1], exclude, 2)
    _, want = ExactIndex(items).search(items[:1], exclude, 2)
    assert ids.tolist() == want.tolist()


def test_recommend_through_hnsw_equals_exact_search_on_a_small_catalogue(tmp_path):
    from gr.export import export_model
    from gr.serving import Ranker, RecommendRequest
    from helpers.models import build_generative_model, users

    path = export_model(build_generative_model(1, 3), tmp_path / "export")
    exact, approx = Ranker.load(path), Ranker.load(path, index="hnsw")
    assert type(approx.catalogue()[0].index).__name__ == "HNSWIndex"
    for user, history in users(4):
        want = exact.recommend(RecommendRequest(user, history, 8))
        got = approx.recommend(RecommendRequest(user, history, 8))
        assert got.items == want.items
        torch.testing.assert_close(torch.from_numpy(got.scores), torch.from_numpy(want.scores))
