"""PostfixDNN: the user's heads behind HSTU."""

from __future__ import annotations

from typing import Dict, Sequence

from torch import Tensor, nn


class PostfixDNN(nn.Module):
    """Turns HSTU outputs at the scored rows into task outputs, row by row.

    ``forward(hidden, common) -> {output name: [N, ...]}`` where ``hidden`` is
    ``[N, hidden_dim]`` (one row per scored token: every token in autoregressive
    training, the target tokens when ``num_targets`` is given) and
    ``common[name]`` is ``[N, d]``: the request's common features, repeated for
    each of its rows by the framework. Subclasses set ``common_feature_names``
    and ``output_names`` (ONNX input/output order).
    """

    common_feature_names: Sequence[str] = ()
    output_names: Sequence[str] = ()

    def forward(self, hidden: Tensor, common: Dict[str, Tensor]) -> Dict[str, Tensor]:  # pragma: no cover
        raise NotImplementedError(f"{type(self).__name__}.forward(hidden, common) -> {{name: [N, ...]}}")
