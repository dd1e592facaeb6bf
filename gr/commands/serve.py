"""``python -m gr.serving serve EXPORT_DIR [--host 127.0.0.1] [--port 8000] [--workers N]`` serves
the export over HTTP (``gr.serving.http``);
``python -m gr.serving rank EXPORT_DIR --request request.json`` prints the scores as JSON;
``python -m gr.serving generate EXPORT_DIR --request request.json --k 10`` prints each user's
next k items (greedy; the request's ``candidates`` are not needed).
Each takes ``--device cpu|cuda|npu`` (default cpu): where the ONNX slices (through that device's
execution provider), the HSTU engine and its caches run; a device this host cannot serve on is
one error line and exit status 2.

request.json holds one request object (see ``gr.serving.request``) or a list of them.
A bad request prints ``{"error": ...}`` in its place; the exit status is then 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

from gr.export.format import ExportFormatError
from gr.export.reader import check_export
from gr.serving.catalogue import INDEXES
from gr.serving.errors import RequestError
from gr.serving.id_maps import ID_SPACES
from gr.serving.limits import BODY_TIMEOUT_FLAG, DEFAULT_BODY_TIMEOUT_S, DEFAULT_LIMITS, DESCRIPTIONS, flag
from gr.serving.metrics import MULTIPROC_ENV
from gr.serving.model import check_device
from gr.serving.request import GenerateRequest, RankRequest
from gr.serving.runtime import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_MICRO_BATCH,
    LONG_HISTORY,
    Ranker,
)
from gr.utils.devices import DEVICES

ADMIN_TOKEN_ENV = "GR_ADMIN_TOKEN"
GRACEFUL_SHUTDOWN_S = 5  # SIGTERM: requests in flight get this long, then a 503 (gr.serving.http)

IDS_HELP = "ids of requests without an 'ids' key: raw (through sparse/id_maps) or model (table rows)"
DEVICE_HELP = "where the ONNX slices, the HSTU engine and its caches run (default cpu)"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gr.serving", description="Serve an exported gr model.")
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
    rank.add_argument("--device", choices=DEVICES, default="cpu", help=DEVICE_HELP)
    gen = commands.add_parser("generate", help="generate each request's user's next k items (greedy)")
    gen.add_argument("export_dir", type=Path)
    gen.add_argument("--request", type=Path, required=True, help="JSON file: a request object or a list of them")
    gen.add_argument("--k", type=int, default=10, help="items to generate per user")
    gen.add_argument("--ids", choices=ID_SPACES, default="raw", help=IDS_HELP)
    gen.add_argument("--device", choices=DEVICES, default="cpu", help=DEVICE_HELP)
    serve = commands.add_parser("serve", help="serve the export over HTTP (FastAPI + uvicorn)")
    serve.add_argument("export_dir", type=Path)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1, help="server processes, each with its own model and cache")
    serve.add_argument("--micro-batch", type=int, default=DEFAULT_MICRO_BATCH, help="candidates per HSTU pass")
    serve.add_argument("--long-history", choices=LONG_HISTORY, default="truncate")
    serve.add_argument("--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES)
    serve.add_argument("--threads", type=int, default=None, help="intra-op threads per ONNX Runtime session")
    serve.add_argument("--device", choices=DEVICES, default="cpu", help=DEVICE_HELP)
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
        "--admin-token",
        default=None,
        help="enables POST /admin/reload for 'Authorization: Bearer <token>' (default: off); "
        f"or set ${ADMIN_TOKEN_ENV}",
    )
    args = parser.parse_args(argv)
    try:
        check_device(args.device)
    except RuntimeError as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return _serve(args)
    if args.command == "generate":
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
    serve_one = _rank_one if args.command == "rank" else _generate_one
    outputs = [
        serve_one(ranker, item, "request" if single else f"request[{i}]", args)
        for i, item in enumerate([payload] if single else payload)
    ]
    print(json.dumps(outputs[0] if single else outputs))
    failed = [o["error"] for o in outputs if "error" in o]
    for message in failed:
        print(message, file=sys.stderr)
    return 2 if failed else 0


def _rank_one(ranker: Ranker, item: Any, where: str, args: argparse.Namespace) -> Dict[str, Any]:
    try:
        request = RankRequest.from_dict(item, where, default_ids=args.ids)
        result = ranker.rank(request, use_cache=not args.no_cache)
    except RequestError as exc:
        return _error(where, exc)
    return {"user_id": request.user_id, **result.to_json()}


def _generate_one(ranker: Ranker, item: Any, where: str, args: argparse.Namespace) -> Dict[str, Any]:
    try:
        if isinstance(item, dict):  # a rank request's file serves too: its candidates are not needed
            item = {"k": args.k, **{key: value for key, value in item.items() if key != "candidates"}}
        request = GenerateRequest.from_dict(item, where, default_ids=args.ids)
        result = ranker.generate(request)
    except RequestError as exc:
        return _error(where, exc)
    return {"user_id": request.user_id, **result.to_json()}


def _serve(args: argparse.Namespace) -> int:
    """Check the export and options (one clear line and exit 2 on a problem), then run uvicorn."""
    import uvicorn

    from gr.serving.http import OPTIONS_ENV  # the HTTP stack (fastapi), loaded by serve only, as uvicorn

    if (
        args.workers < 1
        or not 0 < args.port < 65536
        or args.micro_batch < 1
        or args.cache_bytes < 0
        or args.batch_window_ms < 0
        or not 0 < args.body_timeout < float("inf")
    ):
        print(
            "serve: expected --workers >= 1, --port in 1..65535, --micro-batch >= 1, --cache-bytes >= 0, "
            f"--batch-window-ms >= 0, {BODY_TIMEOUT_FLAG} > 0 (finite)",
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
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    if args.workers > 1:  # every worker writes its metrics here, and /metrics adds them up (gr.serving.metrics)
        metrics_dir = tempfile.mkdtemp(prefix="gr-metrics-")
        os.environ[MULTIPROC_ENV] = metrics_dir
    os.environ[OPTIONS_ENV] = json.dumps(
        {
            "export_dir": str(args.export_dir.resolve()),
            "admin_token": token,
            "batching": not args.no_batching,
            "batch_window_ms": args.batch_window_ms,
            "body_timeout_s": args.body_timeout,
            "micro_batch": args.micro_batch,
            "long_history": args.long_history,
            "cache_bytes": args.cache_bytes,
            "threads": args.threads,
            "index": args.index,
            "device": args.device,
            "workers": args.workers,
            "limits": limits,
        }
    )
    try:
        uvicorn.run(
            "gr.serving.http:app_from_environment",
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level="warning",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    except (OSError, SystemExit) as exc:
        print(f"serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.workers > 1:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def _error(where: str, exc: RequestError) -> Dict[str, Any]:
    return {"error": f"{where}: {exc}" if not str(exc).startswith(where) else str(exc)}


if __name__ == "__main__":
    sys.exit(main())
