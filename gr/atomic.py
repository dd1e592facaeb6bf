"""Atomic writes: a file or directory appears whole under its final name, or not at all.

Everything gr writes for a person or a later process (configs, metrics, mappings,
checkpoints, exports) goes through these helpers: the content is written to a temporary
sibling, flushed, and renamed over the target, so a crash leaves the old version or the
new one, never a torn file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import IO, Any, Iterator, Union

from gr.crash_points import crash_point

PathLike = Union[str, Path]


@contextlib.contextmanager
def atomic_file(path: PathLike, *, binary: bool = False) -> Iterator[IO]:
    """Yield a handle on a temporary sibling of ``path``; on a clean exit it replaces ``path``."""
    path = Path(path)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb" if binary else "w", **({} if binary else {"encoding": "utf8", "newline": ""})) as f:
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
def atomic_directory(target: PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``target``; on a clean exit it replaces ``target``.

    Without ``overwrite`` an existing ``target`` is a FileExistsError before anything is
    written. A replaced ``target`` is first renamed aside and removed only once the new
    directory is in place (``replace_directory``).
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target}: already exists; pass overwrite=True (--overwrite) to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        yield tmp
        replace_directory(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


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
