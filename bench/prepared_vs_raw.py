"""Training from a prepared dataset against reading the raw file: the same config and seed, test HR@10 of both.

    python bench/prepared_vs_raw.py [--users 3000] [--epochs 8] [--seed 0] [--shuffle-buffer N]
    python bench/prepared_vs_raw.py --smoke                 # 200 users, 1 epoch: checks it runs

The source: one month of a log (March 2024, UTC), one Parquet file in time order, generated
deterministically from ``--seed``: ``gr.data.synthetic``'s learnable sequences (``--users`` users,
``--items`` items), each user's events at sorted random times over the month, with an item category,
the item's genres (a list of strings: a list feature, pooled by a ``token_bag`` table), the user's
country and the event's device. The split is the time split at the 90th percentile of the timestamps
(validation: each user's first event after it, test: the second). Both runs train configs/quickstart.yaml's
model with those features, the same seeds, one rank: (a) raw reads the Parquet file (``data.path``), (b)
prepared reads ``gr data prepare``'s DuckDB output (``data.prepared``), with ``data.shuffle_buffer``
(default: the data default, 4096 users, which holds every user of the full size).

Prints both runs, then one JSON line: bench, users, items, interactions, epochs, split_time,
shuffle_buffer, test_users, raw and prepared (hr@10, ndcg@10, best_checkpoint, epochs, val_hr10 per
epoch, train_s), prepare_s, se_hr10 (sqrt(p (1 - p) / n) of the raw run's HR@10 p over the n test
users), prepared_minus_raw (the HR@10 difference) and prepared_minus_raw_in_se, train_time_ratio
(prepared over raw training seconds, the preparation not counted), same_val_curve, targets (prepared
within one SE of raw), cpu, cpu_flags, load_average.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import smoke  # noqa: E402
import yaml  # noqa: E402
from _host import cpu, load_average  # noqa: E402
from bench_data import synthetic_month  # noqa: E402

from gr.data.config import SyntheticConfig  # noqa: E402
from gr.data.prepared.duckdb_engine import prepare_with_duckdb  # noqa: E402
from gr.ops.native import native_ops  # noqa: E402
from gr.train.config import TrainConfig  # noqa: E402
from gr.train.run import train  # noqa: E402

RECIPE = ROOT / "configs" / "quickstart.yaml"
COUNTRIES = ("fr", "de", "jp", "us", "br", "in", "ng")
COLUMNS = {
    "user": "user_id",
    "item": "item_id",
    "timestamp": "ts",
    "item_features": ["category", "genres"],
    "user_features": ["country"],
    "token_features": ["device"],
    "list_features": ["genres"],
}
TABLES = [
    {"name": "category", "embedding_dim": 8, "features": ["category"]},
    {"name": "genre", "embedding_dim": 8, "features": ["genres"], "kind": "token_bag", "pooling": "mean"},
    {"name": "device", "embedding_dim": 4, "features": ["device"]},
    {"name": "country", "embedding_dim": 4, "features": ["country"], "kind": "common"},
]


def write_log(path: Path, users: int, items: int, seed: int) -> Dict[str, int]:
    """Write the month's log (module docstring) to ``path`` -> {"interactions", "split_time"}."""
    data, times, rng = synthetic_month(SyntheticConfig(num_users=users, num_items=items, min_len=10, max_len=60), seed)
    category = data.item_side.categorical["item_category"]  # [items] by raw id - 1
    genres = [[f"g{c}", f"g{(c * 7 + i) % 17}"][: 1 + i % 2] for i, c in enumerate(category.tolist())]
    item, user = data.items - 1, data.users - 1
    country = np.array(COUNTRIES)[data.user_side.categorical["user_age"]]
    table = pa.table(
        {
            "user_id": pa.array(np.char.add("u", data.users.astype(str))),
            "item_id": pa.array(data.items.astype(np.int64)),
            "ts": pa.array(times.astype(np.int64)),
            "category": pa.array(np.char.add("c", category.astype(str))[item]),
            "genres": pa.array([genres[i] for i in item.tolist()], pa.list_(pa.string())),
            "country": pa.array(country[user]),
            "device": pa.array(np.array(["web", "app", "tv"])[rng.integers(0, 3, len(times))]),
        }
    )
    pq.write_table(table.take(np.argsort(times, kind="stable")), path)
    return {"interactions": len(times), "split_time": int(np.percentile(times, 90))}


def config(source: Path, split_time: int, args: argparse.Namespace) -> TrainConfig:
    """The quickstart recipe's model and trainer on the log, with its features and the time split."""
    values = yaml.safe_load(RECIPE.read_text())
    values["data"].update(
        source="parquet",
        path=str(source),
        columns=COLUMNS,
        item_features=True,
        user_features=True,
        split="time",
        split_time=split_time,
        seed=args.seed,
        max_seq_len=args.max_seq_len,
    )
    values["data"].pop("synthetic")
    if args.shuffle_buffer is not None:
        values["data"]["shuffle_buffer"] = args.shuffle_buffer
    values["model"]["hstu"]["max_seq_len"] = args.max_seq_len
    values["model"]["tables"] += TABLES
    values["trainer"].update(max_epochs=args.epochs, seed=args.seed, enable_progress_bar=False)
    return TrainConfig.from_dict(values)


def val_curve(run: Path) -> List[float]:
    """Each epoch's val/hr@10 from the run's CSV log."""
    with (run / "logs" / "metrics.csv").open(newline="") as handle:
        return [float(row["val/hr@10"]) for row in csv.DictReader(handle) if row.get("val/hr@10")]


def trained(values: TrainConfig, out: Path) -> Dict[str, Any]:
    """Train ``values`` into ``out`` -> its test hr@10, ndcg@10, best checkpoint, epochs, val curve, seconds."""
    start = time.perf_counter()
    metrics = train(values, out)
    seconds = time.perf_counter() - start
    kept = {k: metrics[k] for k in ("hr@10", "ndcg@10", "best_checkpoint", "epochs")}
    return {**kept, "val_hr10": val_curve(out), "train_s": seconds, "test_users": metrics["data"]["evaluated_users"]}


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=3000)
    parser.add_argument("--items", type=int, default=1500)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0, help="the data's and both runs' seed")
    parser.add_argument("--shuffle-buffer", type=int, help="data.shuffle_buffer (default: the data default)")
    args, _ = smoke.parse_args(parser, {"users": 200, "items": 300, "epochs": 1, "max_seq_len": 20}, argv)
    native_ops("gr_cpu_fused")  # a first build (~1 min) here, not inside the first timed run
    start_load = load_average()
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        log = write_log(root / "events-2024-03.parquet", args.users, args.items, args.seed)
        raw_config = config(root / "events-2024-03.parquet", log["split_time"], args)
        start = time.perf_counter()
        prepare_with_duckdb(raw_config.data, root / "prepared", threads=1)
        prepare_s = time.perf_counter() - start
        prepared_config = TrainConfig.from_dict(
            {**raw_config.to_dict(), "data": {**raw_config.data.to_dict(), "prepared": str(root / "prepared")}}
        )
        runs = {"raw": trained(raw_config, root / "raw"), "prepared": trained(prepared_config, root / "prepared-run")}
    test_users = runs["raw"].pop("test_users")["test"]
    if runs["prepared"].pop("test_users")["test"] != test_users:
        raise RuntimeError("prepared_vs_raw: the runs were not tested on the same users")
    p = runs["raw"]["hr@10"]
    se = math.sqrt(p * (1 - p) / test_users)
    difference = runs["prepared"]["hr@10"] - p
    in_se = difference / se if se > 0 else 0.0
    ratio = runs["prepared"]["train_s"] / runs["raw"]["train_s"]
    for name, run in runs.items():
        curve = " ".join(f"{v:.4f}" for v in run["val_hr10"])
        print(
            f"{name}: test hr@10 {run['hr@10']:.4f} ndcg@10 {run['ndcg@10']:.4f} (best {run['best_checkpoint']}, "
            f"{run['train_s']:.1f} s); val hr@10 per epoch {curve}"
        )
    print(
        f"{test_users} test users: SE {se:.4f}; prepared - raw {difference:+.4f} ({in_se:+.2f} SE); "
        f"train time prepared/raw {ratio:.2f}; preparing took {prepare_s:.1f} s"
    )
    model, flags = cpu()
    summary = {
        "bench": "prepared_vs_raw",
        "users": args.users,
        "items": args.items,
        "interactions": log["interactions"],
        "epochs": args.epochs,
        "split_time": log["split_time"],
        "shuffle_buffer": prepared_config.data.shuffle_buffer,
        "test_users": test_users,
        **runs,
        "prepare_s": prepare_s,
        "se_hr10": se,
        "prepared_minus_raw": difference,
        "prepared_minus_raw_in_se": in_se,
        "train_time_ratio": ratio,
        "same_val_curve": runs["raw"]["val_hr10"] == runs["prepared"]["val_hr10"],
        "targets": {"prepared_within_one_se_of_raw": abs(in_se) <= 1.0},
        "cpu": model,
        "cpu_flags": flags,
        "load_average": {"start": start_load, "end": load_average()},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
