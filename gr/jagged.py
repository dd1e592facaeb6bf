"""Jagged-sequence helpers shared by every module.

A batch of B sequences is stored flat: ``values [T, D]`` with ``seq_offsets [B+1]``
(int64, ``seq_offsets[0] == 0``, ``seq_offsets[-1] == T``). The trailing
``num_targets[b]`` tokens of sequence b are candidate (target) tokens; the rest is
history. Padding to ``[B, L, D]`` happens only inside a backend that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, overload

import numpy as np
import torch
from torch import Tensor


@overload
def evicted_prefix(lengths: int, max_len: int, block: int = 1) -> int: ...
@overload
def evicted_prefix(lengths: np.ndarray, max_len: int, block: int = 1) -> np.ndarray: ...
def evicted_prefix(lengths: "np.ndarray | int", max_len: int, block: int = 1) -> "np.ndarray | int":
    """How many oldest tokens a history of ``lengths`` tokens drops to fit ``max_len``: whole
    blocks of ``block`` tokens (``HSTUConfig.eviction_block``), so a growing history's window
    start moves once per block, not on every new token. Training windows and served histories
    both use it, which keeps train/serve parity and lets the serving cache extend in between."""
    overflow = np.maximum(np.asarray(lengths) - max_len, 0)
    dropped = -(-overflow // block) * block
    return int(dropped) if dropped.ndim == 0 else dropped


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[sum(lengths)] int64: ``starts[0] .. starts[0]+lengths[0]-1``, then the next range..."""
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    out_starts = np.cumsum(lengths) - lengths
    return np.repeat(starts - out_starts, lengths) + np.arange(total, dtype=np.int64)


@dataclass(frozen=True)
class JaggedRows:
    """Rows of variable length, flat (numpy): row r holds ``values[offsets[r]:offsets[r+1]]``.

    offsets: [M+1] int64 (``offsets[0] == 0``, non-decreasing, ``offsets[-1] == V``)
    values: [V] (raw values, int64 or str, or int64 ids)
    The list-valued features (a movie's genres) of M users, items or events.
    """

    offsets: np.ndarray
    values: np.ndarray

    def __post_init__(self) -> None:
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or self.offsets[0] != 0:
            raise ValueError(f"JaggedRows.offsets: expected [M+1] int64 from 0, got {self.offsets[:5].tolist()}...")
        if self.offsets[-1] != len(self.values) or (np.diff(self.offsets) < 0).any():
            raise ValueError(
                f"JaggedRows.offsets: expected non-decreasing offsets ending at the {len(self.values)} values"
            )

    @classmethod
    def from_lengths(cls, lengths: "np.ndarray | Sequence[int]", values: np.ndarray) -> "JaggedRows":
        """Rows of ``lengths`` ([M] int) values each, taken from ``values`` in order."""
        return cls(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64), values)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        """[M] int64 values per row."""
        return np.diff(self.offsets)

    def take(self, index: np.ndarray) -> "JaggedRows":
        """The rows ``index`` ([M'] int64) in that order; an index of -1 is an empty row."""
        index = np.asarray(index, dtype=np.int64)
        present = index >= 0
        lengths, starts = np.zeros(len(index), dtype=np.int64), np.zeros(len(index), dtype=np.int64)
        lengths[present] = self.lengths()[index[present]]
        starts[present] = self.offsets[index[present]]
        return JaggedRows.from_lengths(lengths, self.values[concat_ranges(starts, lengths)])

    def with_values(self, values: np.ndarray) -> "JaggedRows":
        """The same rows holding ``values`` ([V], e.g. the raw values' ids) instead."""
        return JaggedRows(self.offsets, values)


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
