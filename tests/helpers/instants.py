"""Instants as a warehouse, a request or a ``gr predict`` input writes them, with the Unix seconds
every reader must give each (floored, UTC unless an offset says otherwise)."""

import datetime
from typing import List, Optional, Tuple

import pyarrow as pa

from gr.timestamps import PER_SECOND

# (ISO 8601 texts of one instant, or of an instant in its second, its seconds), oldest first
INSTANTS: List[Tuple[Tuple[str, ...], int]] = [
    (("1969-12-31T23:59:59.5Z", "1970-01-01T00:59:59.999+01:00"), -1),
    (
        ("2024-01-05T10:00:00Z", "2024-01-05 12:00:00+02:00", "2024-01-05T05:30-04:30", "2024-01-05T10:00:00.999"),
        1704448800,
    ),
    (("2024-01-06", "2024-01-06T00:00:00.5Z", "2024-01-05T19:00:00-05:00"), 1704499200),
]
TEXTS = [text for texts, _ in INSTANTS for text in texts]  # every text, oldest first
SECONDS = [seconds for texts, seconds in INSTANTS for _ in texts]  # the seconds of each of TEXTS


def timestamps(seconds: List[int], unit: str, zone: Optional[str]) -> pa.Array:
    """A TIMESTAMP(unit, zone) array holding the last instant of each second (floored: those seconds)."""
    per_second = PER_SECOND[unit]
    return pa.array([s * per_second + per_second - 1 for s in seconds], pa.timestamp(unit, zone))


def iso_text(seconds: int, form: int) -> str:
    """``seconds`` as one of four ISO 8601 forms: UTC with Z, an offset, naive (UTC), milliseconds."""
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    if form == 1:
        return moment.astimezone(datetime.timezone(datetime.timedelta(hours=-5, minutes=-30))).isoformat()
    text = moment.replace(tzinfo=None).isoformat(sep=" " if form == 2 else "T")
    return text + ("Z" if form == 0 else ".999" if form == 3 else "")
