"""``--smoke``: the few-second size of a benchmark, at which tests/test_benches.py runs every one.

A benchmark builds its argparse parser and calls ``parse_args(parser, smoke)``: with
``--smoke``, every argument not given on the command line takes its value from ``smoke``
instead of the parser's default. Numbers measured at that size mean nothing; the run only
shows that the benchmark still works end to end and prints its JSON last line.

``ML_100K``: where the benchmarks that read MovieLens-100K find it by default.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Tuple

# $GR_ML100K_DIR (a relative path is taken from the repository root), as the tests read it, else
# data/ml-100k, where `gr data download ml-100k data/ml-100k` writes it.
ML_100K = Path(__file__).resolve().parents[1] / (os.environ.get("GR_ML100K_DIR") or "data/ml-100k")
# A --smoke run's training on ML-100K: two steps an epoch, on sequences of at most 50 events.
ML_100K_SMOKE_TRAINING: List[Tuple[str, str]] = [
    ("trainer.limit_train_batches", "2"),
    ("data.max_seq_len", "50"),
    ("model.hstu.max_seq_len", "50"),
]


def parse_args(
    parser: argparse.ArgumentParser, smoke: Mapping[str, Any], argv: Optional[Sequence[str]] = None, known: bool = False
) -> Tuple[argparse.Namespace, List[str]]:
    """-> (arguments, the ones ``parser`` does not know: only with ``known``, else [] or an error)."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a size that runs in seconds and checks the benchmark works (its numbers mean nothing)",
    )
    parse = parser.parse_known_args if known else (lambda a: (parser.parse_args(a), []))
    args, rest = parse(argv)
    if args.smoke:
        parser.set_defaults(**smoke)
        args, rest = parse(argv)
    return args, rest
