"""A scratch directory a process owns while it runs (a server's shared tier in ``/dev/shm``, its
workers' metrics files), which the next process of its kind removes when the owner died without
removing it (a kill -9 runs no clean-up; in ``/dev/shm`` the files hold memory until a reboot).

The owner holds an advisory lock (``fcntl.flock``) on ``.owner`` inside the directory for as long
as the directory is open; the OS drops it when the owner exits or dies, whatever its PID namespace.
Creating a new directory first removes each sibling of the same prefix whose ``.owner`` lock can be
taken: its owner is gone. A sibling without ``.owner`` is left alone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)
OWNER_FILE = ".owner"


class ScratchDirectory:
    """A new directory ``<parent>/<prefix>XXXXXXXX`` (parent: the OS temporary directory when None),
    owned until ``close`` removes it; stale siblings are removed first (module docstring)."""

    def __init__(self, prefix: str, parent: Optional[Path] = None) -> None:
        root = Path(parent) if parent is not None else Path(tempfile.gettempdir())
        for sibling in sorted(root.glob(f"{prefix}*")):
            _remove_if_abandoned(sibling)
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        staged = self.path / f"{OWNER_FILE}.new"
        self._fd: Optional[int] = os.open(staged, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        staged.rename(self.path / OWNER_FILE)  # appears locked: another process's sweep never takes it

    def close(self) -> None:
        """Remove the directory and let go of it (again: nothing)."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None


def _remove_if_abandoned(directory: Path) -> None:
    """Remove ``directory`` when its ``.owner`` lock can be taken (its owner is gone)."""
    try:
        fd = os.open(directory / OWNER_FILE, os.O_RDWR)
    except OSError:  # not one of ours, not a directory, or not ours to open
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # its owner holds it: in use
        os.close(fd)
        return
    shutil.rmtree(directory, ignore_errors=True)
    os.close(fd)
    log.info("removed %s, left behind by a process that is gone", directory)
