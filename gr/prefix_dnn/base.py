"""PrefixDNN: the user's token encoder in front of HSTU."""

from __future__ import annotations

from typing import Dict, Sequence

import torch
from torch import Tensor, nn


class PrefixDNN(nn.Module):
    """Turns each token's features into its HSTU input embedding, token by token.

    Subclasses set ``feature_names`` (the token features they read, in ONNX input
    order) and implement ``forward(features) -> [T, hidden_dim]``, where
    ``features[name]`` is ``[T, d]`` float (embedded ids, dense side features).
    Inputs are flat over the batch's tokens, never ``[B, L, ...]``: a PrefixDNN
    cannot mix positions, which is what keeps a user's cached history valid.
    """

    feature_names: Sequence[str] = ()

    def forward(self, features: Dict[str, Tensor]) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.forward(features) -> [T, hidden_dim]")


def check_token_wise(module: PrefixDNN, features: Dict[str, Tensor], atol: float = 1e-5) -> None:
    """Raise AssertionError unless ``module`` maps each token independently of the others.

    Runs the module on all tokens, on a permutation of them and on each token alone.
    features: {name: [T, d]} with T >= 1.
    """
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            full = module(features)
            total = full.shape[0]
            perm = torch.randperm(total)
            permuted = module({name: x[perm] for name, x in features.items()})
            if not torch.allclose(permuted, full[perm], atol=atol):
                raise AssertionError(f"{type(module).__name__}: output depends on token order")
            for i in range(min(total, 8)):
                alone = module({name: x[i : i + 1] for name, x in features.items()})
                if not torch.allclose(alone, full[i : i + 1], atol=atol):
                    raise AssertionError(f"{type(module).__name__}: token {i} alone differs from in a batch")
    finally:
        module.train(was_training)
