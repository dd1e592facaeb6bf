"""Side features aligned with dense user/item ids, and the FeatureSpec a model is built from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from gr.data.config import ITEM_ID as ITEM_ID  # defined with the config, which reads it without numpy
from gr.data.interactions import SideTable
from gr.data.mappings import IdMap
from gr.jagged_rows import JaggedRows


@dataclass(frozen=True)
class FeatureSpec:
    """What the batches carry, with cardinalities (ids are dense, 0-based, < cardinality).

    sequence: {feature: cardinality}, one id per token (always has "item_id")
    common: {feature: cardinality}, a bag of ids per sequence (user attributes; one id each,
        or a list-valued feature's ids)
    token_lists: {feature: cardinality}, a bag of ids per token (a list-valued item or row
        feature, e.g. genres), pooled by its ``token_bag`` table
    token_dense: {name: dim}, [T, dim] float per token
    common_dense: {name: dim}, [B, dim] float per sequence
    event_features: the sequence / token_lists / token_dense features that come from the interaction row
        itself, not from the item: candidate tokens (which have no row) take id 0 / zeros, and
        a served request may leave them out of its candidates
    """

    sequence: Dict[str, int]
    common: Dict[str, int] = field(default_factory=dict)
    token_dense: Dict[str, int] = field(default_factory=dict)
    common_dense: Dict[str, int] = field(default_factory=dict)
    event_features: List[str] = field(default_factory=list)
    token_lists: Dict[str, int] = field(default_factory=dict)


@dataclass
class SideFeatures:
    """Side features looked up by dense id. Categorical values are dense ids with 0 = unknown.

    categorical: {feature: [num_ids] int64}
    dense: {feature: [num_ids, d] float32} (zeros when unknown)
    vocabularies: {feature: IdMap (offset 1)} raw value <-> dense id
    dense_columns: {feature: column names}
    lists: {feature: num_ids rows of dense ids} of a list-valued feature (an empty row when unknown)
    """

    categorical: Dict[str, np.ndarray] = field(default_factory=dict)
    dense: Dict[str, np.ndarray] = field(default_factory=dict)
    vocabularies: Dict[str, IdMap] = field(default_factory=dict)
    dense_columns: Dict[str, List[str]] = field(default_factory=dict)
    lists: Dict[str, JaggedRows] = field(default_factory=dict)

    @classmethod
    def align(
        cls, table: Optional[SideTable], ids: IdMap, base: Optional[Mapping[str, IdMap]] = None, extend: bool = True
    ) -> "SideFeatures":
        """Reorder ``table`` (rows keyed by raw id) to dense ids; ids the table lacks get 0/zeros.
        base: vocabularies by feature name (categorical and list features alike), a warm start's
        or a prepared dataset's: extended by the values they lack, or with ``extend=False`` (a
        trained model's, evaluated) kept as they are, a value they lack becoming the unknown id 0."""
        if table is None:
            return cls()
        dense_ids = ids.encode(table.keys, unknown=-1)
        known = dense_ids >= 0
        out = cls(dense_columns=dict(table.dense_columns))

        def vocabulary_of(name: str, values: np.ndarray) -> IdMap:
            if base and name in base:
                return base[name].extended(values, f"column {name!r}") if extend else base[name]
            return IdMap.of(values, offset=1)

        for name, values in table.categorical.items():
            vocabulary = vocabulary_of(name, values)
            column = np.zeros(ids.cardinality, dtype=np.int64)
            column[dense_ids[known]] = vocabulary.encode(values[known], unknown=0)
            out.categorical[name], out.vocabularies[name] = column, vocabulary
        for name, values in table.dense.items():
            matrix = np.zeros((ids.cardinality, values.shape[1]), dtype=np.float32)
            matrix[dense_ids[known]] = values[known]
            out.dense[name] = matrix
            out.dense_columns.setdefault(name, [f"{name}_{i}" for i in range(values.shape[1])])
        table_row = np.full(ids.cardinality, -1, dtype=np.int64)
        table_row[dense_ids[known]] = np.flatnonzero(known)
        for name, rows in table.lists.items():
            vocabulary = vocabulary_of(name, rows.values)
            out.lists[name] = rows.with_values(vocabulary.encode(rows.values, unknown=0)).take(table_row)
            out.vocabularies[name] = vocabulary
        return out

    def columns(self) -> Dict[str, np.ndarray | JaggedRows]:
        """{feature: its values by dense id}, categorical, dense and list-valued features alike."""
        return {**self.categorical, **self.dense, **self.lists}

    def take(self, index: np.ndarray) -> "SideFeatures":
        """The rows ``index`` ([M'] int64) of every feature, in that order (vocabularies shared)."""
        return SideFeatures(
            {name: column[index] for name, column in self.categorical.items()},
            {name: matrix[index] for name, matrix in self.dense.items()},
            self.vocabularies,
            self.dense_columns,
            {name: rows.take(index) for name, rows in self.lists.items()},
        )

    @classmethod
    def concat(cls, parts: Sequence["SideFeatures"]) -> "SideFeatures":
        """The rows of ``parts`` (the same features and vocabularies each) one after another."""
        first = parts[0]
        return cls(
            {name: np.concatenate([p.categorical[name] for p in parts]) for name in first.categorical},
            {name: np.concatenate([p.dense[name] for p in parts]) for name in first.dense},
            first.vocabularies,
            first.dense_columns,
            {
                name: JaggedRows.from_lengths(
                    np.concatenate([p.lists[name].lengths() for p in parts]),
                    np.concatenate([p.lists[name].values for p in parts]),
                )
                for name in first.lists
            },
        )

    def cardinalities(self) -> Dict[str, int]:
        """{feature: cardinality} of the single-valued categorical features."""
        return {name: self.vocabularies[name].cardinality for name in self.categorical}

    def list_cardinalities(self) -> Dict[str, int]:
        """{feature: cardinality} of the list-valued features."""
        return {name: self.vocabularies[name].cardinality for name in self.lists}

    def dims(self) -> Dict[str, int]:
        return {name: matrix.shape[1] for name, matrix in self.dense.items()}
