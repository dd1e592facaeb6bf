"""The fused CPU attention tiles (``csrc/cpu_fused_attention.cpp``), compiled for this machine on first use.

``fused_ops()`` returns ``torch.ops.gr_cpu_fused`` (``forward_chunk``, ``backward_chunk``) or None when
they are off or unavailable; ``gr.hstu.kernels.cpu`` then runs its unfused chunks, which compute the
same thing. The build uses ``torch.utils.cpp_extension`` (the machine's C++ compiler, ~30 s once;
later processes load the cached library in well under a second) with ``-march=native``, so the cache
directory is keyed by this CPU's model and flags. It needs the BLAS that PyTorch's x86 builds carry
(MKL's ``sgemm_``); where that, or a compiler, is missing the build fails once per process and the
reason is logged.

``GR_CPU_FUSED=0`` turns it off (the unfused kernel runs); ``GR_CPU_FUSED=1`` makes a failed build an
error instead of a fallback. The build directory is ``$GR_EXTENSIONS_DIR`` or
``~/.cache/gr/extensions``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from functools import lru_cache
from pathlib import Path
from typing import Optional, Tuple

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_fused_attention.cpp"
# -fopenmp: at::parallel_for is inline and runs serially without it (the OpenMP runtime is torch's libgomp);
# -ffast-math: vectorised expf from glibc's libmvec. Fast-math only compiles: linking it would bring
# crtfastmath, which sets flush-to-zero for the whole process.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-fopenmp", "-lmvec"]
_build_lock = threading.Lock()


def _cpu_key() -> str:
    """A short hash of this CPU's model and instruction set flags (the library is built with -march=native)."""
    text = platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        text += "".join(line for line in info.splitlines() if line.startswith(("model name", "flags")))[:8192]
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def fused_setting() -> str:
    """``GR_CPU_FUSED``: "auto" (default: use when it builds), "0" (off) or "1" (required)."""
    value = os.environ.get("GR_CPU_FUSED", "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"GR_CPU_FUSED: expected 'auto', '0' or '1', got {value!r}")
    return value


def fused_ops() -> Optional[object]:
    """``torch.ops.gr_cpu_fused`` when the fused tiles are on and built, else None."""
    setting = fused_setting()
    if setting == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        if setting == "1":
            raise RuntimeError("GR_CPU_FUSED=1: the fused CPU attention needs an x86-64 CPU")
        return None
    ops, error = _load_once()
    if ops is None and setting == "1":
        raise RuntimeError(f"GR_CPU_FUSED=1 but the fused CPU attention did not build: {error}")
    return ops


@lru_cache(maxsize=None)
def _load_once() -> Tuple[Optional[object], str]:
    """(the ops, "") or (None, why not); built and loaded at most once per process."""
    with _build_lock:
        directory = Path(os.environ.get("GR_EXTENSIONS_DIR", Path.home() / ".cache" / "gr" / "extensions"))
        try:
            build(f"gr_cpu_fused_{_cpu_key()}", SOURCE, directory)
        except Exception as error:  # a compiler or BLAS symbol missing: run the unfused kernel
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            log.warning("fused CPU attention unavailable (%s); using the unfused kernel", reason)
            return None, reason
        return torch.ops.gr_cpu_fused, ""


def build(name: str, source: Path, directory: Path) -> None:
    """Compile ``source`` into ``directory/name`` (or reuse it there) and load it into this process."""
    import ninja
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # torch runs `ninja` from PATH; the pip package's is not there
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    build_dir = directory / name
    build_dir.mkdir(parents=True, exist_ok=True)
    load(
        name=name,
        sources=[str(source)],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
