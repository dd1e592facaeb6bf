"""What every reader returns: raw interaction events plus optional user/item side tables."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sized

import numpy as np

from gr.jagged_rows import JaggedRows


class DataFormatError(ValueError):
    """Bad input data. The message starts with ``file:line:`` (or ``file:`` when no line applies)."""

    def __init__(self, file: object, message: str, line: Optional[int] = None) -> None:
        self.file = str(file)
        self.line = line
        super().__init__(f"{self.file}:{line}: {message}" if line is not None else f"{self.file}: {message}")


@dataclass
class SideTable:
    """Side features of users (or items): one row per described raw id.

    keys: [M] raw ids (int64 or str)
    categorical: {feature: [M] raw values (int64 or str)}
    dense: {feature: [M, d] float32}, e.g. multi-hot genres
    dense_columns: {feature: the d column names}, e.g. the genre names
    lists: {feature: M rows of raw values (int64 or str)}, a list-valued categorical feature
    """

    keys: np.ndarray
    categorical: Dict[str, np.ndarray] = field(default_factory=dict)
    dense: Dict[str, np.ndarray] = field(default_factory=dict)
    dense_columns: Dict[str, List[str]] = field(default_factory=dict)
    lists: Dict[str, JaggedRows] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rows = len(self.keys)
        columns: Dict[str, Sized] = {**self.categorical, **self.dense, **self.lists}
        bad = [n for n, v in columns.items() if len(v) != rows]
        if bad:
            raise ValueError(f"SideTable: features {bad} do not have one row per key ({rows})")

    def take(self, index: np.ndarray) -> "SideTable":
        """The rows ``index`` ([M'] int64) of this table, keyed 0 .. M'-1 (per-event features in a new order)."""
        return SideTable(
            np.arange(len(index), dtype=np.int64),
            {name: values[index] for name, values in self.categorical.items()},
            {name: values[index] for name, values in self.dense.items()},
            dict(self.dense_columns),
            {name: rows.take(index) for name, rows in self.lists.items()},
        )


@dataclass
class Interactions:
    """Raw events in file order (one row per user-item action).

    users: [N] raw user ids (int64 or str)
    items: [N] raw item ids (int64 or str)
    timestamps: [N] int64 seconds
    ratings: [N] float32, or None when the source has none
    requests: [N] raw request ids (``data.columns.request``), or None
    user_side / item_side: side features keyed by raw user / item id
    row_side: features of each row itself (keys 0 .. N-1, in file order), or None
    source: the file (or generator) it came from, for error messages
    duplicates: how many rows repeat an earlier row's (user, item, timestamp); ``read_source``
        drops them unless ``data.keep_duplicates`` (``duplicates_dropped`` says which)
    """

    users: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray
    ratings: Optional[np.ndarray] = None
    requests: Optional[np.ndarray] = None
    user_side: Optional[SideTable] = None
    item_side: Optional[SideTable] = None
    row_side: Optional[SideTable] = None
    source: str = ""
    duplicates: int = 0
    duplicates_dropped: bool = False

    def __post_init__(self) -> None:
        n = len(self.users)
        optional = [column for column in (self.ratings, self.requests) if column is not None]
        lengths = [len(self.items), len(self.timestamps)] + [len(column) for column in optional]
        if any(length != n for length in lengths):
            raise ValueError(f"Interactions from {self.source}: columns have different lengths {[n, *lengths]}")
        if n == 0:
            raise DataFormatError(self.source, "no interactions (empty dataset)")
        if self.row_side is not None and len(self.row_side.keys) != n:
            raise ValueError(f"Interactions from {self.source}: row_side has {len(self.row_side.keys)} rows, not {n}")

    def duplicate_rows(self) -> np.ndarray:
        """[N] bool: rows whose (user, item, timestamp) an earlier row (in file order) already has."""
        order = np.lexsort((np.arange(len(self.users)), self.timestamps, self.items, self.users))
        users, items, times = self.users[order], self.items[order], self.timestamps[order]
        repeat = (users[1:] == users[:-1]) & (items[1:] == items[:-1]) & (times[1:] == times[:-1])
        marked = np.zeros(len(order), dtype=bool)
        marked[order[1:][repeat]] = True
        return marked

    def without_duplicates(self, drop: bool = True) -> "Interactions":
        """These events with ``duplicates`` counted and, if ``drop``, every repeated row removed
        (the first of each (user, item, timestamp) is kept). Side tables are shared."""
        repeats = self.duplicate_rows()
        count = int(repeats.sum())
        if not (drop and count):
            return replace(self, duplicates=count, duplicates_dropped=False)
        keep = ~repeats
        return replace(
            self,
            users=self.users[keep],
            items=self.items[keep],
            timestamps=self.timestamps[keep],
            ratings=None if self.ratings is None else self.ratings[keep],
            requests=None if self.requests is None else self.requests[keep],
            row_side=None if self.row_side is None else self.row_side.take(np.flatnonzero(keep)),
            duplicates=count,
            duplicates_dropped=True,
        )
