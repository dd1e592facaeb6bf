"""One writer per run directory: an advisory lock on ``RUN/.lock`` while a run is written or exported.

The lock is ``fcntl.flock`` (a BSD lock, POSIX hosts only). The OS ties it to the open file and
drops it when the process exits or dies (kill -9 included), so a crashed run never leaves a run
locked: a ``.lock`` file left behind by a dead process is taken over by the next one.

* ``gr train`` and ``gr train --resume`` hold it exclusively for the whole run (rank 0).
* ``gr export`` holds it shared while it reads the run: exports may read a run together, never
  while it is being written, and a run is not written while it is exported.

Taking the lock never waits: the second comer gets ``RunLockedError`` (one line naming the
directory and the holder) before it has written anything. The writer puts its pid and
command in the file; the file is removed when the last holder lets go (and the directories the
writer created are removed too when nothing else was written to them).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from typing import Iterator, List, Mapping, Optional

LOCK_FILE = ".lock"
ACQUIRE_TRIES = 5  # each retry follows a holder that removed the file between our open and our lock


class RunLockedError(OSError):
    """The run directory is locked by another process; the message names both."""


@contextlib.contextmanager
def run_lock(run_dir: str | Path, command: str, *, shared: bool = False) -> Iterator[None]:
    """Hold ``run_dir``'s lock (exclusive for a writer, ``shared`` for a reader) for the ``with`` body.

    command: what this process is, for the other side's error message (e.g. "gr train").
    A writer creates ``run_dir`` when missing. A reader of a directory it cannot write to reads
    it unlocked (no writer can write there either)."""
    run_dir = Path(run_dir)
    created = [] if shared else [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # deepest first
    if created:
        run_dir.mkdir(parents=True)
    fd = _acquire(run_dir, command, shared)
    try:
        yield
    finally:
        if fd is not None:
            _release(run_dir, fd, created)


def _acquire(run_dir: Path, command: str, shared: bool) -> Optional[int]:
    path = run_dir / LOCK_FILE
    for _ in range(ACQUIRE_TRIES):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            if shared and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return None
            raise
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf8", "replace").strip() or "gr export, reading it"
            os.close(fd)
            raise RunLockedError(
                f"{run_dir}: in use by another process ({holder}); {command} stops here without touching it "
                "(a run directory takes one writer at a time: wait for the other process to finish)"
            ) from None
        if _same_file(fd, path):
            os.ftruncate(fd, 0)
            if not shared:
                os.pwrite(fd, f"pid {os.getpid()}: {command}\n".encode(), 0)
            return fd
        os.close(fd)  # the holder we waited on removed the file: lock the current one
    raise RunLockedError(f"{run_dir}: {path} keeps being replaced by other processes; {command} stops here")


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _release(run_dir: Path, fd: int, created: List[Path]) -> None:
    """Remove the lock file when no one else holds it (taken exclusively first), then unlock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # other readers still hold it
        os.close(fd)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(run_dir / LOCK_FILE)
    with contextlib.suppress(OSError):  # not empty: the run wrote something, keep it
        for directory in created:
            directory.rmdir()
    os.close(fd)


def writes_run(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is the one rank of a run that takes the run's lock: global rank 0
    (torchrun's RANK, Lightning's NODE_RANK / LOCAL_RANK; unset: a single process)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    return all(env.get(name, "0") == "0" for name in ("RANK", "NODE_RANK", "LOCAL_RANK"))
