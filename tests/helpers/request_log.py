"""An impressions log grouped in requests (``data.columns.request``), and its ranking samples as
batches show them: shared by the raw-versus-prepared tests of both engines, the stream and appends."""

from pathlib import Path
from typing import Iterable, List, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HEADER = ("user", "item", "ts", "clicked", "request")
COLUMNS = {"user": "user", "item": "item", "timestamp": "ts", "rating": "clicked", "request": "request"}
IMPRESSIONS = {"candidates": "impressions", "positives_per_sample": 3, "samples_per_user": 4}
TASKS = [{"name": "click", "min_rating": 1}]


def request_rows(users: Iterable[int], start: int, end: int, seed: int, items: int = 40) -> List[tuple]:
    """Rows (user, item, ts, clicked, request) of ``users`` (numbers), each with 3 to 7 requests in
    [start, end) of 1 to 4 impressions sharing the request's time. A user's request ids cycle
    r0, r1, r2 (so an id comes back, a later request of its own); two requests may share a time
    (then file order keeps them apart); user ``u`` is ``u{u:02d}``."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in users:
        times = np.sort(rng.integers(start, end, size=int(rng.integers(3, 8))))
        for k, stamp in enumerate(times):
            for item in rng.choice(items, size=int(rng.integers(1, 5)), replace=False):
                rows.append((f"u{u:02d}", int(item), int(stamp), int(rng.integers(0, 2)), f"r{k % 3}"))
    return rows


def write_request_log(path: Path, *parts: List[tuple]) -> Path:
    """``parts``' rows as a CSV, or (a ``.parquet`` path) a Parquet file with integer request ids
    (``r2`` -> 2)."""
    rows = [row for part in parts for row in part]
    if path.suffix == ".parquet":
        columns = {name: [row[i] for row in rows] for i, name in enumerate(HEADER)}
        columns["request"] = [int(r[1:]) for r in columns["request"]]
        pq.write_table(pa.table(columns), path)
    else:
        path.write_text("\n".join([",".join(HEADER), *(",".join(map(str, row)) for row in rows)]) + "\n")
    return path


def request_data(path: Path, **overrides) -> dict:
    """A ranking-from-impressions data section reading the request log ``path``."""
    return {
        "source": path.suffix[1:],
        "path": str(path),
        "task": "ranking",
        "columns": COLUMNS,
        "max_seq_len": 8,
        "batch_size": 6,
        "eval_batch_size": 6,
        "ranking": {**IMPRESSIONS, "tasks": TASKS},
        **overrides,
    }


def request_samples(batches) -> List[Tuple[int, tuple, tuple, tuple, tuple]]:
    """Every sample of ``batches``, sorted: (dataset user, history items, history times, candidate
    items, candidate labels)."""
    found = []
    for batch in batches:
        offsets, items = batch.seq_offsets.tolist(), batch.sequence_ids["item_id"].values().tolist()
        times, labels = batch.timestamps.tolist(), batch.labels["click"].tolist()
        for b, user in enumerate(batch.labels["user"].tolist()):
            start, end, n = offsets[b], offsets[b + 1], int(batch.num_targets[b])
            history = (tuple(items[start : end - n]), tuple(times[start : end - n]))
            found.append((user, *history, tuple(items[end - n : end]), tuple(labels[:n])))
            labels = labels[n:]
    return sorted(found)
