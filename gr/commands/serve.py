"""``gr serve EXPORT_DIR [--host 127.0.0.1] [--port 8000] [--workers N]`` serves
the export over HTTP (``gr.serving.http``);
``gr rank EXPORT_DIR --request request.json`` prints the scores as JSON;
``gr recommend EXPORT_DIR --request request.json --k 10`` prints each user's top k
catalogue items and their scores (retrieval exports);
``gr generate EXPORT_DIR --request request.json --k 10`` prints each user's
next k items and their log-probabilities (greedy; recommend and generate need no ``candidates``:
a rank request's file serves too; ``--k``, when given, wins over each request's own ``k``, which
otherwise applies, else 10).
Each takes ``--device cpu|cuda|npu`` (default cpu): where the ONNX slices (through that device's
execution provider), the HSTU engine and its caches run; a device this host cannot serve on is
one error line and exit status 2.

``serve`` binds its address before anything loads (a port in use or a host that does not resolve is
one line and exit status 2), then logs on stderr (``--log-format text|json``, ``gr.serving.logs``):
one start-up line (export, model version: the MANIFEST's digest, device, workers, the history store,
address), one access line per request, a warning for each worker that ends and the one started in
its place (``--workers N``), and one line when it stops.

request.json holds one request object (see ``gr.serving.request``) or a list of them.
A bad request prints ``{"error": ...}`` in its place; the exit status is then 2.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from gr.export.format import ExportFormatError
from gr.export.manifest import manifest_digest
from gr.serving.errors import RequestError
from gr.serving.limits import (
    BODY_TIMEOUT_FLAG,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_LIMITS,
    DEFAULT_MAX_PENDING,
    DESCRIPTIONS,
    MAX_PENDING_FLAG,
    flag,
)
from gr.serving.logs import LOG_FORMATS, log_config
from gr.serving.options import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_MICRO_BATCH,
    DEFAULT_PAGE_SIZE,
    DEFAULT_TIER_BYTES,
    DEFAULT_TIER_MIN_TOKENS,
    ID_SPACES,
    INDEXES,
    LONG_HISTORY,
    UNKNOWN_IDS,
)
from gr.utils.devices import DEVICES
from gr.utils.scratch_dir import ScratchDirectory

if TYPE_CHECKING:
    from gr.serving.runtime import Ranker

ADMIN_TOKEN_ENV = "GR_ADMIN_TOKEN"
DEFAULT_HISTORY_STORE = "gr-histories.sqlite"  # in the working directory
HISTORY_STORE_OFF = "off"
GRACEFUL_SHUTDOWN_S = 5  # SIGTERM: requests in flight get this long, then a 503 (gr.serving.http)

IDS_HELP = "ids of requests without an 'ids' key: raw (through sparse/id_maps) or model (table rows)"
UNKNOWN_IDS_HELP = (
    "unknown raw ids of requests without an 'unknown_ids' key: error (a 400), or oov (row 0 where a map has "
    "one; a history token of an item the export has no row for is left out)"
)
DEVICE_HELP = "where the ONNX slices, the HSTU engine and its caches run (default cpu)"
log = logging.getLogger("gr.serve")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gr", description="Serve an exported gr model (also: python -m gr.serving).")
    commands = parser.add_subparsers(dest="command", required=True)
    rank = commands.add_parser("rank", help="score the candidates of one or more requests")
    rank.add_argument("export_dir", type=Path)
    rank.add_argument("--request", type=Path, required=True, help="JSON file: a request object or a list of them")
    rank.add_argument("--micro-batch", type=int, default=DEFAULT_MICRO_BATCH, help="candidates per HSTU pass")
    rank.add_argument(
        "--long-history",
        choices=LONG_HISTORY,
        default="truncate",
        help="histories longer than max_seq_len: keep the most recent tokens, or refuse",
    )
    rank.add_argument("--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES)
    rank.add_argument("--no-cache", action="store_true", help="one target-aware pass per request, no history cache")
    rank.add_argument("--ids", choices=ID_SPACES, default="raw", help=IDS_HELP)
    rank.add_argument("--unknown-ids", choices=UNKNOWN_IDS, default="error", help=UNKNOWN_IDS_HELP)
    rank.add_argument("--device", choices=DEVICES, default="cpu", help=DEVICE_HELP)
    for verb, text in (
        ("recommend", "each request's user's top k catalogue items and their scores (retrieval exports)"),
        ("generate", "generate each request's user's next k items and their log-probabilities (greedy)"),
    ):
        top_k = commands.add_parser(verb, help=text)
        top_k.add_argument("export_dir", type=Path)
        top_k.add_argument("--request", type=Path, required=True, help="JSON file: a request object or a list of them")
        top_k.add_argument(
            "--k",
            type=int,
            default=None,
            help="items per user; given, it wins over a request's own k (default: its k, or 10)",
        )
        top_k.add_argument("--ids", choices=ID_SPACES, default="raw", help=IDS_HELP)
        top_k.add_argument("--unknown-ids", choices=UNKNOWN_IDS, default="error", help=UNKNOWN_IDS_HELP)
        top_k.add_argument("--device", choices=DEVICES, default="cpu", help=DEVICE_HELP)
    serve = commands.add_parser("serve", help="serve the export over HTTP (FastAPI + uvicorn)")
    serve.add_argument("export_dir", type=Path)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1, help="server processes, each with its own model and cache")
    serve.add_argument("--micro-batch", type=int, default=DEFAULT_MICRO_BATCH, help="candidates per HSTU pass")
    serve.add_argument("--long-history", choices=LONG_HISTORY, default="truncate")
    serve.add_argument("--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES)
    serve.add_argument(
        "--page-size",
        type=int,
        default=DEFAULT_PAGE_SIZE,
        help=f"tokens per page of the cached histories' K/V (one pool of --cache-bytes per worker; 0: each history "
        f"in its own tensors, copied when it grows; default {DEFAULT_PAGE_SIZE})",
    )
    serve.add_argument(
        "--tier-bytes",
        type=int,
        default=DEFAULT_TIER_BYTES,
        help="bytes of the shared tier every worker reads and writes: encoded histories in shared memory, fetched "
        "instead of encoded again when a user's request lands on another worker or was evicted (0: off; default "
        f"{DEFAULT_TIER_BYTES})",
    )
    serve.add_argument(
        "--tier-redis",
        default=None,
        help="redis://host:port/db: the remote tier, encoded histories shared by servers on several machines "
        "(behind the shared tier; bound it with Redis' maxmemory and allkeys-lru; default: off)",
    )
    serve.add_argument(
        "--tier-min-tokens",
        type=_min_tokens,
        default="auto",
        help="histories shorter than this are encoded, never fetched from nor written to a tier: encoding them "
        "costs less than fetching; auto (default): where that line lies, measured for the model at start-up and "
        f"at each reload (a number: fixed; {DEFAULT_TIER_MIN_TOKENS} suits models whose passes cost milliseconds)",
    )
    serve.add_argument("--threads", type=int, default=None, help="intra-op threads per ONNX Runtime session")
    serve.add_argument("--device", choices=DEVICES, default="cpu", help=DEVICE_HELP)
    serve.add_argument("--unknown-ids", choices=UNKNOWN_IDS, default="error", help=UNKNOWN_IDS_HELP)
    serve.add_argument(
        "--index",
        choices=INDEXES,
        default="exact",
        help="catalogue search of recommend/generate: exact, or hnsw (approximate; needs faiss-cpu)",
    )
    serve.add_argument(
        "--no-batching",
        action="store_true",
        help="run each rank request on its own (default: requests arriving while a batch runs form the next one)",
    )
    serve.add_argument(
        "--batch-window-ms",
        type=float,
        default=0.0,
        help="how long a batch waits after its first request for others to join (default 0)",
    )
    for name, text in DESCRIPTIONS.items():
        default = getattr(DEFAULT_LIMITS, name)
        serve.add_argument(flag(name), type=int, default=default, help=f"{text} (default {default})")
    serve.add_argument(
        BODY_TIMEOUT_FLAG,
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request body may take to arrive after its headers; a slower one is answered 408 and its "
        f"connection closed (default {DEFAULT_BODY_TIMEOUT_S:g})",
    )
    serve.add_argument(
        MAX_PENDING_FLAG,
        type=int,
        default=DEFAULT_MAX_PENDING,
        help="rank, recommend and generate requests a worker process serves at once, queued or running; one more "
        f"is answered 503 overloaded with Retry-After: 1 (default {DEFAULT_MAX_PENDING})",
    )
    serve.add_argument(
        "--history-store",
        default=DEFAULT_HISTORY_STORE,
        help="where the users' histories that POST /v1/events appends to are kept: an SQLite file (default "
        f"{DEFAULT_HISTORY_STORE} in the working directory, created when missing, kept across restarts), a Redis URL "
        f"redis://host:port/db shared by several servers, or {HISTORY_STORE_OFF} (every request carries its history)",
    )
    serve.add_argument(
        "--history-events",
        type=int,
        default=None,
        help="events kept per user, the most recent (default: the model's max_seq_len)",
    )
    serve.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="stderr log lines: text, or json (one JSON object a line); one access line per request",
    )
    serve.add_argument(
        "--admin-token",
        default=None,
        help="enables POST /admin/reload for 'Authorization: Bearer <token>' (default: off); "
        f"or set ${ADMIN_TOKEN_ENV}",
    )
    args = parser.parse_args(argv)
    # The serving runtime (torch, ONNX Runtime) loads once the arguments parse: --help and usage errors go without.
    from gr.serving.model import check_device
    from gr.serving.runtime import Ranker

    try:
        check_device(args.device)
    except RuntimeError as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return _serve(args)
    if args.command in ("recommend", "generate"):
        args.micro_batch, args.long_history, args.cache_bytes, args.no_cache = (
            DEFAULT_MICRO_BATCH,
            "truncate",
            DEFAULT_CACHE_BYTES,
            False,
        )

    try:
        payload = json.loads(args.request.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"--request {args.request}: cannot read JSON: {exc}", file=sys.stderr)
        return 2
    try:
        ranker = Ranker.load(
            args.export_dir,
            cache_bytes=args.cache_bytes,
            micro_batch=args.micro_batch,
            long_history=args.long_history,
            device=args.device,
        )
    except (ExportFormatError, OSError, ValueError) as exc:
        print(f"{args.command}: {args.export_dir}: not a valid export: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    single = not isinstance(payload, list)
    serve_one = _rank_one if args.command == "rank" else _top_k_one
    outputs = [
        serve_one(ranker, item, "request" if single else f"request[{i}]", args)
        for i, item in enumerate([payload] if single else payload)
    ]
    print(json.dumps(outputs[0] if single else outputs))
    failed = [o["error"] for o in outputs if "error" in o]
    for message in failed:
        print(message, file=sys.stderr)
    return 2 if failed else 0


def _min_tokens(value: str) -> Any:
    """--tier-min-tokens: "auto" or an int (its range is checked with the other options)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or auto, got {value!r}") from None


def _rank_one(ranker: Ranker, item: Any, where: str, args: argparse.Namespace) -> Dict[str, Any]:
    from gr.serving.request import IdOptions, RankRequest  # loaded by main

    try:
        request = RankRequest.from_dict(item, where, IdOptions(args.ids, args.unknown_ids))
        result = ranker.rank(request, use_cache=not args.no_cache)
    except RequestError as exc:
        return _error(where, exc)
    return {"user_id": request.user_id, **result.to_json()}


def _top_k_one(ranker: Ranker, item: Any, where: str, args: argparse.Namespace) -> Dict[str, Any]:
    """One recommend or generate request (``args.command``) -> its JSON answer or error."""
    from gr.serving.request import GenerateRequest, IdOptions, RecommendRequest  # loaded by main

    kind: Any = RecommendRequest if args.command == "recommend" else GenerateRequest
    try:
        if isinstance(item, dict):  # a rank request's file serves too: its candidates are not needed
            item = {key: value for key, value in item.items() if key != "candidates"}
            if args.k is not None:
                item["k"] = args.k
        request = kind.from_dict(item, where, IdOptions(args.ids, args.unknown_ids))
        result = ranker.recommend(request) if args.command == "recommend" else ranker.generate(request)
    except RequestError as exc:
        return _error(where, exc)
    return {"user_id": request.user_id, **result.to_json()}


def _serve(args: argparse.Namespace) -> int:
    """Check the export, options and address (one clear line and exit 2 on a problem), then run uvicorn."""
    import uvicorn

    from gr.export.reader import check_export  # the export reader (torch, onnx), as the runtime in main
    from gr.serving.http import OPTIONS_ENV  # the HTTP stack (fastapi), loaded by serve only, as uvicorn
    from gr.serving.metrics import MULTIPROC_ENV
    from gr.serving.tier_spec import TIER_FILE
    from gr.serving.workers import LoggedMultiprocess

    if (
        args.workers < 1
        or not 0 < args.port < 65536
        or args.micro_batch < 1
        or args.cache_bytes < 0
        or args.page_size < 0
        or args.tier_bytes < 0
        or (args.tier_min_tokens != "auto" and args.tier_min_tokens < 1)
        or args.batch_window_ms < 0
        or not 0 < args.body_timeout < float("inf")
        or args.max_pending < 1
    ):
        print(
            "serve: expected --workers >= 1, --port in 1..65535, --micro-batch >= 1, --cache-bytes >= 0, "
            "--page-size >= 0, --tier-bytes >= 0, --tier-min-tokens >= 1 (or auto), --batch-window-ms >= 0, "
            f"{BODY_TIMEOUT_FLAG} > 0 (finite), {MAX_PENDING_FLAG} >= 1",
            file=sys.stderr,
        )
        return 2
    limits = {name: getattr(args, name) for name in DESCRIPTIONS}
    for name, value in limits.items():
        if value < 1:
            print(f"serve: {flag(name)}: expected an integer >= 1, got {value}", file=sys.stderr)
            return 2
    check: List[object]
    try:
        check = list(check_export(args.export_dir))
    except OSError as exc:
        check = [str(exc)]
    if check:
        print(
            f"serve: {args.export_dir}: not a valid export: {' '.join('; '.join(map(str, check)).split())}",
            file=sys.stderr,
        )
        return 2
    try:  # before anything is set up: a port in use or a bad host is one line
        sock = listen(args.host, args.port)
    except ValueError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    try:
        store, histories = _history_store(args)
        tier_dir, tiers = _tiers(args)
    except ValueError as exc:
        sock.close()
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    # every worker writes its metrics here, and /metrics adds them up (gr.serving.metrics)
    metrics_dir = ScratchDirectory("gr-metrics-") if args.workers > 1 else None
    if metrics_dir is not None:
        os.environ[MULTIPROC_ENV] = str(metrics_dir.path)
    os.environ[OPTIONS_ENV] = json.dumps(
        {
            "export_dir": str(args.export_dir.resolve()),
            "admin_token": token,
            "history_store": store,
            "history_events": args.history_events,
            "batching": not args.no_batching,
            "batch_window_ms": args.batch_window_ms,
            "body_timeout_s": args.body_timeout,
            "max_pending": args.max_pending,
            "unknown_ids": args.unknown_ids,
            "micro_batch": args.micro_batch,
            "long_history": args.long_history,
            "cache_bytes": args.cache_bytes,
            "page_size": args.page_size,
            "tier_path": None if tier_dir is None else str(tier_dir.path / TIER_FILE),
            "tier_bytes": args.tier_bytes,
            "tier_redis": args.tier_redis,
            "tier_min_tokens": args.tier_min_tokens,
            "threads": args.threads,
            "index": args.index,
            "device": args.device,
            "workers": args.workers,
            "limits": limits,
        }
    )
    config = uvicorn.Config(
        "gr.serving.http:app_from_environment",
        factory=True,
        workers=args.workers,
        log_config=log_config(args.log_format),  # the gr loggers on stderr; uvicorn's at WARNING
        access_log=False,  # gr.serving.logs.AccessLog writes the access lines
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"
    workers = f"{args.workers} worker{'s' if args.workers > 1 else ''}"
    version = manifest_digest(args.export_dir)
    log.info(
        "serving %s (model %s, %s, %s, histories: %s%s) on %s",
        args.export_dir,
        version,
        args.device,
        workers,
        histories,
        f", tiers: {tiers}" if tiers else "",
        url,
    )
    started = True
    try:
        if args.workers > 1:
            LoggedMultiprocess(config, sockets=[sock]).run()
        else:
            started = _run_one(uvicorn.Server(config), sock)
    except SystemExit:  # uvicorn's exit when the app does not load: it logged why
        started = False
    finally:
        sock.close()
        for scratch in (metrics_dir, tier_dir):
            if scratch is not None:
                scratch.close()
    if not started:
        print(f"serve: {args.export_dir}: the server did not start (the log above says why)", file=sys.stderr)
        return 1
    log.info("stopped serving on %s (started with %s; reloads log what followed)", url, args.export_dir)
    return 0


def _history_store(args: argparse.Namespace) -> Tuple[Optional[str], str]:
    """``--history-store`` as the workers open it (None: off; an SQLite file's absolute path) and
    where it keeps the histories, for the start-up line (a Redis URL without its password); opened
    once here, so that a store that cannot be opened is one line (ValueError) before the server
    starts."""
    from gr.serving.history_store import HistoryStoreError
    from gr.serving.history_store_spec import REDIS_SCHEMES, open_history_store

    if args.history_events is not None and args.history_events < 1:
        raise ValueError(f"--history-events: expected an integer >= 1, got {args.history_events}")
    if args.history_store == HISTORY_STORE_OFF:
        return None, HISTORY_STORE_OFF
    spec = args.history_store
    if not spec.startswith(REDIS_SCHEMES):
        spec = str(Path(spec).resolve())
    try:
        store = open_history_store(spec, args.history_events or 1)
    except HistoryStoreError as exc:
        raise ValueError(f"--history-store {args.history_store}: {exc}") from None
    store.close()
    return spec, store.location


def _tiers(args: argparse.Namespace) -> Tuple[Optional[ScratchDirectory], str]:
    """The shared tier's new directory (``--tier-bytes`` > 0; None: off) and the tiers, for the
    start-up line; each opened once here, so that one that cannot be opened is one line
    (ValueError) before the server starts."""
    from gr.serving.shared_tier import TierError
    from gr.serving.tier_spec import TIER_FILE, open_tiers, tier_directory

    directory = tier_directory() if args.tier_bytes > 0 else None
    try:
        tiers = open_tiers(
            None if directory is None else str(directory.path / TIER_FILE), args.tier_bytes, args.tier_redis
        )
    except TierError as exc:
        if directory is not None:
            directory.close()
        flag = "--tier-redis" if args.tier_redis and "remote" in str(exc) else "--tier-bytes"
        raise ValueError(f"{flag}: {exc}") from None
    for tier in tiers:
        tier.close()
    return directory, ", ".join(f"{tier.name} {tier.location}" for tier in tiers)


def _run_one(server: Any, sock: socket.socket) -> bool:
    """Run one uvicorn ``server`` on ``sock`` until it has shut down -> whether it started. uvicorn
    handles SIGINT and SIGTERM (a graceful shutdown), then raises them again at the handlers it
    found: these let this function return, so that the shutdown is logged."""
    handlers = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return bool(server.started)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port for uvicorn (which listens on it), inheritable by worker
    processes; ValueError in one line for a host that does not resolve or an address in use."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"--host {host}: cannot resolve it ({getattr(exc, 'strerror', None) or exc})") from None
    sock = socket.socket(family, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = "the address is in use: another process listens there" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise ValueError(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


def _error(where: str, exc: RequestError) -> Dict[str, Any]:
    return {"error": f"{where}: {exc}" if not str(exc).startswith(where) else str(exc)}


if __name__ == "__main__":
    sys.exit(main())
