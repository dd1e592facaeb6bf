"""Jagged rows in numpy: the data layer's and the serving runtime's form of jagged sequences,
importable without torch (``gr data download`` reads datasets with it).

Rows are flat: ``values [V]`` with ``offsets [M+1]`` (int64, ``offsets[0] == 0``,
``offsets[-1] == V``), the numpy twin of ``gr.jagged``'s ``seq_offsets``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, overload

import numpy as np


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
