"""``MANIFEST``: the sha256 of every file of an export, and where its paths may point.

The file is in ``sha256sum`` format (``<hex digest>  <relative path>`` per line, sorted), so
``sha256sum -c MANIFEST`` inside the export verifies it too. ``check`` and every loader verify
it before reading anything else: a missing, extra, edited or linked file (MANIFEST itself
included) is a named problem, and so is any path (in the manifest or in an .ini) that leaves
the export directory.
"""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath
from typing import Dict, List, Optional

from gr.export.format import Problem
from gr.utils.atomic import write_text
from gr.utils.checksums import file_sha256

MANIFEST = "MANIFEST"
LINKED = "a symbolic link: an export holds plain files only"


def write_manifest(root: Path) -> None:
    """Hash every file under ``root`` (the manifest itself excepted) into ``root/MANIFEST``."""
    write_text(root / MANIFEST, manifest_text({rel: file_sha256(path) for rel, path in _files(root).items()}))


def manifest_text(digests: Dict[str, str]) -> str:
    """{relative path: sha256 hex} -> the MANIFEST's text (one sorted line per file)."""
    return "".join(f"{digest}  {rel}\n" for rel, digest in sorted(digests.items()))


def text_sha256(text: str) -> str:
    """The sha256 hex of ``text`` (UTF-8): a MANIFEST's, for ``manifest_text``."""
    return hashlib.sha256(text.encode("utf8")).hexdigest()


def manifest_digest(root: Path) -> str:
    """The first 12 hex digits of the MANIFEST's sha256: the export's identity (its model version in logs)."""
    return file_sha256(root / MANIFEST)[:12]


def check_manifest(root: Path, problems: List[Problem]) -> bool:
    """Verify ``root/MANIFEST`` against the files; -> whether it holds (problems added if not)."""
    return read_manifest(root, problems) is not None


def read_manifest(root: Path, problems: List[Problem]) -> Optional[Dict[str, str]]:
    """{relative path: sha256 hex} of ``root/MANIFEST``, verified against the files; None (problems
    added) where it does not hold."""
    start = len(problems)
    path = root / MANIFEST
    if path.is_symlink():  # never followed: it could point at any file on the host
        problems.append(Problem(MANIFEST, "-", LINKED))
        return None
    if not path.is_file():
        problems.append(
            Problem(
                MANIFEST,
                "-",
                "file is missing: every export carries the sha256 of its files (re-export it with this version of gr)",
            )
        )
        return None
    listed: Dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf8")
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(Problem(MANIFEST, "-", f"unreadable: {exc}"))
        return None
    for number, line in enumerate(text.splitlines(), start=1):
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            problems.append(Problem(MANIFEST, f"line {number}", "expected '<sha256 hex>  <relative path>'"))
        elif inside(root, rel, MANIFEST, f"line {number}", problems) is not None:
            listed[rel] = digest
    on_disk = _files(root)
    for rel in sorted(rel for rel, p in on_disk.items() if p.is_symlink()):
        problems.append(Problem(rel, "-", LINKED))
    for rel, digest in sorted(listed.items()):
        if rel in on_disk and on_disk[rel].is_symlink():
            continue
        if rel not in on_disk:
            problems.append(Problem(rel, "-", f"file is missing ({MANIFEST} lists it)"))
        elif file_sha256(on_disk[rel]) != digest:
            problems.append(Problem(rel, "-", f"sha256 differs from {MANIFEST}: the file was changed after export"))
    for rel in sorted(set(on_disk) - set(listed)):
        problems.append(Problem(rel, "-", f"file is not in {MANIFEST}: added after export"))
    return listed if len(problems) == start else None


def inside(root: Path, rel: str, where: str, key: str, problems: List[Problem], base: str = "") -> Optional[Path]:
    """``root/base/rel`` when ``rel`` is a relative path without ``..`` that stays inside ``root``
    (symbolic links resolved); otherwise a problem naming ``where``/``key`` and None."""
    pure = PurePosixPath(rel)
    if not rel or pure.is_absolute() or ".." in pure.parts:
        problems.append(Problem(where, key, f"path {rel!r} leaves the export directory"))
        return None
    path = root / base / rel
    if not path.resolve().is_relative_to(root.resolve()):
        problems.append(Problem(where, key, f"path {rel!r} resolves outside the export directory"))
        return None
    return path


def _files(root: Path) -> Dict[str, Path]:
    """{posix relative path: path} of the files under ``root`` except MANIFEST; links count as files."""
    return {
        p.relative_to(root).as_posix(): p
        for p in root.rglob("*")
        if (p.is_file() or p.is_symlink()) and p.relative_to(root).as_posix() != MANIFEST
    }
