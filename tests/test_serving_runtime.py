"""The serving runtime: cached = uncached = trained scores, user cache (appends, LRU by bytes,
reload, threads), bad requests, batch form and CLI; and the HSTU slice and the runtime loading
and scoring in a process that cannot import the training code (an import guard refuses
torchrec, lightning and gr.model/train/data/sparse/DNNs)."""

import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from gr.commands.serve import main as serving_main
from gr.export import export_model
from gr.export.manifest import write_manifest
from gr.hstu.cache import TIMESTAMP_BYTES, cache_bytes_per_token
from gr.serving import Ranker, RankRequest, RequestError, UserCache
from gr.serving.history_store import SqliteHistoryStore
from gr.serving.limits import RequestLimits
from gr.serving.scores import ranking_scores
from gr.serving.user_cache import kept_bytes
from helpers.models import (
    DENSE_DIMS,
    as_served,
    build_ranking_model,
    random_batch,
    rank_all,
    requests_from_batch,
)

ATOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]
# The import guard of the standalone test: training code a serving process must never load.
BLOCKED = (
    "torchrec",
    "fbgemm_gpu",
    "lightning",
    "pytorch_lightning",
    "gr.model",
    "gr.train",
    "gr.data",
    "gr.sparse",
    "gr.prefix_dnn",
    "gr.postfix_dnn",
    "gr.export.writer",
)
# ...except the id-map format (numpy only, behind gr.data's lazy package init): serving reads raw ids with it.
ALLOWED = ("gr.data", "gr.data.mappings", "gr.data.popularity")  # file formats an export shares with a run

SCRIPT = r"""
import importlib.abc, json, sys
import numpy as np

BLOCKED, ALLOWED = (tuple(names) for names in json.loads(sys.argv[1]))

def blocked(name):
    return name not in ALLOWED and any(name == b or name.startswith(b + ".") for b in BLOCKED)

class Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if blocked(name):
            raise ImportError(f"import guard: {name} is training code")
        return None

sys.meta_path.insert(0, Guard())
import torch
from gr.export import load_hstu
from gr.serving import Ranker

export_dir, work = sys.argv[2], sys.argv[3]
inputs = np.load(f"{work}/hstu_inputs.npz")
hstu = load_hstu(export_dir)
with torch.no_grad():
    hidden = hstu(torch.from_numpy(inputs["x"]), torch.from_numpy(inputs["offsets"]), int(inputs["max_len"]),
                  torch.from_numpy(inputs["timestamps"]), torch.from_numpy(inputs["num_targets"]))
ranker = Ranker.load(export_dir, micro_batch=2)
scores = {}
for request in json.load(open(f"{work}/requests.json")):
    result = ranker.rank(request["user_id"], request["history"], request["candidates"], request["common_features"])
    for task, value in result.scores.items():
        scores.setdefault(task, []).append(value)
leaked = sorted(m for m in sys.modules if blocked(m))
np.savez(f"{work}/out.npz", hidden=hidden.numpy(), **{k: np.concatenate(v) for k, v in scores.items()})
print(json.dumps({"leaked": leaked}))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = build_ranking_model(max_seq_len=40, contextual_len=1)
    return model, export_model(model, tmp_path_factory.mktemp("serving") / "export", dense_dims=DENSE_DIMS)


@pytest.fixture(scope="module")
def users(exported):
    """Test users: a batch, the trained model's predictions on it as served (probabilities and
    logits, ``as_served``), and one request per user."""
    model, _ = exported
    batch = random_batch(model, [30, 17, 40, 9], [5, 9, 2, 6], seed=7)
    with torch.no_grad():
        predictions = as_served(model(batch).predictions)
    return predictions, requests_from_batch(batch)


def slice_history(request, end):
    return {**request, "history": {k: v[:end] for k, v in request["history"].items()}}


def rank(ranker, request, **kwargs):
    return ranker.rank(
        request["user_id"], request["history"], request["candidates"], request["common_features"], **kwargs
    )


def test_cached_uncached_and_trained_scores_agree_for_every_micro_batch(exported, users):
    _, path = exported
    want, requests = users
    for micro_batch in (1, 4, 1000):
        ranker = Ranker.load(path, micro_batch=micro_batch)
        cold = rank_all(ranker, requests)
        warm = rank_all(ranker, requests)
        uncached = rank_all(ranker, requests, use_cache=False)
        for task in want:
            np.testing.assert_allclose(cold[task], want[task], rtol=0, atol=ATOL)
            np.testing.assert_allclose(warm[task], want[task], rtol=0, atol=ATOL)
            np.testing.assert_allclose(uncached[task], want[task], rtol=0, atol=ATOL)


def test_a_missed_history_runs_its_candidates_in_its_encoding_pass_when_they_fit_a_micro_batch(exported, users):
    """A history encoded from scratch scores its candidates in the encoding pass, unless they are more
    than micro_batch (then they are scored against its cache in passes of micro_batch); a cached
    history always scores them against its cache. Scores equal the trained model's either way."""
    _, path = exported
    want, requests = users  # 5, 9, 2 and 6 candidates
    ranker = Ranker.load(path, micro_batch=6)
    engine, passes = ranker.model.engine, []
    score_batch = engine.score_batch
    engine.score_batch = lambda caches, x, *args: passes.append(x.shape[0]) or score_batch(caches, x, *args)
    cold = rank_all(ranker, requests)
    assert passes == [9]  # the one user whose candidates do not fit
    warm = rank_all(ranker, requests)
    assert passes == [9, 5, 9, 2, 6]
    for task in want:
        np.testing.assert_allclose(cold[task], want[task], rtol=0, atol=ATOL)
        np.testing.assert_allclose(warm[task], want[task], rtol=0, atol=ATOL)


def test_new_actions_extend_the_cached_history_and_match_the_trained_model(exported, users):
    _, path = exported
    want, requests = users
    ranker = Ranker.load(path, micro_batch=3)
    request = requests[0]  # 25 history tokens, 5 candidates
    assert rank(ranker, slice_history(request, 18)).cache_status == "miss"
    cached = ranker.cache.get(request["user_id"])
    assert cached.cache.length == 18
    assert rank(ranker, slice_history(request, 19)).cache_status == "extend"
    result = rank(ranker, request)
    assert result.cache_status == "extend" and ranker.cache.get(request["user_id"]).cache.length == 25
    for task in want:
        np.testing.assert_allclose(result.scores[task], want[task][:5], rtol=0, atol=ATOL)
    assert rank(ranker, request).cache_status == "hit"
    edited = {**request, "history": {**request["history"], "item_id": request["history"]["item_id"].copy()}}
    edited["history"]["item_id"][3] = (edited["history"]["item_id"][3] + 1) % 50
    assert rank(ranker, edited).cache_status == "miss", "a changed past action must not reuse the cache"


def test_ranking_scores_are_stable_probabilities_next_to_their_logits():
    logits = {"click": np.array([-1000.0, -2.0, 0.0, 3.0, 1000.0], dtype=np.float32)}
    scores = ranking_scores(logits)
    assert list(scores) == ["click", "click_logit"] and scores["click"].dtype == np.float32
    np.testing.assert_array_equal(scores["click_logit"], logits["click"])
    np.testing.assert_allclose(scores["click"], [0.0, 0.11920292, 0.5, 0.95257413, 1.0], rtol=1e-6, atol=0)


def test_next_event_models_rank_as_trained_cached_extended_and_uncached(tmp_path):
    """query_time "next_event": the last history token's output depends on the request time, so
    the cache keeps it pending and each request settles it; scores still equal the trained model's."""
    model = build_ranking_model(max_seq_len=40, query_time="next_event")
    path = export_model(model, tmp_path / "export", dense_dims=DENSE_DIMS)
    batch = random_batch(model, [30, 17], [5, 9], seed=8)
    with torch.no_grad():
        want = as_served(model(batch).predictions)
    requests = requests_from_batch(batch)
    ranker = Ranker.load(path, micro_batch=2)
    assert rank(ranker, slice_history(requests[0], 20)).cache_status == "miss"
    assert ranker.cache.get(requests[0]["user_id"]).cache.pending is not None
    results = [rank_all(ranker, requests), rank_all(ranker, requests), rank_all(ranker, requests, use_cache=False)]
    for task in want:
        for got in results:  # extended + miss, hits, one pass
            np.testing.assert_allclose(got[task], want[task], rtol=0, atol=ATOL)


def test_user_cache_keeps_at_most_its_byte_bound_and_evicts_the_least_recently_used(exported, users):
    _, path = exported
    _, requests = users
    ranker = Ranker.load(path)
    config = ranker.model.config
    sizes = {}
    for r in requests:
        rank(ranker, r)
        sizes[r["user_id"]] = kept_bytes(r["user_id"], ranker.cache.get(r["user_id"]))
        history_bytes = ranker.cache.get(r["user_id"]).cache.nbytes
        length, page = len(r["history"]["timestamps"]), ranker.page_size  # K/V in whole pages, a timestamp a token
        kv_per_token = cache_bytes_per_token(config) - TIMESTAMP_BYTES
        assert history_bytes == -(-length // page) * page * kv_per_token + length * TIMESTAMP_BYTES
    u0, u1, u2, u3 = (r["user_id"] for r in requests)
    bound = sizes[u0] + sizes[u1] + sizes[u2] - 1  # the three first users do not fit together
    ranker = Ranker.load(path, cache_bytes=bound)
    for r in requests[:3]:
        rank(ranker, r)
    assert ranker.cache.users() == [u1, u2] and ranker.cache.nbytes <= bound
    rank(ranker, requests[1])  # u1 becomes the most recently used ...
    rank(ranker, requests[0])  # ... so u2 is evicted for u0
    assert ranker.cache.users() == [u1, u0] and ranker.cache.nbytes == sizes[u1] + sizes[u0]
    tiny = Ranker.load(path, cache_bytes=sizes[u3] - 1)
    assert rank(tiny, requests[3]).cache_status == "miss" and len(tiny.cache) == 0, (
        "an entry above the bound is not kept"
    )


def test_the_cache_bound_counts_each_users_id_as_well_as_its_history(exported, users):
    _, path = exported
    _, requests = users
    long_ids = [f"{i}-" + "x" * 300_000 for i in range(6)]  # 300 KB ids (a service refuses them: max_user_id_bytes)
    ranker = Ranker.load(path, cache_bytes=1_000_000, limits=RequestLimits(max_user_id_bytes=400_000))
    for user in long_ids:
        rank(ranker, {**requests[0], "user_id": user})
    assert len(ranker.cache) == 3 and ranker.cache.nbytes <= 1_000_000
    assert ranker.cache.nbytes == sum(kept_bytes(u, ranker.cache.get(u)) for u in ranker.cache.users())


def test_reload_invalidates_the_cache_and_stale_entries_are_refused(exported, users, tmp_path):
    _, path = exported
    _, requests = users
    newer = tmp_path / "newer"  # the same export with different HSTU weights: a "newer model"
    shutil.copytree(path, newer)
    weights = load_file(str(newer / "hstu/model.safetensors"))
    weights["layers.1.o_proj.bias"] += 0.5
    save_file(weights, str(newer / "hstu/model.safetensors"))
    write_manifest(newer)
    ranker = Ranker.load(path)
    before = rank(ranker, requests[0]).scores["click"]
    version = ranker.cache.model_version
    stale = ranker.cache.get(requests[0]["user_id"])
    ranker.reload(newer)
    assert len(ranker.cache) == 0 and ranker.cache.model_version == version + 1
    after = rank(ranker, requests[0])
    assert after.cache_status == "miss" and not np.allclose(after.scores["click"], before, atol=1e-3)
    np.testing.assert_allclose(
        after.scores["click"], rank(Ranker.load(newer), requests[0]).scores["click"], rtol=0, atol=ATOL
    )
    assert not ranker.cache.put("late", stale, version), "an entry computed before the reload is refused"


def test_concurrent_requests_give_the_sequential_results(exported, users):
    _, path = exported
    want, requests = users
    sequential = [rank(Ranker.load(path), r).scores for r in requests]
    ranker = Ranker.load(path, cache_bytes=2 * 40 * cache_bytes_per_token(Ranker.load(path).model.config))
    jobs = [requests[i % len(requests)] for i in range(24)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda r: (r["user_id"], rank(ranker, r)), jobs))
    index = {r["user_id"]: i for i, r in enumerate(requests)}
    for user, result in results:
        for task, value in sequential[index[user]].items():
            np.testing.assert_allclose(result.scores[task], value, rtol=0, atol=ATOL)
    assert ranker.cache.nbytes <= ranker.cache.max_bytes
    assert {res.cache_status for _, res in results} <= {"miss", "hit"}


def test_a_paged_ranker_answers_as_the_unpaged_one_to_the_bit(exported, users):
    """Histories kept in K/V pages (encoded, then extended a few actions at a time) give exactly the
    scores of histories kept in their own tensors; the pool counts the pages they hold."""
    _, path = exported
    _, requests = users
    paged, unpaged = Ranker.load(path, page_size=4), Ranker.load(path, page_size=0)
    for end in (5, 6, 9, 40):
        for r in requests:
            got, want = rank(paged, slice_history(r, end)), rank(unpaged, slice_history(r, end))
            assert got.cache_status == want.cache_status
            for task, value in want.scores.items():
                np.testing.assert_array_equal(got.scores[task], value)
    assert all(paged.cache.get(r["user_id"]).cache.paged is not None for r in requests)
    used, free = paged.pages()
    pages = sum(-(-len(r["history"]["timestamps"]) // 4) for r in requests)
    assert used == pages and used + free == paged.model.engine.pool.pages
    assert unpaged.pages() == (0, 0)


def test_a_full_page_pool_evicts_least_recently_used_users_and_a_reload_frees_every_page(exported, users):
    _, path = exported
    _, requests = users
    config = Ranker.load(path).model.config
    page_bytes = 4 * (cache_bytes_per_token(config) - TIMESTAMP_BYTES)
    ranker = Ranker.load(path, page_size=4, cache_bytes=20 * page_bytes)  # 20 pages: two users of 40 tokens do not fit
    for r in requests:
        rank(ranker, r)
    used, free = ranker.pages()
    assert used + free == 20 and used <= 20
    assert ranker.cache.users()[-1] == requests[-1]["user_id"]
    assert ranker.cache.get(requests[-1]["user_id"]).cache.paged is not None
    old_pool = ranker.model.engine.pool
    ranker.reload(path)
    assert len(ranker.cache) == 0 and old_pool.used == 0, "a reload frees every page"
    assert ranker.pages() == (0, 20)


BAD_REQUESTS = {
    "unknown feature": (
        lambda r: {**r, "candidates": {**r["candidates"], "colour": [1] * 5}},
        r"candidates: unknown feature.*colour",
    ),
    "id out of range": (
        lambda r: {**r, "candidates": {**r["candidates"], "item_id": np.array([1, 2, 50, 3, 4])}},
        r"candidates\.item_id: ids \[50\] out of range \[0, 50\)",
    ),
    "common id out of range": (
        lambda r: {**r, "common_features": {**r["common_features"], "user_id": [-1]}},
        r"common_features\.user_id: ids \[-1\] out of range",
    ),
    "empty candidates": (
        lambda r: {**r, "candidates": {k: v[:0] for k, v in r["candidates"].items()}},
        "candidates.*empty",
    ),
    "missing feature": (
        lambda r: {**r, "history": {k: v for k, v in r["history"].items() if k != "genre"}},
        r"history: missing feature.*genre",
    ),
    "ragged columns": (
        lambda r: {**r, "history": {**r["history"], "genre": r["history"]["genre"][:-1]}},
        "different lengths",
    ),
    "wrong dense dim": (
        lambda r: {**r, "common_features": {**r["common_features"], "user_score": [0.5]}},
        r"user_score: expected 2 floats",
    ),
    "float ids": (lambda r: {**r, "history": {**r["history"], "item_id": r["history"]["item_id"] + 0.5}}, "integers"),
}


@pytest.mark.parametrize("kind", list(BAD_REQUESTS))
def test_bad_requests_are_clear_errors_and_leave_the_cache_untouched(exported, users, kind):
    _, path = exported
    want, requests = users
    ranker = Ranker.load(path)
    request = requests[0]
    rank(ranker, request)
    entry, size = ranker.cache.get(request["user_id"]), ranker.cache.nbytes
    corrupt, message = BAD_REQUESTS[kind]
    with pytest.raises(RequestError, match=message):
        rank(ranker, corrupt(request))
    assert ranker.cache.get(request["user_id"]) is entry and ranker.cache.nbytes == size
    again = rank(ranker, request)
    assert again.cache_status == "hit"
    np.testing.assert_allclose(again.scores["click"], want["click"][:5], rtol=0, atol=ATOL)


def test_history_longer_than_max_seq_len_is_truncated_and_reported_or_refused(exported, users):
    model, path = exported
    _, requests = users
    request = requests[2]  # 38 history tokens; make 45 > max_seq_len = 40
    long = {**request, "history": {k: np.concatenate([v[:7], v]) for k, v in request["history"].items()}}
    long["history"]["timestamps"] = np.sort(long["history"]["timestamps"])
    with pytest.raises(RequestError, match="45 tokens exceed the model's max_seq_len 40"):
        rank(Ranker.load(path, long_history="refuse"), long)
    result = rank(Ranker.load(path), long)
    assert result.truncated == 5 and result.history_length == 40
    assert "truncated" in result.to_json()["warnings"][0]
    kept = {**long, "history": {k: v[5:] for k, v in long["history"].items()}}
    np.testing.assert_allclose(
        result.scores["like"], rank(Ranker.load(path), kept, use_cache=False).scores["like"], rtol=0, atol=ATOL
    )


def test_a_batch_of_histories_validates_as_each_one_alone_and_a_bad_one_is_named(exported, users):
    """Ranker.histories of the users' histories back to back: each History as Ranker.history gives it;
    a history out of order or past the token limit is named by its index (the histories' own
    boundaries going back in time are not refused), an id out of range by its feature."""
    _, path = exported
    _, requests = users
    ranker = Ranker.load(path)
    names = list(requests[0]["history"])
    columns = {name: np.concatenate([r["history"][name] for r in requests]) for name in names}
    offsets = np.cumsum([0, *(len(r["history"]["timestamps"]) for r in requests)])
    ts = columns["timestamps"]
    assert (ts[offsets[1:-1]] < ts[offsets[1:-1] - 1]).any()  # a history starts before the last one ends
    user_ids, commons = [r["user_id"] for r in requests], [r["common_features"] for r in requests]
    together = ranker.histories(user_ids, columns, offsets, commons)
    for got, request in zip(together, requests):
        alone = ranker.history(request["user_id"], request["history"], request["common_features"])
        assert (got.user_id, got.truncated, got.model_version) == (alone.user_id, alone.truncated, alone.model_version)
        for name in (*alone.tokens, *alone.common):
            want, have = alone.tokens.get(name, alone.common.get(name)), got.tokens.get(name, got.common.get(name))
            np.testing.assert_array_equal(have, want)
    backwards = {**columns, "timestamps": ts.copy()}
    backwards["timestamps"][offsets[2] + 3] = backwards["timestamps"][offsets[2] + 2] - 1
    with pytest.raises(RequestError, match=r"history\[2\]\.timestamps: out of order: \[3\]"):
        ranker.histories(user_ids, backwards, offsets, commons)
    limited = Ranker.load(path, limits=RequestLimits(max_history_tokens=30))
    with pytest.raises(RequestError, match=r"history\[2\]: 38 tokens exceed the limit 30"):
        limited.histories(user_ids, columns, offsets, commons)
    bad_id = {**columns, "item_id": columns["item_id"].copy()}
    bad_id["item_id"][offsets[3]] = 50
    with pytest.raises(RequestError, match=r"history\.item_id: ids \[50\] out of range"):
        ranker.histories(user_ids, bad_id, offsets, commons)
    with pytest.raises(ValueError, match="3 users, 4 common features and 4 histories"):
        ranker.histories(user_ids[:3], columns, offsets, commons)


def test_batch_form_and_cli_print_scores_per_task(exported, users, tmp_path, capsys):
    _, path = exported
    want, requests = users
    ranker = Ranker.load(path)
    results = ranker.rank([RankRequest(**r) for r in requests])
    np.testing.assert_allclose(np.concatenate([r.scores["click"] for r in results]), want["click"], rtol=0, atol=ATOL)
    with pytest.raises(RequestError, match=r"requests\[1\]: candidates.*empty"):
        no_candidates = {k: v[:0] for k, v in requests[1]["candidates"].items()}
        ranker.rank([RankRequest(**requests[0]), RankRequest(**{**requests[1], "candidates": no_candidates})])

    def as_json(r):
        return {
            **r,
            "history": {k: v.tolist() for k, v in r["history"].items()},
            "candidates": {k: v.tolist() for k, v in r["candidates"].items()},
            "common_features": {k: v.tolist() for k, v in r["common_features"].items()},
        }

    file = tmp_path / "request.json"
    file.write_text(json.dumps(as_json(requests[1])))
    assert serving_main(["rank", str(path), "--request", str(file), "--micro-batch", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["user_id"] == requests[1]["user_id"] and set(printed["scores"]) == set(want)
    np.testing.assert_allclose(printed["scores"]["like"], want["like"][5:14], rtol=0, atol=ATOL)
    bad = as_json(requests[1])
    bad["candidates"]["item_id"][0] = 999
    file.write_text(json.dumps([as_json(requests[0]), bad]))
    assert serving_main(["rank", str(path), "--request", str(file)]) == 2
    printed = json.loads(capsys.readouterr().out)
    assert "scores" in printed[0] and "out of range" in printed[1]["error"] and "request[1]" in printed[1]["error"]


def test_user_cache_is_thread_safe_under_concurrent_puts():
    class Entry:
        def __init__(self, nbytes):
            self.nbytes = nbytes

    bound = 10 * kept_bytes(0, Entry(40))  # about ten of the 37 users fit
    cache = UserCache(max_bytes=bound)
    version = cache.model_version

    def worker(offset):
        for i in range(300):
            cache.put((offset + i) % 37, Entry(10 + (i % 7) * 10), version)
            cache.get((offset * 3 + i) % 37)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.nbytes == sum(kept_bytes(u, cache.get(u)) for u in cache.users()) <= bound


def test_hstu_and_ranker_work_in_a_process_without_training_code(exported, tmp_path):
    model, export_dir = exported
    batch = random_batch(model, [14, 6, 21], [3, 2, 4], seed=11)
    with torch.no_grad():
        want_scores = as_served(model(batch).predictions)
        x = torch.randn(int(batch.seq_offsets[-1]), 16)
        want_hidden = model.hstu(x, batch.seq_offsets, batch.max_seq_len, batch.timestamps, batch.num_targets)
    np.savez(
        tmp_path / "hstu_inputs.npz",
        x=x.numpy(),
        offsets=batch.seq_offsets.numpy(),
        max_len=batch.max_seq_len,
        timestamps=batch.timestamps.numpy(),
        num_targets=batch.num_targets.numpy(),
    )
    parts = ("history", "candidates", "common_features")
    requests = [
        {**r, **{part: {k: v.tolist() for k, v in r[part].items()} for part in parts}}
        for r in requests_from_batch(batch)
    ]
    (tmp_path / "requests.json").write_text(json.dumps(requests))

    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps([BLOCKED, ALLOWED]), str(export_dir), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"leaked": []}
    out = np.load(tmp_path / "out.npz")
    np.testing.assert_allclose(out["hidden"], want_hidden.numpy(), rtol=0, atol=1e-5)
    for task, value in want_scores.items():
        np.testing.assert_allclose(out[task], value, rtol=0, atol=1e-5)


def test_the_import_guard_refuses_training_code():
    for module in ("gr.model", "gr.data.datamodule"):
        probe = SCRIPT.split("import torch")[0] + f"import {module}\n"
        run = subprocess.run(
            [sys.executable, "-c", probe, json.dumps([BLOCKED, ALLOWED])],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
        )
        assert run.returncode != 0 and f"import guard: {module} is training code" in run.stderr


def _imports(path: Path) -> set:
    import ast

    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_generation_never_imports_the_serving_runtime_and_generate_not_the_ranker():
    for path in sorted((ROOT / "gr" / "generation").glob("*.py")):
        assert not any(name.startswith("gr.serving") for name in _imports(path)), path
    for module in ("generate", "history", "catalogue", "model"):
        assert not any(
            name.startswith("gr.serving.runtime") for name in _imports(ROOT / "gr" / "serving" / f"{module}.py")
        )


@pytest.mark.slow
@pytest.mark.parametrize("block", [1, 4])
def test_long_histories_are_evicted_in_blocks_and_the_cache_survives_between_them(block, tmp_path):
    """max_seq_len 8: a history streamed one action at a time is re-encoded only when its window
    start moves (once per ``eviction_block`` actions, not on every action past 8), and every
    served score equals the one-pass scores of the window training draws (``window_starts``)."""
    from gr.data.sequences import window_starts

    model = build_ranking_model(max_seq_len=8, eviction_block=block)
    path = export_model(model, tmp_path / "export", dense_dims=DENSE_DIMS)
    request = requests_from_batch(random_batch(model, [23], [3], seed=5))[0]  # 20 history actions, 3 candidates
    ranker = Ranker.load(path, micro_batch=2)
    statuses = []
    for length in range(1, 21):
        start = int(window_starts(np.array([0]), np.array([length]), 8, block)[0])
        served = rank(ranker, slice_history(request, length))
        assert served.truncated == start and served.history_length == length - start
        window = {**request, "history": {k: v[start:length] for k, v in request["history"].items()}}
        one_pass = rank(ranker, window, use_cache=False)
        for task, value in one_pass.scores.items():
            np.testing.assert_allclose(served.scores[task], value, rtol=0, atol=ATOL)
        statuses.append(served.cache_status)
    misses = [length for length, status in enumerate(statuses, start=1) if status == "miss"]
    assert misses == ([1, *range(9, 21)] if block == 1 else [1, 9, 13, 17])
    assert set(statuses) - {"miss"} == {"extend"}


@pytest.mark.parametrize("query_time", ["token", "next_event"])
def test_a_batch_of_users_scores_exactly_as_one_user_at_a_time(query_time, tmp_path):
    """rank of a list packs several users' candidates into shared HSTU passes (micro_batch 4 splits one
    user's 9 candidates and packs others together) and one postfix run: the scores equal ``rank``."""
    model = build_ranking_model(max_seq_len=40, query_time=query_time)
    path = export_model(model, tmp_path / "export", dense_dims=DENSE_DIMS)
    requests = requests_from_batch(random_batch(model, [30, 17, 8, 22], [5, 9, 1, 3], seed=11))
    one_by_one = Ranker.load(path, micro_batch=4)
    want = [rank(one_by_one, r) for r in requests]
    batched = Ranker.load(path, micro_batch=4)
    rank(batched, slice_history(requests[0], 20))  # one user's cache holds a prefix: extended in the batch
    got = batched.rank([RankRequest(**r) for r in requests])
    assert [g.cache_status for g in got] == ["extend", "miss", "miss", "miss"]
    for g, w in zip(got, want):
        assert g.scores.keys() == w.scores.keys()
        for task in w.scores:
            np.testing.assert_allclose(g.scores[task], w.scores[task], rtol=0, atol=ATOL)
    assert [g.cache_status for g in batched.rank([RankRequest(**r) for r in requests])] == ["hit"] * 4


@pytest.mark.parametrize("history_events", [None, 12])
def test_a_reload_carries_the_new_model_window_to_the_history_store_unless_its_bound_was_given(
    tmp_path, history_events
):
    short = export_model(build_ranking_model(max_seq_len=20), tmp_path / "short", dense_dims=DENSE_DIMS)
    long = export_model(build_ranking_model(max_seq_len=48), tmp_path / "long", dense_dims=DENSE_DIMS)
    store = SqliteHistoryStore(tmp_path / "histories.sqlite", history_events or 20)
    ranker = Ranker.load(short, history_store=store, history_events=history_events)
    ranker.reload(long)
    assert store.max_events == (48 if history_events is None else history_events)
    store.close()
