"""The HTTP service against real server processes: HTTP = in-process scores, raw ids round-trip,
each bad request class gets its 400 naming the field (and changes nothing), metrics move, a
reload under traffic never mixes two models in one answer, and hash-on-user-id routing keeps a
user's cache warm on its replica."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from gr.export import export_model
from gr.serving import GenerateRequest, IdOptions, Ranker, RecommendRequest
from gr.serving.__main__ import main as serving_main
from helpers.models import (
    DENSE_DIMS,
    NUM_ITEMS,
    build_generative_model,
    build_ranking_model,
    random_batch,
    requests_from_batch,
)
from helpers.servers import Server, metric, replica_of, write_item_map

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
    first = export_model(build_generative_model(2, 3), root / "first", id_mappings_dir=maps)
    second = export_model(build_generative_model(2, 5), root / "second", id_mappings_dir=maps)
    ranking_model = build_ranking_model(max_seq_len=40)
    ranking = export_model(ranking_model, root / "ranking", dense_dims=DENSE_DIMS)
    return {"first": first, "second": second, "ranking": ranking, "ranking_model": ranking_model}


@pytest.fixture(scope="module")
def servers(exports):
    """Two replicas of the retrieval export (the first one with the admin token) and a ranking server."""
    started = []
    try:
        for args in ((exports["first"], "--admin-token", TOKEN), (exports["first"],), (exports["ranking"],)):
            started.append(Server(*args))
        yield started
    finally:
        for server in started:
            server.stop()


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
    ("recommend", {"user_id": "u", "history": HISTORY, "k": 10**6}, "k"),
    ("recommend", {"user_id": "u", "history": HISTORY, "ids": "internal"}, "body.ids"),
    ("generate", {"user_id": "u", "history": HISTORY, "strategy": "topp"}, "strategy"),
    ("generate", {"user_id": "u", "history": HISTORY, "temperature": -1}, "body.temperature"),
    ("generate", {"user_id": "u", "history": {"item_id": [], "timestamps": []}}, "history"),
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
    assert moved("gr_errors_total", endpoint="recommend", status="400") == 1
    assert [moved("gr_cache_total", status=s) for s in ("miss", "hit", "extend")] == [1, 1, 1]
    assert moved("gr_request_seconds_count", endpoint="recommend") == 4
    assert metric(after, "gr_cache_bytes") > 0 and metric(after, "gr_model_version") == 0


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
    server = Server(export_model(model, tmp_path / "broken"))
    try:
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
    finally:
        server.stop()


@pytest.mark.parametrize("command", ["serve", "rank", "generate"])
def test_the_serving_cli_reports_a_bad_export_in_one_line_and_exits_2(command, tmp_path, capsys):
    (tmp_path / "request.json").write_text("{}")
    extra = [] if command == "serve" else ["--request", str(tmp_path / "request.json")]
    assert serving_main([command, str(tmp_path / "missing"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path / "missing") in err and "not a valid export" in err
