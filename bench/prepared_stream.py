"""One training epoch's batches from a prepared dataset (``data.prepared``) against raw reading.

The rows (``prepare_duckdb.write_rows``: ~--per-user interactions a user, Zipf-like items, ratings,
a categorical token feature) are written as a CSV and prepared with ``prepare_with_duckdb``
(--users-per-shard users a shard) in a child process. Each side then runs in a child of its own, which sets up
``SequenceDataModule`` on the CSV (raw) or on the prepared directory, computes ``popularity()`` and
builds every batch of one training epoch (no model), and reports its seconds, its resident memory
once imports are done and its peak (``ru_maxrss``): the prepared side's must not grow with the rows.

Run: ``.venv/bin/python bench/prepared_stream.py [--rows 1000000] [--users-per-shard 2000]``
(``--smoke``: 20,000 rows). The last line is one JSON object: rows, users, interactions, shards,
batches, raw_setup_seconds, raw_epoch_seconds, raw_rss_after_imports_mb, raw_peak_rss_mb, and the same
prepared_* keys, cpus, load_average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke  # noqa: E402
from prepare_duckdb import write_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Every step runs in a child of its own: on Linux a child's ru_maxrss starts at its parent's resident set
# when it forks, so the parent only writes the rows and reads the reports.
PREPARE = """
import json, sys
from pathlib import Path
from gr.data.config import DataConfig
from gr.data.prepared.duckdb_engine import prepare_with_duckdb
config = DataConfig.from_dict(json.loads(sys.argv[1]))
manifest = prepare_with_duckdb(config, Path(sys.argv[2]), memory_limit="1GB", users_per_shard=int(sys.argv[3]))
print(json.dumps({"shards": len(manifest.shards)}))
"""
# An epoch's report: seconds to set up and to build every batch, resident memory after imports, peak.
EPOCH = """
import json, resource, sys, time
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
from gr.data.datamodule import SequenceDataModule
after_imports = rss()
start = time.perf_counter()
data = SequenceDataModule(json.loads(sys.argv[1]))
data.setup()
data.popularity()
setup = time.perf_counter() - start
batches = samples = 0
for batch in data.train_dataloader():
    batches, samples = batches + 1, samples + len(batch.labels["user"])
print(json.dumps({"setup_seconds": setup, "epoch_seconds": time.perf_counter() - start - setup,
                  "rss_after_imports_mb": after_imports, "batches": batches, "samples": samples,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "interactions": data.summary["interactions"], "users": data.summary["users"]}))
"""
REPORTED = ("setup_seconds", "epoch_seconds", "rss_after_imports_mb", "peak_rss_mb")


def child(script: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"child failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--per-user", type=int, default=50, help="mean interactions per user")
    parser.add_argument("--users-per-shard", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=128)
    args, _ = smoke.parse_args(parser, {"rows": 20_000}, argv)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "rows.csv"
        write_rows(source, args.rows, args.per_user, "csv")
        data = {
            "source": "csv",
            "path": str(source),
            "columns": {"rating": "rating", "token_features": ["device"]},
            "batch_size": args.batch_size,
            "max_seq_len": 50,
        }
        prepared_dir = str(Path(tmp) / "prepared")
        shards = child(PREPARE, json.dumps(data), prepared_dir, str(args.users_per_shard))["shards"]
        raw = child(EPOCH, json.dumps(data))
        prepared = child(EPOCH, json.dumps({**data, "prepared": prepared_dir}))
    same = ("users", "interactions", "batches", "samples")
    assert [raw[k] for k in same] == [prepared[k] for k in same], (raw, prepared)
    result = {
        "rows": args.rows,
        "users": raw["users"],
        "interactions": raw["interactions"],
        "shards": shards,
        "batches": raw["batches"],
        **{f"raw_{k}": round(raw[k], 2) for k in REPORTED},
        **{f"prepared_{k}": round(prepared[k], 2) for k in REPORTED},
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
