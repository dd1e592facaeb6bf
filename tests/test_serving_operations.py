"""Operating the service: a real ``gr serve`` logs a start-up line, one access line per request (with
its request id and error kind; text or JSON; the path's control characters escaped, a long one cut),
each reload (or refused reload) and a shutdown line; /metrics counts errors by kind, batches, queue
depths, cache entries and bytes and fallbacks; a port in use or a bad address is one line and exit 2.
Cold start: an empty history gets the export's most popular items, marked ``"fallback":
"popularity"``, from recommend and generate (in-process, HTTP and the one-shot commands); an export
without popularity keeps the error, and an edited popularity file is refused by name. ``gr
recommend`` prints the top k (``--k`` wins over a request's own k); generate's scores are
log-probabilities."""

import asyncio
import json
import logging
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from gr.commands.export import main as export_main
from gr.commands.serve import main as serving_main
from gr.data.popularity import save_popularity
from gr.export import check_export, export_model
from gr.export.manifest import manifest_digest, write_manifest
from gr.export.popularity import POPULARITY
from gr.serving import GenerateRequest, IdOptions, Ranker, RecommendRequest, http
from gr.serving.errors import RequestError
from gr.serving.http import OPTIONS_ENV, create_app
from gr.serving.logs import ACCESS_LOGGER, MAX_LOGGED_PATH, TEXT_FORMAT, AccessLog, JsonFormatter
from helpers.models import NUM_ITEMS, build_generative_model
from helpers.servers import AppServer, Server, free_port, metric, write_item_map

RAW_ITEMS = [1000 + 7 * i for i in range(NUM_ITEMS)]  # raw id of model item i
COUNTS = (np.arange(NUM_ITEMS) * 37) % 23  # training counts with ties
HISTORY = {"item_id": [RAW_ITEMS[i] for i in (4, 9, 17)], "timestamps": [10, 20, 30]}
MODEL_HISTORY = {"item_id": [4, 9, 17], "timestamps": [10, 20, 30]}
EMPTY = {"item_id": [], "timestamps": []}


def most_popular(k):
    """Model ids of the k most popular items: count descending, the lowest id on ties."""
    return sorted(range(NUM_ITEMS), key=lambda i: (-COUNTS[i], i))[:k]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A retrieval export with item popularity, and the same export as an older one without it."""
    root = tmp_path_factory.mktemp("operations")
    maps = write_item_map(root / "maps", RAW_ITEMS)
    popular = export_model(build_generative_model(2, 3), root / "popular", id_mappings_dir=maps, popularity=COUNTS)
    old = root / "old"
    shutil.copytree(popular, old)
    (old / POPULARITY).unlink()
    write_manifest(old)
    return {"popular": popular, "old": old}


def lines_of(server: Server) -> list:
    server.stop()
    return server.process.stdout.read().splitlines()


def test_the_server_logs_a_start_up_line_access_lines_reloads_and_a_shutdown_line(exports, warm_python):
    export, other = exports["popular"], exports["old"]
    server = Server(warm_python, export, "--admin-token", "t")
    ok = server.call(
        "POST", "/v1/recommend", {"user_id": "u", "history": HISTORY, "k": 3}, headers=[("X-Request-Id", "req-ok")]
    )
    bad = server.call(
        "POST", "/v1/recommend", {"user_id": "u", "history": HISTORY, "k": 0}, headers=[("X-Request-Id", "req-bad")]
    )
    assert ok[0] == 200 and bad[0] == 400
    auth = [("Authorization", "Bearer t")]
    assert server.call("POST", "/admin/reload", {"export_dir": str(other)}, headers=auth)[0] == 200
    assert server.call("POST", "/admin/reload", {"export_dir": str(other / "nowhere")}, headers=auth)[0] == 400
    lines = lines_of(server)
    start = (
        f"gr.serve: serving {export} (model {manifest_digest(export)}, cpu, 1 worker, "
        f"histories: {Path(server.directory).resolve() / 'gr-histories.sqlite'}) on http://127.0.0.1:{server.port}"
    )
    assert sum(line.endswith(start) for line in lines) == 1, lines
    access = [line for line in lines if "gr.access: POST /v1/recommend" in line]
    assert len(access) == 2, access  # one line per request
    assert re.search(r"POST /v1/recommend 200 [0-9.]+ ms error=- request_id=req-ok$", access[0]), access
    assert re.search(r"POST /v1/recommend 400 [0-9.]+ ms error=bad_request request_id=req-bad$", access[1]), access
    assert (
        sum(line.endswith(f"reloaded: serving {other} (model {manifest_digest(other)}, version 1)") for line in lines)
        == 1
    )
    refused = f"WARNING gr.serving.http: reload of {other / 'nowhere'} refused, the previous model keeps serving: "
    assert sum(refused in line and line.endswith("export directory does not exist") for line in lines) == 1, lines
    address = f"http://127.0.0.1:{server.port}"
    stopped = f"gr.serve: stopped serving on {address} (started with {export}; reloads log what followed)"
    assert lines[-1].endswith(stopped), lines[-3:]


def test_log_format_json_writes_one_json_object_per_line(exports, warm_python):
    server = Server(warm_python, exports["popular"], "--log-format", "json")
    assert server.call("POST", "/v1/generate", {"user_id": "u", "history": HISTORY, "k": 0})[0] == 400
    records = [json.loads(line) for line in lines_of(server) if line.strip()]  # every line is one object
    access = [r for r in records if r["logger"] == "gr.access" and r["path"] == "/v1/generate"]
    assert len(access) == 1 and access[0]["status"] == 400 and access[0]["error"] == "bad_request"
    assert access[0]["method"] == "POST" and access[0]["ms"] > 0 and len(access[0]["request_id"]) == 32
    served = [r for r in records if r["logger"] == "gr.access" and r["status"] == 200]
    assert served and all(r["error"] is None for r in served)
    assert records[0]["message"].startswith("serving ") and records[-1]["message"].startswith("stopped serving ")


async def _not_found(scope, receive, send):
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b'{"error": "not_found"}'})


def test_an_access_line_escapes_control_characters_and_cuts_a_long_path_in_both_formats(caplog):
    """A client's percent-encoded CR, LF and ESC (uvicorn decodes them into the path) are logged
    escaped: no forged line, no terminal colour; a 100 KB path is cut, saying the length it had."""
    forged = "/v1/nope\r\nINFO gr.access: forged\x1b[31m"
    long = "/v1/" + "a" * 100_000
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)

    async def receive():
        return {"type": "http.request", "body": b""}

    async def sent(message):
        pass

    for path in (forged, long, "/v1/a\\r"):
        asyncio.run(AccessLog(_not_found)({"type": "http", "method": "POST", "path": path}, receive, sent))
    records = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    text = [logging.Formatter(TEXT_FORMAT).format(r) for r in records]
    objects = [JsonFormatter().format(r) for r in records]
    escaped = "/v1/nope\\r\\nINFO gr.access: forged\\x1b[31m"
    assert re.fullmatch(
        rf".* gr\.access: POST {re.escape(escaped)} 404 [0-9.]+ ms error=not_found request_id=\w+", text[0]
    )
    cut = "/v1/" + "a" * (MAX_LOGGED_PATH - 4) + "...[cut: 100004 characters]"
    assert f"POST {cut} 404 " in text[1] and len(text[1]) < MAX_LOGGED_PATH + 200
    assert [json.loads(line)["path"] for line in objects] == [escaped, cut, "/v1/a\\\\r"]  # a client's backslash too
    assert not [line for line in text + objects if any(char in line for char in "\r\n\x1b")]


def test_metrics_count_errors_by_kind_batches_queue_depths_cache_entries_and_fallbacks(exports):
    with AppServer(create_app(Ranker.load(exports["popular"]))) as server:
        server.wait_ready()
        empty = server.call("POST", "/v1/recommend", {"user_id": "cold", "history": EMPTY, "k": 4})[1]
        assert empty["fallback"] == "popularity" and empty["items"] == [RAW_ITEMS[i] for i in most_popular(4)]
        assert server.call("POST", "/v1/recommend", {"user_id": "u", "history": HISTORY, "k": 3})[0] == 200
        assert server.call("POST", "/v1/recommend", {"user_id": "u", "history": HISTORY, "k": 0})[0] == 400
        assert server.call("POST", "/v1/recommend", {"user_id": "u", "history": HISTORY, "k": 5000})[0] == 400
        text = server.call("GET", "/metrics")[1]
    errors = {"endpoint": "recommend", "status": "400"}
    assert metric(text, "gr_errors_total", **errors, kind="bad_request") == 1
    assert metric(text, "gr_errors_total", **errors, kind="limit_exceeded") == 1
    assert metric(text, "gr_fallback_total", kind="popularity") == 1
    # the two good requests ran as two batches of one, each alone in the queue; bad ones never joined
    assert metric(text, "gr_batch_size_count") == metric(text, "gr_batch_size_sum") == 2
    assert metric(text, "gr_queue_depth_count") == metric(text, "gr_queue_depth_sum") == 2
    assert metric(text, "gr_batch_size_bucket", le="1.0") == 2
    assert metric(text, "gr_cache_entries") == 1 and metric(text, "gr_cache_bytes") > 0  # the fallback caches nothing


def test_under_oov_history_tokens_of_items_the_export_lacks_are_left_out_said_and_counted(exports):
    """Yesterday's export and today's histories: a token of an item with no row is left out of the
    history (its answer is the history's without it, and says so); a candidate without a row stays a
    400, as does the history without ``unknown_ids: oov``."""
    new = max(RAW_ITEMS) + 1
    mixed = {"item_id": [RAW_ITEMS[4], new, RAW_ITEMS[9], RAW_ITEMS[17]], "timestamps": [10, 15, 20, 30]}
    with AppServer(create_app(Ranker.load(exports["popular"]))) as server:
        server.wait_ready()
        status, left = server.call(
            "POST", "/v1/recommend", {"user_id": "a", "history": mixed, "k": 3, "unknown_ids": "oov"}
        )
        clean = server.call("POST", "/v1/recommend", {"user_id": "b", "history": HISTORY, "k": 3})[1]
        assert status == 200 and left["items"] == clean["items"] and left["history_length"] == 3
        assert left["history_left_out"] == 1
        assert left["warnings"] == ["history: left out 1 token(s) of items the model has no row for (unknown_ids oov)"]
        rank = {"user_id": "c", "history": mixed, "candidates": {"item_id": [RAW_ITEMS[1]]}, "unknown_ids": "oov"}
        assert server.call("POST", "/v1/rank", rank)[1]["history_left_out"] == 1
        assert server.call("POST", "/v1/rank", {**rank, "candidates": {"item_id": [new]}})[0] == 400
        assert server.call("POST", "/v1/recommend", {"user_id": "d", "history": mixed, "k": 3})[0] == 400
        short = {**mixed, "timestamps": mixed["timestamps"][:3]}  # misaligned: refused, no token left out
        status, refused = server.call("POST", "/v1/recommend", {"user_id": "e", "history": short, "unknown_ids": "oov"})
        assert status == 400 and refused["detail"].startswith("history.item_id: unknown raw id(s)")
        text = server.call("GET", "/metrics")[1]
    assert metric(text, "gr_history_tokens_left_out_total") == 2


def test_a_history_that_oov_leaves_empty_says_how_many_tokens_were_left_out_as_unknown(exports):
    unknown = {"item_id": [max(RAW_ITEMS) + 1, max(RAW_ITEMS) + 2], "timestamps": [10, 20]}
    oov = IdOptions("raw", "oov")
    left_out = r"^history: empty: its 2 token\(s\) were left out as unknown \(items the model has no row for; "
    with pytest.raises(RequestError, match=left_out + ".*; a retrieval model scores items against the query"):
        Ranker.load(exports["popular"]).rank("u", unknown, {"item_id": [RAW_ITEMS[1]]}, id_options=oov)
    with pytest.raises(RequestError, match=left_out + ".*; recommend needs at least one item"):
        Ranker.load(exports["old"]).recommend(RecommendRequest("u", unknown, 3, id_options=oov))


def test_gr_serve_unknown_ids_oov_is_the_default_of_requests_that_do_not_say(exports, monkeypatch):
    """``gr serve --unknown-ids oov`` reaches every worker's app through its options (the worker's
    own app is not started here: it ends its process after shutdown), and the app applies it."""
    options = {"export_dir": str(exports["popular"]), "admin_token": None, "unknown_ids": "oov"}
    monkeypatch.setenv(OPTIONS_ENV, json.dumps(options))
    given = {}
    monkeypatch.setattr(http, "create_app", lambda ranker, **kwargs: given.update(kwargs))
    http.app_from_environment()
    assert given["unknown_ids"] == "oov" and given["exit_after_shutdown"] is True
    mixed = {"item_id": [RAW_ITEMS[4], max(RAW_ITEMS) + 1], "timestamps": [10, 20]}
    with AppServer(create_app(Ranker.load(exports["popular"]), unknown_ids="oov")) as server:
        server.wait_ready()
        status, answer = server.call("POST", "/v1/recommend", {"user_id": "a", "history": mixed, "k": 3})
        assert status == 200 and answer["history_left_out"] == 1
        said = {"user_id": "b", "history": mixed, "k": 3, "unknown_ids": "error"}
        assert server.call("POST", "/v1/recommend", said)[0] == 400  # a request's own choice wins
    with pytest.raises(ValueError, match=r"create_app: unknown_ids: expected one of \['error', 'oov'\], got 'skip'"):
        create_app(Ranker.load(exports["popular"]), unknown_ids="skip")


@pytest.mark.parametrize("page_size", [0, 8])
def test_gr_serve_page_size_reaches_every_workers_page_pool(exports, monkeypatch, page_size):
    options = {"export_dir": str(exports["popular"]), "admin_token": None, "page_size": page_size}
    monkeypatch.setenv(OPTIONS_ENV, json.dumps(options))
    given = {}
    monkeypatch.setattr(http, "create_app", lambda ranker, **kwargs: given.update(ranker=ranker))
    http.app_from_environment()
    pool = given["ranker"].model.engine.pool
    assert (pool is None) if page_size == 0 else (pool.page_size == page_size and pool.pages > 0)


def test_a_negative_page_size_is_one_line_and_exit_2(exports, capsys):
    assert serving_main(["serve", str(exports["popular"]), "--port", str(free_port()), "--page-size", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--page-size >= 0" in err[0]


def test_a_port_in_use_and_a_bad_address_are_one_line_and_exit_2(exports, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serving_main(["serve", str(exports["popular"]), "--port", str(port)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"serve: cannot listen on 127.0.0.1:{port}: the address is in use: another process listens there"
        ]
    assert serving_main(["serve", str(exports["popular"]), "--host", "nosuch.invalid", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("serve: --host nosuch.invalid: cannot resolve it"), err
    assert serving_main(["serve", str(exports["popular"]), "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--port in 1..65535" in err[0]


def test_a_history_store_that_cannot_be_opened_is_one_line_and_exit_2(exports, tmp_path, capsys):
    export = str(exports["popular"])
    missing = tmp_path / "nowhere" / "h.sqlite"
    assert serving_main(["serve", export, "--port", str(free_port()), "--history-store", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"serve: --history-store {missing}: history store {missing}: unable to open database file"]
    assert serving_main(["serve", export, "--port", str(free_port()), "--history-store", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("serve: --history-store redis://127.0.0.1:1/0: history store "), err
    assert serving_main(["serve", export, "--port", str(free_port()), "--history-events", "0"]) == 2
    assert capsys.readouterr().err.strip() == "serve: --history-events: expected an integer >= 1, got 0"


def test_an_empty_history_gets_the_most_popular_items_marked_as_the_popularity_fallback(exports):
    ranker = Ranker.load(exports["popular"])
    top = ranker.recommend(RecommendRequest("cold", EMPTY, 5))
    assert top.items == most_popular(5) and top.fallback == "popularity" and top.to_json()["fallback"] == "popularity"
    assert top.scores.tolist() == [float(COUNTS[i]) for i in most_popular(5)] and top.cache_status == "off"
    for strategy in ("greedy", "beam", "sample"):
        generated = ranker.generate(GenerateRequest("cold", {}, 5, strategy=strategy))
        assert generated.items == most_popular(5) and generated.fallback == "popularity"
        want = np.log((COUNTS[most_popular(5)] + 1.0) / (COUNTS.sum() + NUM_ITEMS))
        np.testing.assert_allclose(generated.scores, want)
    # in a batch, the cold user's answer is the fallback and the others' the model's own
    batch = ranker.recommend([RecommendRequest("cold", EMPTY, 3), RecommendRequest("warm", MODEL_HISTORY, 3)])
    alone = Ranker.load(exports["popular"]).recommend(RecommendRequest("warm", MODEL_HISTORY, 3))
    assert batch[0].items == most_popular(3) and batch[1].items == alone.items and batch[1].fallback is None
    assert len(ranker.cache) == 1  # the fallback touched no cache
    old = Ranker.load(exports["old"])
    for call in (lambda: old.recommend(RecommendRequest("cold", EMPTY, 3)), lambda: old.generate("cold", EMPTY, 3)):
        with pytest.raises(RequestError, match="history: empty; .*no item popularity"):
            call()


def test_an_edited_popularity_file_is_refused_by_name(exports, tmp_path, capsys):
    edited = tmp_path / "edited"
    shutil.copytree(exports["popular"], edited)
    save_popularity(edited / POPULARITY, COUNTS + 1)
    assert [p.file for p in check_export(edited)] == [POPULARITY]
    capsys.readouterr()
    assert export_main(["check", str(edited)]) == 1
    assert f"ERROR {POPULARITY} [-]: sha256 differs from MANIFEST" in capsys.readouterr().out
    save_popularity(edited / POPULARITY, COUNTS[:-1])  # a count short of the item table, re-hashed
    write_manifest(edited)
    assert [(p.file, p.key) for p in check_export(edited)] == [(POPULARITY, "count")]


def test_gr_recommend_and_generate_print_items_and_scores_with_the_fallback_for_an_empty_history(
    exports, tmp_path, capsys
):
    request = tmp_path / "requests.json"
    request.write_text(json.dumps([{"user_id": "u", "history": HISTORY}, {"user_id": "cold", "history": EMPTY}]))
    local = Ranker.load(exports["popular"])
    for verb in ("recommend", "generate"):
        capsys.readouterr()
        assert serving_main([verb, str(exports["popular"]), "--request", str(request), "--k", "3"]) == 0
        warm, cold = json.loads(capsys.readouterr().out)
        want = (local.recommend if verb == "recommend" else local.generate)(
            (RecommendRequest if verb == "recommend" else GenerateRequest)("u", MODEL_HISTORY, 3)
        )
        assert warm["items"] == [RAW_ITEMS[i] for i in want.items] and "fallback" not in warm
        np.testing.assert_allclose(warm["scores"], want.scores, rtol=0, atol=1e-6)
        assert cold["items"] == [RAW_ITEMS[i] for i in most_popular(3)] and cold["fallback"] == "popularity"


def test_gr_recommend_and_generate_k_flag_wins_over_a_requests_own_k_which_applies_without_it(
    exports, tmp_path, capsys
):
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"user_id": "u", "history": HISTORY, "k": 5}))
    for verb in ("recommend", "generate"):
        for flag, count in ((["--k", "3"], 3), ([], 5)):
            capsys.readouterr()
            assert serving_main([verb, str(exports["popular"]), "--request", str(request), *flag]) == 0
            assert len(json.loads(capsys.readouterr().out)["items"]) == count, (verb, flag)


def test_generate_scores_are_log_probabilities_of_the_catalogue_scores_recommend_returns(exports):
    ranker = Ranker.load(exports["popular"])
    generated = ranker.generate(GenerateRequest("u", MODEL_HISTORY, 3))
    everything = ranker.recommend(RecommendRequest("u", MODEL_HISTORY, NUM_ITEMS - 3))  # every eligible item
    assert everything.items[0] == generated.items[0]
    cosines = torch.tensor(everything.scores, dtype=torch.float64)
    assert generated.scores[0] == pytest.approx(float(cosines[0] - torch.logsumexp(cosines, 0)), abs=1e-5)
    # later steps: each is a log-probability (<= 0), their distribution excluding the earlier items
    assert all(score <= 0 for score in generated.scores) and len(generated.scores) == 3
