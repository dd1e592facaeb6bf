"""sha256 of files, read in chunks (a file of any size in constant memory)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Union

CHUNK = 1 << 20


def file_sha256(path: Union[str, Path]) -> str:
    """The hex sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()
