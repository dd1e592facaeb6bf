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
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke  # noqa: E402


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
            f.writelines(f"{u},{i},{r:.1f},{t}\n" for u, i, r, t in
                         zip(users[block], items[block], ratings[block], times[block]))


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
    print(f"parse {args.lines} lines: pyarrow {arrow_seconds:.2f}s, python csv loop {loop_seconds:.2f}s; "
          f"build_sequences {sequences_seconds:.2f}s; batches/s retrieval {retrieval:.0f}, ranking {ranking:.0f}")
    print(json.dumps({
        "lines": args.lines,
        "parse_seconds_pyarrow": round(arrow_seconds, 3),
        "parse_seconds_python_loop": round(loop_seconds, 3),
        "parse_speedup": round(loop_seconds / arrow_seconds, 2),
        "build_sequences_seconds": round(sequences_seconds, 3),
        "retrieval_train_batches_per_second": round(retrieval, 1),
        "ranking_train_batches_per_second": round(ranking, 1),
    }))


if __name__ == "__main__":
    main()
