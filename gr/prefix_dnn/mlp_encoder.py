"""A ready PrefixDNN: concatenated token features (embedded ids + side features) -> MLP."""

from __future__ import annotations

from typing import Dict, Mapping, Sequence

import torch
from torch import Tensor, nn

from gr.prefix_dnn.base import PrefixDNN


def mlp(input_dim: int, dims: Sequence[int], dropout: float = 0.0) -> nn.Sequential:
    """Linear layers with SiLU between them (none after the last); empty dims -> identity."""
    layers: list = []
    for i, dim in enumerate(dims):
        layers.append(nn.Linear(input_dim, dim))
        if i < len(dims) - 1:
            layers.append(nn.SiLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
        input_dim = dim
    return nn.Sequential(*layers)


class MLPTokenEncoder(PrefixDNN):
    """features {name: [T, d_name]} -> concat [T, sum d] -> MLP -> [T, hidden_dim].

    feature_dims: ordered {feature name: dim}; the first usually is the item id embedding.
    mlp_dims: hidden layer sizes before the final projection to hidden_dim. With no
    hidden layers and a single feature already of size hidden_dim, the encoder is the
    identity (the HSTU paper's setting: the item embedding is the input).
    """

    def __init__(
        self, feature_dims: Mapping[str, int], hidden_dim: int, mlp_dims: Sequence[int] = (), dropout: float = 0.0
    ):
        super().__init__()
        if not feature_dims:
            raise ValueError("MLPTokenEncoder.feature_dims: expected at least one token feature")
        self.feature_names = tuple(feature_dims)
        self.feature_dims = dict(feature_dims)
        input_dim = sum(self.feature_dims.values())
        identity = not mlp_dims and input_dim == hidden_dim
        self.mlp = nn.Sequential() if identity else mlp(input_dim, [*mlp_dims, hidden_dim], dropout)

    def forward(self, features: Dict[str, Tensor]) -> Tensor:
        parts = [features[name].reshape(features[name].shape[0], -1) for name in self.feature_names]
        return self.mlp(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))  # one feature: no copy
