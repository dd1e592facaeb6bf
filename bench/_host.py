"""What the benchmarks report about the host and their own process, without importing torch: the CPU
(model and SIMD flags), the load average, and the process's peak resident set."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Tuple

SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512", "amx", "avx_vnni")  # prefixes of the flags shown


def peak_resident_bytes() -> int:
    """This process's peak resident set so far (``VmHWM`` of /proc/self/status)."""
    with open("/proc/self/status", encoding="ascii") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:"))


def cpu() -> Tuple[str, List[str]]:
    """(model name, its SIMD flags among ``SIMD_FLAGS``) from /proc/cpuinfo."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines if ":" in line)}
    flags = [f for f in fields.get("flags", "").split() if f.startswith(SIMD_FLAGS)]
    return f"{fields.get('model name', 'unknown')} ({os.cpu_count()} cores)", flags


def load_average() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]
