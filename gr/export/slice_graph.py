"""``default/slice_graph.ini``: the slices of an export, their tensors and the edges between them.

INI layout::

    [graph]          order = sparse, prefix_dnn, hstu, postfix_dnn
    [request]        tensors = <request tensor names>
    [request.<t>]    dtype, shape[, candidates = optional]
    [slice.<s>]      engine, files, inputs, outputs
    [slice.<s>.input.<t>]   dtype, shape, source = request.<t> | <slice>.<output>[, repeat = per_target]
    [slice.<s>.output.<t>]  dtype, shape

``repeat = per_target`` feeds a ``[batch, ...]`` source to a ``[targets, ...]`` input, one
copy per candidate row of the request. ``candidates = optional`` marks a token feature of the
interaction itself (e.g. action type): candidate tokens, which have no interaction yet, may leave
it out and then take id 0 (the unknown id) or zeros, as in training.
"""

from __future__ import annotations

import configparser
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from gr.export.format import (
    BATCH,
    DTYPES,
    REPEAT_PER_TARGET,
    SLICE_ENGINES,
    SLICE_GRAPH,
    SLICE_ORDER,
    TARGETS,
    TOKENS,
    Problem,
    format_shape,
    parse_shape,
    split_list,
)

REQUEST = "request"
CANDIDATES_OPTIONAL = "optional"


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor: dtype ("float32" | "int64"), shape (ints fixed, strings symbolic), for
    a slice input the ``source`` ("request.<name>" or "<slice>.<output>") and ``repeat``, and for
    a request token feature ``candidates`` ("optional": candidates may leave it out)."""

    name: str
    dtype: str
    shape: Tuple[Any, ...]
    source: Optional[str] = None
    repeat: Optional[str] = None
    candidates: Optional[str] = None

    @property
    def input_source(self) -> str:
        """The ``source`` of a slice input, which always has one (``from_ini`` refuses an input without)."""
        if self.source is None:
            raise ValueError(f"tensor {self.name!r} has no source: not a slice input")
        return self.source


@dataclass(frozen=True)
class SliceSpec:
    name: str
    engine: str
    files: Tuple[str, ...]
    inputs: Tuple[TensorSpec, ...]
    outputs: Tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        return _by_name(self.inputs, name, f"slice {self.name!r} input")

    def output(self, name: str) -> TensorSpec:
        return _by_name(self.outputs, name, f"slice {self.name!r} output")


@dataclass(frozen=True)
class SliceGraph:
    request: Tuple[TensorSpec, ...]
    slices: Tuple[SliceSpec, ...]

    def slice(self, name: str) -> SliceSpec:
        return _by_name(self.slices, name, "slice")

    def request_tensor(self, name: str) -> TensorSpec:
        return _by_name(self.request, name, "request tensor")

    def to_sections(self) -> Dict[str, Dict[str, str]]:
        sections: Dict[str, Dict[str, str]] = {
            "graph": {"order": ", ".join(s.name for s in self.slices)},
            REQUEST: {"tensors": ", ".join(t.name for t in self.request)},
        }
        for t in self.request:
            sections[f"{REQUEST}.{t.name}"] = _tensor_values(t)
        for s in self.slices:
            sections[f"slice.{s.name}"] = {
                "engine": s.engine,
                "files": ", ".join(s.files),
                "inputs": ", ".join(t.name for t in s.inputs),
                "outputs": ", ".join(t.name for t in s.outputs),
            }
            for kind, tensors in (("input", s.inputs), ("output", s.outputs)):
                for t in tensors:
                    sections[f"slice.{s.name}.{kind}.{t.name}"] = _tensor_values(t)
        return sections

    @classmethod
    def from_ini(cls, parser: configparser.ConfigParser, problems: List[Problem]) -> Optional["SliceGraph"]:
        """Parse the graph; every missing or malformed key is added to ``problems``."""
        start = len(problems)
        if not parser.has_section("graph") or "order" not in parser["graph"]:
            problems.append(Problem(SLICE_GRAPH, "graph.order", "missing"))
            return None
        order = split_list(parser["graph"]["order"])
        declared = [s[len("slice.") :] for s in parser.sections() if s.startswith("slice.") and s.count(".") == 1]
        for name in sorted(set(declared) - set(order)):
            problems.append(Problem(SLICE_GRAPH, f"slice.{name}", "slice is not listed in graph.order"))
        request = tuple(_read_tensors(parser, REQUEST, "tensors", REQUEST, problems, with_source=False))
        slices = []
        for name in order:
            section = f"slice.{name}"
            if not parser.has_section(section):
                problems.append(Problem(SLICE_GRAPH, section, "slice listed in graph.order has no section"))
                continue
            values = parser[section]
            for key in ("engine", "files", "inputs", "outputs"):
                if key not in values:
                    problems.append(Problem(SLICE_GRAPH, f"{section}.{key}", "missing"))
            slices.append(
                SliceSpec(
                    name=name,
                    engine=values.get("engine", ""),
                    files=tuple(split_list(values.get("files", ""))),
                    inputs=tuple(_read_tensors(parser, section, "inputs", f"{section}.input", problems, True)),
                    outputs=tuple(_read_tensors(parser, section, "outputs", f"{section}.output", problems, False)),
                )
            )
        if len(problems) > start:
            return None
        return cls(request, tuple(slices))

    def check(self) -> List[Problem]:
        """Structure (the version-1 slices and engines) and edges: every source resolves to the
        request or an earlier slice's output with the same dtype and a compatible shape."""
        problems: List[Problem] = []
        names = [s.name for s in self.slices]
        if tuple(names) != SLICE_ORDER:
            problems.append(
                Problem(SLICE_GRAPH, "graph.order", f"expected {', '.join(SLICE_ORDER)}, got {', '.join(names)}")
            )
        available = {f"{REQUEST}.{t.name}": t for t in self.request}
        for s in self.slices:
            expected_engine = SLICE_ENGINES.get(s.name)
            if expected_engine is not None and s.engine != expected_engine:
                problems.append(
                    Problem(SLICE_GRAPH, f"slice.{s.name}.engine", f"expected {expected_engine!r}, got {s.engine!r}")
                )
            for t in s.inputs:
                key = f"slice.{s.name}.input.{t.name}.source"
                upstream = available.get(t.source or "")
                if upstream is None:
                    problems.append(
                        Problem(
                            SLICE_GRAPH,
                            key,
                            f"dangling edge: {t.source!r} is neither a request "
                            "tensor nor an output of an earlier slice",
                        )
                    )
                    continue
                problems.extend(_edge_problems(key, upstream, t))
            available.update({f"{s.name}.{t.name}": t for t in s.outputs})
        return problems


def _edge_problems(key: str, upstream: TensorSpec, dest: TensorSpec) -> List[Problem]:
    out = []
    if upstream.dtype != dest.dtype:
        out.append(Problem(SLICE_GRAPH, key, f"{dest.source} is {upstream.dtype}, the input expects {dest.dtype}"))
    shape = upstream.shape
    if dest.repeat == REPEAT_PER_TARGET:
        if not shape or shape[0] != BATCH:
            out.append(
                Problem(
                    SLICE_GRAPH, key, f"repeat = {REPEAT_PER_TARGET} needs a [{BATCH}, ...] source, got {list(shape)}"
                )
            )
        shape = (TARGETS, *shape[1:])
    elif dest.repeat is not None:
        out.append(Problem(SLICE_GRAPH, key.replace(".source", ".repeat"), f"unknown repeat {dest.repeat!r}"))
    if tuple(shape) != tuple(dest.shape):
        out.append(
            Problem(SLICE_GRAPH, key, f"{dest.source} has shape {list(shape)}, the input expects {list(dest.shape)}")
        )
    return out


def _tensor_values(t: TensorSpec) -> Dict[str, str]:
    values = {"dtype": t.dtype, "shape": format_shape(t.shape)}
    if t.source is not None:
        values["source"] = t.source
    if t.repeat is not None:
        values["repeat"] = t.repeat
    if t.candidates is not None:
        values["candidates"] = t.candidates
    return values


def _read_tensors(
    parser: configparser.ConfigParser, section: str, key: str, prefix: str, problems: List[Problem], with_source: bool
) -> List[TensorSpec]:
    if not parser.has_section(section):
        problems.append(Problem(SLICE_GRAPH, section, "section is missing"))
        return []
    tensors = []
    for name in split_list(parser[section].get(key, "")):
        tsec = f"{prefix}.{name}"
        if not parser.has_section(tsec):
            problems.append(Problem(SLICE_GRAPH, tsec, f"tensor listed in {section}.{key} has no section"))
            continue
        values = parser[tsec]
        dtype = values.get("dtype")
        if dtype not in DTYPES:
            problems.append(Problem(SLICE_GRAPH, f"{tsec}.dtype", f"expected one of {list(DTYPES)}, got {dtype!r}"))
        if "shape" not in values:
            problems.append(Problem(SLICE_GRAPH, f"{tsec}.shape", "missing"))
        if with_source and "source" not in values:
            problems.append(Problem(SLICE_GRAPH, f"{tsec}.source", "missing: which upstream output feeds this input"))
        candidates = values.get("candidates")
        token_feature = not with_source and parse_shape(values.get("shape", ""))[:1] == (TOKENS,)
        if candidates not in (None, CANDIDATES_OPTIONAL) or (candidates and not token_feature):
            problems.append(
                Problem(
                    SLICE_GRAPH,
                    f"{tsec}.candidates",
                    f"expected {CANDIDATES_OPTIONAL!r} on a request token feature (shape [{TOKENS}, ...]), "
                    f"got {candidates!r}",
                )
            )
        tensors.append(
            TensorSpec(
                name,
                dtype or "",
                parse_shape(values.get("shape", "")),
                values.get("source"),
                values.get("repeat"),
                candidates,
            )
        )
    return tensors


def _by_name(items: Tuple[Any, ...], name: str, what: str) -> Any:
    for item in items:
        if item.name == name:
            return item
    raise KeyError(f"{what} {name!r} not found; have {[i.name for i in items]}")
