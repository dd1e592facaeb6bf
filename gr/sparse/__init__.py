from gr.sparse.optimizer import EmbeddingOptimizerConfig
from gr.sparse.tables import SparseEmbeddings, TableConfig, storage_dim

__all__ = ["EmbeddingOptimizerConfig", "SparseEmbeddings", "TableConfig", "storage_dim"]
