"""The machine's matmul peak, measured in the same run as a benchmark's numbers (a fraction of
peak is only meaningful against the peak of that moment: other processes and clocks move it)."""

from __future__ import annotations

import time
from typing import Callable, List

import torch


def _best_rate(run: Callable[[], object], flops: int, seconds: float, sync: Callable[[], None]) -> float:
    run()
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        run()
        sync()
        best = max(best, flops / (time.perf_counter() - start) / 1e9)
    return best


def matmul_peak(
    dtype: torch.dtype = torch.float32, seconds: float = 0.5, size: int = 1024, device: str = "cpu"
) -> float:
    """GFLOP/s of [size, size] @ [size, size] in ``dtype`` on ``device``: the best of repeated timings.

    On CPU, the best of ``torch.matmul`` and oneDNN's linear kernel: PyTorch's x86 builds multiply
    fp32 with MKL, which runs its AVX2 code on AMD CPUs, while oneDNN uses AVX-512 where the CPU has
    it, so torch.matmul alone can understate what the machine can do (on the project's 2-core AMD
    EPYC, 2026-11-27: 193 against 215 GFLOP/s fp32)."""
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    runs: List[Callable[[], object]] = [lambda: torch.matmul(a, b)]
    if device == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        onednn = lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")  # noqa: E731
        try:
            onednn()
            runs.append(onednn)
        except RuntimeError:  # no oneDNN kernel for this dtype on this CPU (bf16 without AVX-512)
            pass
    return max(_best_rate(run, 2 * size**3, seconds / len(runs), sync) for run in runs)
