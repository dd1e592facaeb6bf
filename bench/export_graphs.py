"""Export time with and without the ONNX graph cache: the next day's export of an unchanged architecture.

    python bench/export_graphs.py [--config configs/ml100k_ranking.yaml] [--steps 5] [--repeats 3]
    python bench/export_graphs.py --smoke             # configs/quickstart.yaml, 2 steps, 1 repeat

Two runs of the recipe (``trainer.seed`` 0 and 1, ``--steps`` training steps each: yesterday's model
and today's, one architecture, other weights) are trained into a temporary directory. Yesterday's run
is exported with an empty graph cache (``gr.export.onnx_graph_cache``: it translates both ONNX slices
and keeps their graphs); then, in this process, ``gr.export.export_run`` of today's run is timed (the
fastest of ``--repeats``) with the cache off (every slice translated afresh, the export as it was
without the cache) and with yesterday's graphs in the cache (reused, today's weights written into them).
The reused export's ONNX files must equal the fresh ones byte for byte.

Prints each export, then one JSON line: bench, config, seconds and cpu_seconds (cold: yesterday's
export, which fills the cache; fresh; reused: wall and this process's CPU time), fresh_over_reused and
fresh_over_reused_cpu, identical (the ONNX files of both exports equal),
cache_bytes (the cached graphs), threads, cpu, cpu_flags, load_average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import smoke  # noqa: E402
import torch  # noqa: E402
from _host import cpu, load_average  # noqa: E402

from gr.export import onnx_graph_cache  # noqa: E402
from gr.export.format import POSTFIX_ONNX, PREFIX_ONNX  # noqa: E402
from gr.export.writer import export_run  # noqa: E402
from gr.train.config import load_config  # noqa: E402
from gr.train.run import train  # noqa: E402


def train_day(recipe: Path, data: str, seed: int, steps: int, threads: int, out: Path) -> Path:
    """A run of ``recipe`` trained for ``steps`` steps from ``trainer.seed`` ``seed``."""
    overrides = [
        ("trainer.seed", str(seed)),
        ("trainer.max_epochs", "1"),
        ("trainer.limit_train_batches", str(steps)),
        ("trainer.enable_progress_bar", "false"),
        ("trainer.num_threads", str(threads)),
    ]
    if data:
        overrides.append(("data.path", data))
    train(load_config(recipe, overrides), out)
    return out


def timed_export(run: Path, out: Path, cache: str, repeats: int) -> Tuple[float, float]:
    """(wall, CPU) seconds of the fastest of ``repeats`` exports of ``run`` to ``out`` with
    ``$GR_ONNX_CACHE_DIR`` = ``cache``: each the least of its kind (CPU time is this process's, steadier
    than wall time on a shared machine)."""
    os.environ[onnx_graph_cache.CACHE_DIR_ENV] = cache
    wall, cpu_time = float("inf"), float("inf")
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        start, start_cpu = time.perf_counter(), time.process_time()
        export_run(run, out)
        wall, cpu_time = min(wall, time.perf_counter() - start), min(cpu_time, time.process_time() - start_cpu)
    return wall, cpu_time


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "ml100k_ranking.yaml"), help="the recipe")
    parser.add_argument("--data.path", dest="data_path", default="", help="the recipe's data.path (ML-100K: default)")
    parser.add_argument("--steps", type=int, default=5, help="training steps of each run (quality does not matter)")
    parser.add_argument("--repeats", type=int, default=3, help="timed exports of each kind; the fastest counts")
    parser.add_argument("--threads", type=int, default=1)
    args, _ = smoke.parse_args(
        parser, {"config": str(ROOT / "configs" / "quickstart.yaml"), "steps": 2, "repeats": 1}, argv
    )
    recipe = Path(args.config)
    data = args.data_path or (str(smoke.ML_100K) if "ml100k" in recipe.name else "")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root, cache = Path(tmp), str(Path(tmp) / "graphs")
        yesterday = train_day(recipe, data, 0, args.steps, args.threads, root / "day0")
        today = train_day(recipe, data, 1, args.steps, args.threads, root / "day1")
        cold = timed_export(yesterday, root / "export0", cache, 1)
        print(f"yesterday's export, graphs translated and cached: {cold[0]:.2f} s ({cold[1]:.2f} s CPU)", flush=True)
        fresh = timed_export(today, root / "fresh", onnx_graph_cache.OFF, args.repeats)
        print(f"today's export, graphs translated (cache off): {fresh[0]:.2f} s ({fresh[1]:.2f} s CPU)", flush=True)
        reused = timed_export(today, root / "reused", cache, args.repeats)
        print(
            f"today's export, yesterday's graphs reused: {reused[0]:.2f} s ({reused[1]:.2f} s CPU): "
            f"{fresh[0] / reused[0]:.2f}x ({fresh[1] / reused[1]:.2f}x CPU)",
            flush=True,
        )
        identical = all(
            (root / "fresh" / name).read_bytes() == (root / "reused" / name).read_bytes()
            for name in (PREFIX_ONNX, POSTFIX_ONNX)
        )
        cache_bytes = sum(p.stat().st_size for p in Path(cache).glob("*"))
    name, flags = cpu()
    report = {
        "bench": "export_graphs",
        "config": recipe.name,
        "seconds": {"cold": round(cold[0], 3), "fresh": round(fresh[0], 3), "reused": round(reused[0], 3)},
        "cpu_seconds": {"cold": round(cold[1], 3), "fresh": round(fresh[1], 3), "reused": round(reused[1], 3)},
        "fresh_over_reused": round(fresh[0] / reused[0], 2),
        "fresh_over_reused_cpu": round(fresh[1] / reused[1], 2),
        "identical": identical,
        "cache_bytes": cache_bytes,
        "threads": args.threads,
        "cpu": name,
        "cpu_flags": flags,
        "load_average": load_average(),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
