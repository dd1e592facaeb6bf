"""Peak memory of one HSTU training step (forward, backward, AdamW step) against gr.plan's estimate.

    python bench/memory.py [--lengths 1024 2048 4096] [--recompute none layer] [--precisions 32-true bf16-mixed]
    python bench/memory.py --smoke   # one short fp32 case: checks it runs

One sequence of each length goes through an HSTU stack (hidden 128, 2 layers, 2 heads of
64) with fp32 weights, in fp32 or under bf16 autocast, with each recompute mode. Every case
runs in a fresh subprocess: after a warm-up step on a short sequence (libraries and
their buffers loaded), the measured peak is the process's resident-set high-water mark
(``ru_maxrss``) during the step minus its resident set just before it (model and input
already allocated), so it holds activations, gradients, the optimizer's state, the
kernels' temporary buffers and what the allocator keeps. The estimate is gr.plan's: the
stack's activation peak in backward (``hstu_activation_bytes``) + gradients + AdamW state.
Prints a table; the last line is one JSON object: bench, model, cases (one per case: length,
precision, recompute, measured_mib, estimate_mib, estimate_over_measured).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke  # noqa: E402
import torch  # noqa: E402

from gr.hstu import HSTU, HSTUConfig  # noqa: E402

MIB = 1 << 20
WARM_UP_LENGTH = 128
HIDDEN = 128
SMOKE = {"lengths": [256], "precisions": ["32-true"], "recompute": ["none"]}


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


def resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
    from gr.plan import DENSE_OPTIMIZER_FLOATS, FP32, PRECISION_BYTES, hstu_activation_bytes

    config = stack_config(length, recompute)
    _, peak = hstu_activation_bytes(config, length, recompute, PRECISION_BYTES[precision])
    params = sum(p.numel() for p in HSTU(config).parameters())
    return peak + FP32 * params * (1 + DENSE_OPTIMIZER_FLOATS["adamw"])  # gradients + AdamW moments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--recompute", nargs="+", default=["none", "layer"])
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--case", nargs=3, metavar=("LENGTH", "RECOMPUTE", "PRECISION"), help=argparse.SUPPRESS)
    args, _ = smoke.parse_args(parser, SMOKE)
    if args.case:
        print(measure(int(args.case[0]), args.case[1], args.case[2]))
        return
    rows = []
    print(f"{'length':>6} {'precision':>10} {'recompute':>9} {'measured MiB':>12} {'estimate MiB':>12} {'est/meas':>8}")
    for length in args.lengths:
        for precision in args.precisions:
            for recompute in args.recompute:
                run = subprocess.run(
                    [sys.executable, __file__, "--case", str(length), recompute, precision],
                    capture_output=True,
                    text=True,
                    check=True,
                )
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
    print(json.dumps({"bench": "memory", "model": "hstu d128 x2 layers, 2 heads of 64", "cases": rows}))


if __name__ == "__main__":
    main()
