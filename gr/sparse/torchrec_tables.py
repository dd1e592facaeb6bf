"""The TorchRec backend's tables: EmbeddingCollection / EmbeddingBagCollection, the modules
DistributedModelParallel shards (``gr.sparse.sharding``)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.modules.embedding_configs import PoolingType

from gr.sparse.tables import TableConfig, storage_dim

__all__ = ["KeyedJaggedTensor", "pooled_collection", "sequence_collection"]

POOLING_TYPES = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}


def sequence_collection(tables: Sequence[TableConfig], device: Optional[str]) -> EmbeddingCollection:
    """One vector per id, for sequence tables of one embedding dim."""
    return EmbeddingCollection(tables=[EmbeddingConfig(**_table_arguments(t)) for t in tables], device=device)


def pooled_collection(tables: Sequence[TableConfig], device: Optional[str]) -> EmbeddingBagCollection:
    """Ids pooled per sample (each table's ``pooling``), for common tables."""
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(**_table_arguments(t), pooling=POOLING_TYPES[t.pooling]) for t in tables],
        device=device,
    )


def _table_arguments(table: TableConfig) -> Dict[str, Any]:
    """TorchRec table config arguments: rows stored ``storage_dim`` wide."""
    std = table.init_std
    return {
        "name": table.name,
        "num_embeddings": table.num_embeddings,
        "embedding_dim": storage_dim(table.embedding_dim),
        "feature_names": list(table.features),
        "init_fn": None if std is None else (lambda weight: nn.init.normal_(weight, std=std)),
    }
