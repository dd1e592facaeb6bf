"""A custom gr project on MovieLens-100K: its own GRModel subclass, PrefixDNN and PostfixDNN.

* ``GenreEncoder`` (PrefixDNN): each token is its item embedding plus the mean of its genres'
  vectors (a learned projection of the 19-dim multi-hot ``item_genres``).
* ``DemographicQueryHead`` (PostfixDNN): the retrieval query is the HSTU output shifted by a
  projection of the user's age, gender and occupation embeddings (per-request common features),
  L2-normalised; items are scored by their normalised item-table rows, as in ``RetrievalHead``.
* ``GenreModel`` (GRModel): while training, ``split_input`` hides the genres of a random share
  of tokens (genre dropout), so the model also learns items whose genres it is not told; in
  evaluation, export and serving every token keeps its genres.

Named in ``config.yaml`` by import path (``examples.custom_project.model.GenreModel``), which
resolves from the repository root (``train.py`` and ``gr`` both put it on the import path).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gr import GRInput, GRModel, PostfixDNN, PrefixDNN

GENRES = "item_genres"
DEMOGRAPHICS = ("user_age", "user_gender", "user_occupation")


class GenreEncoder(PrefixDNN):
    """features: item_id [T, d_item] embedded, item_genres [T, G] multi-hot -> [T, hidden_dim]."""

    feature_names = ("item_id", GENRES)

    def __init__(self, hidden_dim: int, feature_dims: Mapping[str, int], genre_dim: int = 16) -> None:
        super().__init__()
        item_dim = feature_dims["item_id"]
        self.genres = nn.Linear(feature_dims[GENRES], genre_dim, bias=False)  # one vector per genre
        self.item = nn.Identity() if item_dim == hidden_dim else nn.Linear(item_dim, hidden_dim)
        self.out = nn.Linear(genre_dim, hidden_dim)
        nn.init.zeros_(self.out.weight)  # starts as the plain item embedding
        nn.init.zeros_(self.out.bias)

    def forward(self, features: Dict[str, Tensor]) -> Tensor:
        multi_hot = features[GENRES]
        genre_mean = self.genres(multi_hot) / multi_hot.sum(-1, keepdim=True).clamp_min(1.0)
        return self.item(features["item_id"]) + self.out(genre_mean)


class DemographicQueryHead(PostfixDNN):
    """hidden [N, D] + the user's demographics [N, d_f] each -> {"query": [N, embedding_dim]}, unit norm."""

    common_feature_names = DEMOGRAPHICS
    output_names = ("query",)

    def __init__(self, hidden_dim: int, embedding_dim: int, common_dims: Mapping[str, int]) -> None:
        super().__init__()
        user_dim = sum(common_dims[name] for name in DEMOGRAPHICS)
        self.hidden = nn.Identity() if hidden_dim == embedding_dim else nn.Linear(hidden_dim, embedding_dim)
        self.user = nn.Sequential(
            nn.Linear(user_dim, embedding_dim), nn.Tanh(), nn.Linear(embedding_dim, embedding_dim)
        )
        nn.init.zeros_(self.user[-1].weight)  # starts as the HSTU paper's query (the normalised output)
        nn.init.zeros_(self.user[-1].bias)

    def forward(self, hidden: Tensor, common: Dict[str, Tensor]) -> Dict[str, Tensor]:
        user = torch.cat([common[name] for name in DEMOGRAPHICS], dim=-1)
        return {"query": F.normalize(self.hidden(hidden) + self.user(user), dim=-1)}

    @staticmethod
    def item_embedding(item_rows: Tensor) -> Tensor:
        """item_rows [M, d] -> [M, d], unit norm: what training, evaluation and serving score."""
        return F.normalize(item_rows, dim=-1)


class GenreModel(GRModel):
    """GRModel whose training batches hide the genres of ``genre_dropout`` of their tokens."""

    genre_dropout = 0.2

    def split_input(self, batch: GRInput) -> GRInput:
        inputs = super().split_input(batch)
        genres = inputs.token_dense.get(GENRES)
        if not self.training or genres is None or self.genre_dropout == 0:
            return inputs
        keep = torch.rand(genres.shape[0], 1, device=genres.device) >= self.genre_dropout  # [T, 1]
        return dataclasses.replace(inputs, token_dense={**inputs.token_dense, GENRES: genres * keep})
