"""An export's item catalogue: the token input of every item and the item index searched by
``recommend`` and generation, and the ``GenerativeModel`` view of an export.

An item's token is the PrefixDNN output of its table row and its features (computed once for the
whole catalogue: the PrefixDNN is token-wise): the export's stored item features
(``gr.export.item_store``), and id 0 / zeros for the features of the interaction, as a candidate
has them. An export that reads token features it neither stores nor may leave out has no item
tokens: its items cannot become tokens (no generation). The query is the postfix_dnn output ``query``; items are
scored against the L2-normalised rows of the item table, as the retrieval head defines
(``RetrievalHead.item_embedding``): a score is the cosine that training divides by its
temperature and evaluation ranks by.

The item tokens live on the model's device (they feed the HSTU engine); the item index stays
in host memory, next to its inputs: the query comes out of the postfix_dnn ONNX slice as numpy
and the generation loop keeps its exclusion masks on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gr.export.format import POSTFIX_QUERY, TIMESTAMPS
from gr.export.item_store import ITEM_FEATURE
from gr.hstu.cache import CachedHSTU
from gr.index.exact import ExactIndex, ItemIndex
from gr.index.hnsw import HNSWIndex
from gr.serving.errors import RequestError
from gr.serving.onnx_slice import OnnxSlice
from gr.serving.options import INDEXES
from gr.serving.request import RequestSchema
from gr.serving.sparse_store import PatchedTable, SparseStore

QUERY = POSTFIX_QUERY
INDEX_CLASSES = dict(zip(INDEXES, (ExactIndex, HNSWIndex), strict=True))  # --index NAME -> its class


class CatalogueModel(Protocol):
    """What a catalogue reads of a loaded export (``gr.serving.model.ServingModel``, which builds its
    catalogue from itself): its schema, sparse store, HSTU engine, postfix slice and two passes."""

    schema: RequestSchema
    sparse: SparseStore
    engine: CachedHSTU
    postfix: OnnxSlice

    def embed_tokens(self, tokens: Dict[str, np.ndarray]) -> Tensor: ...

    def heads(self, hidden: Tensor, common: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]: ...


class Catalogue:
    """One export's items: token inputs of every item [M, D], item vectors [M, d] and their index.

    item_feature: the token id feature that holds the item (its table is the catalogue)
    index: the ``ItemIndex`` over the item vectors: "exact" (default) or "hnsw" (approximate, FAISS)
    """

    def __init__(self, model: CatalogueModel, item_feature: str = ITEM_FEATURE, index: str = "exact") -> None:
        if index not in INDEXES:
            raise ValueError(f"Catalogue.index: expected one of {list(INDEXES)}, got {index!r}")
        schema = model.schema
        if item_feature not in schema.token_ids:
            raise RequestError(
                f"model: the export has no token feature {item_feature!r} (token features: {list(schema.token_ids)})"
            )
        if QUERY not in model.postfix.output_names:
            raise RequestError(
                f"model: the postfix_dnn has no {QUERY!r} output (a retrieval head is needed); "
                f"outputs: {model.postfix.output_names}"
            )
        rows = model.sparse.rows(item_feature)
        self.model = model
        self.item_feature = item_feature
        features = [f for f in schema.token_features if f != item_feature]
        # whether a history token is more than its item: then the history's own features are its input
        self.item_only = not features
        # Token features an item has no value for (neither stored nor of the interaction): items
        # cannot become tokens (generation); ranking and recommending work.
        self.other_token_features = [f for f in features if f not in (*schema.stored, *schema.candidate_optional)]
        self.tokens: Optional[Tensor] = None  # [M, D]
        if not self.other_token_features:
            ids = np.arange(rows, dtype=np.int64)
            columns = {item_feature: ids, TIMESTAMPS: np.zeros(rows, dtype=np.int64)}
            for name in schema.candidate_optional:  # the unknown id / zeros, as a candidate's
                columns[name] = schema.unknown(name, rows)
            for name in schema.stored:
                columns[name] = model.sparse.stored(name, ids)
            self.tokens = model.embed_tokens(columns)
        table = model.sparse.tables[model.sparse.features[item_feature].table]
        weight = table.array() if isinstance(table, PatchedTable) else table
        self.vectors = F.normalize(torch.from_numpy(weight), dim=-1)  # [M, d]
        self.index: ItemIndex = INDEX_CLASSES[index](self.vectors)


@dataclass
class ServingGenerativeModel:
    """``GenerativeModel`` over a loaded export for one request's common features."""

    catalogue: Catalogue
    common: Dict[str, np.ndarray]

    @property
    def engine(self) -> CachedHSTU:
        return self.catalogue.model.engine

    def item_tokens(self, items: Tensor) -> Tensor:
        """items: [n] int64 (any device) -> [n, D] float on the model's device."""
        tokens = self.catalogue.tokens
        if tokens is None:
            raise RequestError(
                f"model: generation appends catalogue items as tokens, and the export reads token features "
                f"{self.catalogue.other_token_features} that its items have no value for (the export's "
                "item store holds none of them; rank and recommend work)"
            )
        return tokens[items.to(tokens.device)]

    def queries(self, hidden: Tensor) -> Tensor:
        """hidden: [n, D] float -> [n, d] float (L2-normalised by the head)."""
        return torch.from_numpy(self.catalogue.model.heads(hidden, self.common)[QUERY])
