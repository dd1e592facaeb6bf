"""The timestamp policy for a user's history, shared by every path that takes one as given
(HTTP requests, ``gr predict`` rows).

* A history is given oldest first, and its timestamps must be non-decreasing. Out-of-order
  timestamps are refused, not sorted: the model reads the tokens in the order given (causal
  attention, relative time buckets, position), so a silent re-order would change the scores
  without the caller knowing which order was scored, and would have to move every other
  token feature with the timestamps.
* Equal timestamps are allowed and keep the order given. Dataset readers do the same: each
  user's events are sorted by timestamp stably, ties keeping file order
  (``gr.data.sequences.build_sequences``), so training and serving see ties alike.
* Negative timestamps are allowed: they are seconds before 1970, valid integers that the model's
  relative time buckets handle like any other.
* A timestamp type (a Parquet / Arrow TIMESTAMP of s, ms, us or ns, with or without a time zone)
  is read as its whole seconds, floored (``floor_seconds``), by the dataset readers and ``gr
  predict`` alike; so is an ISO 8601 text (``iso_text_seconds``: a CSV cell, a request's or a
  ``gr predict`` input's timestamps, a config's split times), UTC unless it has an offset.
* Every timestamp is an int64. Values outside [-2^63, 2^63) are refused, never wrapped, and so
  are the times of one user's request (history, candidates, request time) or one user's
  training sequence that lie 2^63 s or more apart: the model takes their differences.

Dataset files are event logs, not histories: their rows may come in any order and are sorted
as above; only values that do not fit int64 are refused there (by the readers).
"""

from __future__ import annotations

import datetime
import re
from typing import Any, Mapping, Optional

import numpy as np

# The name of a history's timestamps everywhere a history travels by name: a request's token column,
# a cached user state's tokens, the export format's HSTU input (gr.export.format.TIMESTAMPS).
TIMESTAMPS = "timestamps"  # [tokens] int64 seconds
INT64_MIN = int(np.iinfo(np.int64).min)
INT64_MAX = int(np.iinfo(np.int64).max)
PER_SECOND = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}  # a Parquet / Arrow timestamp's units in a second
# The ISO 8601 texts read as times: a date, or a date and a time (``T`` or a space between; seconds and
# their fraction optional), then ``Z`` or an offset ``+hh:mm`` / ``-hh:mm`` (none: UTC). The engines of
# gr.data.prepared match the same pattern (``ISO_TEXT_SQL``).
ISO_TEXT = re.compile(
    r"(?P<year>[0-9]{4})-(?P<month>[0-9]{2})-(?P<day>[0-9]{2})"
    r"(?:[T ](?P<hour>[0-9]{2}):(?P<minute>[0-9]{2})(?::(?P<second>[0-9]{2})(?:\.[0-9]+)?)?"
    r"(?P<zone>Z|(?P<sign>[-+])(?P<zone_hours>[0-9]{2}):(?P<zone_minutes>[0-9]{2}))?)?"
)
# The pattern with numbered groups (year 1, month 2, day 3, hour 4, minute 5, second 6, zone 7, sign 8,
# zone hours 9, zone minutes 10), as DuckDB's and Spark's regular expressions read it.
ISO_TEXT_SQL = re.sub(r"\?P<\w+>", "", ISO_TEXT.pattern)
EPOCH = datetime.datetime(1970, 1, 1)


class TimestampError(ValueError):
    """A history's timestamps break the policy above; the message starts with the field name
    (``history.timestamps: ...``)."""


def check_history_timestamps(ts: np.ndarray, where: str) -> None:
    """Refuse a history's timestamps that break the policy (module docstring).

    ts: [n] integer seconds, oldest first (any integer dtype; uint64 values past int64 are refused)
    where: the field name the message starts with, e.g. ``history.timestamps``
    """
    ts = np.asarray(ts)
    if ts.size == 0:
        return
    if ts.ndim != 1 or ts.dtype.kind not in "iu":
        raise TimestampError(f"{where}: expected a list of integers (seconds), got {ts.dtype} shape {list(ts.shape)}")
    if ts.dtype.kind == "u" and int(ts.max()) > INT64_MAX:
        bad = int(np.flatnonzero(ts > np.uint64(INT64_MAX))[0])
        raise TimestampError(f"{where}: [{bad}] = {int(ts[bad])} does not fit int64 (at most {INT64_MAX})")
    back = np.flatnonzero(ts[1:] < ts[:-1])
    if back.size:
        i = int(back[0]) + 1
        raise TimestampError(
            f"{where}: out of order: [{i}] = {int(ts[i])} is earlier than [{i - 1}] = {int(ts[i - 1])}; "
            "give the history oldest first (equal timestamps are allowed)"
        )


def floor_seconds(counts: np.ndarray, unit: str) -> np.ndarray:
    """A timestamp column's values as whole seconds, floored, as training and ``gr predict`` read them.

    counts: [n] integers, each a count of ``unit`` ("s" | "ms" | "us" | "ns") since 1970 (an Arrow
    timestamp cast to int64) -> [n] int64 seconds (-0.5 s is -1: floored, not truncated)."""
    return np.floor_divide(np.asarray(counts, dtype=np.int64), PER_SECOND[unit])


def iso_text_seconds(text: str) -> Optional[int]:
    """An ISO 8601 date or time (``ISO_TEXT``: ``2024-01-05``, ``2024-01-05T10:00:00Z``,
    ``2024-01-05 10:00:00.5+02:00``) -> its Unix seconds, floored (a fraction of a second dropped),
    UTC unless it has an offset; None for any other text or an impossible date, time or offset
    (month 13, February 30, hour 24, an offset of 24 hours or more, year 0)."""
    found = ISO_TEXT.fullmatch(text)
    if found is None:
        return None
    part = {name: int(value) for name, value in found.groupdict(default="0").items() if name not in ("zone", "sign")}
    if part["zone_hours"] > 23 or part["zone_minutes"] > 59:
        return None
    try:
        moment = datetime.datetime(
            part["year"], part["month"], part["day"], part["hour"], part["minute"], part["second"]
        )
    except ValueError:
        return None
    offset = (part["zone_hours"] * 60 + part["zone_minutes"]) * 60 * (-1 if found["sign"] == "-" else 1)
    return (moment - EPOCH) // datetime.timedelta(seconds=1) - offset


def check_time_span(times: Mapping[str, Any]) -> None:
    """Refuse the times of one user's sequence that lie 2^63 s or more apart: the model takes
    differences of them in int64, which such a gap would wrap around.

    times: {field name: an int, None (absent), or [n] integers} of one request, e.g.
    ``{"history.timestamps": ..., "candidates.timestamps": ..., "request_time": ...}``; each
    already within int64. The message starts with the (first given) field holding the latest time."""
    bounds = []
    for name, value in times.items():
        values = np.asarray([] if value is None else value, dtype=np.int64).reshape(-1)
        if values.size:
            bounds += [(int(values.min()), name), (int(values.max()), name)]
    if not bounds:
        return
    earliest, latest = min(t for t, _ in bounds), max(t for t, _ in bounds)
    first, last = (next(name for t, name in bounds if t == bound) for bound in (earliest, latest))
    if latest - earliest > INT64_MAX:
        raise TimestampError(
            f"{last}: {latest} lies {latest - earliest} s after {earliest} ({first}); the times of one "
            f"request must lie less than 2^63 s apart"
        )


def first_overflowing_span(offsets: np.ndarray, timestamps: np.ndarray) -> int:
    """The first sequence whose times span 2^63 s or more, or -1.

    offsets: [U+1] int64 sequence bounds; timestamps: [T] int64, each sequence's sorted oldest first."""
    lengths = np.diff(offsets)
    nonempty = np.flatnonzero(lengths > 0)
    first, last = timestamps[offsets[nonempty]], timestamps[offsets[nonempty + 1] - 1]
    wrapped = np.flatnonzero(last - first < 0)  # last >= first: a negative difference wrapped
    return int(nonempty[wrapped[0]]) if wrapped.size else -1
