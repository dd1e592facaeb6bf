"""Bounds on what one request may ask of the service: its size and its work.

Each limit has a documented default and a ``serve`` flag (``python -m gr.serving serve --help``).
A request past one is refused before it does any work: ``LimitError`` (a ``RequestError``, HTTP
400 ``limit_exceeded``) naming the field, the limit and its flag; a body past ``max_body_bytes``
is refused with HTTP 413 before it is read whole, and one that has not arrived whole within the body
timeout (``--body-timeout``) with HTTP 408.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Hashable

from gr.serving.errors import RequestError
from gr.timestamps import INT64_MAX, INT64_MIN


class LimitError(RequestError):
    """A request past one of the service's ``RequestLimits``."""


DESCRIPTIONS = {
    "max_body_bytes": "request body bytes; a larger body is refused with 413 before it is read whole",
    "max_history_tokens": "history tokens a request may send (before truncation to max_seq_len)",
    "max_candidates": "candidates of one rank request",
    "max_k": "items one recommend or generate request may ask for",
    "max_beam_width": "beams of a beam-search generate request",
    "max_user_id_bytes": "UTF-8 bytes of a string user id (an integer id must fit int64)",
}


@dataclass(frozen=True)
class RequestLimits:
    """Each field is the bound DESCRIPTIONS describes, an integer >= 1."""

    max_body_bytes: int = 8 * 2**20
    max_history_tokens: int = 10_000
    max_candidates: int = 10_000
    max_k: int = 1_000
    max_beam_width: int = 64
    max_user_id_bytes: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RequestLimits.{f.name}: expected an integer >= 1, got {value!r}")

    def check_count(self, count: int, limit: str, where: str, what: str) -> None:
        """Refuse ``count`` items of ``where`` past the limit named ``limit`` (a field of this class)."""
        bound = getattr(self, limit)
        if count > bound:
            raise LimitError(f"{where}: {count} {what} exceed the limit {bound} ({flag(limit)})")

    def check_user_id(self, user: Hashable, where: str = "user_id") -> None:
        """A user id: a string of at most max_user_id_bytes UTF-8 bytes, or an integer in int64."""
        if isinstance(user, str):
            self.check_count(len(user.encode("utf-8", "surrogatepass")), "max_user_id_bytes", where, "bytes")
        elif isinstance(user, int) and not INT64_MIN <= user <= INT64_MAX:
            raise RequestError(f"{where}: integer ids must fit int64, got {user}")


DEFAULT_LIMITS = RequestLimits()
DEFAULT_BODY_TIMEOUT_S = 30.0  # a request body not received whole this long after its headers is a 408
BODY_TIMEOUT_FLAG = "--body-timeout"
# Requests one server process serves at once (past their body, queued or running): one more is a 503
# "overloaded" at once. 256 at ~10 ms a request is ~2.5 s of queue, beyond which a client is better
# served by a retry on another replica than by waiting.
DEFAULT_MAX_PENDING = 256
MAX_PENDING_FLAG = "--max-pending"


def flag(limit: str) -> str:
    """The ``serve`` flag of a RequestLimits field: max_k -> --max-k."""
    return "--" + limit.replace("_", "-")


def limits_from_options(options: dict) -> RequestLimits:
    """RequestLimits from ``{field: value}``, e.g. parsed flags; fields left out keep their defaults."""
    names = {f.name for f in fields(RequestLimits)}
    given: dict[str, Any] = {name: options[name] for name in names if options.get(name) is not None}
    return RequestLimits(**given)
