"""The export format (version 2): file layout, names and INI helpers.

Layout of an export directory::

    default/slice_graph.ini   slices in execution order: engine, files, tensors, edges
    sparse/sparse.ini         tables (file, rows, dim, kind, pooling) and features (table, id mapping)
    sparse/<table>.safetensors  one tensor "weight" [rows, dim] per table
    sparse/id_maps/           raw -> model id mappings, copied from the training run (optional)
    sparse/item_features.safetensors  each item's declared item features (optional; gr.export.item_store)
    sparse/popularity.safetensors  each item's training count (optional; gr.export.popularity)
    sparse/item_encoder.safetensors  the item tower's feature encoder (optional; gr.export.item_encoder)
    prefix_dnn/model.onnx     token features -> "embedding" [tokens, hidden_dim]
    hstu/config.json          Hugging Face-style keys + every HSTUConfig field (gr.export.hstu_slice)
    hstu/model.safetensors    per-layer, per-projection weights, float32 or bfloat16 (docs/hstu_slice.md)
    hstu/empty_history.safetensors  the HSTU output of a user with no history (optional; gr.export.new_user)
    postfix_dnn/model.onnx    "hidden" [targets, hidden_dim] + common features -> task outputs
    MANIFEST                  sha256 of every other file (gr.export.manifest)

Every INI has a ``[format]`` section with ``version``; readers refuse other versions.
Symbolic dims: ``tokens`` (history + candidate tokens of a request), ``targets``
(candidate rows), ``batch`` (requests), ``batch+1`` (sequence offsets), ``bag``
(ids of one pooled common feature). ``[tokens, bag]`` is jagged: a bag of ids per token (a
list-valued token feature, pooled per token by its ``token_bag`` table).
"""

from __future__ import annotations

import configparser
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from safetensors import SafetensorError, safe_open

from gr.timestamps import TIMESTAMPS as TIMESTAMPS  # [tokens] int64 seconds: the HSTU slice's input

# 2: hstu/config.json (Hugging Face-style keys) and per-projection weight names, float32 or
# bfloat16, and a MANIFEST of sha256 sums. Format 1 exports (hstu/config.ini, no MANIFEST) are
# refused with an error that says to re-export: their files cannot be verified.
FORMAT_VERSION = 2

SLICE_GRAPH = "default/slice_graph.ini"
SPARSE_DIR = "sparse"
SPARSE_INI = "sparse/sparse.ini"
ID_MAPS_DIR = "sparse/id_maps"
PREFIX_ONNX = "prefix_dnn/model.onnx"
POSTFIX_ONNX = "postfix_dnn/model.onnx"
HSTU_CONFIG = "hstu/config.json"
HSTU_WEIGHTS = "hstu/model.safetensors"
SOURCE = "source.json"  # the run and checkpoint an export of a run came from (gr export RUN)

# The four slices of a version-1 graph, in execution order, with their engines.
SPARSE, PREFIX, HSTU_SLICE, POSTFIX = "sparse", "prefix_dnn", "hstu", "postfix_dnn"
SLICE_ENGINES = {SPARSE: "sparse", PREFIX: "onnxruntime", HSTU_SLICE: "hstu", POSTFIX: "onnxruntime"}
SLICE_ORDER = (SPARSE, PREFIX, HSTU_SLICE, POSTFIX)

# Fixed tensor names.
PREFIX_OUTPUT = "embedding"  # [tokens, hidden_dim]
HSTU_INPUT = "x"  # [tokens, hidden_dim]
SEQ_OFFSETS = "seq_offsets"  # [batch+1] int64
NUM_TARGETS = "num_targets"  # [batch] int64
HSTU_OUTPUT = "hidden"  # [targets, hidden_dim]: HSTU outputs at the candidate rows
POSTFIX_HIDDEN = "hidden"
POSTFIX_QUERY = "query"  # a retrieval head's output: the catalogue search scores item rows against it
TABLE_TENSOR = "weight"  # the tensor inside each sparse/<table>.safetensors

TOKENS, TARGETS, BATCH, BATCH_OFFSETS, BAG = "tokens", "targets", "batch", "batch+1", "bag"
TOKEN_BAGS = (TOKENS, BAG)  # the shape of a list-valued token feature's ids: a bag per token (jagged)
REPEAT_PER_TARGET = "per_target"  # a [batch, ...] source repeated once per target row
DTYPES = ("float32", "int64")


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


# ---- INI -----------------------------------------------------------------------------
def new_parser() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # case-sensitive keys (the documented way)
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
        problems.append(
            Problem(rel, "format.version", f"unknown format version {version!r}; this reader knows {FORMAT_VERSION}")
        )
        return None
    return parser


def read_safetensors(
    root: Path, rel: str, problems: List[Problem], framework: str = "numpy"
) -> Optional[Tuple[Dict[str, str], Dict[str, Any]]]:
    """``root/rel``'s metadata and tensors (numpy arrays, or torch tensors with ``framework="pt"``),
    read once; None, with a problem added, where it is not a readable safetensors file."""
    try:
        with safe_open(str(root / rel), framework=framework) as f:
            return dict(f.metadata() or {}), {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        problems.append(Problem(rel, "-", f"not a readable safetensors file (truncated or corrupt?): {exc}"))
        return None


def split_list(value: str) -> List[str]:
    """ "a, b, c" -> ["a", "b", "c"]; "" -> []."""
    return [item.strip() for item in value.split(",") if item.strip()]


def format_shape(shape: Tuple[Any, ...]) -> str:
    return ", ".join(str(d) for d in shape)


def parse_shape(value: str) -> Tuple[Any, ...]:
    """ "tokens, 16" -> ("tokens", 16)."""
    return tuple(int(d) if d.isdigit() else d for d in split_list(value))
