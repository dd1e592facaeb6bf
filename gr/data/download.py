"""Fetch a public dataset (``gr data download NAME DIR``, ``gr.commands.data``), verify its checksum, unpack it
safely into DIR and check its interaction and item counts with our own readers.

DIR appears whole or not at all: everything happens in a temporary sibling that is renamed
to DIR only once the counts match (``gr.utils.atomic.atomic_directory``: a failed download also removes
the parent directories it created). DIR then holds the dataset's files (``--data.path DIR``;
for amazon-books ``--data.path DIR/ratings_Books.csv``) and ``DOWNLOAD.json`` (url, sha256,
md5, counts).

Checksums: GroupLens publishes an MD5 next to each MovieLens archive (``<url>.md5``) and no
SHA-256, so MovieLens downloads are checked against those published MD5s (the values
below). The Amazon ratings file has no published checksum at all, so ``--sha256`` is
required for it. Whatever is published, ``--sha256`` adds a SHA-256 check, and the SHA-256
of every download is printed and recorded so a later download can be pinned to it.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import shutil
import stat
import sys
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Dict, Mapping, Optional

import numpy as np
from tqdm import tqdm

from gr.data.interactions import Interactions
from gr.data.readers import read_amazon, read_ml_1m, read_ml_20m, read_ml_100k
from gr.utils.atomic import atomic_directory, write_json

log = logging.getLogger(__name__)

CHUNK = 1 << 20
RECORD = "DOWNLOAD.json"
MOVIELENS_TERMS = (
    "GroupLens usage licence: research use; no commercial use and no redistribution without "
    "GroupLens's permission; no claim of endorsement; cite F. M. Harper and J. A. Konstan, "
    '"The MovieLens Datasets: History and Context", ACM TiiS 5(4), 2015. '
    "Full terms: the README in the archive and https://grouplens.org/datasets/movielens/"
)
AMAZON_TERMS = (
    "Amazon review data (2014), McAuley lab, UCSD: released for research use; cite R. He and "
    'J. McAuley, "Ups and downs", WWW 2016, and J. McAuley et al., "Image-based '
    'recommendations on styles and substitutes", SIGIR 2015. '
    "https://cseweb.ucsd.edu/~jmcauley/datasets/amazon/links.html"
)


class DownloadError(Exception):
    """A download that cannot be trusted or used; the message names the dataset and the file."""


class MissingChecksum(DownloadError):
    """No checksum is published for the dataset and none was given."""


class TruncatedDownload(DownloadError):
    """The server sent fewer bytes than it announced."""


class ChecksumMismatch(DownloadError):
    """The downloaded bytes do not hash to the expected digest."""


class UnsafeArchive(DownloadError):
    """An archive member would land outside the target directory, or is a link or device."""


class CountMismatch(DownloadError):
    """The parsed dataset does not hold the documented number of interactions or items."""


@dataclass(frozen=True)
class DatasetSource:
    """Where a public dataset lives and what it must contain.

    archive_root: the folder inside the zip whose files land in DIR; None: ``url`` is the
    data file itself, saved as ``file_name``.
    md5 / sha256: digests published by the host (None: none published).
    items: distinct items in the interactions (None: no trustworthy published count).
    """

    url: str
    file_name: str
    read: Callable[[Path], Interactions]
    interactions: int
    items: Optional[int]
    terms: str
    archive_root: Optional[str] = None
    md5: Optional[str] = None
    sha256: Optional[str] = None


GROUPLENS = "https://files.grouplens.org/datasets/movielens"
DATASETS: Dict[str, DatasetSource] = {
    "ml-100k": DatasetSource(
        f"{GROUPLENS}/ml-100k.zip",
        "ml-100k.zip",
        lambda d: read_ml_100k(str(d)),
        interactions=100_000,
        items=1_682,
        terms=MOVIELENS_TERMS,
        archive_root="ml-100k",
        md5="0e33842e24a9c977be4e0107933c0723",
    ),
    "ml-1m": DatasetSource(
        f"{GROUPLENS}/ml-1m.zip",
        "ml-1m.zip",
        lambda d: read_ml_1m(str(d)),
        interactions=1_000_209,
        items=3_706,
        terms=MOVIELENS_TERMS,
        archive_root="ml-1m",
        md5="c4d9eecfca2ab87c1945afe126590906",
    ),
    "ml-20m": DatasetSource(
        f"{GROUPLENS}/ml-20m.zip",
        "ml-20m.zip",
        lambda d: read_ml_20m(str(d)),
        interactions=20_000_263,
        items=26_744,
        terms=MOVIELENS_TERMS,
        archive_root="ml-20m",
        md5="cd245b17a1ae2cc31bb14903e1204af3",
    ),
    # The ratings-only file of the 2014 Amazon dump, as the HSTU paper's code fetches it.
    # Its page gives the rating count but no checksum and no distinct-item count.
    "amazon-books": DatasetSource(
        "http://snap.stanford.edu/data/amazon/productGraph/categoryFiles/ratings_Books.csv",
        "ratings_Books.csv",
        lambda d: read_amazon(str(d / "ratings_Books.csv")),
        interactions=22_507_155,
        items=None,
        terms=AMAZON_TERMS,
    ),
}


def download_dataset(
    name: str,
    target: Path,
    *,
    sha256: Optional[str] = None,
    url: Optional[str] = None,
    overwrite: bool = False,
    progress: bool = True,
    sources: Mapping[str, DatasetSource] = DATASETS,
) -> Dict[str, object]:
    """Download ``name`` into ``target`` (see the module docstring); -> the DOWNLOAD.json record.

    sha256: an expected SHA-256 (hex), checked on top of any published digest.
    url: a mirror of the same file (the same digests apply).
    """
    if name not in sources:
        raise DownloadError(f"unknown dataset {name!r}; expected one of {sorted(sources)}")
    source = sources[name]
    if sha256 is not None:
        sha256 = sha256.lower()
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise DownloadError(f"--sha256: expected 64 hex digits, got {sha256!r}")
    if sha256 is None and source.sha256 is None and source.md5 is None:
        raise MissingChecksum(
            f"{name}: no checksum is published for {source.url}; pass --sha256 HEX (the SHA-256 of a copy "
            "you trust) so the download can be verified"
        )
    url = url or source.url
    old = target.with_name(target.name + ".old")  # where ``replace_directory`` parks the DIR it replaces
    if overwrite and target.exists() and old.exists():
        log.warning("--overwrite: %s exists and will be deleted (the old %s is moved there, then removed)", old, target)
    with atomic_directory(target, command="gr data download", overwrite=overwrite) as tmp:
        fetched = tmp / source.file_name
        digests = _fetch(url, fetched, progress)
        _verify(name, url, digests, source, sha256)
        if source.archive_root is not None:
            _unpack(fetched, source.archive_root, tmp)
            fetched.unlink()
        data = source.read(tmp)
        counts = {"interactions": len(data.items), "items": int(len(np.unique(data.items)))}
        _check_counts(name, source, counts)
        record = {"dataset": name, "url": url, **digests, **counts}
        write_json(tmp / RECORD, record)
    return record


def _fetch(url: str, path: Path, progress: bool) -> Dict[str, str]:
    """Stream ``url`` into ``path``; -> {"sha256": hex, "md5": hex} of the bytes received."""
    if not url.startswith(("https://", "http://")):
        raise DownloadError(f"{url}: expected an http(s) URL")
    sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(path, "wb") as out:
            announced = response.headers.get("Content-Length")
            total = int(announced) if announced is not None else None
            received = 0
            with tqdm(
                total=total, unit="B", unit_scale=True, desc=path.name, disable=not progress, file=sys.stderr
            ) as bar:
                while chunk := response.read(CHUNK):
                    out.write(chunk)
                    sha.update(chunk)
                    md5.update(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
    except http.client.IncompleteRead as error:
        raise TruncatedDownload(
            f"{url}: the connection closed after {len(error.partial)} more bytes, {error.expected} short; try again"
        ) from None
    except urllib.error.URLError as error:
        raise DownloadError(f"{url}: download failed ({error.reason})") from None
    if total is not None and received != total:
        raise TruncatedDownload(f"{url}: received {received} bytes, the server announced {total}; try again")
    return {"sha256": sha.hexdigest(), "md5": md5.hexdigest()}


def _verify(name: str, url: str, digests: Mapping[str, str], source: DatasetSource, sha256: Optional[str]) -> None:
    expected = {
        "sha256 (--sha256)": (sha256, digests["sha256"]),
        "published sha256": (source.sha256, digests["sha256"]),
        "published md5": (source.md5, digests["md5"]),
    }
    for what, (want, got) in expected.items():
        if want is not None and want != got:
            raise ChecksumMismatch(
                f"{name}: {url} does not match its {what}: expected {want}, got {got}; "
                "the download is corrupt or not the published file"
            )


def _unpack(archive: Path, root: str, target: Path) -> None:
    """Extract the regular files under ``root/`` of zip ``archive`` into ``target`` (``root/`` stripped).

    Absolute names, ``..`` parts, links and special files are UnsafeArchive errors."""
    try:
        with zipfile.ZipFile(archive) as zf:
            for member in zf.infolist():
                relative = _safe_member(archive, member, root)
                if relative is None:
                    continue
                destination = target.joinpath(*relative.parts)
                if member.is_dir():
                    destination.mkdir(parents=True, exist_ok=True)
                    continue
                destination.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(member) as data, open(destination, "wb") as out:
                    shutil.copyfileobj(data, out, CHUNK)
    except zipfile.BadZipFile as error:
        raise DownloadError(f"{archive.name}: not a readable zip archive ({error})") from None


def _safe_member(archive: Path, member: zipfile.ZipInfo, root: str) -> Optional[PurePosixPath]:
    """The member's path below ``root`` (None: outside ``root``, skipped), refusing unsafe members."""
    name = member.filename.replace("\\", "/")
    path = PurePosixPath(name)
    kind = stat.S_IFMT(member.external_attr >> 16)  # 0: no Unix mode recorded (a plain file)
    if path.is_absolute() or ".." in path.parts or (path.parts and ":" in path.parts[0]):
        raise UnsafeArchive(f"{archive.name}: member {member.filename!r} would be written outside the target")
    if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
        raise UnsafeArchive(f"{archive.name}: member {member.filename!r} is a link or special file, not a regular file")
    if not path.parts or path.parts[0] != root:
        log.info("%s: skipping %s (outside %s/)", archive.name, member.filename, root)
        return None
    relative = PurePosixPath(*path.parts[1:])
    return relative if relative.parts else None


def _check_counts(name: str, source: DatasetSource, counts: Mapping[str, int]) -> None:
    for key, want in (("interactions", source.interactions), ("items", source.items)):
        if want is not None and counts[key] != want:
            raise CountMismatch(
                f"{name}: parsed {counts[key]} {key}, the published dataset has {want}; "
                "the files are not the published release"
            )
