"""Evaluation cost: a run's test pass with ``data.test_events: next``, with ``all``, and its export's.

    python bench/eval_cost.py [--users 3000] [--items 2000] [--min-len 60] [--max-len 260] [--max-seq-len 200]
                              [--eviction-block 1] [--repeats 2]
    python bench/eval_cost.py --smoke                 # 150 users, a few training steps: checks it runs

The source: one month of a log (one Parquet file: user, item, time), generated deterministically from
``--seed``: ``gr.data.synthetic``'s learnable sequences (``--users`` users of ``--min-len`` to
``--max-len`` events, ``--items`` items), each user's events at sorted random times over the month. The
split is the time split at the ``--cut`` percentile of the timestamps. configs/quickstart.yaml's model
(with ``--max-seq-len`` and ``--eviction-block``) trains on it for ``--steps`` steps (what it learns
does not matter here), is exported, and then, in this process, each pass is timed (the fastest of
``--repeats``, each from reading the data to the metrics):

* next: ``gr evaluate RUN`` with ``data.test_events: next`` (the run's own test pass: one target a user);
* all: ``gr evaluate RUN`` with ``data.test_events: all`` (every event of a user after its validation
  event is a test target, with every earlier event as history);
* export: ``gr evaluate EXPORT`` with ``data.test_events: all`` (through the serving runtime).

A user's targets whose windows start at the same event share one sequence; a history longer than
``--max-seq-len`` slides its window (in blocks of ``--eviction-block``), so its targets share one only
within a block: the tokens the test batches hold (``tokens``) bound what ``all`` can cost.

Prints each pass, then one JSON line: bench, users, items, interactions, max_seq_len, eviction_block,
test_targets and tokens (next, all: the test batches' tokens), seconds and cpu_seconds (next, all,
export: wall and this process's CPU), all_over_next, export_over_next and their cpu_ forms,
tokens_all_over_next, hr@10 (per pass), export_metric_difference (the largest difference between a
metric of the export's pass and the same metric of all's: fp32 rounding at most), targets (both ratios of
CPU seconds at most 1.5: with one torch thread the CPU seconds are the pass's work, which other jobs on
a shared machine do not inflate), threads, cpu, cpu_flags, load_average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import smoke  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from _host import cpu, load_average  # noqa: E402
from bench_data import synthetic_month  # noqa: E402

from gr.commands.evaluate import evaluate_export, evaluate_run  # noqa: E402
from gr.data.config import SyntheticConfig  # noqa: E402
from gr.data.datamodule import SequenceDataModule  # noqa: E402
from gr.export.writer import export_run  # noqa: E402
from gr.ops.native import native_ops  # noqa: E402
from gr.train.config import TrainConfig, load_config  # noqa: E402
from gr.train.run import train  # noqa: E402

RECIPE = ROOT / "configs" / "quickstart.yaml"
TARGET_RATIO = 1.5


def write_log(path: Path, args: argparse.Namespace) -> Dict[str, int]:
    """Write the month's log (module docstring) to ``path`` -> {"interactions", "split_time"}."""
    synthetic = SyntheticConfig(num_users=args.users, num_items=args.items, min_len=args.min_len, max_len=args.max_len)
    data, times, _ = synthetic_month(synthetic, args.seed)
    table = pa.table(
        {
            "user_id": pa.array(data.users.astype(np.int64)),
            "item_id": pa.array(data.items.astype(np.int64)),
            "ts": pa.array(times.astype(np.int64)),
        }
    )
    pq.write_table(table.take(np.argsort(times, kind="stable")), path)
    return {"interactions": len(times), "split_time": int(np.percentile(times, args.cut))}


def config(source: Path, split_time: int, args: argparse.Namespace) -> TrainConfig:
    """The quickstart recipe's model on the log, the time split, ``--steps`` training steps."""
    values = yaml.safe_load(RECIPE.read_text())
    values["data"].update(
        source="parquet",
        path=str(source),
        columns={"user": "user_id", "item": "item_id", "timestamp": "ts"},
        split="time",
        split_time=split_time,
        seed=args.seed,
        max_seq_len=args.max_seq_len,
    )
    values["data"].pop("synthetic")
    values["model"]["hstu"].update(max_seq_len=args.max_seq_len, eviction_block=args.eviction_block)
    values["trainer"].update(
        max_epochs=1,
        limit_train_batches=args.steps,
        seed=args.seed,
        enable_progress_bar=False,
        num_threads=args.threads,
    )
    return TrainConfig.from_dict(values)


def batch_tokens(run: Path, test_events: str) -> int:
    """The tokens of the run's test batches under ``data.test_events: test_events``."""
    values = load_config(run / "config.yaml", [("data.test_events", test_events)])
    data = SequenceDataModule(values.data, values.model.hstu.eviction_block)
    data.setup()
    return sum(int(batch.seq_offsets[-1]) for batch in data.test_dataloader())


def fastest(run: Callable[[], Dict[str, Any]], repeats: int) -> Dict[str, Any]:
    """The report of ``run()`` with the fewest seconds of ``repeats`` calls (under "seconds"), with the
    fewest CPU seconds of this process over the calls (under "cpu_seconds")."""
    best: Dict[str, Any] = {}
    least_cpu = float("inf")
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        report = run()
        seconds, least_cpu = time.perf_counter() - start, min(least_cpu, time.process_time() - cpu_start)
        if not best or seconds < best["seconds"]:
            best = {**report, "seconds": seconds}
    return {**best, "cpu_seconds": least_cpu}


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=3000)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--min-len", type=int, default=60)
    parser.add_argument("--max-len", type=int, default=260)
    parser.add_argument("--max-seq-len", type=int, default=200)
    parser.add_argument("--eviction-block", type=int, default=1, help="model.hstu.eviction_block")
    parser.add_argument("--cut", type=float, default=90.0, help="the split time's percentile of the timestamps")
    parser.add_argument("--steps", type=int, default=20, help="training steps (the model's quality does not matter)")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls of each pass; the fastest counts")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (training's and evaluation's)")
    parser.add_argument("--seed", type=int, default=0)
    sizes = {"users": 150, "items": 300, "min_len": 20, "max_len": 60, "max_seq_len": 50, "steps": 2, "repeats": 1}
    args, _ = smoke.parse_args(parser, sizes, argv)
    native_ops("gr_cpu_fused")  # a first build (~1 min) here, not inside a timed pass
    torch.set_num_threads(args.threads)
    start_load = load_average()
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        log = write_log(root / "events-2024-03.parquet", args)
        run = root / "run"
        train(config(root / "events-2024-03.parquet", log["split_time"], args), run)
        export = export_run(run, root / "export")
        torch.set_num_threads(args.threads)
        passes = {
            "next": lambda: evaluate_run(run, [("data.test_events", "next")]),
            "all": lambda: evaluate_run(run, [("data.test_events", "all")]),
            "export": lambda: evaluate_export(export, run / "config.yaml", [("data.test_events", "all")]),
        }
        reports = {name: fastest(call, args.repeats) for name, call in passes.items()}
        tokens = {name: batch_tokens(run, name) for name in ("next", "all")}
    seconds = {name: report["seconds"] for name, report in reports.items()}
    cpu_seconds = {name: report["cpu_seconds"] for name, report in reports.items()}
    targets = {name: reports[name]["data"]["evaluated_targets"]["test"] for name in ("next", "all")}
    for name, report in reports.items():
        print(f"{name}: {report['seconds']:.2f} s ({report['cpu_seconds']:.2f} s of CPU), hr@10 {report['hr@10']:.4f}")
    ratios = {
        "all_over_next": seconds["all"] / seconds["next"],
        "export_over_next": seconds["export"] / seconds["next"],
    }
    cpu_ratios = {
        "cpu_all_over_next": cpu_seconds["all"] / cpu_seconds["next"],
        "cpu_export_over_next": cpu_seconds["export"] / cpu_seconds["next"],
    }
    metrics = [key for key in reports["all"] if key.startswith(("hr@", "ndcg@", "mrr"))]
    difference = max(abs(reports["export"][key] - reports["all"][key]) for key in metrics)
    print(f"export's metrics against all's ({', '.join(metrics)}): at most {difference:.2e} apart")
    print(
        f"{targets['next']} test targets in {tokens['next']} tokens (next), {targets['all']} in {tokens['all']} "
        f"(all): all/next {ratios['all_over_next']:.2f} ({cpu_ratios['cpu_all_over_next']:.2f} in CPU seconds), "
        f"export/next {ratios['export_over_next']:.2f} ({cpu_ratios['cpu_export_over_next']:.2f})"
    )
    model, flags = cpu()
    summary = {
        "bench": "eval_cost",
        "users": args.users,
        "items": args.items,
        "interactions": log["interactions"],
        "max_seq_len": args.max_seq_len,
        "eviction_block": args.eviction_block,
        "test_targets": targets,
        "tokens": tokens,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        **ratios,
        **cpu_ratios,
        "tokens_all_over_next": tokens["all"] / tokens["next"],
        "hr@10": {name: report["hr@10"] for name, report in reports.items()},
        "export_metric_difference": difference,
        "targets": {f"{name}_at_most_{TARGET_RATIO}": value <= TARGET_RATIO for name, value in cpu_ratios.items()},
        "threads": args.threads,
        "cpu": model,
        "cpu_flags": flags,
        "load_average": {"start": start_load, "end": load_average()},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
