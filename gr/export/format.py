"""The export format (version 1): file layout, names, INI helpers and the HSTU tensor schema.

Layout of an export directory::

    default/slice_graph.ini   slices in execution order: engine, files, tensors, edges
    sparse/sparse.ini         tables (file, rows, dim, kind, pooling) and features (table, id mapping)
    sparse/<table>.safetensors  one tensor "weight" [rows, dim] per table
    sparse/id_maps/           raw -> model id mappings, copied from the training run (optional)
    prefix_dnn/model.onnx     token features -> "embedding" [tokens, hidden_dim]
    hstu/config.ini           model_type = hstu, every HSTUConfig field, dtype
    hstu/model.safetensors    the HSTU weights, names from ``hstu_tensor_shapes``
    postfix_dnn/model.onnx    "hidden" [targets, hidden_dim] + common features -> task outputs

Every INI has a ``[format]`` section with ``version``; readers refuse other versions.
Symbolic dims: ``tokens`` (history + candidate tokens of a request), ``targets``
(candidate rows), ``batch`` (requests), ``batch+1`` (sequence offsets), ``bag``
(ids of one pooled common feature).
"""
from __future__ import annotations

import configparser
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from gr.hstu.config import HSTUConfig

FORMAT_VERSION = 1
# HSTUConfig fields added after format 1 was released, and what an export without them means.
FIELDS_SINCE_FORMAT_1 = {"query_time": "token", "eviction_block": 1}

SLICE_GRAPH = "default/slice_graph.ini"
SPARSE_DIR = "sparse"
SPARSE_INI = "sparse/sparse.ini"
ID_MAPS_DIR = "sparse/id_maps"
PREFIX_ONNX = "prefix_dnn/model.onnx"
POSTFIX_ONNX = "postfix_dnn/model.onnx"
HSTU_CONFIG = "hstu/config.ini"
HSTU_WEIGHTS = "hstu/model.safetensors"

# The four slices of a version-1 graph, in execution order, with their engines.
SPARSE, PREFIX, HSTU_SLICE, POSTFIX = "sparse", "prefix_dnn", "hstu", "postfix_dnn"
SLICE_ENGINES = {SPARSE: "sparse", PREFIX: "onnxruntime", HSTU_SLICE: "hstu", POSTFIX: "onnxruntime"}
SLICE_ORDER = (SPARSE, PREFIX, HSTU_SLICE, POSTFIX)

# Fixed tensor names.
PREFIX_OUTPUT = "embedding"  # [tokens, hidden_dim]
HSTU_INPUT = "x"  # [tokens, hidden_dim]
TIMESTAMPS = "timestamps"  # [tokens] int64 seconds
SEQ_OFFSETS = "seq_offsets"  # [batch+1] int64
NUM_TARGETS = "num_targets"  # [batch] int64
HSTU_OUTPUT = "hidden"  # [targets, hidden_dim]: HSTU outputs at the candidate rows
POSTFIX_HIDDEN = "hidden"
TABLE_TENSOR = "weight"  # the tensor inside each sparse/<table>.safetensors

TOKENS, TARGETS, BATCH, BATCH_OFFSETS, BAG = "tokens", "targets", "batch", "batch+1", "bag"
REPEAT_PER_TARGET = "per_target"  # a [batch, ...] source repeated once per target row
DTYPES = ("float32", "int64")
HSTU_DTYPES = ("float32",)
MODEL_TYPE = "hstu"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an export: the file (relative to the export dir), the key, what."""

    file: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.file} [{self.key}]: {self.message}"


class ExportFormatError(ValueError):
    """An export directory that does not load; ``problems`` lists every finding."""

    def __init__(self, problems: List[Problem]) -> None:
        self.problems = list(problems)
        lines = "\n  ".join(str(p) for p in self.problems)
        super().__init__(f"invalid export ({len(self.problems)} problem(s)):\n  {lines}")


class ExportError(RuntimeError):
    """Writing an export failed (e.g. a module that ONNX cannot export)."""


def hstu_tensor_shapes(config: HSTUConfig) -> Dict[str, Tuple[int, ...]]:
    """The documented tensor names and shapes of ``hstu/model.safetensors``.

    ``position_embedding.weight`` [max_seq_len + 1, D] (when position_embedding), and per
    layer i: ``layers.{i}.input_norm.{weight,bias}`` [D], ``layers.{i}.uvqk.weight``
    [H*(2*Dl + 2*Da), D] and ``.bias`` [H*(2*Dl + 2*Da)] (output split as U, V, Q, K),
    ``layers.{i}.attn_norm.{weight,bias}`` [H*Dl], ``layers.{i}.output.weight`` [D, H*Dl]
    and ``.bias`` [D], ``layers.{i}.position_bias`` [P] (relative position bias table,
    when P > 0) and ``layers.{i}.time_bias`` [time_buckets] (when > 0).
    """
    d, h = config.hidden_dim, config.num_heads
    uvqk = h * (2 * config.linear_dim + 2 * config.attention_dim)
    shapes: Dict[str, Tuple[int, ...]] = {}
    if config.position_embedding:
        shapes["position_embedding.weight"] = (config.max_seq_len + 1, d)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_norm.weight": (d,), p + "input_norm.bias": (d,),
            p + "uvqk.weight": (uvqk, d), p + "uvqk.bias": (uvqk,),
            p + "attn_norm.weight": (h * config.linear_dim,), p + "attn_norm.bias": (h * config.linear_dim,),
            p + "output.weight": (d, h * config.linear_dim), p + "output.bias": (d,),
        })
        if config.num_position_buckets > 0:
            shapes[p + "position_bias"] = (config.num_position_buckets,)
        if config.time_buckets > 0:
            shapes[p + "time_bias"] = (config.time_buckets,)
    return shapes


# ---- INI -----------------------------------------------------------------------------
def new_parser() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # keys are case-sensitive names
    return parser


def write_ini(path: Path, sections: Mapping[str, Mapping[str, str]], header: str = "") -> None:
    """Write ``{"format": {"version": ...}, **sections}`` to ``path``."""
    parser = new_parser()
    parser["format"] = {"version": str(FORMAT_VERSION)}
    for name, values in sections.items():
        parser[name] = dict(values)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        if header:
            f.write("".join(f"# {line}\n" for line in header.splitlines()))
        parser.write(f)


def read_ini(root: Path, rel: str, problems: List[Problem]) -> Optional[configparser.ConfigParser]:
    """Parse ``root/rel``; on a missing file, a syntax error or an unknown version, add a
    problem and return None."""
    path = root / rel
    if not path.is_file():
        problems.append(Problem(rel, "-", "file is missing"))
        return None
    parser = new_parser()
    try:
        parser.read(path)
    except configparser.Error as exc:
        problems.append(Problem(rel, "-", f"not a valid INI file: {exc}"))
        return None
    version = parser.get("format", "version", fallback=None)
    if version is None:
        problems.append(Problem(rel, "format.version", "missing"))
        return None
    if version.strip() != str(FORMAT_VERSION):
        problems.append(Problem(rel, "format.version",
                                f"unknown format version {version!r}; this reader knows {FORMAT_VERSION}"))
        return None
    return parser


def split_list(value: str) -> List[str]:
    """"a, b, c" -> ["a", "b", "c"]; "" -> []."""
    return [item.strip() for item in value.split(",") if item.strip()]


def format_shape(shape: Tuple[Any, ...]) -> str:
    return ", ".join(str(d) for d in shape)


def parse_shape(value: str) -> Tuple[Any, ...]:
    """"tokens, 16" -> ("tokens", 16)."""
    return tuple(int(d) if d.isdigit() else d for d in split_list(value))


# ---- hstu/config.ini ---------------------------------------------------------------------
def hstu_config_sections(config: HSTUConfig, dtype: str = "float32") -> Dict[str, Dict[str, str]]:
    """-> INI sections: ``[model]`` with model_type, dtype and every HSTUConfig field."""
    values = {"model_type": MODEL_TYPE, "dtype": dtype}
    for f in fields(HSTUConfig):
        values[f.name] = _format_value(getattr(config, f.name))
    return {"model": values}


def hstu_config_from_ini(
    parser: configparser.ConfigParser, rel: str, problems: List[Problem]
) -> Optional[HSTUConfig]:
    """Parse ``[model]`` back into an HSTUConfig; each bad key becomes a problem."""
    if not parser.has_section("model"):
        problems.append(Problem(rel, "model", "section is missing"))
        return None
    section = parser["model"]
    start = len(problems)
    if section.get("model_type") != MODEL_TYPE:
        problems.append(Problem(rel, "model.model_type", f"expected {MODEL_TYPE!r}, got {section.get('model_type')!r}"))
    if section.get("dtype") not in HSTU_DTYPES:
        problems.append(Problem(rel, "model.dtype",
                                f"expected one of {list(HSTU_DTYPES)}, got {section.get('dtype')!r}"))
    hints = typing.get_type_hints(HSTUConfig)
    known = {f.name for f in fields(HSTUConfig)}
    for key in sorted(set(section) - known - {"model_type", "dtype"}):
        problems.append(Problem(rel, f"model.{key}", "unknown HSTUConfig field"))
    values: Dict[str, Any] = {}
    for name in sorted(known):
        if name not in section and name in FIELDS_SINCE_FORMAT_1:
            values[name] = FIELDS_SINCE_FORMAT_1[name]
            continue
        if name not in section:
            problems.append(Problem(rel, f"model.{name}", "missing HSTUConfig field"))
            continue
        try:
            values[name] = _parse_value(section[name], hints[name])
        except ValueError as exc:
            problems.append(Problem(rel, f"model.{name}", str(exc)))
    if len(problems) > start:
        return None
    try:
        return HSTUConfig(**values)
    except ValueError as exc:
        problems.append(Problem(rel, "model", str(exc)))
        return None


def _format_value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _parse_value(text: str, hint: Any) -> Any:
    """Parse one INI value by the HSTUConfig field's type hint."""
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    text = text.strip()
    if optional and text.lower() == "none":
        return None
    if base is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"expected true or false, got {text!r}")
        return text.lower() == "true"
    if base is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if base is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    return text
