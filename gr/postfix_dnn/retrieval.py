"""A ready PostfixDNN for retrieval: an L2-normalised query embedding per row."""

from __future__ import annotations

from typing import Dict, Sequence

import torch.nn.functional as F
from torch import Tensor

from gr.postfix_dnn.base import PostfixDNN
from gr.prefix_dnn.mlp_encoder import mlp


class RetrievalHead(PostfixDNN):
    """hidden [N, D] -> {"query": [N, embedding_dim]}, unit L2 norm.

    Scores against items are ``query . item_embedding(item table row)``; with no
    ``mlp_dims`` and ``embedding_dim == D`` the head is a plain normalisation
    (the HSTU paper's retrieval setting).
    """

    output_names = ("query",)

    def __init__(self, hidden_dim: int, embedding_dim: int, mlp_dims: Sequence[int] = ()):
        super().__init__()
        identity = not mlp_dims and embedding_dim == hidden_dim
        self.mlp = mlp(hidden_dim, [] if identity else [*mlp_dims, embedding_dim])

    def forward(self, hidden: Tensor, common: Dict[str, Tensor]) -> Dict[str, Tensor]:
        return {"query": F.normalize(self.mlp(hidden), dim=-1)}

    @staticmethod
    def item_embedding(item_rows: Tensor) -> Tensor:
        """Item-side embedding scored against queries: item_rows [M, d] -> [M, d], unit norm.

        Training (sampled softmax), evaluation and serving all score items this way.
        """
        return F.normalize(item_rows, dim=-1)
