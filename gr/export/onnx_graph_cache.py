"""Reuse of translated ONNX graphs across exports of one architecture.

An export traces each slice with ``torch.export`` (~0.2-0.5 s for a small prefix or postfix on CPU)
and then translates the traced program to ONNX: decompositions, translation and graph optimisation,
~1-2 s more. The translation depends on the traced program and not on the values of its parameters
and buffers, so a daily export of an unchanged architecture gets the earlier ONNX graph back, with
this export's weights written into it: the file equals a fresh translation, byte for byte.

Key: a SHA-256 over what the translation reads from the program besides parameter and buffer values:
every node (operator, arguments, shapes and dtypes, and the stack trace and module path the exporter
copies into the ONNX metadata), the graph signature, the range constraints, the parameters' and
buffers' names, shapes and dtypes, the lifted constants' values, the input and output names, the
dynamic dimensions, and the torch, onnx and onnxscript versions. An entry is the ONNX model with
the bytes of its parameter and buffer initializers left out. A graph whose parameters were folded
into other constants is not stored, and the export still checks ONNX Runtime against PyTorch after
a reuse (``gr.export.writer``), translating afresh if they differ. A cache file that cannot be read
or does not fit the program is a miss.

The cache lives in ``$GR_ONNX_CACHE_DIR`` (default ``~/.cache/gr/onnx``; ``off`` turns it off) and
keeps the ``MAX_ENTRIES`` used last. The program is traced the way ``torch.onnx.export`` traces a
module first (its non-strict capture strategy, torch-internal); where that strategy is not found
(another torch version), exports translate every time, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import onnx
import torch
from google.protobuf.message import DecodeError
from torch import Tensor, nn

from gr.utils.atomic import write_bytes

CACHE_DIR_ENV = "GR_ONNX_CACHE_DIR"
OFF = "off"
MAX_ENTRIES = 256
SUFFIX = ".onnx"
_NODE_META = ("val", "stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn")  # what the key reads per node


def cache_directory() -> Optional[Path]:
    """``$GR_ONNX_CACHE_DIR`` or ``~/.cache/gr/onnx``; None when the variable is ``off``."""
    value = os.environ.get(CACHE_DIR_ENV)
    if value is not None and value.strip().lower() == OFF:
        return None
    return Path(value) if value else Path.home() / ".cache" / "gr" / "onnx"


def capture(module: nn.Module, example: tuple, dynamic_shapes: tuple) -> Optional[torch.export.ExportedProgram]:
    """The program ``torch.onnx.export`` would trace from ``module`` with its first capture strategy
    (non-strict ``torch.export``), or None when that strategy is unavailable or fails (the export then
    hands ``module`` to ``torch.onnx.export``, which tries its other strategies and reports)."""
    try:
        from torch.onnx._internal.exporter._capture_strategies import TorchExportNonStrictStrategy
    except ImportError:
        return None
    strategy = TorchExportNonStrictStrategy(verbose=False, dump=False, artifacts_dir=".", timestamp="")
    result = strategy(module, example, None, dynamic_shapes)
    return result.exported_program


def graph_key(
    program: torch.export.ExportedProgram,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_shapes: tuple,
) -> str:
    """Hex SHA-256 of everything the ONNX translation of ``program`` reads but its weights."""
    import onnxscript

    digest = hashlib.sha256()

    def add(*parts: Any) -> None:
        for part in parts:
            digest.update(str(part).encode())
            digest.update(b"\0")

    add(torch.__version__, onnx.__version__, onnxscript.__version__, list(input_names), list(output_names))
    add(dynamic_shapes, program.graph_signature, program.range_constraints)
    for node in program.graph.nodes:
        add(node.format_node(), *(node.meta.get(key) for key in _NODE_META))
    for name, tensor in sorted(program.state_dict.items()):
        add(name, tuple(tensor.shape), tensor.dtype)
    for name, constant in sorted(program.constants.items()):
        add(name, type(constant).__name__)
        if isinstance(constant, Tensor):
            add(tuple(constant.shape), constant.dtype)
            digest.update(_tensor_bytes(constant))
    return digest.hexdigest()


@dataclass
class CachedGraph:
    """One slice's traced ``program`` and its entry ``key`` in ``directory``."""

    directory: Path
    key: str
    program: torch.export.ExportedProgram

    @classmethod
    def trace(
        cls,
        module: nn.Module,
        example: tuple,
        input_names: Sequence[str],
        output_names: Sequence[str],
        dynamic_shapes: tuple,
    ) -> Optional["CachedGraph"]:
        """None when the cache is off or ``capture`` cannot trace ``module``."""
        directory = cache_directory()
        if directory is None:
            return None
        try:
            program = capture(module, example, dynamic_shapes)
        except Exception:  # torch.export raises many types; torch.onnx.export traces again and reports
            return None
        if program is None:
            return None
        return cls(directory, graph_key(program, input_names, output_names, dynamic_shapes), program)

    @property
    def path(self) -> Path:
        return self.directory / f"{self.key}{SUFFIX}"

    def write(self, target: Path) -> bool:
        """Writes the cached graph with this program's weights to ``target``; False (nothing written)
        when there is no entry, or it cannot be read or does not fit the program."""
        try:
            model = onnx.load_model_from_string(self.path.read_bytes())
        except (OSError, DecodeError):
            return False
        pairs = _weight_initializers(model, self.program)
        if pairs is None or any(initializer.raw_data for initializer, _ in pairs):
            return False
        for initializer, data in pairs:
            initializer.raw_data = data
        write_bytes(target, model.SerializeToString())
        with contextlib.suppress(OSError):
            os.utime(self.path)
        return True

    def keep(self, translated: Path) -> None:
        """Stores the freshly translated graph at ``translated`` without its weights; one in which a
        weight is not an initializer of its own (folded into another constant) is not stored."""
        model = onnx.load_model_from_string(translated.read_bytes())
        pairs = _weight_initializers(model, self.program)
        if pairs is None or any(initializer.raw_data != data for initializer, data in pairs):
            return
        for initializer, _ in pairs:
            initializer.ClearField("raw_data")
        self.directory.mkdir(parents=True, exist_ok=True)
        write_bytes(self.path, model.SerializeToString())
        _evict(self.directory)

    def discard(self) -> None:
        """Removes the entry (its reuse did not match PyTorch)."""
        self.path.unlink(missing_ok=True)


def _weight_initializers(
    model: onnx.ModelProto, program: torch.export.ExportedProgram
) -> Optional[List[Tuple[onnx.TensorProto, bytes]]]:
    """Each parameter and buffer of ``program`` as (its initializer in ``model``, by name, its bytes);
    None when one has no initializer of its shape."""
    initializers = {initializer.name: initializer for initializer in model.graph.initializer}
    pairs = []
    for name, tensor in program.state_dict.items():
        initializer = initializers.get(name)
        if initializer is None or list(initializer.dims) != list(tensor.shape):
            return None
        pairs.append((initializer, _tensor_bytes(tensor)))
    return pairs


def _tensor_bytes(tensor: Tensor) -> bytes:
    """The little-endian bytes ONNX keeps as an initializer's ``raw_data``."""
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _evict(directory: Path) -> None:
    """Keeps the ``MAX_ENTRIES`` entries used last."""
    entries = sorted(directory.glob(f"*{SUFFIX}"), key=_used_at)
    for stale in entries[:-MAX_ENTRIES]:
        stale.unlink(missing_ok=True)


def _used_at(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # evicted by another export meanwhile
        return 0.0
