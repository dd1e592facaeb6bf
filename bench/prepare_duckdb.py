"""``gr data prepare`` with DuckDB against the in-memory path, on --rows synthetic interactions.

The rows (users with ~--per-user interactions each, Zipf-like item popularity, ratings, integer
timestamps, a categorical token feature) are written with numpy + pyarrow as a CSV or Parquet file in a
temporary directory. Each side runs in a child process of its own, which reports its wall time, its
resident memory once imports are done and its peak (``ru_maxrss``):

* prepare: ``prepare_with_duckdb`` (what ``gr data prepare --memory-limit M --threads N`` runs);
* in-memory: ``build_sequences(read_source(config))`` and ``SideFeatures.align`` of the events, what
  ``SequenceDataModule.setup`` does today before batching.

Run: ``.venv/bin/python bench/prepare_duckdb.py [--rows 1000000] [--memory-limit 1GB] [--format csv]``
(``--smoke``: 20,000 rows). The last line is one JSON object: rows, format, users, interactions,
memory_limit, threads, prepare_seconds, prepare_rss_after_imports_mb, prepare_peak_rss_mb,
in_memory_seconds, in_memory_rss_after_imports_mb, in_memory_peak_rss_mb, duckdb_version, cpus,
load_average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# A child's report: its seconds, resident memory after imports and peak (MB), and what it prepared.
CHILD = """
import json, resource, sys, time
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
from gr.data.config import DataConfig
from gr.data.features import SideFeatures
from gr.data.mappings import IdMap
from gr.data.readers import read_source
from gr.data.sequences import build_sequences
from gr.data.prepared.duckdb_engine import prepare_with_duckdb
after_imports = rss()
start = time.perf_counter()
{body}
print(json.dumps({{"seconds": time.perf_counter() - start, "rss_after_imports_mb": after_imports,
                   "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **counts}}))
"""
PREPARE = """
config = DataConfig.from_dict(json.loads(sys.argv[1]))
manifest = prepare_with_duckdb(config, sys.argv[2], memory_limit=sys.argv[3], threads=int(sys.argv[4]))
counts = {k: manifest.summary[k] for k in ("users", "interactions")}
"""
IN_MEMORY = """
config = DataConfig.from_dict(json.loads(sys.argv[1]))
sequences, users, items = build_sequences(read_source(config), config.min_seq_len)
SideFeatures.align(sequences.events, IdMap(__import__("numpy").arange(len(sequences.items))))
counts = {"users": sequences.num_users, "interactions": len(sequences.items)}
"""


def write_rows(path: Path, rows: int, per_user: int, fmt: str) -> None:
    """``rows`` synthetic interactions as ``path`` (CSV with a header, or Parquet)."""
    rng = np.random.default_rng(0)
    users = rng.integers(0, max(1, rows // per_user), size=rows)
    items = np.minimum(rng.zipf(1.3, size=rows), 200_000)
    table = pa.table(
        {
            "user_id": users,
            "item_id": items,
            "timestamp": rng.integers(1_500_000_000, 1_600_000_000, size=rows),
            "rating": rng.integers(1, 6, size=rows).astype(np.float64),
            "device": pa.array(np.asarray(["web", "ios", "android"])[rng.integers(0, 3, size=rows)]),
        }
    )
    if fmt == "csv":
        pacsv.write_csv(table, path, pacsv.WriteOptions(quoting_style="none"))
    else:
        pq.write_table(table, path)


def child(body: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(body=body), *args], capture_output=True, text=True, env=env, cwd=ROOT
    )
    if done.returncode != 0:
        raise SystemExit(f"child failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--per-user", type=int, default=100, help="mean interactions per user")
    parser.add_argument("--format", choices=("csv", "parquet"), default="csv")
    parser.add_argument("--memory-limit", default="1GB")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args, _ = smoke.parse_args(parser, {"rows": 20_000}, argv)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / f"rows.{args.format}"
        write_rows(source, args.rows, args.per_user, args.format)
        data = {"source": args.format, "path": str(source), "columns": {"token_features": ["device"]}}
        data["columns"]["rating"] = "rating"
        out = str(Path(tmp) / "prepared")
        prepared = child(PREPARE, [json.dumps(data), out, args.memory_limit, str(args.threads)])
        in_memory = child(IN_MEMORY, [json.dumps(data)])
    assert (prepared["users"], prepared["interactions"]) == (in_memory["users"], in_memory["interactions"])
    result = {
        "rows": args.rows,
        "format": args.format,
        "users": prepared["users"],
        "interactions": prepared["interactions"],
        "memory_limit": args.memory_limit,
        "threads": args.threads,
        **{f"prepare_{k}": round(prepared[k], 2) for k in ("seconds", "rss_after_imports_mb", "peak_rss_mb")},
        **{f"in_memory_{k}": round(in_memory[k], 2) for k in ("seconds", "rss_after_imports_mb", "peak_rss_mb")},
        "duckdb_version": duckdb.__version__,
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
