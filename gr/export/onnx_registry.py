"""torch.onnx.export with its aten-to-ONNX registry built once per process.

``torch.onnx.export(dynamo=True)`` rebuilds that registry from onnxscript's torchlib on every call:
it reads and parses the source of about 1,000 functions, ~1.8 s here, which is most of the export
time of a small prefix or postfix slice (an export has two). The registry depends only on the opset,
and gr never adds to it (no ``custom_translation_table``), so gr's exports reuse one per opset.

The registry constructor is torch-internal (``torch.onnx._internal.exporter._registration``); where it
is not found (another torch version), exports run unchanged, only slower.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator, Optional

_SWAP_LOCK = threading.Lock()


def _registry_class() -> Optional[Any]:  # a torch-internal class, whose constructor is swapped
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        return None
    registry = getattr(_registration, "ONNXRegistry", None)
    return registry if registry is not None and "from_torchlib" in vars(registry) else None


@functools.lru_cache(maxsize=None)
def _built(registry: type, constructor: classmethod, opset_version: Optional[int]) -> Any:
    build = constructor.__get__(None, registry)
    return build() if opset_version is None else build(opset_version=opset_version)


@contextlib.contextmanager
def registry_built_once() -> Iterator[None]:
    """Within the block, ``torch.onnx.export`` gets the process's registry for its opset instead of
    building a new one. One block at a time: the constructor is swapped on the class meanwhile."""
    registry = _registry_class()
    if registry is None:
        yield
        return
    with _SWAP_LOCK:
        original = vars(registry)["from_torchlib"]

        def reused(opset_version: Optional[int] = None) -> Any:
            return _built(registry, original, opset_version)

        registry.from_torchlib = staticmethod(reused)
        try:
            yield
        finally:
            registry.from_torchlib = original
