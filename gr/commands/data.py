"""``gr data download NAME DIR``: fetch a public dataset (``gr.data.download``) and print what it holds.

Imports no torch (``gr.data.download`` reads with numpy), like ``gr --help``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from gr.data.download import DATASETS, DownloadError, download_dataset
from gr.utils.cli_errors import USAGE_EXIT_STATUS, one_line


def describe() -> str:
    """The --help epilog: each dataset's URL, checks and licence terms."""
    lines = ["datasets (use each under its licence terms):"]
    for name, source in DATASETS.items():
        digest = (
            "md5 published by the host"
            if source.md5
            else "sha256 published"
            if source.sha256
            else "no published checksum: --sha256 required"
        )
        items = f", {source.items:,} items" if source.items is not None else ""
        lines += [
            f"  {name}: {source.url}",
            f"    {digest}; checks {source.interactions:,} interactions{items}",
            f"    terms: {source.terms}",
        ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gr data download",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Download a public dataset, verify its checksum, unpack it into DIR and check its counts.",
        epilog=describe(),
    )
    parser.add_argument("name", choices=sorted(DATASETS), metavar="NAME", help=f"one of {sorted(DATASETS)}")
    parser.add_argument("dir", type=Path, metavar="DIR", help="directory to create with the dataset's files")
    parser.add_argument("--sha256", help="expected SHA-256 (hex) of the download; required for amazon-books")
    parser.add_argument("--url", help="a mirror of the same file (the same checksums apply)")
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        record = download_dataset(
            args.name,
            args.dir,
            sha256=args.sha256,
            url=args.url,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except (DownloadError, OSError, ValueError) as error:  # OSError: DIR exists or cannot be written
        print(f"gr data download: error: {type(error).__name__}: {one_line(error)}", file=sys.stderr)
        return USAGE_EXIT_STATUS
    print(
        f"{args.name}: {record['interactions']:,} interactions, {record['items']:,} items in {args.dir} "
        f"(sha256 {record['sha256']})"
    )
    return 0
