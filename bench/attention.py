"""HSTU attention: a fast backend against a padded dense implementation of the same math.

The batch has skewed lengths (lognormal, mean ~300, one sequence at the 2048 maximum), position
and time bias on, as in training. Measured in one run: forward and forward+backward time of
the backend and of the padded implementation (``pytorch``: pads to [B, H, L, L] and masks, the
way padded frameworks compute HSTU), the first call's time (kernel compile and autotuning
included), the useful GFLOP/s (q.k and attention.v multiply-adds of visible pairs only:
2 * pairs * H * (Dqk + Dv) forward, three times that forward+backward) and the device's matmul
peak in the same dtype (``--dtype`` for q, k, v; the bias weights stay fp32 parameters, as in
mixed-precision training; on CPU the peak is fp32's). The error is against the padded
implementation in fp32 on the same inputs. ``--shape`` presets the batch: ``ml1m`` (128 histories of
the ML-1M recipe: mean 120, at most 200, 1 head of 50) or ``long`` (16 histories of 1024 to
2048, 2 heads of 128). The last line is one JSON object: device, backend, dtype, shape,
threads, load_average, fwd_speedup_vs_padded, fwd_bwd_speedup_vs_padded, fwd_ms, fwd_bwd_ms,
first_fwd_s, first_fwd_bwd_s, fwd_gflops, fwd_bwd_gflops, matmul_peak_gflops, peak_dtype,
fwd_fraction_of_peak, fwd_bwd_fraction_of_peak, padded_fwd_fraction_of_peak, max_relative_error.

Here (CPU):        python bench/attention.py    (add --threads 1 when other jobs load the cores: with
                   more threads than free cores, every op waits at OpenMP barriers for a
                   descheduled thread, and the many small ops of a jagged path suffer most)
On a CUDA host:    python bench/attention.py --device cuda --backend triton --dtype bf16 --shape long
On an Ascend host: python bench/attention.py --device npu --backend ascend_triton   (or ascend)
A few seconds:     python bench/attention.py --smoke   (a small batch; checks it runs)
(the Triton kernels only run on those hosts; nothing here measured them).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke  # noqa: E402
from _peak import matmul_peak  # noqa: E402

from gr.hstu.kernels.attention import RelativeBias, hstu_attention  # noqa: E402

SMOKE = {"batch": 4, "mean_len": 32.0, "max_len": 128, "dim": 16, "repeats": 1, "peak_size": 256}
SHAPES = {
    "ml1m": {"batch": 128, "mean_len": 120.0, "min_len": 1, "max_len": 200, "heads": 1, "dim": 50},
    "long": {"batch": 16, "mean_len": 1536.0, "min_len": 1024, "max_len": 2048, "heads": 2, "dim": 128},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "npu":
        torch.npu.synchronize()


def timed(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Best wall time of ``repeats`` calls, seconds."""
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def skewed_batch(args: argparse.Namespace) -> Dict[str, object]:
    g = torch.Generator().manual_seed(args.seed)
    sigma = 1.0
    mu = math.log(args.mean_len) - sigma**2 / 2  # lognormal with mean mean_len
    lengths = torch.exp(mu + sigma * torch.randn(args.batch, generator=g)).round()
    lengths = lengths.clamp(args.min_len, args.max_len).long()
    lengths[0] = args.max_len
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    total = int(offsets[-1])
    q, k, v = (torch.randn(total, args.heads, args.dim, generator=g) * 0.5 for _ in range(3))
    ts = torch.cat([torch.sort(torch.randint(0, 10**8, (int(n),), generator=g)).values for n in lengths])
    return dict(
        lengths=lengths,
        offsets=offsets.to(args.device),
        timestamps=ts.to(args.device),
        inputs=[  # q, k, v in --dtype; the bias weights are fp32 parameters, as in mixed-precision training
            *(x.to(device=args.device, dtype=DTYPES[args.dtype]) for x in (q, k, v)),
            *(
                x.to(args.device)
                for x in (torch.randn(args.max_len + 1, generator=g) * 0.02, torch.randn(128, generator=g) * 0.02)
            ),
        ],
    )


def attention_call(attention: Callable, batch: Dict[str, object], args: argparse.Namespace, backward: bool) -> Callable:
    """A call of ``attention`` (hstu_attention's arguments) on the batch -> [out] or [out, grads...]."""

    def call() -> List[torch.Tensor]:
        leaves = [x.detach().requires_grad_(backward) for x in batch["inputs"]]
        rab = RelativeBias(leaves[3], leaves[4], batch["timestamps"])
        out = attention(
            *leaves[:3],
            batch["offsets"],
            args.max_len,
            alpha=1 / math.sqrt(args.dim),
            silu_scale=1 / args.max_len,
            rab=rab,
        )
        if not backward:
            return [out.detach()]
        return [out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out))]

    return call


def contenders(args: argparse.Namespace) -> List[tuple]:
    """(label, attention function, timed repeats after a warm-up call; 0 = time the first call)."""
    return [
        (args.backend, functools.partial(hstu_attention, backend=args.backend), args.repeats),
        ("padded", functools.partial(hstu_attention, backend="pytorch"), 0),
    ]


def max_relative_error(got: List[torch.Tensor], want: List[torch.Tensor]) -> float:
    return max(float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-12)) for a, b in zip(got, want))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="cpu", help="backend measured against 'pytorch' (padded)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="inputs' dtype and the peak's")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a preset batch (explicit size flags win)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--mean-len", type=float, default=300.0)
    parser.add_argument("--min-len", type=int, default=1)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--peak-size", type=int, default=2048, help="square matmul size of the peak measure")
    shape = parser.parse_known_args()[0].shape
    if shape is not None:
        parser.set_defaults(**SHAPES[shape])  # defaults: flags given still win
    args, _ = smoke.parse_args(parser, SMOKE)
    if args.threads:
        torch.set_num_threads(args.threads)

    # the peak in --dtype; on CPU in fp32 (this torch build's bf16 CPU matmul is no reference)
    peak_dtype = "fp32" if args.device == "cpu" else args.dtype
    peak = matmul_peak(DTYPES[peak_dtype], 1.0, args.peak_size, args.device)
    batch = skewed_batch(args)
    lengths = batch["lengths"]
    pairs = int((lengths * (lengths + 1) // 2).sum())  # causal: visible (query, key) pairs
    fwd_flops = 2 * pairs * args.heads * (args.dim + args.dim)
    padded_pairs = args.batch * args.max_len**2
    load = os.getloadavg()[0]
    print(
        f"device {args.device}, {torch.get_num_threads()} threads, {peak_dtype} matmul peak {peak:.1f} GFLOP/s "
        f"(same threads), load average {load:.1f} (1 min, includes other jobs)"
    )
    print(
        f"batch: B={args.batch} lengths mean {lengths.float().mean():.0f} median {lengths.median():.0f} "
        f"max {int(lengths.max())}, H={args.heads}, D={args.dim}; visible pairs {pairs:,} "
        f"(padded [B, L, L]: {padded_pairs:,}, {padded_pairs / pairs:.0f}x)"
    )

    results = {}
    for label, attention, repeats in contenders(args):
        for backward in (False, True):
            call = attention_call(attention, batch, args, backward)
            synchronize(args.device)
            start = time.perf_counter()
            outputs = call()
            synchronize(args.device)
            first = time.perf_counter() - start
            seconds = timed(call, args.device, repeats) if repeats else first
            results[label, backward] = dict(seconds=seconds, first=first, outputs=outputs)

    print(f"\n{'backend':<10} {'pass':<9} {'seconds':>9} {'first call':>11} {'GFLOP/s':>9} {'% of peak':>10}")
    for (label, backward), r in results.items():
        gflops = fwd_flops * (3 if backward else 1) / r["seconds"] / 1e9
        r["gflops"] = gflops
        print(
            f"{label:<10} {'fwd+bwd' if backward else 'fwd':<9} {r['seconds']:>9.3f} {r['first']:>11.2f} "
            f"{gflops:>9.1f} {100 * gflops / peak:>9.1f}%"
        )
    fast_fwd, fast_bwd = results[args.backend, False], results[args.backend, True]
    ref_fwd, ref_bwd = results["padded", False], results["padded", True]
    reference = ref_bwd["outputs"]
    if args.dtype != "fp32":  # the reference in fp32 on the same (rounded) inputs
        fp32_batch = dict(batch, inputs=[x.float() for x in batch["inputs"]])
        reference = attention_call(functools.partial(hstu_attention, backend="pytorch"), fp32_batch, args, True)()
    error = max_relative_error(fast_bwd["outputs"], reference)
    print(f"\nmax relative difference to the fp32 padded reference (output and all gradients): {error:.1e}")
    summary = dict(
        device=args.device,
        backend=args.backend,
        dtype=args.dtype,
        shape=args.shape or "custom",
        threads=torch.get_num_threads(),
        load_average=round(load, 2),
        fwd_speedup_vs_padded=round(ref_fwd["seconds"] / fast_fwd["seconds"], 2),
        fwd_bwd_speedup_vs_padded=round(ref_bwd["seconds"] / fast_bwd["seconds"], 2),
        fwd_ms=round(1e3 * fast_fwd["seconds"], 3),
        fwd_bwd_ms=round(1e3 * fast_bwd["seconds"], 3),
        first_fwd_s=round(fast_fwd["first"], 2),
        first_fwd_bwd_s=round(fast_bwd["first"], 2),
        fwd_gflops=round(fast_fwd["gflops"], 2),
        fwd_bwd_gflops=round(fast_bwd["gflops"], 2),
        matmul_peak_gflops=round(peak, 1),
        peak_dtype=peak_dtype,
        fwd_fraction_of_peak=round(fast_fwd["gflops"] / peak, 3),
        fwd_bwd_fraction_of_peak=round(fast_bwd["gflops"] / peak, 3),
        padded_fwd_fraction_of_peak=round(ref_fwd["gflops"] / peak, 4),
        max_relative_error=float(f"{error:.2e}"),
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
