"""The service's log: one access line per request, and the log configuration of ``gr serve``.

``AccessLog`` wraps the ASGI app: every request gets a request id (the client's ``X-Request-Id``
when it sends a usable one, else a new one), echoed in the response's ``X-Request-Id`` header, and
one line on the ``gr.access`` logger when its answer is sent: method, path, status, milliseconds,
the error kind (the ``error`` of a JSON error body, else the HTTP status phrase; none for a
success: ``-`` in text, null in JSON) and the request id. The path is the client's, percent-decoded:
it is logged as ``logged_path`` writes it (its first ``MAX_LOGGED_PATH`` characters, control
characters escaped), in both formats, so that a request can neither write a line of its own nor
fill the log. ``log_config(fmt)`` is the ``logging.config.dictConfig`` that ``gr serve`` hands
uvicorn: the ``gr`` loggers at INFO on stderr (uvicorn's own at WARNING; its access log is off,
this one replaces it), as text lines or (``json``) one JSON object a line.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from http import HTTPStatus
from typing import Any, Awaitable, Callable, Dict, MutableMapping, Optional

LOG_FORMATS = ("text", "json")
ACCESS_LOGGER = "gr.access"
REQUEST_ID_HEADER = "x-request-id"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_FIELDS = ("method", "path", "status", "ms", "error", "request_id")
MAX_ERROR_BODY = 1 << 16  # error bodies are small JSON objects; a larger one is not parsed
_USABLE_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
MAX_LOGGED_PATH = 1024  # characters of a request path an access line keeps
_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

access_log = logging.getLogger(ACCESS_LOGGER)


class AccessLog:
    """ASGI middleware: a request id for every HTTP request and one access line when it is answered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        given = headers.get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given if _USABLE_ID.fullmatch(given) else uuid.uuid4().hex
        started, status, body = time.perf_counter(), 0, bytearray()

        async def send_logged(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (REQUEST_ID_HEADER.encode(), request_id.encode())]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < MAX_ERROR_BODY:
                body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            record = {
                "method": scope["method"],
                "path": logged_path(scope["path"]),
                "status": status,
                "ms": round((time.perf_counter() - started) * 1e3, 2),
                "error": error_kind(status, bytes(body)),
                "request_id": request_id,
            }
            access_log.info(
                "%(method)s %(path)s %(status)d %(ms).1f ms error=%(error)s request_id=%(request_id)s",
                {**record, "error": record["error"] or "-"},
                extra={"access": record},
            )


def logged_path(path: str) -> str:
    """``path`` as an access line shows it: its first ``MAX_LOGGED_PATH`` characters, the backslash
    and every character that is not printable (CR, LF, ESC, other controls, line separators)
    escaped as Python writes them (``\\r``, ``\\n``, ``\\x1b``, ``\\u2028``); a longer path ends in
    ``...[cut: N characters]``, N its length."""
    shown = path[:MAX_LOGGED_PATH]
    if not shown.isprintable() or "\\" in shown:
        shown = "".join(_ESCAPES.get(char) or (char if char.isprintable() else _escaped(char)) for char in shown)
    return shown if len(path) <= MAX_LOGGED_PATH else f"{shown}...[cut: {len(path)} characters]"


def _escaped(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def error_kind(status: int, body: bytes) -> Optional[str]:
    """The error an answer reports: None below 400, else the JSON body's "error" (the service's
    error kinds), else the status phrase in snake case ("not_found"); status 0: no answer was sent."""
    if status == 0:
        return "no_response"
    if status < 400:
        return None
    try:
        kind = json.loads(body).get("error")
    except (ValueError, AttributeError):
        kind = None
    if isinstance(kind, str) and kind:
        return kind
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return f"http_{status}"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message; an access line's fields at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        line: Dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "access", {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def log_config(fmt: str = "text") -> Dict[str, Any]:
    """The dictConfig of a server process for log format ``fmt`` ("text" or "json")."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format: expected one of {list(LOG_FORMATS)}, got {fmt!r}")
    formatter = {"()": f"{__name__}.JsonFormatter"} if fmt == "json" else {"format": TEXT_FORMAT}
    handler = {"class": "logging.StreamHandler", "formatter": "gr", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"gr": formatter},
        "handlers": {"stderr": handler},
        "loggers": {
            "gr": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
            "uvicorn": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
        },
    }
