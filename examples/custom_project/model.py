"""A custom gr project on MovieLens-100K: its own GRModel subclass, PrefixDNN and PostfixDNN.

* ``GenreEncoder`` (PrefixDNN): each token is its item embedding plus the mean of its genres'
  vectors (the list-valued ``item_genres``, pooled by the config's ``token_bag`` table).
* ``DemographicQueryHead`` (PostfixDNN): the retrieval query is the HSTU output shifted by a
  projection of the user's feature embeddings (the per-request common features the config
  selects: age, gender and occupation), L2-normalised; items are scored by their normalised
  item-table rows, as in ``RetrievalHead``.
* ``GenreModel`` (GRModel): while training, ``split_input`` hides the genres of a random share
  of tokens (genre dropout), so the model also learns items whose genres it is not told; in
  evaluation, export and serving every token keeps its genres.

The modules read their feature names from the config (``kwargs``, and the ``feature_dims`` /
``common_dims`` the builder fills in), so another dataset's features plug in by config alone.
Named in ``config.yaml`` by import path (``examples.custom_project.model.GenreModel``), which
resolves from the repository root (``train.py`` and ``gr`` both put it on the import path).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gr import GRInput, GRModel, PostfixDNN, PrefixDNN
from gr.sparse.keyed_jagged import JaggedTensor, KeyedJaggedTensor


class GenreEncoder(PrefixDNN):
    """features: the item [T, d_item], its genres' pooled vector [T, d_genre] and, when
    ``year_feature`` is given, its release year's row [T, d_year] -> [T, hidden_dim].

    item_feature / genre_feature / year_feature: the token features read (a list-valued genre
    feature pooled by mean gives the mean of the genres' vectors; an item without genres gives
    zeros; ``year_feature`` None: no year read)."""

    def __init__(
        self,
        hidden_dim: int,
        feature_dims: Mapping[str, int],
        item_feature: str,
        genre_feature: str,
        year_feature: Optional[str] = None,
    ) -> None:
        super().__init__()
        side = (genre_feature,) if year_feature is None else (genre_feature, year_feature)
        self.feature_names = (item_feature, *side)
        self.item_feature, self.genre_feature, self.side_features = item_feature, genre_feature, side
        item_dim = feature_dims[item_feature]
        self.item = nn.Identity() if item_dim == hidden_dim else nn.Linear(item_dim, hidden_dim)
        self.out = nn.Linear(sum(feature_dims[f] for f in side), hidden_dim)
        nn.init.zeros_(self.out.weight)  # starts as the plain item embedding
        nn.init.zeros_(self.out.bias)

    def forward(self, features: Dict[str, Tensor]) -> Tensor:
        side = torch.cat([features[f] for f in self.side_features], dim=-1)
        return self.item(features[self.item_feature]) + self.out(side)


class DemographicQueryHead(PostfixDNN):
    """hidden [N, D] + each common feature of ``common_dims`` [N, d_f] -> {"query": [N, embedding_dim]}, unit norm."""

    output_names = ("query",)

    def __init__(self, hidden_dim: int, embedding_dim: int, common_dims: Mapping[str, int]) -> None:
        super().__init__()
        self.common_feature_names = tuple(common_dims)
        user_dim = sum(common_dims.values())
        self.hidden = nn.Identity() if hidden_dim == embedding_dim else nn.Linear(hidden_dim, embedding_dim)
        self.user = nn.Sequential(
            nn.Linear(user_dim, embedding_dim), nn.Tanh(), nn.Linear(embedding_dim, embedding_dim)
        )
        nn.init.zeros_(self.user[-1].weight)  # starts as the HSTU paper's query (the normalised output)
        nn.init.zeros_(self.user[-1].bias)

    def forward(self, hidden: Tensor, common: Dict[str, Tensor]) -> Dict[str, Tensor]:
        user = torch.cat([common[name] for name in self.common_feature_names], dim=-1)
        return {"query": F.normalize(self.hidden(hidden) + self.user(user), dim=-1)}

    @staticmethod
    def item_embedding(item_rows: Tensor) -> Tensor:
        """item_rows [M, d] -> [M, d], unit norm: what training, evaluation and serving score."""
        return F.normalize(item_rows, dim=-1)


class GenreModel(GRModel):
    """GRModel whose training batches hide the genres (the prefix_dnn's ``genre_feature`` bags of
    ``GRInput.token_lists``) of ``genre_dropout`` of their tokens: their bags become empty."""

    genre_dropout = 0.2

    def split_input(self, batch: GRInput) -> GRInput:
        inputs = super().split_input(batch)
        bags = inputs.token_lists
        genre = getattr(self.prefix_dnn, "genre_feature", None)
        if not self.training or bags is None or genre not in bags.keys() or self.genre_dropout == 0:
            return inputs
        lists = bags.to_dict()
        lengths = lists[genre].lengths()
        keep = torch.rand(lengths.shape[0], device=lengths.device) >= self.genre_dropout  # [T]
        kept = torch.repeat_interleave(keep, lengths)
        lists[genre] = JaggedTensor(lists[genre].values()[kept], lengths * keep)
        return dataclasses.replace(inputs, token_lists=KeyedJaggedTensor.from_jt_dict(lists))
