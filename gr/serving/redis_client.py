"""A Redis database as the serving stores open it: a client that has answered a PING, and the
database's address for log lines (without a password). Needs the ``redis`` client package."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis


def connect(url: str, timeout_s: float, decode_responses: bool = False) -> redis.Redis:
    """A client of the database at ``url`` (``redis://host:port/db``) that answered a PING within
    ``timeout_s`` (connect and socket timeouts); raises ``redis.RedisError`` or ``ValueError``."""
    client = redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=decode_responses
    )
    client.ping()
    return client


def location(url: str) -> str:
    """``url`` without its user and password: what a log line names."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
