"""gr's fused CPU kernels, compiled for this machine on first use: one library, eight op namespaces.

Five are gr.ops' own (``SOURCES``):

* ``gr_cpu_loss`` (``gr/ops/sampled_softmax/sampled_softmax.cpp``): the per-row sampled softmax, used by
  ``gr.ops.sampled_softmax.cpu`` (``sampled_softmax_forward``, ``sampled_softmax_backward``);
* ``gr_cpu_random`` (``gr/ops/random/random.cpp``): counter-based dropout masks and integer draws, used by
  ``gr.ops.random`` (``keep_mask``, ``randint``);
* ``gr_cpu_rank`` (``gr/ops/catalogue_rank/catalogue_rank.cpp``): each evaluation target's rank among the
  catalogue, used by ``gr.ops.catalogue_rank`` (``catalogue_ranks``, ``shared_ranks``);
* ``gr_cpu_gemm`` (``gr/ops/csrc/gemm.cpp``): the small-tile GEMM the attention and layer kernels call
  (``gr/ops/csrc/gr_gemm.h``: AVX-512 where the CPU has it, MKL's ``sgemm_`` otherwise), as ops for
  its tests (``gemm``, ``transpose``);
* ``gr_cpu_silu`` (``gr/ops/csrc/silu.cpp``): the SiLU the projection and attention kernels compute
  (``gr/ops/csrc/gr_silu.h``), as an op for its tests (``silu``).

The packages above add their own sources as they are imported (``add_sources``): ``gr.hstu.kernels``
the HSTU attention tiles (``gr_cpu_fused``), cached attention's (``gr_cpu_cached``) and the HSTU layer's
steps (``gr_cpu_layer``). A process that imports them before it first asks for an op (``import gr.hstu``
does) builds and loads one library of all eight; a source added after that is built into a library of
its own at the next call.

``native_ops(namespace)`` returns ``torch.ops.<namespace>`` or None when the kernels are off or
unavailable; the callers then run their PyTorch code, which computes the same thing. The build uses
``torch.utils.cpp_extension`` (the machine's C++ compiler and the environment's ninja, the ``ninja``
package's even where another is first on PATH; about a minute once on 2 cores,
later processes load the cached library in well under a second) with ``-march=native``. The library's directory is
named by a hash of everything the binary depends on (the sources and headers, the flags, the torch
version and installation, this CPU's model and flags) and compiles copies of the sources kept there,
so two versions or environments never share or rebuild each other's library, and checkouts of one
version using one environment share one build. One
process builds and loads it at most once, whatever its threads do; concurrent processes wait for
each other's build (``build_lock``, which a killed build does not leave held). The attention and layer ops multiply
with ``gr/ops/csrc/gr_gemm.h`` (in bf16 math under CPU autocast to bf16: ``cpu_bf16_math``), which links
the BLAS that PyTorch's x86 builds carry (MKL, ``gr/ops/csrc/gr_blas.h``); where that, or a compiler, is
missing the build fails once per process and the reason is logged.

``GR_CPU_FUSED=0`` turns them off; ``GR_CPU_FUSED=1`` makes a failed build an error instead of a
fallback. The build directory is ``$GR_EXTENSIONS_DIR`` or ``~/.cache/gr/extensions``.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
import sysconfig
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch

from gr.utils.atomic import write_bytes

log = logging.getLogger(__name__)

OPS = Path(__file__).resolve().parent  # gr/ops: each op's C++ beside its CPU code, shared headers in csrc/
# gr.ops' own sources, then those add_sources appends.
SOURCES = [
    OPS / "sampled_softmax" / "sampled_softmax.cpp",
    OPS / "random" / "random.cpp",
    OPS / "catalogue_rank" / "catalogue_rank.cpp",
    OPS / "csrc" / "gemm.cpp",
    OPS / "csrc" / "silu.cpp",
]
# -fopenmp: at::parallel_for is inline and runs serially without it (the OpenMP runtime is torch's libgomp);
# -ffast-math: vectorised expf from glibc's libmvec. Fast-math only compiles: linking it would bring
# crtfastmath, which sets flush-to-zero for the whole process.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
LDFLAGS = ("-fopenmp", "-lmvec")
HEADERS = OPS / "csrc"
_load_lock = threading.Lock()
_libraries: List[Tuple[Path, ...]] = []  # the sources of each library this process loaded (or failed to build)
_loaded: List[Tuple[int, Tuple[bool, str]]] = []  # (sources covered, _load_once's answer) once they were loaded


def _cpu_text() -> str:
    """This CPU's architecture, model and instruction set flags (the library is built with -march=native)."""
    text = platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        text += "".join(line for line in info.splitlines() if line.startswith(("model name", "flags")))[:8192]
    except OSError:
        pass
    return text


def add_sources(sources: Sequence[Path]) -> None:
    """Build ``sources`` (C++ files that define op namespaces of their own and may include the headers of
    ``gr/ops/csrc`` by name) into gr's native library too. A package above gr.ops calls it with its
    kernels' sources as it is imported, before any of its ops is asked for; a source already added is
    ignored."""
    with _load_lock:
        SOURCES.extend(source for source in sources if source not in SOURCES)


def library_name(sources: Sequence[Path]) -> str:
    """``gr_cpu_native_<hash>``: a hash of ``sources`` and the headers, the flags, the torch version and
    installation, the include paths the build writes into its ``build.ninja`` (as spelled: one
    environment reached through a symlink and through its target gets a build per spelling,
    where one shared build was recompiled, silently, at every switch) and this CPU."""
    from torch.utils.cpp_extension import include_paths

    digest = hashlib.sha256()
    for path in (*sources, *_headers()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    torch_install = str(Path(torch.__file__).resolve().parent)  # its headers and libraries: a venv's own
    embedded = (*include_paths(), sysconfig.get_path("include"))
    digest.update(repr((CFLAGS, LDFLAGS, torch.__version__, torch_install, embedded, _cpu_text())).encode())
    return f"gr_cpu_native_{digest.hexdigest()[:16]}"


def fused_setting() -> str:
    """``GR_CPU_FUSED``: "auto" (default: use when it builds), "0" (off) or "1" (required)."""
    value = os.environ.get("GR_CPU_FUSED", "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"GR_CPU_FUSED: expected 'auto', '0' or '1', got {value!r}")
    return value


def fused_expected() -> bool:
    """Whether the fused kernels are on for this machine (x86-64, not GR_CPU_FUSED=0), without building
    them: for estimates such as ``gr plan``'s (a build can still fail, and then the PyTorch code runs)."""
    return _expected(fused_setting())


def _expected(setting: str) -> bool:
    return setting != "0" and platform.machine() in ("x86_64", "AMD64")


def cpu_bf16_math() -> bool:
    """Whether gr's CPU kernels multiply in bf16 math now: under CPU autocast to bf16, where PyTorch's
    own matmuls take bf16 operands too. Their GEMMs then round both operands to bf16 and sum in fp32
    (``gr_gemm::gemm_bf16``, AVX-512 BF16; fp32 math on CPUs without it); what they store, and their
    LayerNorm, SiLU and softmax, stay fp32."""
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def native_ops(namespace: str) -> Optional[Any]:
    """``torch.ops.<namespace>`` (ops as attributes: Any) when the fused CPU kernels are on and built, else None."""
    setting = fused_setting()
    if not _expected(setting):
        if setting == "1":
            raise RuntimeError("GR_CPU_FUSED=1: gr's fused CPU kernels need an x86-64 CPU")
        return None
    built, error = _load_once()
    if not built and setting == "1":
        raise RuntimeError(f"GR_CPU_FUSED=1 but gr's fused CPU kernels did not build: {error}")
    return getattr(torch.ops, namespace) if built else None


def _load_once() -> Tuple[bool, str]:
    """(True, "") or (False, why not: the first failed build's reason) for the sources added so far; each
    library built and loaded at most once per process.

    The lock is held across the cached calls: a second thread waits for the first one's result
    instead of building again (loading a library twice would register its op namespaces twice,
    which aborts the process)."""
    known = _loaded[-1] if _loaded else None  # read without the lock: the fast path of every op call
    if known is not None and known[0] == len(SOURCES):
        return known[1]
    with _load_lock:
        # SOURCES only grows, and each library took the sources added before it: the rest are pending
        pending = tuple(SOURCES[sum(map(len, _libraries)) :])
        if pending:
            _libraries.append(pending)
        failed = [why for built, why in map(_load, _libraries) if not built]
        found = (False, failed[0]) if failed else (True, "")
        _loaded.append((len(SOURCES), found))
    return found


@lru_cache(maxsize=None)
def _load(sources: Tuple[Path, ...]) -> Tuple[bool, str]:
    directory = Path(os.environ.get("GR_EXTENSIONS_DIR", Path.home() / ".cache" / "gr" / "extensions"))
    name = library_name(sources)
    if not (directory / name / f"{name}.so").exists():  # progress: the first step waits for it
        print(f"compiling gr's fused CPU kernels for this CPU, once (~1 min): {directory / name}", file=sys.stderr)
    try:
        build(name, list(sources), directory)
    except Exception as error:  # a compiler or BLAS symbol missing: run the unfused kernel
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        log.warning("fused CPU kernels unavailable (%s); running the PyTorch ones", reason)
        return False, reason
    return True, ""


def _staged(sources: List[Path], target: Path) -> List[Path]:
    """Copies of ``sources`` in ``target`` and of the headers in ``target/../include`` -> the copies.

    The build then names the same paths whichever checkout asks for it, so checkouts of one version
    share one library: ninja rebuilds when a source's path changes, even to identical content. A copy
    is written (atomically) only where it is missing or differs, which keeps a built library current."""
    staged = []
    for source, folder in [(s, target) for s in sources] + [(h, target.parent / "include") for h in _headers()]:
        copy, content = folder / source.name, source.read_bytes()
        if not copy.is_file() or copy.read_bytes() != content:
            folder.mkdir(parents=True, exist_ok=True)
            write_bytes(copy, content)
        if folder == target:
            staged.append(copy)
    return staged


def _headers() -> List[Path]:
    return sorted(HEADERS.glob("*.h"))


def build(name: str, sources: List[Path], directory: Path) -> None:
    """Compile ``sources`` into ``directory/name`` (or reuse it there) and load it into this process."""
    import ninja
    from torch.utils.cpp_extension import load

    build_dir = directory / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with build_lock(build_dir), first_on_path(ninja.BIN_DIR):
        load(
            name=name,
            sources=[str(source) for source in _staged(sources, build_dir / "src")],
            extra_cflags=list(CFLAGS),  # copies: torch's load() appends to its flag lists in place
            extra_ldflags=list(LDFLAGS),
            extra_include_paths=[str(build_dir / "include")],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """One build in ``build_dir`` at a time, whatever the process: an ``fcntl.flock``, which the OS
    releases when its holder dies. torch's ``load()`` takes a lock file of its own (``lock``) that a
    process killed mid-build leaves behind, and every later ``load()`` there waited for it forever;
    under this lock no other build runs, so such a file is a leftover and is removed."""
    with open(build_dir / ".build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


@contextmanager
def first_on_path(folder: str) -> Iterator[None]:
    """PATH with ``folder`` first inside the block. torch's ``load()`` runs ``ninja`` from PATH, and
    ninja versions record commands in the build log differently (a 1.11 log reads as "command line
    changed" to 1.13): with a system ninja first on PATH in some shells and the environment's in
    others (an activated venv), each switch recompiled the whole library, silently."""
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([folder, before]) if before else folder
    try:
        yield
    finally:
        if before is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = before
