"""Sparse id features: embedding tables (TorchRec or torch), sharding, id dedup, row optimizers.

Public names load lazily, so reading a table's config (``gr.sparse.config``) does not import torch.
"""

from typing import TYPE_CHECKING

from gr.utils.lazy import lazy_getattr

if TYPE_CHECKING:
    from gr.sparse.config import TableConfig as TableConfig
    from gr.sparse.optimizer import EmbeddingOptimizerConfig as EmbeddingOptimizerConfig
    from gr.sparse.tables import SparseEmbeddings as SparseEmbeddings
    from gr.sparse.tables import storage_dim as storage_dim

_EXPORTS = {
    "EmbeddingOptimizerConfig": "gr.sparse.optimizer",
    "SparseEmbeddings": "gr.sparse.tables",
    "TableConfig": "gr.sparse.config",
    "storage_dim": "gr.sparse.tables",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
