"""A checkpoint's non-sharded part (epoch, loops, callbacks, schedulers...) as JSON plus
safetensors, never a pickle: reading it runs no code.

``meta.json`` holds the nested structure; each tensor in it is ``{"__tensor__": key}``, its
value ``key`` in ``meta.safetensors``. JSON cannot say everything Python state dicts use, so
a tuple is ``{"__tuple__": [...]}``, a dict with keys that are not plain strings (an
optimizer's ``{0: {...}}``) is ``{"__dict__": [[key, value], ...]}`` and a non-finite float
is ``{"__float__": "nan" | "inf" | "-inf"}``. Any other type is a TypeError naming its place.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict

import torch
from safetensors.torch import load_file, save

from gr.utils.atomic import write_bytes, write_json

META_JSON = "meta.json"
META_TENSORS = "meta.safetensors"
FORMAT_VERSION = 1
_MARKERS = ("__tensor__", "__tuple__", "__dict__", "__float__")


def write_meta(meta: Dict[str, Any], directory: Path) -> None:
    """Write ``meta`` (a checkpoint's non-sharded entries) as ``directory``/meta.json (+ meta.safetensors)."""
    tensors: Dict[str, torch.Tensor] = {}
    encoded = _encode(meta, "meta", tensors)
    if tensors:
        write_bytes(directory / META_TENSORS, save(tensors))
    write_json(directory / META_JSON, {"format_version": FORMAT_VERSION, "meta": encoded})


def read_meta(directory: Path) -> Dict[str, Any]:
    """The dict ``write_meta`` wrote into ``directory``; a damaged or foreign file is a ValueError naming it."""
    path = directory / META_JSON
    try:
        document = json.loads(path.read_text(encoding="utf8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path}: cannot read checkpoint metadata ({error})") from error
    if not isinstance(document, dict) or document.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version must be {FORMAT_VERSION}")
    tensors = load_file(directory / META_TENSORS) if (directory / META_TENSORS).is_file() else {}
    return _decode(document.get("meta"), tensors, path)


def _encode(value: Any, where: str, tensors: Dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().cpu().clone()  # safetensors refuses tensors sharing memory
        return {"__tensor__": key}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in _MARKERS for k in value):
            return {k: _encode(v, f"{where}.{k}", tensors) for k, v in value.items()}
        return {
            "__dict__": [
                [_encode(k, f"{where} key", tensors), _encode(v, f"{where}[{k!r}]", tensors)] for k, v in value.items()
            ]
        }
    raise TypeError(
        f"{where}: a {type(value).__name__} cannot be stored in checkpoint metadata "
        f"(JSON values, tuples and tensors only)"
    )


def _decode(value: Any, tensors: Dict[str, torch.Tensor], path: Path) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, path) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and next(iter(value)) in _MARKERS:
        marker, inner = next(iter(value.items()))
        if marker == "__tensor__":
            if inner not in tensors:
                raise ValueError(f"{path}: tensor {inner!r} is missing from {META_TENSORS}")
            return tensors[inner]
        if marker == "__float__":
            return float(inner)
        if marker == "__tuple__":
            return tuple(_decode(v, tensors, path) for v in inner)
        return {_decode(k, tensors, path): _decode(v, tensors, path) for k, v in inner}
    return {k: _decode(v, tensors, path) for k, v in value.items()}
