"""What ``gr items add`` costs to place new items on an item-tower export, by catalogue size.

For each ``--sizes`` pair (new items, trained items), synthetic vectors of width ``--dim``
(trained vectors, their feature-only vectors the trained ones plus noise, counts up to 1,000, and
4,096 unit served queries) go through ``gr.export.new_item_rows.place``: the neighbour search over
every trained item, the gain fit over up to 4,096 trained items and the shift's bisection. Reports
the seconds, and the nanoseconds per (new item, trained item) pair. Then, on one block of
similarities ([``--select-rows``, trained items]), the neighbour selection that placement runs
(``torch.topk``) against ``numpy.argpartition``, which it replaced: their ratio, measured in this run.

Run: ``.venv/bin/python bench/new_item_placement.py`` (about two minutes on 2 cores); ``--smoke``:
tiny sizes. Last line: one JSON object with keys bench, cpu, load_average, dim, sizes, selection.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402
from _host import cpu, load_average  # noqa: E402

from gr.export.new_item_rows import NEIGHBOURS, place

QUERIES = 4096


def placement(new: int, trained: int, dim: int, seed: int) -> Dict[str, float]:
    """Seconds ``place`` takes for ``new`` items over ``trained`` ones."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((trained, dim)).astype(np.float32)
    features = vectors + rng.standard_normal((trained, dim)).astype(np.float32)
    counts = rng.integers(0, 1000, trained)
    queries = rng.standard_normal((QUERIES, dim))
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    new_features = rng.standard_normal((new, dim)).astype(np.float32)
    new_counts = rng.integers(0, 100, new)
    started = time.perf_counter()
    place(new_features, new_counts, vectors, features, counts, queries.mean(0), queries.astype(np.float32))
    seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 3), "ns_per_pair": round(1e9 * seconds / (new * trained), 3)}


def selection(rows: int, trained: int, seed: int) -> Dict[str, float]:
    """The ``NEIGHBOURS`` largest of each row of a [rows, trained] block: torch.topk against
    numpy.argpartition (the same sets of indices; the seconds of each and their ratio)."""
    similarity = np.random.default_rng(seed).standard_normal((rows, trained))
    started = time.perf_counter()
    chosen = torch.topk(torch.from_numpy(similarity), NEIGHBOURS, dim=1).indices.numpy()
    topk = time.perf_counter() - started
    started = time.perf_counter()
    partitioned = np.argpartition(-similarity, NEIGHBOURS - 1, axis=1)[:, :NEIGHBOURS]
    argpartition = time.perf_counter() - started
    assert (np.sort(chosen, axis=1) == np.sort(partitioned, axis=1)).all()
    return {"topk_s": round(topk, 4), "argpartition_s": round(argpartition, 4), "ratio": round(argpartition / topk, 2)}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", nargs="+", default=["10000x100000", "100000x100000"], help="NEWxTRAINED pairs to place"
    )
    parser.add_argument("--dim", type=int, default=50)
    parser.add_argument("--select-rows", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args, _ = smoke.parse_args(parser, {"sizes": ["200x2000"], "select_rows": 64}, argv)
    start_load = load_average()
    sizes: Dict[str, Dict[str, float]] = {}
    for size in args.sizes:
        new, trained = (int(part) for part in size.split("x"))
        sizes[size] = placement(new, trained, args.dim, args.seed)
        print(f"{new:,} new items over {trained:,} trained: {sizes[size]['seconds']:.1f} s")
    largest = max(int(size.split("x")[1]) for size in args.sizes)
    chosen = selection(args.select_rows, largest, args.seed)
    print(f"neighbour selection over [{args.select_rows}, {largest}]: argpartition / topk {chosen['ratio']:.1f}x")
    model, flags = cpu()
    host: Dict[str, List[float]] = {"start": start_load, "end": load_average()}
    summary = {
        "bench": "new_item_placement",
        "cpu": {"model": model, "flags": flags},
        "load_average": host,
        "dim": args.dim,
        "sizes": sizes,
        "selection": chosen,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
