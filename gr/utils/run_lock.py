"""One writer per run directory: an advisory lock on ``RUN/.lock`` while a run is written or read;
one writer per output directory: ``.NAME.lock`` beside it while it is written.

The lock is ``fcntl.flock`` (a BSD lock, POSIX hosts only). The OS ties it to the open file and
drops it when the process exits or dies (kill -9 included), so a crashed run never leaves a run
locked: a ``.lock`` file left behind by a dead process is taken over by the next one.

* ``gr train`` and ``gr train --resume`` hold it exclusively for the whole run (rank 0).
* ``gr export`` and ``gr train --init-from`` hold it shared while they read the run: readers may
  read a run together, never while it is being written, and a run is not written while it is read.

A directory written whole (``gr.utils.atomic.atomic_directory``: an export, a prepared dataset, a
download) takes one writer at a time by the same rule: ``output_lock`` holds ``.NAME.lock`` beside
the directory NAME exclusively while it is written.

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
RUN_RULE = "a run directory takes one writer at a time"
OUTPUT_RULE = "a directory is written by one process at a time"
READERS = "gr export or gr train --init-from, reading it"  # readers write no record: they may be several


class RunLockedError(OSError):
    """The run or output directory is locked by another process; the message names both."""


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
    fd = _acquire(run_dir / LOCK_FILE, run_dir, command, shared)
    try:
        yield
    finally:
        if fd is not None:
            _release(run_dir / LOCK_FILE, fd, created)


@contextlib.contextmanager
def output_lock(target: str | Path, command: str) -> Iterator[None]:
    """Hold the writer's lock of the directory ``target`` (``.NAME.lock`` beside it, in a parent that
    exists) for the ``with`` body: a second writer of ``target`` gets ``RunLockedError`` at once."""
    target = Path(target)
    path = target.parent / f".{target.name}{LOCK_FILE}"
    fd = _acquire(path, target, command, False, OUTPUT_RULE)
    assert fd is not None  # only a reader goes unlocked
    try:
        yield
    finally:
        _release(path, fd, [])


def _acquire(path: Path, what: Path, command: str, shared: bool, rule: str = RUN_RULE) -> Optional[int]:
    """A descriptor holding the lock file ``path`` of ``what`` (None: a reader that cannot create it)."""
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
            holder = os.pread(fd, 4096, 0).decode("utf8", "replace").strip() or READERS
            os.close(fd)
            raise RunLockedError(
                f"{what}: in use by another process ({holder}); {command} stops here without touching it "
                f"({rule}: wait for the other process to finish)"
            ) from None
        if _same_file(fd, path):
            os.ftruncate(fd, 0)
            if not shared:
                os.pwrite(fd, f"pid {os.getpid()}: {command}\n".encode(), 0)
            return fd
        os.close(fd)  # the holder we waited on removed the file: lock the current one
    raise RunLockedError(f"{what}: {path} keeps being replaced by other processes; {command} stops here")


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _release(path: Path, fd: int, created: List[Path]) -> None:
    """Remove the lock file ``path`` when no one else holds it (taken exclusively first), then unlock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # other readers still hold it
        os.close(fd)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    with contextlib.suppress(OSError):  # not empty: the run wrote something, keep it
        for directory in created:
            directory.rmdir()
    os.close(fd)


def writes_run(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is the one rank of a run that takes the run's lock: global rank 0
    (torchrun's RANK, Lightning's NODE_RANK / LOCAL_RANK; unset: a single process)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    return all(env.get(name, "0") == "0" for name in ("RANK", "NODE_RANK", "LOCAL_RANK"))
