"""``sparse/sparse.ini``: embedding tables and which feature reads which table.

INI layout::

    [table.<name>]    file = <name>.safetensors, rows, dim
    [feature.<name>]  table, kind = sequence | common | token_bag, pooling = none | sum | mean,
                      id_mapping = id_maps/<file> (optional: raw id -> row mapping)

A ``sequence`` feature gives one row per token; a ``common`` feature pools the rows
of a request's ids (its bag) with ``pooling``; a ``token_bag`` feature (list-valued) pools the
rows of each token's bag with ``pooling`` (an empty bag: zeros).
"""

from __future__ import annotations

import configparser
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from gr.export.format import SPARSE_INI, Problem, write_ini

FEATURE_KINDS = ("sequence", "common", "token_bag")
POOLINGS = {"sequence": ("none",), "common": ("sum", "mean"), "token_bag": ("sum", "mean")}
TOKEN_KINDS = ("sequence", "token_bag")  # the kinds of token features (one vector per token)


@dataclass(frozen=True)
class TableEntry:
    name: str
    file: str  # relative to sparse/
    rows: int
    dim: int


@dataclass(frozen=True)
class FeatureEntry:
    name: str
    table: str
    kind: str
    pooling: str
    id_mapping: Optional[str] = None  # relative to sparse/


@dataclass(frozen=True)
class SparseManifest:
    tables: Dict[str, TableEntry]
    features: Dict[str, FeatureEntry]

    def feature_dim(self, feature: str) -> int:
        return self.tables[self.features[feature].table].dim

    def write(self, root: Path) -> None:
        """Write ``root/sparse/sparse.ini``."""
        write_ini(root / SPARSE_INI, self.to_sections(), header="gr sparse tables: one safetensors file per table")

    def to_sections(self) -> Dict[str, Dict[str, str]]:
        sections: Dict[str, Dict[str, str]] = {}
        for t in self.tables.values():
            sections[f"table.{t.name}"] = {"file": t.file, "rows": str(t.rows), "dim": str(t.dim)}
        for f in self.features.values():
            values = {"table": f.table, "kind": f.kind, "pooling": f.pooling}
            if f.id_mapping is not None:
                values["id_mapping"] = f.id_mapping
            sections[f"feature.{f.name}"] = values
        return sections

    @classmethod
    def from_ini(cls, parser: configparser.ConfigParser, problems: List[Problem]) -> Optional["SparseManifest"]:
        """Parse tables and features; each missing or malformed key is added to ``problems``."""
        start = len(problems)
        tables: Dict[str, TableEntry] = {}
        features: Dict[str, FeatureEntry] = {}
        for section in parser.sections():
            values = parser[section]
            if section.startswith("table."):
                name = section[len("table.") :]
                rows = _positive_int(values, section, "rows", problems)
                dim = _positive_int(values, section, "dim", problems)
                if "file" not in values:
                    problems.append(Problem(SPARSE_INI, f"{section}.file", "missing"))
                tables[name] = TableEntry(name, values.get("file", ""), rows or 0, dim or 0)
            elif section.startswith("feature."):
                name = section[len("feature.") :]
                kind = values.get("kind")
                if kind not in FEATURE_KINDS:
                    problems.append(
                        Problem(SPARSE_INI, f"{section}.kind", f"expected one of {list(FEATURE_KINDS)}, got {kind!r}")
                    )
                elif values.get("pooling") not in POOLINGS[kind]:
                    problems.append(
                        Problem(
                            SPARSE_INI,
                            f"{section}.pooling",
                            f"expected one of {list(POOLINGS[kind])} for kind {kind}, got {values.get('pooling')!r}",
                        )
                    )
                features[name] = FeatureEntry(
                    name, values.get("table", ""), kind or "", values.get("pooling", ""), values.get("id_mapping")
                )
            elif section != "format":
                problems.append(
                    Problem(SPARSE_INI, section, "unknown section; expected table.<name> or feature.<name>")
                )
        for f in features.values():
            if f.table not in tables:
                problems.append(Problem(SPARSE_INI, f"feature.{f.name}.table", f"no [table.{f.table}] section"))
        if len(problems) > start:
            return None
        return cls(tables, features)


def _positive_int(values: configparser.SectionProxy, section: str, key: str, problems: List[Problem]) -> Optional[int]:
    text = values.get(key)
    if text is None or not text.strip().isdigit() or int(text) < 1:
        problems.append(Problem(SPARSE_INI, f"{section}.{key}", f"expected a positive integer, got {text!r}"))
        return None
    return int(text)
