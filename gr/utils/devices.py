"""Which accelerator a process asks for or has, found without importing vendor packages.

torch-npu, once installed, loads itself on ``import torch`` (the device backend autoload)
and that import fails on a host without CANN. So the NPU is detected from the package's
presence, the device nodes and CANN's environment only; ``configure_backend_autoload`` turns
the autoload off (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``) unless an NPU is requested or present,
and ``load_torch_npu`` imports torch_npu explicitly when one is asked for. No torch import at
module level: ``configure_backend_autoload`` runs before torch is imported.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Dict, Mapping, MutableMapping, Optional

DEVICES = ("cpu", "cuda", "npu")
ACCELERATOR_DEVICES = {"gpu": "cuda", "cuda": "cuda", "npu": "npu"}  # trainer.accelerator -> device
AUTOLOAD_VAR = "TORCH_DEVICE_BACKEND_AUTOLOAD"
CANN_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")  # set by CANN's set_env.sh
# oneDNN JIT-compiles a matmul per shape and keeps 1024 by default; the CPU kernels' bf16 matmuls
# take ~1,350 shapes an ML-1M epoch (jagged groups), so the default re-creates them every epoch.
ONEDNN_CACHE_VAR = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_CAPACITY = "16384"


def cann_home(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """CANN's install directory from its environment, or None when CANN's set_env.sh was not sourced."""
    environ = os.environ if environ is None else environ
    return next((environ[name] for name in CANN_VARS if environ.get(name)), None)


def npu_present(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this host looks like an Ascend host: torch_npu installed, and NPU device nodes
    (/dev/davinci*) or CANN's environment present. Imports nothing."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    return bool(glob.glob("/dev/davinci[0-9]*")) or cann_home(environ) is not None


def autoload_env(requested: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment a process asking for ``requested`` (cpu|cuda|npu, or None / "auto") should
    start torch with: ``{TORCH_DEVICE_BACKEND_AUTOLOAD: "0"}`` unless an NPU is requested or, with
    nothing requested, present; an already-set value is kept. Empty: leave torch's default."""
    environ = os.environ if environ is None else environ
    if AUTOLOAD_VAR in environ:
        return {AUTOLOAD_VAR: environ[AUTOLOAD_VAR]}
    if requested == "npu" or (requested in (None, "auto") and npu_present(environ)):
        return {}
    return {AUTOLOAD_VAR: "0"}


def configure_backend_autoload(
    requested: Optional[str] = None, environ: Optional[MutableMapping[str, str]] = None
) -> None:
    """Apply ``autoload_env`` to ``environ`` (default: this process). Call before importing torch."""
    environ = os.environ if environ is None else environ
    environ.update(autoload_env(requested, environ))


def configure_onednn_cache(environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Raise oneDNN's primitive cache to ``ONEDNN_CACHE_CAPACITY`` unless the environment sets it.
    Call before the process's first CPU bf16 matmul (oneDNN reads it when it creates its cache)."""
    environ = os.environ if environ is None else environ
    environ.setdefault(ONEDNN_CACHE_VAR, ONEDNN_CACHE_CAPACITY)


def load_torch_npu(where: str) -> ModuleType:
    """Import torch_npu for an NPU run asked for by ``where`` (a config key or flag, named in
    errors). Raises RuntimeError naming what is missing: the torch_npu package, CANN's
    environment, or a visible NPU."""
    missing = []
    if importlib.util.find_spec("torch_npu") is None:
        missing.append("the torch_npu package (pip install -e '.[ascend]' on the Ascend host)")
    if cann_home() is None:
        missing.append(f"CANN ({' / '.join(CANN_VARS)} unset: source <CANN>/set_env.sh)")
    if missing:
        raise RuntimeError(f"{where}: 'npu' needs " + " and ".join(missing))
    try:
        torch_npu = importlib.import_module("torch_npu")
    except (ImportError, OSError) as err:
        raise RuntimeError(
            f"{where}: 'npu': torch_npu failed to load ({err}); check that its version matches torch and CANN"
        ) from err
    import torch

    if not torch.npu.is_available():  # type: ignore[attr-defined]  # torch_npu adds torch.npu
        raise RuntimeError(
            f"{where}: 'npu': torch_npu loaded but sees no NPU (check npu-smi and ASCEND_RT_VISIBLE_DEVICES)"
        )
    return torch_npu


def require_device(device: str, where: str) -> None:
    """Check that ``device`` ("cpu", "cuda", "npu") can run here, loading torch_npu for "npu".
    Raises ValueError for an unknown name, RuntimeError naming what is missing."""
    if device not in DEVICES:
        raise ValueError(f"{where}: expected one of {list(DEVICES)}, got {device!r}")
    if device == "npu":
        load_torch_npu(where)
    elif device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{where}: 'cuda' needs a CUDA build of torch and a visible GPU (torch {torch.__version__} sees none)"
            )


def check_accelerator(accelerator: str, where: str = "trainer.accelerator") -> None:
    """Refuse, before anything is built, a training accelerator ("gpu"/"cuda", "npu") this host
    lacks: ValueError naming ``where`` and what is missing. "auto" and "cpu" always pass."""
    device = ACCELERATOR_DEVICES.get(accelerator)
    if device is None:
        return
    try:
        require_device(device, where)
    except RuntimeError as error:  # the host, not a bug: one line at the command line
        raise ValueError(str(error)) from None


def runs_on_cpu(accelerator: str) -> bool:
    """Whether a run asking for ``accelerator`` trains on the CPU ("cpu", or "auto" with no GPU or NPU in sight)."""
    return accelerator == "cpu" or (accelerator == "auto" and detected_device() == "cpu")


def requested_test_device(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The device the test suite is asked to run on: ``GR_TEST_DEVICE`` (cpu|cuda|npu), or None
    when unset. Raises ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    device = environ.get("GR_TEST_DEVICE") or None
    if device is not None and device not in DEVICES:
        raise ValueError(f"GR_TEST_DEVICE: expected one of {list(DEVICES)}, got {device!r}")
    return device


def detected_device() -> str:
    """The accelerator torch sees in this process: "cuda", "npu" (torch_npu already loaded), else "cpu"."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if "torch_npu" in sys.modules and torch.npu.is_available():  # type: ignore[attr-defined]
        return "npu"
    return "cpu"


def suite_device(environ: Optional[Mapping[str, str]] = None) -> str:
    """The device the test suite runs on: ``GR_TEST_DEVICE`` checked with ``require_device``
    (torch_npu loaded for "npu"), else the detected one. Call after ``configure_backend_autoload``."""
    requested = requested_test_device(environ)
    if requested is None:
        return detected_device()
    require_device(requested, "GR_TEST_DEVICE")
    return requested
