"""Item indexes: maximum-inner-product search over the catalogue with per-query exclusions, behind one
protocol (``ItemIndex``). Exact search, an inverted file (IVF) and FAISS HNSW (optional ``faiss-cpu``);
retrieval serving (``gr.serving.catalogue``) and generation both search through them. Imports only torch
(and faiss, when an HNSW index is built)."""

from gr.index.exact import ExactIndex, Exclusions, ItemIndex, ItemMatrix, exclusion_mask, top_items
from gr.index.hnsw import HNSWIndex
from gr.index.ivf import IVFIndex

__all__ = [
    "ExactIndex",
    "Exclusions",
    "HNSWIndex",
    "IVFIndex",
    "ItemIndex",
    "ItemMatrix",
    "exclusion_mask",
    "top_items",
]
