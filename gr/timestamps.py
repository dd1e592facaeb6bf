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
* Every timestamp is an int64. Values outside [-2^63, 2^63) are refused, never wrapped.

Dataset files are event logs, not histories: their rows may come in any order and are sorted
as above; only values that do not fit int64 are refused there (by the readers).
"""

from __future__ import annotations

import numpy as np

INT64_MIN = int(np.iinfo(np.int64).min)
INT64_MAX = int(np.iinfo(np.int64).max)


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
