"""Batched retrieval: ``rank`` and ``recommend`` of a list of requests to a retrieval export (users' histories
encoded and extended in shared passes, one settle pass, one postfix run, one catalogue search per k)
answer every request as ``rank`` and ``recommend`` answer it alone, cache statuses included, with
the exact and the HNSW index, for queries at the token and at the next event; the request batcher
runs concurrent recommend requests as one batch."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from gr import GRModel, HSTUConfig, TableConfig
from gr.export import export_model
from gr.postfix_dnn import RetrievalHead
from gr.prefix_dnn import MLPTokenEncoder
from gr.serving import Ranker, RankRequest, RecommendRequest
from helpers.models import HSTU_KW, NUM_ITEMS, perturb
from helpers.servers import recording_batcher

pytestmark = pytest.mark.usefixtures("single_thread")


def build_model(query_time: str) -> GRModel:
    tables = [TableConfig("item", NUM_ITEMS, 16, ("item_id",))]
    cfg = HSTUConfig(**{**HSTU_KW, "query_time": query_time})
    head = RetrievalHead(16, 16, mlp_dims=(20,))
    return perturb(GRModel(cfg, MLPTokenEncoder({"item_id": 16}, 16, mlp_dims=(24,)), head, tables), seed=7)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval-batch")
    return {q: export_model(build_model(q), root / q) for q in ("token", "next_event")}


def histories(seed: int = 0):
    """Six users (one twice, the second time with two more actions), histories of 3 to 30 items."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for u, length in enumerate((3, 30, 12, 7, 21, 9)):
        items = torch.randperm(NUM_ITEMS, generator=g)[:length].numpy()
        out.append((f"u{u}", {"item_id": items, "timestamps": np.arange(length) * 60 + 1000}))
    longer = {k: np.concatenate([v, v[-2:] + (0 if k == "item_id" else 120)]) for k, v in out[2][1].items()}
    return [*out, ("u2", longer)]


def requests():
    recommend = [
        RecommendRequest(user, history, k=3 + 2 * (i % 2), request_time=5000 + i, exclude_seen=i != 3)
        for i, (user, history) in enumerate(histories())
    ]
    rank = [
        RankRequest(user, history, {"item_id": np.arange(i, NUM_ITEMS, 7)}, request_time=5000 + i)
        for i, (user, history) in enumerate(histories())
    ]
    return recommend, rank


def warm(ranker):
    """u1's cache holds the first 20 of its 30 actions: it is extended in the batch."""
    user, history = histories()[1]
    ranker.rank(user, {k: v[:20] for k, v in history.items()}, {"item_id": [1]}, request_time=10**4)


@pytest.mark.parametrize("index", ["exact", "hnsw"])
@pytest.mark.parametrize("query_time", ["token", "next_event"])
def test_a_batch_of_retrieval_requests_answers_each_as_it_is_answered_alone(exports, query_time, index):
    recommend, rank = requests()
    alone, batched = (Ranker.load(exports[query_time], index=index) for _ in range(2))
    warm(alone)
    warm(batched)
    want = [alone.recommend(r) for r in recommend]
    got = batched.recommend(recommend)
    assert (
        [g.cache_status for g in got]
        == [w.cache_status for w in want]
        == [
            "miss",
            "extend",
            "miss",
            "miss",
            "miss",
            "miss",
            "extend",
        ]
    )
    for g, w in zip(got, want):
        assert g.items == w.items and len(g.items) in (3, 5)
        np.testing.assert_allclose(g.scores, w.scores, rtol=0, atol=1e-6)
    want = [alone.rank(r) for r in rank]
    got = batched.rank(rank)
    statuses = ["hit", "hit", "miss", "hit", "hit", "hit", "extend"]  # u2's shorter history is no longer cached
    assert [g.cache_status for g in got] == [w.cache_status for w in want] == statuses
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.scores["retrieval"], w.scores["retrieval"], rtol=0, atol=1e-6)
    uncached = batched.rank(rank, use_cache=False)
    assert {u.cache_status for u in uncached} == {"off"}
    for u, w in zip(uncached, want):
        np.testing.assert_allclose(u.scores["retrieval"], w.scores["retrieval"], rtol=0, atol=1e-5)


def test_concurrent_recommend_requests_run_as_one_batch_through_the_batcher(exports):
    recommend, _ = requests()
    want = [Ranker.load(exports["token"]).recommend(r) for r in recommend]
    batcher, sizes = recording_batcher(Ranker.load(exports["token"]), window_ms=200)
    with ThreadPoolExecutor(len(recommend)) as pool:
        got = list(pool.map(batcher.recommend, recommend))
    assert max(sizes) > 1 and sum(sizes) == len(recommend)
    assert [g.items for g in got] == [w.items for w in want]
