"""Definitions every attention backend implements: the HSTU mask and the bucketed bias.

Backends may fuse these differently, but the math here is the contract that the
conformance tests hold each of them to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

TIME_BUCKET_LOG_DIV = 0.301  # log bucketing: floor(ln(max(|dt|, 1)) / 0.301), as in the HSTU paper code


@dataclass
class RelativeBias:
    """Bucketed relative attention bias, shared by all heads of one layer.

    bias(i, j) = position_weights[clamp(pos_i - pos_j, 0, P - 1)]
               + time_weights[clamp(bucket(|t_i - t_j|), 0, NB - 1)]
    Either part may be None (off). ``pos`` is ``gr.jagged.token_positions``
    (targets sit at the history length).

    position_weights: [P] float, or None
    time_weights: [NB] float, or None
    timestamps: [T] int64 seconds; required when time_weights is given
    time_bucketing: "log" or "sqrt"
    """

    position_weights: Optional[Tensor] = None
    time_weights: Optional[Tensor] = None
    timestamps: Optional[Tensor] = None
    time_bucketing: str = "log"

    def __post_init__(self) -> None:
        if self.time_weights is not None and self.timestamps is None:
            raise ValueError("RelativeBias.timestamps: required when time_weights is given")
        if self.time_bucketing not in ("log", "sqrt"):
            raise ValueError(f"RelativeBias.time_bucketing: expected 'log' or 'sqrt', got {self.time_bucketing!r}")


def time_bucket(delta_seconds: Tensor, bucketing: str, num_buckets: int) -> Tensor:
    """|dt| (any int/float shape) -> bucket index in [0, num_buckets) (int64)."""
    dt = delta_seconds.abs().to(torch.float32).clamp(min=1.0)
    if bucketing == "log":
        bucket = torch.log(dt) / TIME_BUCKET_LOG_DIV
    else:
        bucket = torch.sqrt(dt)
    return bucket.long().clamp(0, num_buckets - 1)


def position_bucket(rel_position: Tensor, num_buckets: int) -> Tensor:
    """pos_query - pos_key -> bucket index in [0, num_buckets) (int64)."""
    return rel_position.clamp(0, num_buckets - 1).long()


def hstu_visibility(
    row: Tensor,
    col: Tensor,
    length: Tensor,
    history_len: Tensor,
    contextual_len: int,
    max_attn_len: int,
) -> Tensor:
    """Whether query token ``row`` may attend to key token ``col`` of the same sequence.

    All arguments broadcast together; row/col are 0-based indices inside the sequence.
    * history: causal (a token sees itself and earlier tokens);
    * targets (index >= history_len): see all history and themselves, no other target;
    * the first ``contextual_len`` history tokens are visible to every token;
    * ``max_attn_len > 0``: the look-back over positions is at most that many.
    """
    pos_row = torch.minimum(row, history_len)
    pos_col = torch.minimum(col, history_len)
    dist = pos_row - pos_col
    seen = dist > 0
    if max_attn_len > 0:
        seen = seen & (dist <= max_attn_len)
    if contextual_len > 0:
        seen = seen | ((col < contextual_len) & (col < history_len))
    in_range = (row < length) & (col < length)
    return in_range & (seen | (row == col))


def silu_norm(position: Tensor, silu_scale: Optional[float]) -> Tensor:
    """Per-query factor applied after SiLU: silu_scale, or 1 / (position + 1) when None."""
    if silu_scale is not None:
        return torch.full_like(position, silu_scale, dtype=torch.float32)
    return 1.0 / (position.to(torch.float32) + 1.0)
