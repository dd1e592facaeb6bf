"""Where a command may write its output directory: never over what it reads.

``checked_output`` compares real paths (symbolic links and ``..`` resolved), so no spelling of an
input gets past it. Refused before anything is written, in one line naming the flag and the input:
an output that is an input, lies inside one (a directory the command copies or lists would hold its
own output) or holds one (``--overwrite`` would remove it); an output that is the working directory
or holds it; an output that is a symbolic link to nothing (``os.rename`` cannot put a directory
there).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional, Tuple, Union

PathLike = Union[str, Path]


def real_path(path: PathLike) -> Path:
    """``path`` absolute, with every symbolic link and ``..`` resolved (the parts that exist)."""
    return Path(os.path.realpath(path))


def checked_output(output: PathLike, inputs: Iterable[Tuple[str, Optional[PathLike]]], flag: str) -> Path:
    """``output``'s real path, once it is known to be apart from each input.

    inputs: (what the command line calls it, e.g. "EXPORT" or "data.path"; its path or None: none given).
    flag: how the command line names ``output`` (e.g. "--out"). Raises ValueError for an output
    that is, holds or lies inside an input or the working directory; FileNotFoundError for an
    output that is a symbolic link to nothing."""
    given = Path(output)
    if given.is_symlink() and not given.exists():
        raise FileNotFoundError(
            f"{flag} {output}: a symbolic link to {os.readlink(given)}, which does not exist; name a directory "
            "to write, or point the link at an existing one"
        )
    real, here = real_path(output), real_path(os.getcwd())
    if real == here or real in here.parents:
        raise ValueError(
            f"{flag} {output}: is {'the working directory' if real == here else 'a parent of the working directory'} "
            f"({here}); name a new directory to write, e.g. one inside it"
        )
    for name, path in inputs:
        if path is None:
            continue
        source = real_path(path)
        if real == source:
            where = "is"
        elif source in real.parents:
            where = "is inside"
        elif real in source.parents:
            where = "holds"
        else:
            continue
        resolved = "" if str(source) == str(path) else f" ({source})"
        raise ValueError(
            f"{flag} {output}: {where} {name} {path}{resolved}, which this command reads; write the output "
            "outside what it reads"
        )
    return real
