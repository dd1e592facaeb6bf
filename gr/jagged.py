"""Jagged-sequence helpers shared by every module.

A batch of B sequences is stored flat: ``values [T, D]`` with ``seq_offsets [B+1]``
(int64, ``seq_offsets[0] == 0``, ``seq_offsets[-1] == T``). The trailing
``num_targets[b]`` tokens of sequence b are candidate (target) tokens; the rest is
history. Padding to ``[B, L, D]`` happens only inside a backend that needs it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def lengths_from_offsets(seq_offsets: Tensor) -> Tensor:
    """seq_offsets: [B+1] int64 -> lengths: [B] int64."""
    return seq_offsets[1:] - seq_offsets[:-1]


def offsets_from_lengths(lengths: Tensor) -> Tensor:
    """lengths: [B] int -> seq_offsets: [B+1] int64."""
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).long()


def token_seq_ids(seq_offsets: Tensor, total_tokens: Optional[int] = None) -> Tensor:
    """Which sequence each token belongs to: [T] int64."""
    lengths = lengths_from_offsets(seq_offsets)
    batch = torch.arange(lengths.numel(), device=seq_offsets.device)
    return torch.repeat_interleave(batch, lengths, output_size=total_tokens)


def token_offsets_in_seq(seq_offsets: Tensor, total_tokens: Optional[int] = None) -> Tensor:
    """Index of each token inside its own sequence, 0-based: [T] int64."""
    seq_ids = token_seq_ids(seq_offsets, total_tokens)
    flat = torch.arange(seq_ids.numel(), device=seq_offsets.device)
    return flat - seq_offsets[seq_ids]


def history_lengths(seq_offsets: Tensor, num_targets: Optional[Tensor]) -> Tensor:
    """Number of history (non-target) tokens per sequence: [B] int64."""
    lengths = lengths_from_offsets(seq_offsets)
    return lengths if num_targets is None else lengths - num_targets.to(lengths.dtype)


def token_positions(seq_offsets: Tensor, num_targets: Optional[Tensor] = None) -> Tensor:
    """Position id of every token: [T] int64.

    History token i of a sequence has position i; every target token of sequence b
    has position ``history_len[b]``: candidates all stand right after the history,
    so a candidate's position never depends on how many other candidates there are.
    """
    pos = token_offsets_in_seq(seq_offsets, int(seq_offsets[-1]))
    if num_targets is None:
        return pos
    hist = history_lengths(seq_offsets, num_targets)
    return torch.minimum(pos, hist[token_seq_ids(seq_offsets, pos.numel())])


def target_token_index(seq_offsets: Tensor, num_targets: Tensor) -> Tensor:
    """Flat indices of the target tokens, sequence by sequence: [sum(num_targets)] int64."""
    starts = seq_offsets[1:] - num_targets.to(seq_offsets.dtype)
    target_offsets = offsets_from_lengths(num_targets.long())
    owner = token_seq_ids(target_offsets)
    within = torch.arange(owner.numel(), device=seq_offsets.device) - target_offsets[owner]
    return starts[owner] + within


def validate_jagged(
    values: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    num_targets: Optional[Tensor] = None,
    timestamps: Optional[Tensor] = None,
    query_times: Optional[Tensor] = None,
) -> None:
    """Raise ValueError with the argument's name when a jagged batch is inconsistent."""
    if seq_offsets.dim() != 1 or seq_offsets.numel() < 1:
        raise ValueError(f"seq_offsets: expected [B+1] int64, got shape {tuple(seq_offsets.shape)}")
    if seq_offsets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"seq_offsets: expected an integer tensor, got {seq_offsets.dtype}")
    if int(seq_offsets[0]) != 0 or int(seq_offsets[-1]) != values.shape[0]:
        raise ValueError(
            f"seq_offsets: must start at 0 and end at the token count {values.shape[0]}, "
            f"got {int(seq_offsets[0])}..{int(seq_offsets[-1])}"
        )
    lengths = lengths_from_offsets(seq_offsets)
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError("seq_offsets: must be non-decreasing")
    if lengths.numel() and int(lengths.max()) > max_seq_len:
        raise ValueError(f"max_seq_len: {max_seq_len} is below the longest sequence ({int(lengths.max())})")
    if num_targets is not None:
        if num_targets.shape != lengths.shape:
            raise ValueError(f"num_targets: expected [B]={tuple(lengths.shape)}, got {tuple(num_targets.shape)}")
        if bool((num_targets < 0).any()) or bool((num_targets > lengths).any()):
            raise ValueError("num_targets: each entry must lie in [0, sequence length]")
    for name, times in (("timestamps", timestamps), ("query_times", query_times)):
        if times is not None and times.shape != values.shape[:1]:
            raise ValueError(f"{name}: expected [T]={values.shape[0]}, got {tuple(times.shape)}")
