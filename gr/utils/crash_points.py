"""A test hook that kills the process at a named point, to show a crash there loses nothing.

``GR_TEST_CRASH_AT=<point>`` or ``<point>:<n>`` makes the n-th arrival (default the first)
at ``crash_point(<point>)`` end the process at once with ``os._exit(CRASH_EXIT_STATUS)``:
no cleanup, no ``finally`` blocks, no flushed buffers, like ``kill -9``. Unset, it does nothing.

Points: ``checkpoint_before_save``, ``checkpoint_mid_save`` (the DCP shards written, the
metadata not), ``checkpoint_after_save`` (in ``gr.train.checkpoint``) and
``replace_directory_mid_rename`` (the old directory moved aside, the new one not yet in
place, in ``gr.utils.atomic.replace_directory``).
"""

from __future__ import annotations

import os
from collections import Counter

ENV = "GR_TEST_CRASH_AT"
CRASH_EXIT_STATUS = 77

_arrivals: Counter = Counter()  # per point, how often this process reached it (the hook's only state)


def crash_point(point: str) -> None:
    """End the process here if ``GR_TEST_CRASH_AT`` names ``point`` and this is the arrival it counts."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    name, _, nth = wanted.partition(":")
    if name != point:
        return
    _arrivals[point] += 1
    if _arrivals[point] == int(nth or 1):
        os._exit(CRASH_EXIT_STATUS)
