"""``gr items add EXPORT ITEMS --out NEW_EXPORT``: a new export whose catalogue holds the items of
the file ITEMS too, with their item features (``gr.export.new_items``); the model is not retrained."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from gr.utils.cli_errors import run_cli


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli("gr items add", lambda: _main(sys.argv[1:] if argv is None else list(argv)))


def _main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gr items add",
        description="Write a new export (the old one is left as it is) whose catalogue also holds the items of "
        "ITEMS (CSV with a header, or Parquet): a column item_id and each item feature the export stores. Their "
        "item-table rows are the mean of the trained rows; their features tell them apart. Serve it with "
        'gr serve NEW_EXPORT, or POST /admin/reload {"export_dir": NEW_EXPORT} to a running service.',
    )
    parser.add_argument("export", type=Path, metavar="EXPORT")
    parser.add_argument("items", type=Path, metavar="ITEMS")
    parser.add_argument("--out", type=Path, required=True, help="the new export's directory, outside EXPORT")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--list-separator", default="|", help="joins a list feature's values in a CSV cell")
    parser.add_argument(
        "--replace-known",
        action="store_true",
        help="an item the export already has gets the file's features (its trained row and popularity stay); "
        "without it such an item is refused",
    )
    args = parser.parse_args(argv)
    from gr.export.new_items import add_items  # the export stack (torch, onnx, pyarrow): once the arguments parse

    summary = add_items(
        args.export, args.items, args.out, args.list_separator, args.replace_known, overwrite=args.overwrite
    )
    print(json.dumps({**summary, "export": str(args.out)}))
    return 0
