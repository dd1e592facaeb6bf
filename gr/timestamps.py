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
* A timestamp type (a Parquet / Arrow TIMESTAMP of s, ms, us or ns) is read as its whole seconds,
  floored (``floor_seconds``), by the dataset readers and ``gr predict`` alike.
* Every timestamp is an int64. Values outside [-2^63, 2^63) are refused, never wrapped, and so
  are the times of one user's request (history, candidates, request time) or one user's
  training sequence that lie 2^63 s or more apart: the model takes their differences.

Dataset files are event logs, not histories: their rows may come in any order and are sorted
as above; only values that do not fit int64 are refused there (by the readers).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

# The name of a history's timestamps everywhere a history travels by name: a request's token column,
# a cached user state's tokens, the export format's HSTU input (gr.export.format.TIMESTAMPS).
TIMESTAMPS = "timestamps"  # [tokens] int64 seconds
INT64_MIN = int(np.iinfo(np.int64).min)
INT64_MAX = int(np.iinfo(np.int64).max)
PER_SECOND = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}  # a Parquet / Arrow timestamp's units in a second


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
