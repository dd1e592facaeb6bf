"""``gr items add EXPORT ITEMS --out NEW_EXPORT``: a new export whose catalogue holds the items of
the file ITEMS too, with their item features (``gr.export.new_items``); the model is not retrained.

On a retrieval export the summary's ``placement`` says where the new items land: ``PLACEMENT_HISTORIES``
trained items, each a one-item history (an export holds no user histories), get the new export's top
``PLACEMENT_K``, as ``gr recommend`` gives it; new items taking more of those slots than
``PLACEMENT_WARN_SHARE`` and than twice their share of the catalogue (a flood, not the share their
counts earn them) are warned about on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from gr.utils.cli_errors import run_cli

PLACEMENT_HISTORIES = 100
PLACEMENT_K = 10
PLACEMENT_WARN_SHARE = 0.1


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli("gr items add", lambda: _main(sys.argv[1:] if argv is None else list(argv)))


def _main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gr items add",
        description="Write a new export (the old one is left as it is) whose catalogue also holds the items of "
        "ITEMS (CSV with a header, or Parquet): a column item_id, each item feature the export stores and "
        "optionally item_popularity (each item's count of events); their features tell them apart. On an export "
        "with an item tower their rows are placed from its encoder of their features (the trained items nearest "
        "them) and their counts. On another "
        "export with a retrieval head their item-table rows are zero, so a "
        "catalogue search (recommend, generate) scores each 0 and ranks it below every trained item the query "
        "matches (the mean of the trained rows, where typical queries point, would put them first for nearly "
        "everyone); the summary's placement gives, for 100 trained items taken as one-item histories, how many "
        "top 10s hold a new item, the best rank one reaches and their share of the slots (a warning above 10% "
        "and above twice their share of the catalogue). "
        "On a ranking export their rows are the mean of the trained rows. Serve it with "
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
        help="an item the export already has gets the file's features (its trained row stays, and its popularity "
        "unless the file gives item_popularity); "
        "without it such an item is refused",
    )
    args = parser.parse_args(argv)
    from gr.export.new_items import add_items  # the export stack (torch, onnx, pyarrow): once the arguments parse

    summary = add_items(
        args.export, args.items, args.out, args.list_separator, args.replace_known, overwrite=args.overwrite
    )
    out: Dict[str, object] = {**summary, "export": str(args.out)}
    trained = out.pop("trained_items", None)
    if isinstance(trained, int):
        out["placement"] = report = placement(args.out, trained)
        if report["new_share"] > max(PLACEMENT_WARN_SHARE, 2 * report["catalogue_share"]):
            print(
                f"gr items add: warning: new items take {report['new_share']:.0%} of the top-{PLACEMENT_K} slots "
                f"for {report['histories']} trained items' one-item histories, being "
                f"{report['catalogue_share']:.0%} of the catalogue",
                file=sys.stderr,
            )
    print(json.dumps(out))
    return 0


def placement(export_dir: Path, trained: int) -> Dict[str, Any]:
    """Where items from row ``trained`` on land in the top ``PLACEMENT_K`` of ``export_dir``'s
    catalogue search, for up to ``PLACEMENT_HISTORIES`` one-item histories of trained items (spread
    evenly over the rows) -> {"histories", "histories_with_new" (whose top k holds a new item),
    "best_new_rank" (1-based, None: no new item in any top k), "new_share" (of all top-k slots),
    "catalogue_share" (new items among all the catalogue's)}."""
    import numpy as np

    from gr.export.format import TIMESTAMPS
    from gr.export.item_store import ITEM_FEATURE
    from gr.serving import Ranker, RecommendRequest  # torch and onnxruntime: only once the export is written

    ranker = Ranker.load(export_dir)
    items = np.unique(np.linspace(0, trained - 1, min(trained, PLACEMENT_HISTORIES)).astype(np.int64))
    requests = [
        RecommendRequest(f"item{item}", {ITEM_FEATURE: [int(item)], TIMESTAMPS: [0]}, k=PLACEMENT_K) for item in items
    ]
    ranks: List[Optional[int]] = []
    new_slots = slots = 0
    for result in ranker.recommend(requests):
        new = np.flatnonzero(np.asarray(result.items, dtype=np.int64) >= trained)
        ranks.append(int(new[0]) + 1 if len(new) else None)
        new_slots, slots = new_slots + len(new), slots + len(result.items)
    reached = [rank for rank in ranks if rank is not None]
    return {
        "histories": len(requests),
        "histories_with_new": len(reached),
        "best_new_rank": min(reached) if reached else None,
        "new_share": round(new_slots / max(slots, 1), 4),
        "catalogue_share": round(1 - trained / max(len(ranker.catalogue()[0].vectors), 1), 4),
    }
