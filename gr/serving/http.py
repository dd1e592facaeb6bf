"""The HTTP/JSON service over a ``Ranker`` (FastAPI on uvicorn): the standard ASGI stack, with
OpenAPI at /openapi.json and /docs.

POST /v1/rank, /v1/recommend, /v1/generate take the request objects of ``gr.serving.request``
(raw ids by default; ``"ids": "model"`` for table rows); one without a history is answered from
the user's history kept by the service, which POST /v1/events {"user_id", "history"} appends to
(``gr.serving.history_store``; answered {"user_id", "appended", "stored"}). GET /healthz (process alive),
/readyz (200 once the model is loaded and warmed up: the fused kernels built and one request of
each kind answered; 503 before, or once the process can no longer answer), /metrics (Prometheus,
added up over the server's worker processes: ``gr.serving.metrics``).
POST /admin/reload {"export_dir": ...} loads and warms up the new model while the old one serves,
then swaps it in ({"export_dir": DELTA} or {"deltas": [DELTA, ...]}: a delta export or a chain of
them applied to the serving model, ``Ranker.reload``); it answers 404 unless the server was given
an admin token, 401 without ``Authorization: Bearer <token>``, and 409 when the server runs several worker processes (a
reload would swap only the one that answers).

Errors are JSON ``{"error": name, "field": request field, "detail": message}``, each for its own
request alone: 400 ``bad_request`` (it touches no cache), 400 ``limit_exceeded`` and 413
``body_too_large`` (``gr.serving.limits``), 408 ``body_timeout`` when the body has not arrived
whole within ``--body-timeout`` (the connection is then closed), 415 ``unsupported_encoding`` for a
``Content-Encoding`` other than identity, 500 ``non_finite_score`` when the model outputs NaN or
infinity, 500 ``internal`` for anything unexpected (logged with its traceback), 503
``unavailable`` when the request batcher has stopped (the process then exits, non-zero, for its
supervisor to restart it) or when the server shuts down (SIGTERM) before the request is done, 503
``overloaded`` (with ``Retry-After: 1``) when ``max_pending`` requests of this process are already
being served: a flood is answered at once instead of queueing without bound, 503
``history_store_unavailable`` when the history store cannot be read or written.
Every error counts in ``gr_errors_total`` by endpoint, status and kind (its ``error`` name), and
every request logs one access line with its request id (``gr.serving.logs``). A recommend or
generate request with an empty history gets the new-user query's answer from the user's common
features (``"fallback": "user_features"``) where the export stores the new-user state, else the
export's most popular items (``"fallback": "popularity"``; ``gr.serving.fallback``), each counted in
``gr_fallback_total`` by kind. A client
that closes its connection before its body has arrived is no error: it counts in
``gr_client_disconnects_total`` and logs one line.
Several replicas scale out behind any L7 load balancer that hashes on ``user_id`` (see docs/serving.md, Replicas).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from gr.serving.batcher import BatcherDied, RequestBatcher
from gr.serving.errors import IdMapError, RequestError, ScoringError
from gr.serving.history_store import HistoryStoreError
from gr.serving.history_store_spec import open_history_store
from gr.serving.limits import (
    BODY_TIMEOUT_FLAG,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_PENDING,
    LimitError,
    flag,
    limits_from_options,
)
from gr.serving.logs import AccessLog, error_kind
from gr.serving.metrics import ServerMetrics
from gr.serving.options import UNKNOWN_IDS
from gr.serving.request import (
    EVENTS_KEYS,
    GENERATE_KEYS,
    RECOMMEND_KEYS,
    REQUEST_KEYS,
    SEED_RANGE,
    TEMPERATURE_RANGE,
    EventsRequest,
    GenerateRequest,
    IdOptions,
    RankRequest,
    RecommendRequest,
)
from gr.serving.runtime import Ranker
from gr.serving.tier_spec import open_tiers
from gr.timestamps import INT64_MAX, INT64_MIN

RAW = "raw"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
EXIT_BATCHER_DIED = 70  # EX_SOFTWARE: the process cannot answer rank or recommend requests any more
EXIT_DELAY_S = 1.0  # lets the failed requests' answers leave before the process exits
log = logging.getLogger(__name__)


class BodyError(RequestError):
    """A body ``read_json`` refuses before parsing it, answered ``status`` ``name``."""

    status: int
    name: str


class BodyTooLarge(BodyError):
    """A request body past ``RequestLimits.max_body_bytes`` (HTTP 413)."""

    status, name = 413, "body_too_large"


class BodyTimeout(BodyError):
    """A request body not received whole within the server's body timeout (HTTP 408)."""

    status, name = 408, "body_timeout"


class UnsupportedEncoding(BodyError):
    """A request body sent with a ``Content-Encoding`` other than identity (HTTP 415)."""

    status, name = 415, "unsupported_encoding"


class Overloaded(Exception):
    """This process already serves its ``max_pending`` requests (HTTP 503 ``overloaded``)."""


class Readiness:
    """Whether the service can answer fast: "starting" (warming up), "ready", or "failed" (why)."""

    def __init__(self) -> None:
        self.status, self.detail = "starting", ""
        self._lock = threading.Lock()

    def set(self, status: str, detail: str = "") -> None:
        with self._lock:
            if self.status != "failed":  # a failed process stays failed
                self.status, self.detail = status, detail

    def get(self) -> tuple:
        with self._lock:
            return self.status, self.detail


def exit_soon(status: int) -> None:
    """End the process with ``status`` after EXIT_DELAY_S, from a daemon thread (no cleanup can block
    it; a process that ends sooner by itself ends with its own status)."""
    timer = threading.Timer(EXIT_DELAY_S, os._exit, args=(status,))
    timer.daemon = True
    timer.start()


async def read_json(request: Request, max_bytes: int, timeout_s: float) -> Any:
    """The request body as JSON, refused (BodyTooLarge) as soon as it passes ``max_bytes``:
    never read whole past the limit; BodyTimeout when it has not arrived whole ``timeout_s``
    seconds after its headers, UnsupportedEncoding when it is compressed (or otherwise encoded).
    A body that is not JSON is a RequestError; a client gone before its body arrived raises
    starlette's ClientDisconnect."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedEncoding(f"body: Content-Encoding {encoding!r}: only identity (no encoding) is accepted")
    declared = request.headers.get("content-length", "")
    too_large = f"body: more than {max_bytes} bytes, the limit ({flag('max_body_bytes')})"
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(too_large)
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLarge(too_large)
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(f"body: not received whole within {timeout_s:g} s ({BODY_TIMEOUT_FLAG})") from None
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, too many digits, too deep
        raise RequestError(f"body: not JSON: {' '.join(str(exc).split())}"[:300]) from None


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
        "request_time": {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX},
        "k": {"type": "integer", "minimum": 1},
        "exclude_seen": {"type": "boolean"},
        "strategy": {"enum": ["greedy", "beam", "sample"]},
        "beam_width": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": TEMPERATURE_RANGE[0], "maximum": TEMPERATURE_RANGE[1]},
        "seed": {"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]},
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


def _body_error(exc: BodyError) -> Response:
    """The answer to a refused body; after a timeout the connection closes (the rest is never read)."""
    response = _error(exc.status, exc.name, str(exc), "body")
    if isinstance(exc, BodyTimeout):
        response.headers["connection"] = "close"
    return response


def _error_response(endpoint: str, exc: Exception) -> Response:
    """The JSON error answer to ``exc``, raised while serving ``endpoint``: its status and name as the
    module docstring lists them; anything unexpected is a 500 ``internal``, logged with its traceback."""
    if isinstance(exc, BodyError):
        return _body_error(exc)
    if isinstance(exc, LimitError):
        return _error(400, "limit_exceeded", str(exc), exc.field)
    if isinstance(exc, RequestError):
        return _error(400, "bad_request", str(exc), exc.field)
    if isinstance(exc, ScoringError):
        return _error(500, "non_finite_score", str(exc))
    if isinstance(exc, IdMapError):
        return _error(500, "id_maps_unreadable", str(exc))
    if isinstance(exc, HistoryStoreError):
        return _error(503, "history_store_unavailable", str(exc))
    if isinstance(exc, BatcherDied):
        return _error(503, "unavailable", f"{exc}; this process is exiting")
    if isinstance(exc, Overloaded):
        response = _error(503, "overloaded", str(exc))
        response.headers["retry-after"] = "1"
        return response
    return _internal(endpoint, exc)


def _internal(endpoint: str, exc: BaseException) -> Response:
    """The 500 ``internal`` answer to an unexpected ``exc``, logged with its traceback."""
    log.error("%s: unexpected %s", endpoint, type(exc).__name__, exc_info=exc)
    return _error(500, "internal", f"an unexpected {type(exc).__name__}; the server logged it")


# The verbs under /v1/: (path, request keys, required keys, OpenAPI example, summary).
VERBS = (
    (
        "rank",
        REQUEST_KEYS,
        ("user_id", "candidates"),
        {**EXAMPLE, "candidates": {"item_id": [5, 9]}},
        "Scores of the given candidates (ranking heads by name; retrieval: 'retrieval' cosines)",
    ),
    (
        "recommend",
        RECOMMEND_KEYS,
        ("user_id",),
        {**EXAMPLE, "k": 10},
        "The top k items of the whole catalogue, seen items excluded by default (retrieval exports)",
    ),
    (
        "generate",
        GENERATE_KEYS,
        ("user_id",),
        {**EXAMPLE, "k": 10},
        "The user's next k items, generated autoregressively",
    ),
    (
        "events",
        EVENTS_KEYS,
        ("user_id", "history"),
        EXAMPLE,
        "Append events to the user's stored history (a request without a history is answered from it)",
    ),
)


class ServingApp:
    """The service of one process over ``ranker`` (whose ``limits`` bound each request): the state its
    routes share (readiness, metrics, the request batcher, the requests being served) and one method
    per route; ``build()`` -> the FastAPI app.

    admin_token: enables POST /admin/reload for that bearer token; batching: concurrent rank and
    recommend requests run as batches (``gr.serving.batcher``), the worker waiting
    ``batch_window_ms`` for company; body_timeout_s: how long a request body may take to arrive
    (then 408); max_pending: the rank, recommend and generate requests this process serves at once
    (queued or running; one more is a 503 ``overloaded``); unknown_ids: what a request that does not
    say takes ("error" or "oov", ``gr.serving.id_maps``); warm_up: /readyz turns ready after
    ``Ranker.warm_up`` (run at start-up, in the background) instead of at once; workers: the
    server's worker processes (reload needs 1); on_fatal: called with the exit status when the
    process can no longer answer (default: exit after EXIT_DELAY_S); exit_after_shutdown: once the
    server has shut down (SIGTERM, after its graceful timeout), end the process after EXIT_DELAY_S
    even if a request thread is still busy (a server process's own app; never in a process that
    hosts other work)."""

    def __init__(
        self,
        ranker: Ranker,
        *,
        admin_token: Optional[str] = None,
        batching: bool = True,
        batch_window_ms: float = 0.0,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        max_pending: int = DEFAULT_MAX_PENDING,
        unknown_ids: str = "error",
        warm_up: bool = True,
        workers: int = 1,
        on_fatal: Callable[[int], None] = exit_soon,
        exit_after_shutdown: bool = False,
    ) -> None:
        self.ranker, self.admin_token, self.workers = ranker, admin_token, workers
        self.body_timeout_s, self.max_pending, self.max_body = body_timeout_s, max_pending, ranker.limits.max_body_bytes
        self.warm_up, self.on_fatal, self.exit_after_shutdown = warm_up, on_fatal, exit_after_shutdown
        self.defaults = IdOptions(RAW, unknown_ids)  # what a request that names neither takes
        self.readiness = Readiness()
        self.metrics = ServerMetrics(ranker)
        self.batcher = (
            RequestBatcher(ranker, batch_window_ms, on_death=self._batcher_died, on_batch=self.metrics.observe_batch)
            if batching
            else None
        )
        self.pending = 0  # requests past their body and not yet answered: only the event loop's thread counts them

    def build(self) -> FastAPI:
        """The FastAPI app whose routes are this object's methods, behind the access log."""
        app = FastAPI(title="gr serving", description=__doc__, version="1", lifespan=self.lifespan)
        app.add_middleware(AccessLog)
        app.state.ranker = self.ranker
        app.exception_handler(Exception)(self.internal)
        handlers = {"rank": self.rank, "recommend": self.recommend, "generate": self.generate, "events": self.events}
        for path, keys, required, example, summary in VERBS:
            schema = _body_schema(keys, required, example)
            app.post(f"/v1/{path}", summary=summary, openapi_extra=schema)(self._route(path, handlers[path]))
        app.get("/healthz", summary="The process is alive")(self.healthz)
        app.get("/readyz", summary="The model is loaded and warmed up: the first answer will be fast")(self.readyz)
        app.get("/metrics", summary="Prometheus metrics")(self.prometheus)
        app.post(
            "/admin/reload",
            summary="Swap in another export (needs the admin token)",
            openapi_extra=_body_schema(("export_dir",), ("export_dir",), {"export_dir": "exports/new"}),
        )(self.reload)
        return app

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        """Start-up: the warm-up in the background (or ready at once); shut-down: close the metrics and,
        with exit_after_shutdown, end the process soon."""
        if self.warm_up:
            threading.Thread(target=self._warm_up, name="gr-warm-up", daemon=True).start()
        else:
            self.readiness.set("ready")
        yield
        self.metrics.close()
        if self.ranker.history_store is not None:
            self.ranker.history_store.close()
        self.ranker.cache.close()
        if self.exit_after_shutdown:
            exit_soon(0)

    def _warm_up(self) -> None:
        """``Ranker.warm_up``, then ready; a failed warm-up leaves the process failed (not ready), logged."""
        started = time.perf_counter()
        try:
            self.ranker.warm_up()
        except Exception as exc:
            log.error("warm-up failed; the server stays not ready: %r", exc, exc_info=exc)
            self.readiness.set("failed", f"warm-up failed: {type(exc).__name__}: {exc}"[:2000])
            return
        log.info("warmed up in %.1f s; ready", time.perf_counter() - started)
        self.readiness.set("ready")

    def _batcher_died(self, exc: BaseException) -> None:
        """The request batcher stopped: the process turns failed and ends (``on_fatal``)."""
        self.readiness.set("failed", f"the request batcher stopped: {exc!r}")
        self.on_fatal(EXIT_BATCHER_DIED)

    def _route(self, path: str, serve: Callable[[Any], Dict[str, Any]]) -> Callable[[Request], Awaitable[Response]]:
        """The endpoint of /v1/``path``: its only parameter is the request (FastAPI would read any other
        from the query string)."""

        async def endpoint(request: Request) -> Response:
            return await self.answer(path, request, serve)

        return endpoint

    async def answer(self, endpoint: str, request: Request, serve: Callable[[Any], Dict[str, Any]]) -> Response:
        """``serve`` (run in a worker thread) of the request's JSON body -> its JSON answer, or the JSON
        error of whatever went wrong; counted in the metrics (a client gone before its body is no error)."""
        self.metrics.requests.labels(endpoint).inc()
        started = time.perf_counter()
        try:
            response = self._json_answer(await self._served(request, serve))
        except ClientDisconnect:
            return self._client_gone(endpoint)
        except asyncio.CancelledError:  # only uvicorn cancels a request: its graceful shutdown timed out
            response = _error(503, "unavailable", "the server is shutting down; retry on another replica")
        except Exception as exc:
            response = _error_response(endpoint, exc)
        if response.status_code >= 400:
            kind = error_kind(response.status_code, bytes(response.body)) or ""
            self.metrics.errors.labels(endpoint, str(response.status_code), kind).inc()
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
        self.metrics.refresh()
        return response

    async def _served(self, request: Request, serve: Callable[[Any], Dict[str, Any]]) -> Dict[str, Any]:
        """The answer of ``serve`` to the request's body; Overloaded, before it runs, when ``max_pending``
        requests are already being served."""
        payload = await read_json(request, self.max_body, self.body_timeout_s)
        if self.pending >= self.max_pending:
            raise Overloaded(f"{self.max_pending} requests are being served (--max-pending); retry shortly")
        self.pending += 1
        try:
            return await run_in_threadpool(serve, payload)
        finally:
            self.pending -= 1

    def _json_answer(self, answer: Dict[str, Any]) -> Response:
        """``answer`` as JSON, its cache status, fallback and left-out history tokens counted; a ScoringError
        when it holds NaN or infinity."""
        if "cache_status" in answer:
            self.metrics.cache.labels(answer["cache_status"]).inc()
        if "fallback" in answer:
            self.metrics.fallbacks.labels(answer["fallback"]).inc()
        self.metrics.left_out.inc(answer.get("history_left_out", 0))
        try:
            return _json(answer)
        except ValueError as exc:  # json.dumps(allow_nan=False): a non-finite value got through
            raise ScoringError(str(exc)) from None

    def _client_gone(self, endpoint: str) -> Response:
        """The client closed its connection before its body arrived: nobody reads an answer, and it is
        no error of the server's; counted, and logged in one line."""
        self.metrics.disconnects.labels(endpoint).inc()
        log.info("%s: the client disconnected before its request body arrived", endpoint)
        return Response(status_code=499)  # never sent (the connection is gone); nginx's "client closed request"

    async def internal(self, request: Request, exc: Exception) -> Response:
        """The other endpoints' bugs: a 500 ``internal``, counted and logged."""
        self.metrics.errors.labels(request.url.path, "500", "internal").inc()
        return _internal(request.url.path, exc)

    def rank(self, payload: Any) -> Dict[str, Any]:
        """POST /v1/rank's body -> its answer (through the batcher when batching)."""
        request = RankRequest.from_dict(payload, "body", self.defaults)
        result = self.ranker.rank(request) if self.batcher is None else self.batcher.rank(request)
        return {"user_id": request.user_id, **result.to_json()}

    def recommend(self, payload: Any) -> Dict[str, Any]:
        """POST /v1/recommend's body -> its answer (through the batcher when batching)."""
        request = RecommendRequest.from_dict(payload, "body", self.defaults)
        result = self.ranker.recommend(request) if self.batcher is None else self.batcher.recommend(request)
        return {"user_id": request.user_id, **result.to_json()}

    def generate(self, payload: Any) -> Dict[str, Any]:
        """POST /v1/generate's body -> its answer."""
        request = GenerateRequest.from_dict(payload, "body", self.defaults)
        return {"user_id": request.user_id, **self.ranker.generate(request).to_json()}

    def events(self, payload: Any) -> Dict[str, Any]:
        """POST /v1/events's body -> {"user_id", "appended", "stored"} (``Ranker.append``)."""
        return self.ranker.append(EventsRequest.from_dict(payload, "body", self.defaults))

    # The routes' contracts are comments: FastAPI would publish an endpoint's docstring in /openapi.json.

    def healthz(self) -> Dict[str, str]:
        # GET /healthz: the process is alive.
        return {"status": "ok"}

    def readyz(self) -> Response:
        # GET /readyz: the readiness, the model version and export; 200 when ready, else 503.
        status, detail = self.readiness.get()
        ranker = self.ranker
        body = {"status": status, "model_version": ranker.cache.model_version, "export_dir": str(ranker.model.root)}
        return _json({**body, **({"detail": detail} if detail else {})}, 200 if status == "ready" else 503)

    def prometheus(self) -> Response:
        # GET /metrics: the Prometheus exposition, added up over the worker processes.
        return Response(self.metrics.exposition(), media_type=PROMETHEUS_TEXT)

    async def reload(self, request: Request) -> Response:
        # POST /admin/reload: load and warm up the body's export_dir, then swap it in; 404 without an
        # admin token, 401 without the right bearer, 409 with several workers, 400 for a bad body or
        # export (the old model keeps serving).
        refused = self._reload_refused(request)
        if refused is not None:
            return refused
        try:
            payload = await read_json(request, self.max_body, self.body_timeout_s)
        except ClientDisconnect:
            return self._client_gone("/admin/reload")
        except BodyError as exc:
            return _body_error(exc)
        except RequestError as exc:
            return _error(400, "bad_request", str(exc), "body")
        if isinstance(payload, dict) and set(payload) == {"export_dir"} and isinstance(payload["export_dir"], str):
            return await self._swap_in([Path(payload["export_dir"])])
        deltas = payload.get("deltas") if isinstance(payload, dict) and set(payload) == {"deltas"} else None
        if isinstance(deltas, list) and deltas and all(isinstance(d, str) for d in deltas):
            return await self._swap_in([Path(d) for d in deltas])
        return _error(
            400,
            "bad_request",
            'body: expected {"export_dir": "<export or delta path>"} or {"deltas": ["<delta path>", ...]}',
            "body.export_dir",
        )

    def _reload_refused(self, request: Request) -> Optional[Response]:
        """Why this server refuses the reload before reading its body (None: it does not)."""
        if self.admin_token is None:
            return _error(404, "not_found", "admin endpoints are off: start the server with --admin-token")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.admin_token}".encode()):
            return _error(401, "unauthorized", "expected the header Authorization: Bearer <admin token>")
        if self.workers > 1:
            return _error(
                409,
                "reload_unsupported",
                f"this server runs {self.workers} worker processes and a reload would swap only the one that "
                "answers; restart the server with the new export (replicas one at a time behind the load "
                "balancer), or run --workers 1 per replica",
            )
        return None

    async def _swap_in(self, paths: List[Path]) -> Response:
        """``Ranker.reload`` of an export or of deltas -> 200 with the new model version, or 400
        ``bad_export`` (logged) while the old model keeps serving."""
        given = " ".join(map(str, paths))
        try:
            await run_in_threadpool(self.ranker.reload, paths)
        except Exception as exc:  # a bad export: the old model keeps serving
            why = " ".join(str(exc).split())  # one log line
            log.warning("reload of %s refused, the previous model keeps serving: %s", given, why)
            return _error(400, "bad_export", f"body.export_dir: {exc}"[:2000], "body.export_dir")
        self.metrics.refresh()
        version = self.ranker.cache.model_version
        log.info("reloaded: serving %s (model %s, version %d)", given, self.ranker.model.identity[:12], version)
        return _json({"status": "reloaded", "model_version": version})


def create_app(
    ranker: Ranker,
    *,
    admin_token: Optional[str] = None,
    batching: bool = True,
    batch_window_ms: float = 0.0,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    max_pending: int = DEFAULT_MAX_PENDING,
    unknown_ids: str = "error",
    warm_up: bool = True,
    workers: int = 1,
    on_fatal: Callable[[int], None] = exit_soon,
    exit_after_shutdown: bool = False,
) -> FastAPI:
    """The FastAPI app of ``ServingApp`` over ``ranker`` (its options are documented there); ValueError
    for an unknown_ids other than "error" or "oov"."""
    if unknown_ids not in UNKNOWN_IDS:
        raise ValueError(f"create_app: unknown_ids: expected one of {list(UNKNOWN_IDS)}, got {unknown_ids!r}")
    return ServingApp(
        ranker,
        admin_token=admin_token,
        batching=batching,
        batch_window_ms=batch_window_ms,
        body_timeout_s=body_timeout_s,
        max_pending=max_pending,
        unknown_ids=unknown_ids,
        warm_up=warm_up,
        workers=workers,
        on_fatal=on_fatal,
        exit_after_shutdown=exit_after_shutdown,
    ).build()


OPTIONS_ENV = "GR_SERVING_OPTIONS"


def app_from_environment() -> FastAPI:
    """The app of one uvicorn worker process: ``$GR_SERVING_OPTIONS`` holds the JSON of
    {"export_dir", "admin_token", "history_store" (None: off) and "history_events", the tiers'
    "tier_path" (None: no shared tier), "tier_bytes" and "tier_redis" (None: no remote tier), and
    Ranker options} that ``python -m gr.serving serve`` set."""
    options = json.loads(os.environ[OPTIONS_ENV])
    export_dir, admin_token = options.pop("export_dir"), options.pop("admin_token")
    app_options = {
        key: options.pop(key)
        for key in ("batching", "batch_window_ms", "body_timeout_s", "max_pending", "unknown_ids", "workers")
        if key in options
    }
    limits = limits_from_options(options.pop("limits", {}))
    store, events = options.pop("history_store", None), options.pop("history_events", None)
    tier_path, tier_bytes, tier_redis = (
        options.pop("tier_path", None),
        options.pop("tier_bytes", 0),
        options.pop("tier_redis", None),
    )
    options["tiers"] = open_tiers(tier_path, tier_bytes, tier_redis)
    ranker = Ranker.load(export_dir, limits=limits, history_events=events, **options)
    if store is not None:
        ranker.history_store = open_history_store(store, events or ranker.model.config.max_seq_len)
    return create_app(ranker, admin_token=admin_token, exit_after_shutdown=True, **app_options)
