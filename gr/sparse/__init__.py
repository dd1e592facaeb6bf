from gr.sparse.tables import SparseEmbeddings, TableConfig

__all__ = ["SparseEmbeddings", "TableConfig"]
