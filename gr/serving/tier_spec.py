"""The tiers that ``gr serve --tier-bytes`` and ``--tier-redis`` name (``gr.serving.shared_tier``):
the server's shared tier (an SQLite file that ``gr serve`` creates in shared memory for its
workers) and the remote one (a Redis URL), nearest first."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

from gr.serving.shared_tier import SqliteTier, TierError, TierStore
from gr.utils.scratch_dir import ScratchDirectory

SHARED_MEMORY = Path("/dev/shm")
TIER_FILE = "tier.sqlite"


def tier_directory() -> ScratchDirectory:
    """A new directory for a server's shared tier: in shared memory (``/dev/shm``) where the OS has
    it, else in the OS temporary directory; the server removes it when it stops, and the next server
    removes one a killed server left (``gr.utils.scratch_dir``)."""
    shm = SHARED_MEMORY if SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK) else None
    return ScratchDirectory("gr-tier-", shm)


def open_tiers(shared: Optional[str], shared_bytes: int, remote: Optional[str]) -> List[TierStore]:
    """The tiers to open: ``shared`` (an SQLite file of at most ``shared_bytes``; None: none), then
    ``remote`` (a Redis URL; None: none). TierError when one cannot be opened."""
    tiers: List[TierStore] = []
    if shared is not None:
        tiers.append(SqliteTier(shared, shared_bytes))
    if remote is not None:
        try:
            from gr.serving.redis_tier import RedisTier  # redis-py: only for a remote tier
        except ImportError as exc:
            raise TierError(f"a remote tier needs the redis package (the redis extra): {exc}") from None
        tiers.append(RedisTier(remote))
    return tiers
