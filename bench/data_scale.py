"""Data bigger than memory: prepared sequence shards (``gr data prepare``, DuckDB) against reading the raw source.

    python bench/data_scale.py [--sizes 1000000 10000000] [--memory-limit 4GB] [--steps 40]
    python bench/data_scale.py --sizes 1000000 10000000 100000000     # the 100 M point (minutes, ~5 GB of disk)
    python bench/data_scale.py --smoke      # 350,000 interactions, each step forked from this process: checks it runs

The source: synthetic interactions (user_id, item_id, timestamp) with MovieLens-1M's per-user lengths
(``bench_data.ml1m_lengths``: mean 166) over ML-1M's 3,706 items (Zipf popularity), written as a
directory of Parquet files of 1 M rows each, rows shuffled within a file (a log, not sorted by user).
The catalogue stays at 3,706 items at every size, so a training process's memory shows what the
*data* costs, not a larger item table. Every measured step runs in a fresh process whose peak
resident set (``VmHWM``) is its own:
* prepare: ``gr data prepare --engine duckdb --memory-limit M`` -> wall seconds, peak RSS;
* train: the ML-1M recipe (configs/ml1m_hstu.yaml) on the prepared data for ``--steps`` training
  steps (one epoch cut short, no validation) -> peak RSS, steps/s of Lightning's loop after a
  warm-up (``train_step.EpochClock``); at the smallest size also from the raw source in memory;
* two ranks (torchrun, gloo) iterate one epoch of their training batches on the smallest size's
  prepared data, and one process iterates the raw file's: the users each rank saw (disjoint? together
  the raw epoch's users, each once?), steps per rank, and each process's peak RSS above its imports.
At the smallest size the prepared and raw training processes alternate ``--rounds`` times and each
side's fastest round counts (the machine is shared: one slow moment should not decide the ratio).
Prints a line per size, the CPU and load average; the last line is one JSON object: sizes (per
size: interactions, users, prepare_s, prepare_peak_gib, prepare_above_imports_gib, train_peak_gib,
train_above_imports_gib, train_steps_per_s), raw_smallest (train_peak_gib, train_above_imports_gib,
train_steps_per_s), ratios (train peak largest/smallest; steps/s prepared/raw at the smallest, and
the largest's prepared over the smallest's raw; the largest rank's above-imports peak over the raw
process's), ranks (steps, users, disjoint, every_user_once, peak_gib and above_imports_gib per rank,
one_process_raw_above_imports_gib),
targets, cpu, cpu_flags, load_average. "Above imports": the peak less the process's peak once its
modules are imported (torch, Lightning, gr: ~0.45 GiB), i.e. what the data, the model and the steps add.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import smoke  # noqa: E402
from _host import cpu, load_average, peak_resident_bytes, run_python  # noqa: E402
from bench_data import ML1M_ITEMS, ml1m_lengths  # noqa: E402

RECIPE = ROOT / "configs" / "ml1m_hstu.yaml"
ROWS_PER_FILE = 1_000_000
GIB = 1024**3
SOURCE = [("data.source", "parquet"), ("data.eval_exclude", "window")]


def write_source(directory: Path, interactions: int, seed: int = 0) -> Dict[str, int]:
    """Write ``directory/part-NNNNN.parquet`` (user_id, item_id, timestamp int64) with about
    ``interactions`` rows -> {"interactions", "users"}. Memory: one file's rows at a time."""
    rng = np.random.default_rng(seed)
    lengths = ml1m_lengths(max(interactions // 166, 8), rng)
    popularity = 1.0 / np.arange(1, ML1M_ITEMS + 1)
    cdf = np.cumsum(rng.permutation(popularity / popularity.sum()))
    directory.mkdir(parents=True)
    ends = np.cumsum(lengths)
    first_user, written, part = 0, 0, 0
    while first_user < len(lengths):
        last_user = int(np.searchsorted(ends, written + ROWS_PER_FILE, side="right")) + 1
        block = lengths[first_user:last_user]
        users = np.repeat(np.arange(first_user, first_user + len(block)) + 1, block)
        items = np.searchsorted(cdf, rng.random(len(users)) * cdf[-1]) + 1
        gaps = rng.integers(1, 3600, size=len(users))
        elapsed, first_rows = np.cumsum(gaps), np.cumsum(block) - block
        times = 978_000_000 + elapsed - np.repeat(elapsed[first_rows] - gaps[first_rows], block)  # per user
        order = rng.permutation(len(users))
        table = pa.table({"user_id": users[order], "item_id": items[order], "timestamp": times[order]})
        pq.write_table(table, directory / f"part-{part:05d}.parquet")
        written, first_user, part = written + len(users), first_user + len(block), part + 1
    return {"interactions": written, "users": len(lengths)}


def in_own_process(*flags: str, forked: bool = False) -> Dict[str, Any]:
    """This script run with ``flags`` in a process of its own (``_host.run_python``: a fresh one, or
    with ``forked`` a child of this one) -> the JSON object its last line prints."""
    done = run_python([__file__, *flags], forked)
    if done.returncode != 0:
        raise RuntimeError(f"data_scale.py {' '.join(flags)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def prepare_phase(source: Path, out: Path, memory_limit: str) -> None:
    """--phase prepare: prints {"seconds", "peak_bytes"} of preparing ``source`` into ``out``."""
    from gr.commands.data import prepare
    from gr.data.prepared import duckdb_engine  # noqa: F401 (imported before the baseline, as prepare would)

    imports = peak_resident_bytes()
    start = time.perf_counter()
    overrides = [arg for key, value in [*SOURCE, ("data.path", str(source))] for arg in (f"--{key}", value)]
    status = prepare(["--config", str(RECIPE), "--out", str(out), "--memory-limit", memory_limit, *overrides])
    if status:
        raise SystemExit(status)
    print(
        json.dumps(
            {"seconds": time.perf_counter() - start, "peak_bytes": peak_resident_bytes(), "imports_bytes": imports}
        )
    )


def train_phase(data: Path, prepared: bool, steps: int, work: Path) -> None:
    """--phase train: ``steps`` training steps of the recipe on ``data`` (a prepared dataset, or the
    raw source) -> prints {"steps_per_s", "peak_bytes"}."""
    from train_step import epoch_seconds

    from gr.train.config import load_config

    imports = peak_resident_bytes()
    where = [("data.prepared", str(data))] if prepared else []
    config = load_config(
        RECIPE,
        [
            *SOURCE,
            ("data.path", str(data)),
            *where,
            ("trainer.max_epochs", "1"),
            ("trainer.limit_train_batches", str(steps)),
            ("trainer.check_val_every_n_epoch", "2"),  # no validation
            ("trainer.enable_progress_bar", "false"),
        ],
    )
    clock = epoch_seconds(config, work)
    steps_per_s = clock["loop_steps"] / clock["loop_seconds"]
    print(json.dumps({"steps_per_s": steps_per_s, "peak_bytes": peak_resident_bytes(), "imports_bytes": imports}))


def ranks_phase(data: Path, prepared: bool, out: Path) -> None:
    """--phase ranks, under torchrun: this rank's training batches of one epoch of ``data`` (prepared,
    or the raw source) -> ``out/rank-R.json`` with the dense user ids it saw, its step count, peak RSS."""
    import torch.distributed as dist

    from gr.data.datamodule import SequenceDataModule
    from gr.train.config import load_config

    imports = peak_resident_bytes()
    dist.init_process_group("gloo")
    where = [("data.prepared", str(data))] if prepared else []
    config = load_config(RECIPE, [*SOURCE, ("data.path", str(data)), *where])
    module = SequenceDataModule(config.data)
    module.setup()
    users: List[int] = []
    steps = 0
    for batch in module.train_dataloader():
        users += batch.labels["user"].tolist()
        steps += 1
    record = {"users": users, "steps": steps, "peak_bytes": peak_resident_bytes(), "imports_bytes": imports}
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def torchrun_ranks(ranks: int, data: Path, prepared: bool, work: Path, forked: bool = False) -> List[Dict[str, Any]]:
    """``ranks_phase`` on ``ranks`` processes (torchrun, gloo) -> each rank's record. ``forked`` (a smoke
    run): torchrun's launcher in this process, its ranks forked from it (no interpreter starts)."""
    flags = ["--phase", "ranks", "--data", str(data), "--work", str(work), *([] if prepared else ["--raw"])]
    work.mkdir(parents=True)
    if forked:
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        launch = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=ranks,
            run_id="data_scale",
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            max_restarts=0,
            start_method="fork",
        )
        elastic_launch(launch, ranks_phase)(data, prepared, work)
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        done = subprocess.run(
            [*command, __file__, *flags], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        if done.returncode != 0:
            raise RuntimeError(f"torchrun data_scale.py {' '.join(flags)} failed:\n{done.stderr[-4000:]}")
    return [json.loads((work / f"rank-{r}.json").read_text()) for r in range(ranks)]


def two_ranks(prepared: Path, raw_file: Path, work: Path, forked: bool = False) -> Dict[str, Any]:
    """Both ranks' epochs on the prepared data, against one process reading the raw file -> steps,
    users per rank, disjoint, every_user_once (the raw epoch's users), peak and above-imports GiB."""
    records = torchrun_ranks(2, prepared, True, work / "prepared", forked)
    (whole,) = torchrun_ranks(1, raw_file, False, work / "raw", forked)
    seen = [np.asarray(r["users"], dtype=np.int64) for r in records]
    together = np.sort(np.concatenate(seen))

    def above_imports(record: Dict[str, Any]) -> float:
        return (record["peak_bytes"] - record["imports_bytes"]) / GIB

    return {
        "steps": [r["steps"] for r in records],
        "users": [len(s) for s in seen],
        "disjoint": len(np.intersect1d(seen[0], seen[1])) == 0,
        "every_user_once": bool(np.array_equal(together, np.sort(whole["users"]))),
        "peak_gib": [r["peak_bytes"] / GIB for r in records],
        "above_imports_gib": [above_imports(r) for r in records],
        "one_process_raw_above_imports_gib": above_imports(whole),
    }


def train_point(data: Path, work: Path, steps: int, raw: bool, forked: bool = False) -> Dict[str, float]:
    """``train_phase`` in a process of its own -> train_peak_gib, train_above_imports_gib, train_steps_per_s."""
    flags = ["--phase", "train", "--data", str(data), "--work", str(work), "--steps", str(steps)]
    done = in_own_process(*flags, *(["--raw"] if raw else []), forked=forked)
    return {
        "train_peak_gib": done["peak_bytes"] / GIB,
        "train_above_imports_gib": (done["peak_bytes"] - done["imports_bytes"]) / GIB,
        "train_steps_per_s": done["steps_per_s"],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--memory-limit", default="4GB")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2, help="prepared/raw training alternations at the smallest size")
    parser.add_argument("--phase", choices=["prepare", "train", "ranks"], help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    args, _ = smoke.parse_args(parser, {"sizes": [350_000], "steps": 5, "rounds": 1}, argv)
    if args.phase == "prepare":
        return prepare_phase(args.data, args.work, args.memory_limit)
    if args.phase == "train":
        return train_phase(args.data, not args.raw, args.steps, args.work)
    if args.phase == "ranks":
        return ranks_phase(args.data, not args.raw, args.work)
    start_load = load_average()
    sizes: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for size in sorted(args.sizes):
            source, prepared = work / f"source-{size}", work / f"prepared-{size}"
            counts = write_source(source, size)
            flags = ["--data", str(source), "--work", str(prepared), "--memory-limit", args.memory_limit]
            prep = in_own_process("--phase", "prepare", *flags, forked=args.smoke)
            point = {
                **counts,
                "prepare_s": prep["seconds"],
                "prepare_peak_gib": prep["peak_bytes"] / GIB,
                "prepare_above_imports_gib": (prep["peak_bytes"] - prep["imports_bytes"]) / GIB,
            }
            if sizes:
                point.update(train_point(prepared, work / f"run-{size}", args.steps, False, args.smoke))
            else:  # the smallest size: prepared and raw alternate (their best speed each), then the ranks
                raw_file = work / "raw.parquet"  # the raw readers take one file: the source's files as one
                pq.write_table(pq.read_table(source), raw_file)
                rounds = [
                    (
                        train_point(prepared, work / f"run-{r}", args.steps, False, args.smoke),
                        train_point(raw_file, work / f"raw-{r}", args.steps, True, args.smoke),
                    )
                    for r in range(args.rounds)
                ]
                point.update(max((p for p, _ in rounds), key=lambda t: t["train_steps_per_s"]))
                raw_first = max((r for _, r in rounds), key=lambda t: t["train_steps_per_s"])
                ranks = two_ranks(prepared, raw_file, work / "ranks", args.smoke)
            sizes.append(point)
            print(
                f"{counts['interactions']:>12,} interactions: prepare {point['prepare_s']:.1f} s, peak "
                f"{point['prepare_peak_gib']:.2f} GiB; train peak {point['train_peak_gib']:.2f} GiB "
                f"({point['train_above_imports_gib']:.2f} above imports), "
                f"{point['train_steps_per_s']:.2f} steps/s",
                flush=True,
            )
    first, last = sizes[0], sizes[-1]
    ratios = {
        "train_peak_largest_over_smallest": last["train_peak_gib"] / first["train_peak_gib"],
        "prepared_over_raw_steps_per_s": first["train_steps_per_s"] / raw_first["train_steps_per_s"],
        "largest_prepared_over_raw_smallest_steps_per_s": last["train_steps_per_s"] / raw_first["train_steps_per_s"],
        "rank_over_one_raw_process_above_imports": max(ranks["above_imports_gib"])
        / ranks["one_process_raw_above_imports_gib"],
    }
    model, flags = cpu()
    summary = {
        "bench": "data_scale",
        "memory_limit": args.memory_limit,
        "steps": args.steps,
        "sizes": sizes,
        "raw_smallest": raw_first,
        "ratios": ratios,
        "ranks": ranks,
        "targets": {
            "largest_prepared_within_6_gib": last["prepare_peak_gib"] <= 6,
            "train_peak_within_25_percent": ratios["train_peak_largest_over_smallest"] <= 1.25,
            "steps_per_s_within_10_percent_of_raw": ratios["prepared_over_raw_steps_per_s"] >= 0.9,
            "ranks_disjoint_and_every_user_once": ranks["disjoint"] and ranks["every_user_once"],
            "each_rank_about_half_of_the_whole_or_less": ratios["rank_over_one_raw_process_above_imports"] <= 0.6,
        },
        "cpu": model,
        "cpu_flags": flags,
        "load_average": {"start": start_load, "end": load_average()},
    }
    print(
        f"raw at {first['interactions']:,}: train peak {raw_first['train_peak_gib']:.2f} GiB "
        f"({raw_first['train_above_imports_gib']:.2f} above imports), "
        f"{raw_first['train_steps_per_s']:.2f} steps/s; two ranks: steps {ranks['steps']}, users {ranks['users']}, "
        f"disjoint {ranks['disjoint']}, every user once {ranks['every_user_once']}"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
