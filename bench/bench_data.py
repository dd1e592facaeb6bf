"""Data pipeline speed, measured in one run.

1. Parsing an ML-20M-format ``ratings.csv`` of --lines rows (generated in a temp dir):
   ``gr.data.readers.read_ml_20m`` (pyarrow) against a plain Python ``csv`` loop.
2. ``build_sequences`` (filter, remap, stable sort) on the parsed rows.
3. Batch building: retrieval-train and ranking-train batches per second on the default
   synthetic dataset.

Run: ``.venv/bin/python bench/bench_data.py [--lines 2000000]`` (``--smoke``: 20,000 lines and 5
batches, checks it runs). The last line is one JSON object: lines, parse_seconds_pyarrow,
parse_seconds_python_loop, parse_speedup, build_sequences_seconds,
retrieval_train_batches_per_second, ranking_train_batches_per_second.

``write_ml1m_shaped_ratings`` also gives other benches (bench/train_step.py) a ``ratings.dat``
with MovieLens-1M's shape, since ML-1M itself is not on every machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke  # noqa: E402

MONTH_START = 1_709_251_200  # 2024-03-01T00:00:00Z
MONTH_SECONDS = 31 * 86_400


def synthetic_month(synthetic: Any, seed: int) -> Tuple[Any, np.ndarray, np.random.Generator]:
    """gr's synthetic data (``synthetic``: a ``SyntheticConfig``) as a month's log: each user's events
    at sorted random times in March 2024 -> (the ``Interactions``, their timestamps [N] int64, the
    generator that drew them, for the log's further columns)."""
    from gr.data.synthetic import generate_synthetic

    data = generate_synthetic(synthetic, seed)
    rng = np.random.default_rng([seed, 1])
    lengths = np.bincount(data.users - 1, minlength=synthetic.num_users)  # the generator's rows: user by user
    times = MONTH_START + np.concatenate([np.sort(rng.integers(0, MONTH_SECONDS, n)) for n in lengths])
    return data, times, rng


def write_ratings(path: Path, lines: int) -> None:
    rng = np.random.default_rng(0)
    users = np.sort(rng.integers(1, lines // 150 + 2, size=lines))
    items = rng.integers(1, 27_000, size=lines)
    ratings = rng.integers(1, 11, size=lines) / 2
    times = rng.integers(800_000_000, 1_400_000_000, size=lines)
    with open(path, "w") as f:
        f.write("userId,movieId,rating,timestamp\n")
        for start in range(0, lines, 500_000):
            block = slice(start, start + 500_000)
            f.writelines(
                f"{u},{i},{r:.1f},{t}\n" for u, i, r, t in zip(users[block], items[block], ratings[block], times[block])
            )


# MovieLens-1M's interactions per user: (quantile, length) knots of a log-linear quantile function.
# Min 20, median 96, 90th percentile 400 and max 2,314 are ML-1M's; the 99th-percentile knot is
# chosen so that the mean is ML-1M's 166 (6,040 users then have ~1.0M ratings, as ML-1M does).
ML1M_LENGTH_KNOTS = ((0.0, 20), (0.5, 96), (0.9, 400), (0.99, 580), (1.0, 2314))
ML1M_USERS, ML1M_ITEMS = 6040, 3706
# The ML-1M recipes, by name, that the training benchmarks run on this data unchanged.
ML1M_RECIPES = {"small": "configs/ml1m_hstu.yaml", "large": "configs/ml1m_hstu_large.yaml"}


def ml1m_lengths(num_users: int, rng: np.random.Generator) -> np.ndarray:
    """[num_users] int64 sequence lengths spread over ML-1M's quantiles, shuffled."""
    quantiles, lengths = zip(*ML1M_LENGTH_KNOTS)
    spread = np.arange(num_users) / max(num_users - 1, 1)
    out = np.rint(np.exp(np.interp(spread, quantiles, np.log(lengths)))).astype(np.int64)
    return rng.permutation(out)


def write_ml1m_shaped_ratings(directory: Path, num_users: int = ML1M_USERS, seed: int = 0) -> int:
    """Write ``directory/ratings.dat`` (``UserID::MovieID::Rating::Timestamp``) with ML-1M's
    per-user lengths (``ml1m_lengths``) over its 3,706 items: each user's items are distinct,
    drawn by Zipf popularity (Gumbel top-k), at increasing times. Returns the number of lines."""
    rng = np.random.default_rng(seed)
    lengths = ml1m_lengths(num_users, rng)
    log_popularity = -np.log1p(rng.permutation(ML1M_ITEMS))
    with open(Path(directory) / "ratings.dat", "w") as f:
        for start in range(0, num_users, 1024):
            block = lengths[start : start + 1024]
            keys = log_popularity + rng.gumbel(size=(len(block), ML1M_ITEMS))
            order = np.argsort(-keys, axis=1)
            for offset, length in enumerate(block):
                user = start + offset + 1
                items = order[offset, :length] + 1
                times = 978_000_000 + np.cumsum(rng.integers(1, 3600, size=length))
                ratings = rng.integers(1, 6, size=length)
                f.writelines(f"{user}::{i}::{r}::{t}\n" for i, r, t in zip(items, ratings, times))
    return int(lengths.sum())


def python_loop(path: Path) -> int:
    users, items, ratings, times = [], [], [], []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        next(reader)
        for user, item, rating, stamp in reader:
            users.append(int(user))
            items.append(int(item))
            ratings.append(float(rating))
            times.append(int(stamp))
    return len(np.asarray(users))


def batches_per_second(config: dict, batches: int) -> float:
    from gr.data import SequenceDataModule

    dm = SequenceDataModule(config)
    dm.setup()
    loader = dm.train_dataloader()
    built = 0
    start = time.perf_counter()
    while built < batches:
        for _ in loader:
            built += 1
            if built == batches:
                break
    return batches / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2_000_000)
    parser.add_argument("--batches", type=int, default=50)
    args, _ = smoke.parse_args(parser, {"lines": 20_000, "batches": 5})
    from gr.data.readers import read_ml_20m
    from gr.data.sequences import build_sequences

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ratings.csv"
        write_ratings(path, args.lines)
        start = time.perf_counter()
        data = read_ml_20m(tmp, item_features=False)
        arrow_seconds = time.perf_counter() - start
        start = time.perf_counter()
        python_loop(path)
        loop_seconds = time.perf_counter() - start
    start = time.perf_counter()
    build_sequences(data)
    sequences_seconds = time.perf_counter() - start
    retrieval = batches_per_second({"batch_size": 128, "max_seq_len": 50}, args.batches)
    ranking = batches_per_second({"batch_size": 128, "max_seq_len": 50, "task": "ranking"}, args.batches)
    print(
        f"parse {args.lines} lines: pyarrow {arrow_seconds:.2f}s, python csv loop {loop_seconds:.2f}s; "
        f"build_sequences {sequences_seconds:.2f}s; batches/s retrieval {retrieval:.0f}, ranking {ranking:.0f}"
    )
    print(
        json.dumps(
            {
                "lines": args.lines,
                "parse_seconds_pyarrow": round(arrow_seconds, 3),
                "parse_seconds_python_loop": round(loop_seconds, 3),
                "parse_speedup": round(loop_seconds / arrow_seconds, 2),
                "build_sequences_seconds": round(sequences_seconds, 3),
                "retrieval_train_batches_per_second": round(retrieval, 1),
                "ranking_train_batches_per_second": round(ranking, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
