"""What this machine and process hold now (Linux's /proc; None elsewhere): the memory a new process can
have without swapping, and this process's resident set. ``gr train``'s memory check and ``gr plan``
read them (``gr.train.memory``)."""

from __future__ import annotations

import os
from typing import Optional

MEMINFO = "/proc/meminfo"
STATM = "/proc/self/statm"


def available_memory_bytes(meminfo: str = MEMINFO) -> Optional[int]:
    """What this machine can give a new process without swapping: ``MemAvailable`` of
    /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_bytes(statm: str = STATM) -> Optional[int]:
    """This process's resident set now (Linux: /proc/self/statm), or None where it cannot be read."""
    try:
        with open(statm, encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
