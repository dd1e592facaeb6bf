"""Read and validate an export directory; rebuild the HSTU slice from its files alone.

Imports no training code (no torchrec, lightning, gr.model/train; of gr.data only the id map
format, ``gr.data.mappings``): the serving runtime loads exports through this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import onnx
import torch
from onnx import numpy_helper
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from gr.export.format import (
    BAG,
    BATCH,
    HSTU_CONFIG,
    HSTU_INPUT,
    HSTU_OUTPUT,
    HSTU_SLICE,
    HSTU_WEIGHTS,
    NUM_TARGETS,
    POSTFIX,
    POSTFIX_ONNX,
    PREFIX,
    PREFIX_ONNX,
    SEQ_OFFSETS,
    SLICE_GRAPH,
    SPARSE,
    SPARSE_DIR,
    SPARSE_INI,
    TABLE_TENSOR,
    TARGETS,
    TIMESTAMPS,
    TOKEN_BAGS,
    TOKENS,
    ExportFormatError,
    Problem,
    read_ini,
)
from gr.export.hstu_slice import SAFETENSORS_DTYPES, config_from_slice, from_slice, slice_tensor_shapes
from gr.export.id_maps import read_id_maps
from gr.export.item_encoder import check_item_encoder
from gr.export.item_store import check_item_store
from gr.export.manifest import check_manifest, inside
from gr.export.new_user import check_empty_history
from gr.export.popularity import check_popularity
from gr.export.slice_graph import SliceGraph, SliceSpec
from gr.export.sparse_manifest import SparseManifest
from gr.hstu import HSTU, HSTUConfig
from gr.utils.finite import non_finite

SLICE_FILES = {
    SPARSE: (SPARSE_INI,),
    PREFIX: (PREFIX_ONNX,),
    HSTU_SLICE: (HSTU_CONFIG, HSTU_WEIGHTS),
    POSTFIX: (POSTFIX_ONNX,),
}
HSTU_INPUTS = (HSTU_INPUT, TIMESTAMPS, SEQ_OFFSETS, NUM_TARGETS)
ONNX_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.INT64: "int64"}
TABLE_DTYPE = "F32"
# sparse.ini feature kind -> (its ids' shape in the sparse slice, the rows of its looked-up vectors)
SPARSE_SHAPES = {"sequence": ((TOKENS,), TOKENS), "common": ((BAG,), BATCH), "token_bag": (TOKEN_BAGS, TOKENS)}


@dataclass(frozen=True)
class ExportManifest:
    """A validated export: its directory and parsed manifests."""

    root: Path
    graph: SliceGraph
    sparse: SparseManifest
    hstu_config: HSTUConfig

    def path(self, rel: str) -> Path:
        return self.root / rel


def check_export(export_dir: Union[str, Path]) -> List[Problem]:
    """Every problem found in the export's files and cross-references (empty when it is valid)."""
    return _inspect(Path(export_dir))[1]


def open_export(export_dir: Union[str, Path]) -> ExportManifest:
    """Validate and parse an export; raises ``ExportFormatError`` listing every problem."""
    manifest, problems = _inspect(Path(export_dir))
    if problems or manifest is None:
        raise ExportFormatError(problems)
    return manifest


def read_hstu_config(export_dir: Union[str, Path]) -> HSTUConfig:
    """``hstu/config.json`` -> HSTUConfig (after the MANIFEST check); raises ``ExportFormatError``
    naming the bad keys."""
    root = Path(export_dir)
    problems: List[Problem] = []
    read = _read_hstu_config(root, problems) if _verified(root, problems) else None
    if read is None:
        raise ExportFormatError(problems)
    return read[0]


def load_hstu(export_dir: Union[str, Path]) -> HSTU:
    """Rebuild the HSTU slice from ``hstu/config.json`` and ``hstu/model.safetensors`` only (eval
    mode, float32 compute whatever the stored dtype), after the MANIFEST check."""
    root = Path(export_dir)
    problems: List[Problem] = []
    read = _read_hstu_config(root, problems) if _verified(root, problems) else None
    if read is not None:
        _check_hstu_weights(root, *read, problems)
    if problems or read is None:
        raise ExportFormatError(problems)
    model = HSTU(read[0])
    model.load_state_dict(from_slice(load_file(str(root / HSTU_WEIGHTS)), read[0]), strict=True)
    return model.eval()


def _verified(root: Path, problems: List[Problem]) -> bool:
    """The export directory exists and its MANIFEST holds (problems added otherwise)."""
    if not root.is_dir():
        problems.append(Problem(str(root), "-", "export directory does not exist"))
        return False
    return check_manifest(root, problems)


def _inspect(root: Path) -> Tuple[Optional[ExportManifest], List[Problem]]:
    problems: List[Problem] = []
    if not _verified(root, problems):
        return None, problems
    graph = None
    parser = read_ini(root, SLICE_GRAPH, problems)
    if parser is not None:
        graph = SliceGraph.from_ini(parser, problems)
    if graph is not None:
        problems.extend(graph.check())
    sparse = _read_sparse(root, problems)
    if sparse is not None:
        problems.extend(read_id_maps(root, sparse)[1])
        check_popularity(root, sparse, problems)
    if sparse is not None and graph is not None:
        check_item_store(root, graph, sparse, problems)
    if sparse is not None:
        check_item_encoder(root, sparse, problems)
    read = _read_hstu_config(root, problems)
    hstu_config = None if read is None else read[0]
    if read is not None:
        _check_hstu_weights(root, *read, problems)
        check_empty_history(root, read[0].hidden_dim, problems)
    if graph is not None:
        slices = {s.name: s for s in graph.slices}
        for name, files in SLICE_FILES.items():
            if name in slices and slices[name].files != files:
                problems.append(Problem(SLICE_GRAPH, f"slice.{name}.files", f"expected {', '.join(files)}"))
        for name in (PREFIX, POSTFIX):
            if name in slices and slices[name].files == SLICE_FILES[name]:
                _check_onnx(root, slices[name], problems)
        if SPARSE in slices and sparse is not None:
            _check_sparse_slice(slices[SPARSE], sparse, problems)
        if HSTU_SLICE in slices and hstu_config is not None:
            _check_hstu_slice(slices[HSTU_SLICE], hstu_config, problems)
    if problems or graph is None or sparse is None or hstu_config is None:
        return None, problems
    return ExportManifest(root, graph, sparse, hstu_config), problems


def _read_sparse(root: Path, problems: List[Problem]) -> Optional[SparseManifest]:
    parser = read_ini(root, SPARSE_INI, problems)
    if parser is None:
        return None
    manifest = SparseManifest.from_ini(parser, problems)
    if manifest is None:
        return None
    start = len(problems)
    for table in manifest.tables.values():
        rel = f"{SPARSE_DIR}/{table.file}"
        if inside(root, table.file, SPARSE_INI, f"table.{table.name}.file", problems, base=SPARSE_DIR) is None:
            continue
        shapes = _safetensors_shapes(root, rel, TABLE_DTYPE, problems)
        if shapes is None:
            continue
        if TABLE_TENSOR not in shapes:
            problems.append(Problem(rel, TABLE_TENSOR, f"tensor is missing (table {table.name})"))
        elif shapes[TABLE_TENSOR] != (table.rows, table.dim):
            problems.append(
                Problem(
                    rel,
                    TABLE_TENSOR,
                    f"shape {list(shapes[TABLE_TENSOR])}, sparse.ini says "
                    f"[{table.rows}, {table.dim}] (table.{table.name}.rows/dim)",
                )
            )
        else:
            _check_finite(rel, list(load_file(str(root / rel)).items()), problems)
    for feature in manifest.features.values():
        if feature.id_mapping is None:
            continue
        key = f"feature.{feature.name}.id_mapping"
        path = inside(root, feature.id_mapping, SPARSE_INI, key, problems, base=SPARSE_DIR)
        if path is not None and not path.is_file():
            problems.append(Problem(SPARSE_INI, key, f"file {feature.id_mapping} is missing"))
    return manifest if len(problems) == start else None


def _read_hstu_config(root: Path, problems: List[Problem]) -> Optional[Tuple[HSTUConfig, str]]:
    """-> (config, weight dtype) from ``hstu/config.json``; a format-1 export is named as such."""
    path = root / HSTU_CONFIG
    if not path.is_file():
        old = (root / "hstu" / "config.ini").is_file()
        problems.append(
            Problem(
                HSTU_CONFIG,
                "-",
                "file is missing"
                + (
                    " (this is a format-1 export with hstu/config.ini: re-export the run with this version of gr)"
                    if old
                    else ""
                ),
            )
        )
        return None
    try:
        values = json.loads(path.read_text(encoding="utf8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        problems.append(Problem(HSTU_CONFIG, "-", f"not valid JSON: {exc}"))
        return None
    return config_from_slice(values, HSTU_CONFIG, problems)


def _check_hstu_weights(root: Path, config: HSTUConfig, dtype: str, problems: List[Problem]) -> None:
    shapes = _safetensors_shapes(root, HSTU_WEIGHTS, SAFETENSORS_DTYPES[dtype], problems)
    if shapes is None:
        return
    start = len(problems)
    expected = slice_tensor_shapes(config)
    for name, shape in expected.items():
        if name not in shapes:
            problems.append(Problem(HSTU_WEIGHTS, name, f"tensor is missing (expected shape {list(shape)})"))
        elif shapes[name] != shape:
            problems.append(
                Problem(HSTU_WEIGHTS, name, f"shape {list(shapes[name])}, {HSTU_CONFIG} implies {list(shape)}")
            )
    for name in sorted(set(shapes) - set(expected)):
        problems.append(Problem(HSTU_WEIGHTS, name, f"unexpected tensor for this {HSTU_CONFIG}"))
    if len(problems) == start:
        _check_finite(HSTU_WEIGHTS, list(load_file(str(root / HSTU_WEIGHTS)).items()), problems)


def _safetensors_shapes(
    root: Path, rel: str, dtype: str, problems: List[Problem]
) -> Optional[Dict[str, Tuple[int, ...]]]:
    """{name: shape} of a safetensors file whose tensors must all be ``dtype`` (header only)."""
    path = root / rel
    if not path.is_file():
        problems.append(Problem(rel, "-", "file is missing"))
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for name in f.keys():
                tensor = f.get_slice(name)
                if tensor.get_dtype() != dtype:
                    problems.append(Problem(rel, name, f"dtype {tensor.get_dtype()}, expected {dtype}"))
                out[name] = tuple(tensor.get_shape())
            return out
    except (SafetensorError, OSError) as exc:
        problems.append(Problem(rel, "-", f"not a readable safetensors file (truncated or corrupt?): {exc}"))
        return None


def _check_finite(rel: str, named: List[Tuple[str, torch.Tensor]], problems: List[Problem]) -> None:
    """Each of a file's tensors ((name, tensor) pairs) holds finite values only."""
    for name in non_finite(named):
        problems.append(Problem(rel, name, "holds NaN or infinite values"))


def _check_onnx(root: Path, spec: SliceSpec, problems: List[Problem]) -> None:
    rel = spec.files[0] if spec.files else ""
    path = root / rel
    if not rel or not path.is_file():
        problems.append(Problem(rel or SLICE_GRAPH, "-", f"file is missing (slice {spec.name})"))
        return
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception as exc:  # onnx raises several unrelated types for corrupt files
        problems.append(Problem(rel, "-", f"not a valid ONNX model: {type(exc).__name__}: {exc}"))
        return
    _check_finite(
        rel, [(t.name, torch.from_numpy(numpy_helper.to_array(t).copy())) for t in model.graph.initializer], problems
    )
    initializers = {i.name for i in model.graph.initializer}
    for kind, declared, actual in (
        ("input", spec.inputs, [i for i in model.graph.input if i.name not in initializers]),
        ("output", spec.outputs, list(model.graph.output)),
    ):
        names = [t.name for t in declared]
        if [v.name for v in actual] != names:
            problems.append(
                Problem(
                    rel,
                    f"{kind}s",
                    f"ONNX {kind}s {[v.name for v in actual]}, slice_graph.ini slice.{spec.name}.{kind}s says {names}",
                )
            )
            continue
        for t, value in zip(declared, actual):
            tensor_type = value.type.tensor_type
            dtype = ONNX_DTYPES.get(tensor_type.elem_type, f"onnx type {tensor_type.elem_type}")
            shape = tuple(d.dim_param or d.dim_value for d in tensor_type.shape.dim)
            key = f"slice.{spec.name}.{kind}.{t.name}"
            if dtype != t.dtype:
                problems.append(Problem(rel, t.name, f"dtype {dtype}, {SLICE_GRAPH} {key}.dtype says {t.dtype}"))
            if shape != tuple(t.shape):
                problems.append(
                    Problem(rel, t.name, f"shape {list(shape)}, {SLICE_GRAPH} {key}.shape says {list(t.shape)}")
                )


def _check_sparse_slice(spec: SliceSpec, sparse: SparseManifest, problems: List[Problem]) -> None:
    """Output <f> of the sparse slice is the lookup of its input <f>: ids in, table rows out."""
    if [t.name for t in spec.inputs] != [t.name for t in spec.outputs]:
        problems.append(Problem(SLICE_GRAPH, f"slice.{SPARSE}.outputs", "expected the same names as its inputs"))
    for kind, tensors in (("input", spec.inputs), ("output", spec.outputs)):
        for t in tensors:
            key = f"slice.{SPARSE}.{kind}.{t.name}"
            feature = sparse.features.get(t.name)
            if feature is None:
                problems.append(Problem(SLICE_GRAPH, key, f"no [feature.{t.name}] in {SPARSE_INI}"))
                continue
            ids, rows = SPARSE_SHAPES.get(feature.kind, SPARSE_SHAPES["common"])
            expected: Tuple[str, Tuple[Any, ...]]
            if kind == "input":
                expected = ("int64", ids)
            else:
                expected = ("float32", (rows, sparse.feature_dim(t.name)))
            if (t.dtype, tuple(t.shape)) != expected:
                problems.append(
                    Problem(
                        SLICE_GRAPH,
                        key,
                        f"expected {expected[0]} {list(expected[1])} for "
                        f"{feature.kind} feature {t.name} (table {feature.table}), got "
                        f"{t.dtype} {list(t.shape)}",
                    )
                )


def _check_hstu_slice(spec: SliceSpec, config: HSTUConfig, problems: List[Problem]) -> None:
    names = [t.name for t in spec.inputs]
    if names != list(HSTU_INPUTS):
        problems.append(
            Problem(
                SLICE_GRAPH, f"slice.{HSTU_SLICE}.inputs", f"expected {', '.join(HSTU_INPUTS)}, got {', '.join(names)}"
            )
        )
    for kind, tensors, name, rows in (
        ("input", spec.inputs, HSTU_INPUT, TOKENS),
        ("output", spec.outputs, HSTU_OUTPUT, TARGETS),
    ):
        match = [t for t in tensors if t.name == name]
        key = f"slice.{HSTU_SLICE}.{kind}.{name}"
        if not match:
            problems.append(Problem(SLICE_GRAPH, key, "missing"))
        elif tuple(match[0].shape) != (rows, config.hidden_dim):
            problems.append(
                Problem(
                    SLICE_GRAPH,
                    f"{key}.shape",
                    f"{list(match[0].shape)}, {HSTU_CONFIG} hidden_dim implies {[rows, config.hidden_dim]}",
                )
            )
