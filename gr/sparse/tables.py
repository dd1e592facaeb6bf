"""Sparse id features: TorchRec embedding tables built from the config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from torch import Tensor, nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

TABLE_KINDS = ("sequence", "common")
POOLINGS = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    kind: "sequence" -> one id per token, looked up with ``EmbeddingCollection``
          (jagged, one vector per token); "common" -> per-request ids pooled with
          ``EmbeddingBagCollection`` (one vector per sequence).
    features: the feature names (KJT keys) that read this table.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    features: Tuple[str, ...]
    kind: str = "sequence"
    pooling: str = "sum"
    init_std: Optional[float] = None  # None -> TorchRec's default uniform init
    extra: Dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"table {self.name!r}"
        if not self.name.isidentifier() or hasattr(nn.ModuleDict, self.name):
            raise ValueError(f"{where}: a table name must be an identifier other than {dir(nn.ModuleDict)!r}")
        if int(self.num_embeddings) < 1 or int(self.embedding_dim) < 1:
            raise ValueError(f"{where}: num_embeddings and embedding_dim must be >= 1")
        if not self.features:
            raise ValueError(f"{where}.features: expected at least one feature name")
        if self.kind not in TABLE_KINDS:
            raise ValueError(f"{where}.kind: expected one of {list(TABLE_KINDS)}, got {self.kind!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"{where}.pooling: expected one of {list(POOLINGS)}, got {self.pooling!r}")
        object.__setattr__(self, "features", tuple(self.features))


class SparseEmbeddings(nn.Module):
    """Looks up sequence ids per token and common ids per request.

    ``sequence`` (EmbeddingCollection) and ``common`` (EmbeddingBagCollection) are the
    modules DistributedModelParallel shards.
    """

    def __init__(self, tables: Sequence[TableConfig], device: Optional[str] = None) -> None:
        super().__init__()
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"tables: duplicate table names in {names}")
        features = [f for t in tables for f in t.features]
        if len(set(features)) != len(features):
            raise ValueError(f"tables: a feature is mapped to two tables: {features}")
        self.tables = {t.name: t for t in tables}
        self.feature_to_table = {f: t for t in tables for f in t.features}
        seq = [t for t in tables if t.kind == "sequence"]
        common = [t for t in tables if t.kind == "common"]
        # TorchRec wants one embedding dim per EmbeddingCollection: one collection per dim.
        self.sequence = nn.ModuleDict(
            {
                f"dim{dim}": EmbeddingCollection(
                    tables=[
                        EmbeddingConfig(
                            name=t.name,
                            num_embeddings=t.num_embeddings,
                            embedding_dim=t.embedding_dim,
                            feature_names=list(t.features),
                            init_fn=_init_fn(t),
                        )
                        for t in seq
                        if t.embedding_dim == dim
                    ],
                    device=device,
                )
                for dim in sorted({t.embedding_dim for t in seq})
            }
        )
        self.common = (
            EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name=t.name,
                        num_embeddings=t.num_embeddings,
                        embedding_dim=t.embedding_dim,
                        feature_names=list(t.features),
                        pooling=POOLINGS[t.pooling],
                        init_fn=_init_fn(t),
                    )
                    for t in common
                ],
                device=device,
            )
            if common
            else None
        )

    def feature_dim(self, feature: str) -> int:
        return self.feature_to_table[feature].embedding_dim

    def forward(
        self, sequence_ids: Optional[KeyedJaggedTensor], common_ids: Optional[KeyedJaggedTensor]
    ) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
        """sequence_ids: KJT, stride B, one id per token -> {feature: [T_f, d]};
        common_ids: KJT, stride B -> {feature: [B, d]} (pooled)."""
        seq_out: Dict[str, Tensor] = {}
        common_out: Dict[str, Tensor] = {}
        if sequence_ids is not None:
            unknown = [k for k in sequence_ids.keys() if self.feature_to_table.get(k, None) is None
                       or self.feature_to_table[k].kind != "sequence"]
            if unknown:
                raise ValueError(f"sequence ids: features {unknown} have no table of kind 'sequence'")
            jagged = sequence_ids.to_dict()
            for name, collection in self.sequence.items():
                keys = [k for k in sequence_ids.keys() if f"dim{self.feature_dim(k)}" == name]
                if keys:
                    group = KeyedJaggedTensor.from_jt_dict({k: jagged[k] for k in keys})
                    seq_out.update({k: jt.values() for k, jt in collection(group).items()})
        if common_ids is not None:
            if self.common is None:
                raise ValueError(f"common ids {common_ids.keys()} given but no table has kind 'common'")
            common_out = self.common(common_ids).to_dict()
        return seq_out, common_out


def _init_fn(table: TableConfig):
    if table.init_std is None:
        return None
    std = table.init_std
    return lambda weight: nn.init.normal_(weight, std=std)
