"""The machine's matmul peak, measured in the same run as a benchmark's numbers (a fraction of
peak is only meaningful against the peak of that moment: other processes and clocks move it)."""

from __future__ import annotations

import time

import torch


def matmul_peak(
    dtype: torch.dtype = torch.float32, seconds: float = 0.5, size: int = 1024, device: str = "cpu"
) -> float:
    """GFLOP/s of [size, size] @ [size, size] in ``dtype`` on ``device``: the best of repeated timings."""
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.matmul(a, b)
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.matmul(a, b)
        sync()
        best = max(best, 2 * size**3 / (time.perf_counter() - start) / 1e9)
    return best
