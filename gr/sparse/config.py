"""The sparse layer's configuration, without torch (``gr train --help`` lists it): ``TableConfig``, one
embedding table, and the choices of ``sparse.backend`` and ``sparse.placement``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from gr.sparse.optimizer import EmbeddingOptimizerConfig
from gr.utils.config_checks import NAMES, int_at_least, known_keys, one_of, optional, require

# sparse.backend -> the module that builds its collections (``sequence_collection``,
# ``pooled_collection``) and names its KeyedJaggedTensor class (``gr.sparse.tables.backend_module``).
BACKEND_MODULES = {"torchrec": "gr.sparse.torchrec_tables", "torch": "gr.sparse.torch_tables"}
SPARSE_BACKENDS = tuple(BACKEND_MODULES)
# sparse.placement: where the tables live (``gr.sparse.sharding``).
PLACEMENTS = ("device", "host")
TABLE_KINDS = ("sequence", "common", "token_bag")
POOLINGS = ("sum", "mean")
# Ways the TorchRec planner may split a table across ranks (fused kernels only).
SHARDING_TYPES = ("row_wise", "table_wise", "column_wise", "table_row_wise")


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    kind: "sequence" -> one id per token, looked up with ``EmbeddingCollection``
          (jagged, one vector per token); "common" -> per-request ids pooled with
          ``EmbeddingBagCollection`` (one vector per sequence); "token_bag" -> a bag of ids
          per token (a list-valued token feature, ``GRInput.token_lists``) pooled with an
          ``EmbeddingBagCollection`` of its own (one vector per token).
    pooling: "sum" or "mean" of a bag's rows (common and token_bag tables).
    features: the feature names (KJT keys) that read this table.
    sharding: how ``DistributedModelParallel`` splits the table over ranks; None ->
        "row_wise" for sequence tables, "table_wise" for pooled ones (TorchRec has no
        row-wise pooled kernels on CPU).
    optimizer: the table's embedding optimizer (fused in backward); None -> the
        trainer's default.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    features: Tuple[str, ...]
    kind: str = "sequence"
    pooling: str = "sum"
    init_std: Optional[float] = None  # None -> uniform in ±sqrt(1 / num_embeddings), TorchRec's default
    extra: Dict[str, object] = field(default_factory=dict)
    sharding: Optional[str] = None
    optimizer: Optional[EmbeddingOptimizerConfig] = None

    def __post_init__(self) -> None:
        from torch import nn  # the names a table may not take; torch only once a table is built

        where = f"table {self.name!r}"
        if not self.name.isidentifier() or hasattr(nn.ModuleDict, self.name):
            raise ValueError(f"{where}: a table name must be an identifier other than {dir(nn.ModuleDict)!r}")
        if int(self.num_embeddings) < 1 or int(self.embedding_dim) < 1:
            raise ValueError(f"{where}: num_embeddings and embedding_dim must be >= 1")
        if not self.features:
            raise ValueError(f"{where}.features: expected at least one feature name")
        require(f"{where}.kind", self.kind, one_of(*TABLE_KINDS))
        require(f"{where}.pooling", self.pooling, one_of(*POOLINGS))
        if self.sharding is None:
            object.__setattr__(self, "sharding", "row_wise" if self.kind == "sequence" else "table_wise")
        require(f"{where}.sharding", self.sharding, one_of(*SHARDING_TYPES))
        if self.optimizer is not None and not isinstance(self.optimizer, EmbeddingOptimizerConfig):
            raise ValueError(f"{where}.optimizer: expected an EmbeddingOptimizerConfig, got {self.optimizer!r}")
        object.__setattr__(self, "features", tuple(self.features))

    @classmethod
    def from_dict(
        cls, values: Mapping[str, Any], where: str, cardinalities: Optional[Mapping[str, int]] = None
    ) -> "TableConfig":
        """Build from a config mapping. ``num_embeddings`` may be left out (or null): it is then
        the largest cardinality in ``cardinalities`` among the table's features (ids from the
        data), or 1 when no cardinalities are given (validating the rest before data is read)."""
        values = known_keys(cls, values, where, ignore=("extra",))
        missing = [k for k in ("name", "embedding_dim", "features") if k not in values]
        if missing:
            raise ValueError(f"{where}: missing required key(s) {missing}")
        features = values["features"]
        require(f"{where}.features", features, NAMES)
        for key in ("num_embeddings", "embedding_dim"):
            require(f"{where}.{key}", values.get(key), optional(int_at_least(1)))
        if values.get("num_embeddings") is None:
            known_rows = [cardinalities[f] for f in features if cardinalities and f in cardinalities]
            if cardinalities is not None and not known_rows:
                raise ValueError(
                    f"{where}.num_embeddings: not given, and the data has no cardinality for {list(features)} "
                    f"(it knows {sorted(cardinalities)})"
                )
            values["num_embeddings"] = max(known_rows, default=1)
        if values.get("optimizer") is not None:
            values["optimizer"] = EmbeddingOptimizerConfig.from_dict(values["optimizer"], f"{where}.optimizer")
        try:
            return cls(**values)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from error

    def to_dict(self) -> Dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out["features"] = list(self.features)
        out["optimizer"] = None if self.optimizer is None else self.optimizer.to_dict()
        return out
