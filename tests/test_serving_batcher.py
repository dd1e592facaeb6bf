"""The request batcher: rank requests in flight together run as one batch, each answered as if
alone; a bad request fails alone and a non-finite one does not take the batch down."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from gr.export import export_model
from gr.serving import Ranker, RankRequest, RequestError
from gr.serving.batcher import RankBatcher
from gr.serving.errors import ScoringError
from helpers.models import DENSE_DIMS, build_ranking_model, random_batch, requests_from_batch


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = build_ranking_model(max_seq_len=40)
    path = export_model(model, tmp_path_factory.mktemp("batcher") / "export", dense_dims=DENSE_DIMS)
    requests = [
        RankRequest(**r)
        for r in requests_from_batch(random_batch(model, [30, 17, 8, 22, 12, 9], [5, 9, 1, 3, 2, 4], seed=4))
    ]
    return path, requests


def concurrently(batcher, requests):
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(batcher.rank, r) for r in requests]
        return [f.exception() or f.result() for f in futures]


def test_concurrent_requests_run_as_one_batch_and_score_as_if_alone(served):
    path, requests = served
    want = [Ranker.load(path).rank_request(r) for r in requests]
    batcher = RankBatcher(Ranker.load(path, micro_batch=8), window_ms=200)
    got = concurrently(batcher, requests)
    assert max(batcher.batch_sizes) > 1 and sum(batcher.batch_sizes) == len(requests)
    for g, w in zip(got, want):
        for task in w.scores:
            np.testing.assert_allclose(g.scores[task], w.scores[task], rtol=0, atol=1e-5)


def test_a_bad_request_fails_alone_and_the_rest_of_its_batch_is_answered(served):
    path, requests = served
    bad = RankRequest(**{**vars(requests[1]), "candidates": {k: v[:0] for k, v in requests[1].candidates.items()}})
    batcher = RankBatcher(Ranker.load(path), window_ms=200, max_batch=3)
    got = concurrently(batcher, [requests[0], bad, requests[2]])
    assert batcher.batch_sizes == [3]
    assert isinstance(got[1], RequestError) and "candidates" in str(got[1])
    assert all(not isinstance(g, Exception) for g in (got[0], got[2]))


def test_non_finite_scores_fail_only_the_request_that_produces_them(served, monkeypatch):
    path, requests = served
    ranker = Ranker.load(path)
    heads = ranker.model.heads_batch

    def poisoned(hidden, commons, rows):  # the rows of requests[1] (its 9 candidates) come out NaN
        hidden, start = hidden.clone(), 0
        for n in rows:
            if n == 9:
                hidden[start : start + n] = float("nan")
            start += n
        return heads(hidden, commons, rows)

    monkeypatch.setattr(ranker.model, "heads_batch", poisoned)
    batcher = RankBatcher(ranker, window_ms=200, max_batch=3)
    got = concurrently(batcher, requests[:3])
    assert isinstance(got[1], ScoringError)
    assert all(np.isfinite(v).all() for g in (got[0], got[2]) for v in g.scores.values())


def test_a_lone_request_runs_at_once_and_arrivals_during_a_batch_form_the_next(served):
    path, requests = served
    batcher = RankBatcher(Ranker.load(path))  # no window: continuous batching
    assert batcher.rank(requests[0]).scores and batcher.batch_sizes == [1]
    got = concurrently(batcher, requests)
    assert all(not isinstance(g, Exception) for g in got) and sum(batcher.batch_sizes) == 1 + len(requests)


def test_window_and_batch_size_are_checked():
    with pytest.raises(ValueError, match="window_ms"):
        RankBatcher(None, window_ms=-1)
    with pytest.raises(ValueError, match="max_batch"):
        RankBatcher(None, max_batch=0)
