"""Peak memory against gr.train.memory's estimates: one HSTU training step over sequence lengths, and whole
training runs over embedding table sizes.

    python bench/memory.py [--parts stack tables] [--lengths 1024 2048 4096] [--recompute none layer]
                           [--precisions 32-true bf16-mixed] [--rows 100000 1000000 10000000 40000000]
                           [--backends torchrec torch] [--reserve-gib 2]
    python bench/memory.py --smoke   # one short fp32 step; a 1,000-row table on the torch backend, each in a
                                     # child forked from this process (no fresh interpreter): checks it runs

Stack: one sequence of each length goes through an HSTU stack (hidden 128, 2 layers, 2 heads of
64) with fp32 weights, in fp32 or under bf16 autocast, with each recompute mode. Every case
runs in a fresh subprocess: after a warm-up step on a short sequence (libraries and
their buffers loaded), the measured peak is the process's resident-set high-water mark
(``ru_maxrss``) during the step minus its resident set just before it (model and input
already allocated), so it holds activations, gradients, the optimizer's state, the
kernels' temporary buffers and what the allocator keeps. The estimate is gr.train.memory's: the
stack's activation peak in backward (``hstu_activation_bytes``) + gradients + AdamW state.

Tables: configs/quickstart.yaml with its item table at each row count (dim 32, row-wise Adagrad),
under each sparse backend, trained by ``gr.train.train`` in a fresh process: one epoch of
``TABLE_STEPS`` optimizer steps, validation, the best and last checkpoints saved, the best loaded
back for the test. The measured peak is that process's own ``VmHWM`` (its peak resident set over
the whole run: libraries, data, tables, sharding, steps, checkpoints); the estimate is gr.train.memory's
``memory_bytes_per_rank`` for the run, planned in that process just before it trains, as ``gr
train``'s pre-check plans it (which also runs). A point whose estimate needs more than
MemAvailable less ``--reserve-gib`` is skipped (the machine is shared).

Prints the CPU (model, SIMD flags), the load average and a table per part; the last line is one
JSON object: bench, model, cases (per stack case: length, precision, recompute, measured_mib,
estimate_mib, estimate_over_measured), table_model, tables (per point: rows, backend,
process_mib, estimate_mib, measured_mib, estimate_over_measured, seconds; or rows, backend,
skipped), ratios ({backend: {min, max}} of estimate_over_measured over the table points), cpu,
cpu_flags, load_average (start and end, 1/5/15 min).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke  # noqa: E402
import torch  # noqa: E402
from _host import cpu, load_average, peak_resident_bytes, run_python  # noqa: E402

from gr.hstu import HSTU, HSTUConfig  # noqa: E402
from gr.train.memory import GIB  # noqa: E402
from gr.utils.host import available_memory_bytes, resident_bytes  # noqa: E402

MIB = 1 << 20
WARM_UP_LENGTH = 128
HIDDEN = 128
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
TABLE_STEPS = 2  # optimizer steps per table point (Lightning's limit_train_batches)
SMOKE = {
    "lengths": [256],
    "precisions": ["32-true"],
    "recompute": ["none"],
    "rows": [1_000],
    "backends": ["torch"],
}


def stack_config(length: int, recompute: str) -> HSTUConfig:
    return HSTUConfig(
        hidden_dim=HIDDEN,
        num_layers=2,
        num_heads=2,
        attention_dim=64,
        linear_dim=64,
        max_seq_len=length,
        recompute=recompute,
    )


def measure(length: int, recompute: str, precision: str) -> int:
    """Peak bytes above the resident set before one training step (run in a fresh process)."""
    torch.manual_seed(0)
    stack = HSTU(stack_config(length, recompute)).train()
    optimizer = torch.optim.AdamW(stack.parameters(), lr=1e-3)
    step(stack, WARM_UP_LENGTH, precision)  # loads the kernels' libraries and buffers outside the measure
    stack.zero_grad(set_to_none=True)
    x = torch.randn(length, HIDDEN)
    before = resident_bytes()
    step(stack, length, precision, x)
    optimizer.step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def step(stack: HSTU, length: int, precision: str, x: torch.Tensor | None = None) -> None:
    """Forward and backward of one sequence of ``length`` tokens (x: [length, HIDDEN], random when None)."""
    x = torch.randn(length, HIDDEN) if x is None else x
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        out = stack(x, torch.tensor([0, length]), length, torch.arange(length) * 60)
    out.float().pow(2).mean().backward()


def estimate(length: int, recompute: str, precision: str) -> int:
    from gr.train.memory import DENSE_OPTIMIZER_FLOATS, FP32, PRECISION_BYTES, hstu_activation_bytes

    config = stack_config(length, recompute)
    _, peak = hstu_activation_bytes(config, length, recompute, PRECISION_BYTES[precision])
    params = sum(p.numel() for p in HSTU(config).parameters())
    return peak + FP32 * params * (1 + DENSE_OPTIMIZER_FLOATS["adamw"])  # gradients + AdamW moments


def table_run(rows: int, backend: str, work: Path, reserve: int) -> Dict:
    """Plan, then train, quickstart with a table of ``rows`` rows under ``backend`` in run directory
    ``work`` (in a fresh process) -> estimate and the process's resident set when planned, peak
    resident set (bytes) and seconds; or why it was skipped (the estimate needs more than
    MemAvailable less ``reserve`` bytes)."""
    from gr.train.config import load_config
    from gr.train.memory import plan_from_config
    from gr.train.run import train

    overrides = [
        ("model.tables.0.num_embeddings", str(rows)),
        ("sparse.backend", backend),
        ("trainer.max_epochs", "1"),
        ("trainer.limit_train_batches", str(TABLE_STEPS)),
        ("trainer.enable_progress_bar", "false"),
    ]
    config = load_config(QUICKSTART, overrides)
    plan = plan_from_config(config, nproc=1)
    predicted = max(plan.memory_bytes_per_rank)
    available = available_memory_bytes()
    if available is not None and predicted - (resident_bytes() or 0) > available - reserve:
        return {"skipped": f"estimate {predicted / GIB:.1f} GiB, {available / GIB:.1f} GiB available"}
    start = time.perf_counter()
    train(config, work)
    return {
        "estimate": predicted,
        "process": plan.process_bytes,
        "measured": peak_resident_bytes(),
        "seconds": time.perf_counter() - start,
    }


def stack_cases(args: argparse.Namespace) -> List[Dict]:
    rows = []
    print(f"{'length':>6} {'precision':>10} {'recompute':>9} {'measured MiB':>12} {'estimate MiB':>12} {'est/meas':>8}")
    for length in args.lengths:
        for precision in args.precisions:
            for recompute in args.recompute:
                run = run_python([__file__, "--case", str(length), recompute, precision], args.smoke)
                if run.returncode != 0:
                    case = f"--case {length} {recompute} {precision}"
                    raise RuntimeError(f"memory.py {case} failed:\n{run.stderr[-4000:]}")
                measured = int(run.stdout.split()[-1])
                predicted = estimate(length, recompute, precision)
                rows.append(
                    {
                        "length": length,
                        "precision": precision,
                        "recompute": recompute,
                        "measured_mib": round(measured / MIB, 1),
                        "estimate_mib": round(predicted / MIB, 1),
                        "estimate_over_measured": round(predicted / measured, 3),
                    }
                )
                r = rows[-1]
                print(
                    f"{length:>6} {precision:>10} {recompute:>9} {r['measured_mib']:>12} {r['estimate_mib']:>12} "
                    f"{r['estimate_over_measured']:>8}",
                    flush=True,
                )
    return rows


def table_points(args: argparse.Namespace) -> List[Dict]:
    points = []
    print(
        f"{'rows':>12} {'backend':>8} {'process MiB':>11} {'estimate MiB':>12} {'measured MiB':>12} "
        f"{'est/meas':>8} {'seconds':>8}"
    )
    for rows in args.rows:
        for backend in args.backends:
            with tempfile.TemporaryDirectory(prefix="gr-memory-") as work:
                flags = ["--table-run", str(rows), backend, str(Path(work) / "run"), str(args.reserve_gib)]
                run = run_python([__file__, *flags], args.smoke)
            if run.returncode != 0:
                raise RuntimeError(f"memory.py {' '.join(flags)} failed:\n{run.stderr[-4000:]}")
            result = json.loads(run.stdout.strip().splitlines()[-1])
            if "skipped" in result:
                points.append({"rows": rows, "backend": backend, "skipped": result["skipped"]})
                print(f"{rows:>12,} {backend:>8} skipped: {result['skipped']}", flush=True)
                continue
            points.append(
                {
                    "rows": rows,
                    "backend": backend,
                    "process_mib": round(result["process"] / MIB, 1),
                    "estimate_mib": round(result["estimate"] / MIB, 1),
                    "measured_mib": round(result["measured"] / MIB, 1),
                    "estimate_over_measured": round(result["estimate"] / result["measured"], 3),
                    "seconds": round(result["seconds"], 1),
                }
            )
            p = points[-1]
            print(
                f"{rows:>12,} {backend:>8} {p['process_mib']:>11} {p['estimate_mib']:>12} {p['measured_mib']:>12} "
                f"{p['estimate_over_measured']:>8} {p['seconds']:>8}",
                flush=True,
            )
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=["stack", "tables"], default=["stack", "tables"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--recompute", nargs="+", default=["none", "layer"])
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000, 40_000_000])
    parser.add_argument("--backends", nargs="+", choices=["torchrec", "torch"], default=["torchrec", "torch"])
    parser.add_argument("--reserve-gib", type=float, default=2.0, help="memory to leave others (default 2)")
    parser.add_argument("--case", nargs=3, metavar=("LENGTH", "RECOMPUTE", "PRECISION"), help=argparse.SUPPRESS)
    parser.add_argument("--table-run", nargs=4, metavar=("ROWS", "BACKEND", "DIR", "RESERVE"), help=argparse.SUPPRESS)
    args, _ = smoke.parse_args(parser, SMOKE)
    if args.case:
        print(measure(int(args.case[0]), args.case[1], args.case[2]))
        return
    if args.table_run:
        rows, backend, work, reserve = args.table_run
        print(json.dumps(table_run(int(rows), backend, Path(work), int(float(reserve) * GIB))))
        return
    model, flags = cpu()
    start_load = load_average()
    print(f"{model}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}; SIMD flags: {' '.join(flags)}")
    print(f"load average {' '.join(map(str, start_load))} (1/5/15 min, includes other jobs)", flush=True)
    cases = stack_cases(args) if "stack" in args.parts else []
    points = table_points(args) if "tables" in args.parts else []
    ratios = {}
    for backend in args.backends:
        measured = [p["estimate_over_measured"] for p in points if p["backend"] == backend and "skipped" not in p]
        if measured:
            ratios[backend] = {"min": min(measured), "max": max(measured)}
    end_load = load_average()
    print(f"estimate / measured peak per backend: {ratios}; load average at the end {' '.join(map(str, end_load))}")
    summary = {
        "bench": "memory",
        "model": "hstu d128 x2 layers, 2 heads of 64",
        "cases": cases,
        "table_model": f"configs/quickstart.yaml, item table dim 32, rowwise_adagrad, 1 epoch of {TABLE_STEPS} steps",
        "tables": points,
        "ratios": ratios,
        "cpu": model,
        "cpu_flags": flags,
        "load_average": {"start": start_load, "end": end_load},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
