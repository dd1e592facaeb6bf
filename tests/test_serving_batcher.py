"""The request batcher: rank requests in flight together run as one batch, each answered as if
alone; a bad request is refused before it joins a batch, a request that breaks its batch in any way
fails alone, and a dead worker thread fails every waiting request at once and says so."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from gr.export import export_model
from gr.serving import Ranker, RankRequest, RequestError
from gr.serving.batcher import BatcherDied, RequestBatcher
from gr.serving.errors import ScoringError
from helpers.models import (
    DENSE_DIMS,
    build_generative_model,
    build_ranking_model,
    random_batch,
    requests_from_batch,
)
from helpers.servers import recording_batcher


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
    want = [Ranker.load(path).rank(r) for r in requests]
    batcher, sizes = recording_batcher(Ranker.load(path, micro_batch=8), window_ms=200)
    got = concurrently(batcher, requests)
    assert max(sizes) > 1 and sum(sizes) == len(requests)
    for g, w in zip(got, want):
        for task in w.scores:
            np.testing.assert_allclose(g.scores[task], w.scores[task], rtol=0, atol=1e-5)


def test_a_bad_request_fails_alone_and_the_rest_of_its_batch_is_answered(served):
    path, requests = served
    bad = RankRequest(**{**vars(requests[1]), "candidates": {k: v[:0] for k, v in requests[1].candidates.items()}})
    batcher, sizes = recording_batcher(Ranker.load(path), window_ms=200, max_batch=3)
    got = concurrently(batcher, [requests[0], bad, requests[2]])
    assert sizes == [2], "the bad request is refused in its own thread and never joins"
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
    batcher, sizes = recording_batcher(ranker, window_ms=200, max_batch=3)
    got = concurrently(batcher, requests[:3])
    assert isinstance(got[1], ScoringError)
    assert all(np.isfinite(v).all() for g in (got[0], got[2]) for v in g.scores.values())


def test_a_lone_request_runs_at_once_and_arrivals_during_a_batch_form_the_next(served):
    path, requests = served
    batcher, sizes = recording_batcher(Ranker.load(path))  # no window: continuous batching
    assert batcher.rank(requests[0]).scores and sizes == [1]
    got = concurrently(batcher, requests)
    assert all(not isinstance(g, Exception) for g in got) and sum(sizes) == 1 + len(requests)


def test_window_and_batch_size_are_checked():
    with pytest.raises(ValueError, match="window_ms"):
        RequestBatcher(None, window_ms=-1)
    with pytest.raises(ValueError, match="max_batch"):
        RequestBatcher(None, max_batch=0)


def test_an_empty_retrieval_history_is_refused_before_it_can_fail_its_batch_mates(tmp_path):
    path = export_model(build_generative_model(1, 3), tmp_path / "retrieval")
    good = [
        RankRequest(f"u{i}", {"item_id": [1, 2, 3 + i], "timestamps": [1, 2, 3]}, {"item_id": [5, 6]}) for i in range(3)
    ]
    empty = RankRequest("e", {"item_id": [], "timestamps": []}, {"item_id": [5]})
    batcher, sizes = recording_batcher(Ranker.load(path), window_ms=200)
    got = concurrently(batcher, [good[0], empty, good[1], empty, good[2]])
    assert all(isinstance(got[i], RequestError) and "history: empty" in str(got[i]) for i in (1, 3))
    assert all(not isinstance(got[i], Exception) for i in (0, 2, 4)) and sum(sizes) == 3


def test_any_error_that_breaks_a_batch_fails_only_the_request_that_causes_it(served, monkeypatch):
    path, requests = served
    ranker = Ranker.load(path)
    run = ranker.run

    def breaks_on_nine_candidates(prepared, **options):
        if any(len(p.candidates["timestamps"]) == 9 for p in prepared):
            raise IndexError("a bug that only requests[1] triggers")
        return run(prepared, **options)

    monkeypatch.setattr(ranker, "run", breaks_on_nine_candidates)
    batcher, sizes = recording_batcher(ranker, window_ms=200, max_batch=3)
    got = concurrently(batcher, requests[:3])
    assert isinstance(got[1], IndexError) and sizes == [3]
    assert all(not isinstance(g, Exception) for g in (got[0], got[2]))
    assert not isinstance(batcher.rank(requests[0]), Exception) and batcher.death is None


def test_a_dead_worker_fails_waiting_and_later_requests_at_once_and_reports_its_death(served, monkeypatch):
    path, requests = served
    entered, deaths = threading.Event(), []

    def dies(self, batch):
        entered.set()
        raise KeyboardInterrupt  # a BaseException: nothing in _run may swallow it

    monkeypatch.setattr(RequestBatcher, "_run", dies)
    batcher = RequestBatcher(Ranker.load(path), window_ms=100, on_death=deaths.append)
    got = concurrently(batcher, requests[:3])
    assert entered.is_set() and all(isinstance(g, BatcherDied) for g in got)
    with pytest.raises(BatcherDied, match="the request batcher stopped"):
        batcher.rank(requests[0])
    assert len(deaths) == 1 and isinstance(deaths[0], KeyboardInterrupt)
