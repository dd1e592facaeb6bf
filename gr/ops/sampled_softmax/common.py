"""The call every sampled-softmax backend takes."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True, eq=False)
class SampledSoftmaxCall:
    """One sampled-softmax call (see ``sampled_softmax_loss`` for the shapes)."""

    queries: Tensor
    items: Tensor
    positive_index: Tensor
    negative_index: Tensor
    temperature: float
    rows_per_draw: int = 1

    def validate(self) -> None:
        negative_index, positive_index = self.negative_index, self.positive_index
        if negative_index.dim() == 2 and negative_index.shape[0] != negative_rows(
            positive_index.shape[0], self.rows_per_draw
        ):
            raise ValueError(
                f"sampled_softmax_loss: negative_index has {negative_index.shape[0]} rows, expected ceil("
                f"{positive_index.shape[0]} / {self.rows_per_draw}) for rows_per_draw={self.rows_per_draw}"
            )


def negative_rows(rows: int, rows_per_draw: int) -> int:
    """Rows of ``negative_index`` for ``rows`` scored rows that share draws ``rows_per_draw`` at a time."""
    return -(-rows // rows_per_draw)
