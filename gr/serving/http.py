"""The HTTP/JSON service over a ``Ranker`` (FastAPI on uvicorn): the standard ASGI stack, with
OpenAPI at /openapi.json and /docs.

POST /v1/rank, /v1/recommend, /v1/generate take the request objects of ``gr.serving.request``
(raw ids by default; ``"ids": "model"`` for table rows). GET /healthz (process alive),
/readyz (model loaded), /metrics (Prometheus). POST /admin/reload {"export_dir": ...} swaps the
model atomically; it answers 404 unless the server was given an admin token, and 401 without
``Authorization: Bearer <token>``.

Errors are JSON ``{"error": name, "field": request field, "detail": message}``: 400 for a bad
request (it touches no cache), 500 ``non_finite_score`` when the model outputs NaN or infinity.
Several replicas scale out behind any L7 load balancer that hashes on ``user_id`` (see README).
"""

from __future__ import annotations

import hmac
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from gr.serving.batcher import RankBatcher
from gr.serving.errors import IdMapError, RequestError, ScoringError
from gr.serving.metrics import ServerMetrics
from gr.serving.request import (
    GENERATE_KEYS,
    RECOMMEND_KEYS,
    REQUEST_KEYS,
    GenerateRequest,
    RankRequest,
    RecommendRequest,
)
from gr.serving.runtime import Ranker

RAW = "raw"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def _body_schema(keys, required, example: Dict[str, Any]) -> Dict[str, Any]:
    columns = {
        "type": "object",
        "additionalProperties": {"type": "array"},
        "description": "{feature: [one value per token]}, plus timestamps",
    }
    types = {
        "user_id": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
        "history": columns,
        "candidates": columns,
        "common_features": {"type": "object"},
        "request_time": {"type": "integer"},
        "k": {"type": "integer", "minimum": 1},
        "exclude_seen": {"type": "boolean"},
        "strategy": {"enum": ["greedy", "beam", "sample"]},
        "beam_width": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "exclusiveMinimum": 0},
        "seed": {"type": "integer"},
        "ids": {"enum": ["raw", "model"], "default": "raw"},
        "unknown_ids": {"enum": ["error", "oov"]},
        "export_dir": {"type": "string"},
    }
    schema = {
        "type": "object",
        "properties": {k: types[k] for k in keys},
        "required": list(required),
        "additionalProperties": False,
        "example": example,
    }
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


EXAMPLE = {"user_id": "u1", "history": {"item_id": [3, 8, 1], "timestamps": [100, 160, 200]}}


def _json(content: Any, status: int = 200) -> Response:
    """A JSON response; NaN and infinity are refused (they are not JSON)."""
    return Response(json.dumps(content, allow_nan=False), status_code=status, media_type="application/json")


def _error(status: int, name: str, detail: str, field: str = "") -> Response:
    return _json({"error": name, "field": field, "detail": detail}, status)


def create_app(
    ranker: Ranker, *, admin_token: Optional[str] = None, batching: bool = True, batch_window_ms: float = 0.0
) -> FastAPI:
    """The service over ``ranker``. admin_token: enables POST /admin/reload for that bearer token;
    batching: concurrent rank requests run as batches (``gr.serving.batcher``), the worker waiting
    ``batch_window_ms`` for company."""
    app = FastAPI(title="gr serving", description=__doc__, version="1")
    metrics = ServerMetrics(ranker)
    rank_request = RankBatcher(ranker, batch_window_ms).rank if batching else ranker.rank_request

    async def call(endpoint: str, request: Request, serve: Callable[[Any], Dict[str, Any]]) -> Response:
        metrics.requests.labels(endpoint).inc()
        started = time.perf_counter()
        try:
            try:
                payload = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RequestError(f"body: not JSON: {exc}") from None
            answer = await run_in_threadpool(serve, payload)
            if "cache_status" in answer:
                metrics.cache.labels(answer["cache_status"]).inc()
            try:
                response = _json(answer)
            except ValueError as exc:  # json.dumps(allow_nan=False): a non-finite value got through
                raise ScoringError(str(exc)) from None
        except RequestError as exc:
            response = _error(400, "bad_request", str(exc), exc.field)
        except ScoringError as exc:
            response = _error(500, "non_finite_score", str(exc))
        except IdMapError as exc:
            response = _error(500, "id_maps_unreadable", str(exc))
        if response.status_code >= 400:
            metrics.errors.labels(endpoint, str(response.status_code)).inc()
        metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
        return response

    def rank(payload: Any) -> Dict[str, Any]:
        request = RankRequest.from_dict(payload, "body", default_ids=RAW)
        return {"user_id": request.user_id, **rank_request(request).to_json()}

    def recommend(payload: Any) -> Dict[str, Any]:
        request = RecommendRequest.from_dict(payload, "body", default_ids=RAW)
        return {"user_id": request.user_id, **ranker.recommend(request).to_json()}

    def generate(payload: Any) -> Dict[str, Any]:
        request = GenerateRequest.from_dict(payload, "body", default_ids=RAW)
        return {"user_id": request.user_id, **ranker.generate(request).to_json()}

    rank_example = {**EXAMPLE, "candidates": {"item_id": [5, 9]}}
    for path, serve, keys, required, example, summary in (
        (
            "rank",
            rank,
            REQUEST_KEYS,
            ("user_id", "history", "candidates"),
            rank_example,
            "Scores of the given candidates (ranking heads by name; retrieval: 'retrieval' cosines)",
        ),
        (
            "recommend",
            recommend,
            RECOMMEND_KEYS,
            ("user_id", "history"),
            {**EXAMPLE, "k": 10},
            "The top k items of the whole catalogue, seen items excluded by default (retrieval exports)",
        ),
        (
            "generate",
            generate,
            GENERATE_KEYS,
            ("user_id", "history"),
            {**EXAMPLE, "k": 10},
            "The user's next k items, generated autoregressively",
        ),
    ):

        async def endpoint(request: Request, _path: str = path, _serve=serve) -> Response:
            return await call(_path, request, _serve)

        app.post(f"/v1/{path}", summary=summary, openapi_extra=_body_schema(keys, required, example))(endpoint)

    @app.get("/healthz", summary="The process is alive")
    def healthz() -> Dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="A model is loaded")
    def readyz() -> Dict[str, Any]:
        return {"status": "ready", "model_version": ranker.cache.model_version, "export_dir": str(ranker.model.root)}

    @app.get("/metrics", summary="Prometheus metrics")
    def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=PROMETHEUS_TEXT)

    @app.post(
        "/admin/reload",
        summary="Swap in another export (needs the admin token)",
        openapi_extra=_body_schema(("export_dir",), ("export_dir",), {"export_dir": "exports/new"}),
    )
    async def reload(request: Request) -> Response:
        if admin_token is None:
            return _error(404, "not_found", "admin endpoints are off: start the server with --admin-token")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {admin_token}".encode()):
            return _error(401, "unauthorized", "expected the header Authorization: Bearer <admin token>")
        try:
            payload = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, "bad_request", f"body: not JSON: {exc}", "body")
        if (
            not isinstance(payload, dict)
            or set(payload) != {"export_dir"}
            or not isinstance(payload["export_dir"], str)
        ):
            return _error(400, "bad_request", 'body: expected {"export_dir": "<path>"}', "body.export_dir")
        try:
            await run_in_threadpool(ranker.reload, Path(payload["export_dir"]))
        except Exception as exc:  # a bad export: the old model keeps serving
            return _error(400, "bad_export", f"body.export_dir: {exc}"[:2000], "body.export_dir")
        return _json({"status": "reloaded", "model_version": ranker.cache.model_version})

    return app


OPTIONS_ENV = "GR_SERVING_OPTIONS"


def app_from_environment() -> FastAPI:
    """The app of one uvicorn worker process: ``$GR_SERVING_OPTIONS`` holds the JSON of
    {"export_dir", "admin_token", and Ranker options} that ``python -m gr.serving serve`` set."""
    options = json.loads(os.environ[OPTIONS_ENV])
    export_dir, admin_token = options.pop("export_dir"), options.pop("admin_token")
    batching = {key: options.pop(key) for key in ("batching", "batch_window_ms") if key in options}
    return create_app(Ranker.load(export_dir, **options), admin_token=admin_token, **batching)
