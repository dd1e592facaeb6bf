"""Atomic writes: a file or directory appears whole under its final name, or not at all.

Everything gr writes for a person or a later process (configs, metrics, mappings,
checkpoints, exports) goes through these helpers: the content is written to a temporary
sibling, flushed, and renamed over the target, so a crash leaves the old version or the
new one, never a torn file.

A directory is written by one process at a time (``gr.utils.run_lock.output_lock``), in a sibling
``.NAME.tmp-<hex>`` that its writer holds under ``fcntl.flock``
(the OS drops the lock when the process exits or dies, kill -9 included). One whose lock is free
was left by a killed writer: stale, removed by the next ``atomic_directory`` of NAME.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import IO, Any, Iterator, List, Optional, Tuple, Union

from gr.utils.crash_points import crash_point
from gr.utils.run_lock import RunLockedError, output_lock

PathLike = Union[str, Path]
TEMPORARY = ".tmp-"  # .NAME.tmp-<hex>: where atomic_directory writes NAME
LOCK_TRIES = 5  # each retry follows another process removing our new directory before we locked it


def process_umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status`` on Linux; elsewhere
    set and restored at once, which another thread creating a file at that instant could see)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(path: PathLike, *, binary: bool = False) -> Iterator[IO]:
    """Yield a handle on a temporary sibling of ``path``; on a clean exit it replaces ``path``.
    The file gets the permissions the umask gives a new file (0644 under 022), as ``open`` would."""
    path = Path(path)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(handle, 0o666 & ~process_umask())  # mkstemp's 0600 would keep the file from other accounts
        with os.fdopen(
            handle, "wb" if binary else "w", encoding=None if binary else "utf8", newline=None if binary else ""
        ) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def write_text(path: PathLike, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


def write_bytes(path: PathLike, data: bytes) -> None:
    with atomic_file(path, binary=True) as f:
        f.write(data)


def write_json(path: PathLike, value: Any) -> None:
    with atomic_file(path) as f:
        json.dump(value, f, indent=2)
        f.write("\n")


@contextlib.contextmanager
def atomic_directory(target: PathLike, *, command: str, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``target``; on a clean exit it replaces ``target``.

    ``target`` is taken at its real path (links and ``..`` resolved: a link to a directory keeps
    pointing at the new one). The whole write holds ``target``'s ``output_lock``
    (``gr.utils.run_lock``; ``command``, e.g. "gr export", names this writer to others), so a
    second writer gets ``RunLockedError`` before it writes anything. Without ``overwrite`` an
    existing ``target`` is a FileExistsError before anything is written. A replaced ``target`` is
    first renamed aside and removed only once the new directory is in place
    (``replace_directory``). Stale temporary siblings are removed first; a directory that cannot
    be created is an OSError naming ``target``; on failure the parent directories this call
    created are removed again.
    """
    target = Path(os.path.realpath(target))
    created = [d for d in target.parents if not d.exists()]  # deepest first
    try:
        with contextlib.ExitStack() as held:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                held.enter_context(output_lock(target, command))
            except RunLockedError:
                raise
            except OSError as error:
                raise type(error)(f"{target}: cannot write there ({error})") from None
            if target.exists() and not overwrite:
                raise FileExistsError(f"{target}: already exists; pass overwrite=True (--overwrite) to replace it")
            try:
                for path in _temporaries(target):
                    _remove_stale(path)
                tmp, fd = _locked_temporary(target)
            except OSError as error:
                raise type(error)(f"{target}: cannot write there ({error})") from None
            try:
                yield tmp
                replace_directory(tmp, target)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp)
                os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):  # not empty: someone else wrote there, keep it
            for directory in created:
                directory.rmdir()
        raise


def stale_directories(target: PathLike) -> List[Path]:
    """The temporary siblings of ``target`` (``.NAME.tmp-*``) that no live process holds: left by
    an ``atomic_directory`` whose process was killed."""
    stale = []
    for path in _temporaries(Path(target)):
        fd = _lock_if_free(path)
        if fd is not None:
            os.close(fd)
            stale.append(path)
    return stale


def _temporaries(target: Path) -> List[Path]:
    """The ``.NAME.tmp-*`` siblings of ``target``, live or stale."""
    target = target.absolute()
    prefix = f".{target.name}{TEMPORARY}"
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(prefix))


def _lock_if_free(path: Path) -> Optional[int]:
    """A descriptor holding ``path``'s lock when ``path`` is a directory (not a link) no one holds."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # gone, a link, or not a directory: not ours
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # a live writer holds it
        os.close(fd)
        return None
    return fd


def _remove_stale(path: Path) -> None:
    """Remove a stale temporary directory under its lock (skipped if a process took it meanwhile)."""
    fd = _lock_if_free(path)
    if fd is not None:
        try:
            shutil.rmtree(path, ignore_errors=True)  # what cannot be removed stays, as before
        finally:
            os.close(fd)


def _locked_temporary(target: Path) -> Tuple[Path, int]:
    """A new empty ``.NAME.tmp-<hex>`` beside ``target`` and a descriptor holding its lock."""
    for _ in range(LOCK_TRIES):
        tmp = target.parent / f".{target.name}{TEMPORARY}{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:  # another process took it for stale before we locked it
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while another process checks or removes it
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(tmp)):
                return tmp, fd
        os.close(fd)
    raise OSError("other processes keep removing its new temporary directory")


def replace_directory(source: PathLike, target: PathLike) -> None:
    """Move directory ``source`` to ``target``, replacing an existing ``target``.

    An existing ``target`` is renamed to ``<target>.old`` first and deleted last, so a crash
    in between leaves one complete directory under one of the two names.
    """
    source, target = Path(source), Path(target)
    if not target.exists():
        os.rename(source, target)
        return
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(target, old)
    crash_point("replace_directory_mid_rename")
    os.rename(source, target)
    shutil.rmtree(old)
