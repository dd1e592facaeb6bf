"""Per-user time-ordered sequences with dense ids, and the splits over them.

Leave-one-out, for a user with n >= 3 events at flat rows ``s .. s+n-1``: the last event
(``s+n-1``) is the test target, the second-to-last (``s+n-2``) the validation target,
rows ``s .. s+n-3`` the training part. A target's history is every earlier event.

Time split (``time_split``) at a cut time C (and an optional end E): a user's events before C
are its training part; its first event in [C, E) is its validation target and its second the
test target (whose history then includes the validation event); with a validation start V < C,
the training part ends at V and every event in [V, C) is a validation target instead (the first
event in [C, E) is then neither trained on nor a target); with ``every_test_event``
(``data.test_events: all``) each later event in [C, E) is a test target too, with every earlier
event as its history. A user with no event before C, or fewer than one (two) in [C, E), has
no validation (test) target. With a train start S, training samples predict only events at or
after S; earlier events are history alone, except for a replayed user's (``replayed_users``: a
fixed share of the users per seed), whose samples predict its events from a replay start R (or its
first) on. No cut (``data.split: none``): every event is in the
training part, and no user has a validation or test target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np

from gr.data.config import DataConfig
from gr.data.interactions import DataFormatError, Interactions, SideTable
from gr.data.mappings import IdMap
from gr.jagged_rows import concat_ranges, evicted_prefix
from gr.timestamps import first_overflowing_span

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
HELD_OUT = {"val": 2, "test": 1}  # the target of a split is the n-th event from the end
EVALUATED = tuple(HELD_OUT)


@dataclass(frozen=True)
class SplitRows:
    """Where each user's parts lie, as flat rows ([U] int64 each).

    label_starts: the first row a training sample may predict
    train_ends: one past the training part
    targets: {"val" | "test": (users [S], rows [S])} each held-out event's user and flat row,
        in user then row order
    """

    label_starts: np.ndarray
    train_ends: np.ndarray
    targets: Dict[str, Tuple[np.ndarray, np.ndarray]]


@dataclass
class UserSequences:
    """Every kept user's events, user by user, each user's in time order.

    offsets: [U+1] int64; user u (dense id) owns rows ``offsets[u]:offsets[u+1]``
    items: [N] int64 dense item ids in [0, num_items)
    timestamps: [N] int64 seconds, non-decreasing within a user
    ratings: [N] float32, or None
    events: features of each event (``Interactions.row_side`` in this order, keys 0 .. N-1), or None
    request_starts: [N] int64 the flat row of the first event of each event's request (a user's
        consecutive events of one ``data.columns.request`` id), or None: no request ids
    """

    offsets: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray
    ratings: Optional[np.ndarray]
    num_items: int
    events: Optional[SideTable] = None
    split: Optional[SplitRows] = None  # None: leave-one-out
    request_starts: Optional[np.ndarray] = None

    @property
    def num_users(self) -> int:
        return len(self.offsets) - 1

    @property
    def starts(self) -> np.ndarray:
        return self.offsets[:-1]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def train_ends(self) -> np.ndarray:
        """[U] flat row one past each user's training part."""
        return self.offsets[1:] - HELD_OUT["val"] if self.split is None else self.split.train_ends

    def label_starts(self) -> np.ndarray:
        """[U] the first flat row a training sample of each user may predict."""
        return self.starts if self.split is None else self.split.label_starts

    def targets(self, split: str) -> Tuple[np.ndarray, np.ndarray]:
        """The held-out events of split "val" or "test": (users [S] int64, rows [S] int64 flat rows),
        in user then row order; one per user under leave-one-out, where every user has one."""
        if split not in HELD_OUT:
            raise ValueError(f"split: expected one of {list(HELD_OUT)}, got {split!r}")
        if self.split is None:
            return np.arange(self.num_users, dtype=np.int64), self.offsets[1:] - HELD_OUT[split]
        return self.split.targets[split]

    def evaluated_users(self, split: str) -> np.ndarray:
        """[U'] dense ids of the users with a ``split`` target (every user under leave-one-out)."""
        return np.unique(self.targets(split)[0])


@dataclass(frozen=True)
class Replay:
    """Which users replay their events before the train start: a ``share`` of them (in [0, 1]) drawn
    per ``seed``, from ``start`` seconds on (None: from their first event)."""

    share: float
    seed: int
    start: Optional[int] = None


REPLAY_STREAM = 0x5E9A7  # keeps the replay's draws apart from any other use of data.seed


def replayed_users(user_ids: np.ndarray, share: float, seed: int) -> np.ndarray:
    """[U] bool: whether each user (``user_ids``: [U] int64 dense ids in the dataset) is replayed.
    Each user's draw is splitmix64 of its id under a key mixed from the seed, so the sample depends on
    the seed and the ids alone: a user is drawn alike whichever users are read with it (a prepared
    dataset's chunks)."""
    key = _splitmix64(np.array([seed ^ REPLAY_STREAM], dtype=np.uint64))
    draws = _splitmix64(key + user_ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    return (draws >> np.uint64(11)).astype(np.float64) * 2.0**-53 < share


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """[N] uint64 -> [N] uint64: splitmix64's step (add the golden ratio, then mix), wrapping."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def time_split(
    sequences: UserSequences,
    cut: Optional[int],
    end: Optional[int] = None,
    train_start: Optional[int] = None,
    every_test_event: bool = False,
    replay: Optional[Replay] = None,
    user_ids: Optional[np.ndarray] = None,
    val_start: Optional[int] = None,
) -> SplitRows:
    """The time split of ``sequences`` at ``cut`` seconds, or None: no cut (the module docstring says
    how; ``val_start``: V, only with a cut). user_ids: [U] the dataset's dense id of each user (None:
    0 .. U-1), which ``replay`` draws by."""
    starts, times = sequences.starts, sequences.timestamps

    def per_user(mask: np.ndarray) -> np.ndarray:
        return np.add.reduceat(mask.astype(np.int64), starts) if len(starts) else np.zeros(0, dtype=np.int64)

    if cut is None:
        before, after = sequences.lengths, np.zeros(sequences.num_users, dtype=np.int64)
    else:
        before = per_user(times < cut)
        after = per_user((times >= cut) & (times < (end if end is not None else np.iinfo(np.int64).max)))
    cut_rows = starts + before
    tested = np.flatnonzero((before >= 1) & (after >= 2))
    per_test = after[tested] - 1 if every_test_event else np.ones(len(tested), dtype=np.int64)
    test = (np.repeat(tested, per_test), concat_ranges(cut_rows[tested] + 1, per_test))
    if val_start is None:
        train_ends = cut_rows
        validated = np.flatnonzero((before >= 1) & (after >= 1))
        targets = {"val": (validated, train_ends[validated]), "test": test}
    else:
        kept = per_user(times < val_start)
        train_ends, window = starts + kept, before - kept
        validated = np.flatnonzero((kept >= 1) & (window >= 1))
        val = (np.repeat(validated, window[validated]), concat_ranges(train_ends[validated], window[validated]))
        targets = {"val": val, "test": test}
    label_starts = starts if train_start is None else starts + per_user(times < train_start)
    if replay is not None and replay.share > 0 and train_start is not None:
        ids = np.arange(sequences.num_users, dtype=np.int64) if user_ids is None else user_ids
        replayed = replayed_users(ids, replay.share, replay.seed)
        replay_starts = starts if replay.start is None else starts + per_user(times < replay.start)
        label_starts = np.where(replayed, replay_starts, label_starts)  # ends stay: held-out events never train
    return SplitRows(label_starts, train_ends, targets)


def configured_split(
    sequences: UserSequences, config: DataConfig, user_ids: Optional[np.ndarray] = None
) -> Optional[SplitRows]:
    """The split ``config.split`` makes of ``sequences``: None (leave-one-out) or ``time_split``'s
    (``data.split: none`` is the time split without a cut); user_ids as ``time_split`` reads them."""
    if config.split == "leave_one_out":
        return None
    replay = Replay(config.replay, config.seed, config.replay_start)
    if config.split == "none":
        return time_split(sequences, None, train_start=config.train_start, replay=replay, user_ids=user_ids)
    assert config.split_time is not None  # DataConfig requires it with the time split
    every_test_event = config.test_events == "all"
    return time_split(
        sequences,
        config.split_time,
        config.split_end,
        config.train_start,
        every_test_event,
        replay,
        user_ids,
        config.val_start,
    )


def log_rare_items(source: object, rare: int, items: int, minimum: int) -> None:
    """The info line about the ``rare`` of ``items`` items dropped by data.min_item_interactions."""
    log.info(
        "%s: dropped %d of %d items with fewer than %d interactions (data.min_item_interactions)",
        source,
        rare,
        items,
        minimum,
    )


def log_short_users(source: object, short: int, users: int, min_seq_len: int) -> None:
    """The warning about the ``short`` of ``users`` users dropped by data.min_seq_len (none when 0):
    a warning, since a user's events vanish from every split, which no one asked for."""
    if short:
        log.warning(
            "%s: dropped %d of %d users with fewer than %d interactions (data.min_seq_len)",
            source,
            short,
            users,
            min_seq_len,
        )


def no_user_left(source: object, min_seq_len: int) -> DataFormatError:
    """The error when no user has ``min_seq_len`` interactions."""
    return DataFormatError(
        source,
        f"no user has at least {min_seq_len} interactions (data.min_seq_len): the dataset is empty after filtering",
    )


def too_wide_span(source: object, user: object, first: int, last: int) -> DataFormatError:
    """The error for a user whose timestamps ``first`` .. ``last`` lie 2^63 s or more apart."""
    return DataFormatError(
        source,
        f"user {user!r}: timestamps from {first} to {last} lie 2^63 s or more apart "
        "(the model takes their differences in int64)",
    )


def build_sequences(
    data: Interactions,
    min_seq_len: int = 3,
    min_item_interactions: int = 1,
    base_items: Optional[IdMap] = None,
    drop: Optional[np.ndarray] = None,
    item_column: str = "item_id",
) -> Tuple[UserSequences, IdMap, IdMap]:
    """Filter, remap and sort events -> (sequences, user map, item map).

    Items with fewer than ``min_item_interactions`` events are dropped first (logged), then users
    with fewer than ``min_seq_len`` (a warning saying how many). Dense ids follow sorted raw ids.
    Events are sorted stably by (user, timestamp, original order): equal timestamps keep the
    file's order, as a request's history keeps its own (``gr.timestamps``).
    base_items: an item map to extend (a warm start's): its items keep their dense ids.
    drop: [N] bool, events to leave out before any filter (e.g. those of items a model has no row for).
    item_column: the item ids' column, named when they are not of ``base_items``' kind.
    """
    keep = np.ones(len(data.users), dtype=bool) if drop is None else ~drop
    if min_item_interactions > 1:
        _, item_codes, item_counts = np.unique(data.items[keep], return_inverse=True, return_counts=True)
        keep[keep] = item_counts[item_codes] >= min_item_interactions
        log_rare_items(
            data.source, int((item_counts < min_item_interactions).sum()), len(item_counts), min_item_interactions
        )
    user_raw, user_codes, user_counts = np.unique(data.users[keep], return_inverse=True, return_counts=True)
    long_enough = user_counts >= min_seq_len
    log_short_users(data.source, int((~long_enough).sum()), len(user_raw), min_seq_len)
    if not long_enough.any():
        raise no_user_left(data.source, min_seq_len)
    rows = np.flatnonzero(keep)[long_enough[user_codes]]
    users = IdMap(user_raw[long_enough])
    user_dense = (np.cumsum(long_enough) - 1)[user_codes[long_enough[user_codes]]]
    items = (
        IdMap.of(data.items[rows])
        if base_items is None
        else base_items.extended(data.items[rows], f"{data.source}: column {item_column!r}")
    )
    item_dense = items.encode(data.items[rows])
    timestamps = data.timestamps[rows].astype(np.int64)
    order = np.lexsort((np.arange(len(rows)), timestamps, user_dense))
    offsets = np.concatenate([[0], np.cumsum(np.bincount(user_dense, minlength=len(users.raw)))]).astype(np.int64)
    timestamps = timestamps[order]
    wide = first_overflowing_span(offsets, timestamps)
    if wide >= 0:
        user, span = users.raw[wide : wide + 1].tolist()[0], timestamps[offsets[wide] : offsets[wide + 1]]
        raise too_wide_span(data.source, user, span[0], span[-1])
    sequences = UserSequences(
        offsets=offsets,
        items=item_dense[order],
        timestamps=timestamps,
        ratings=None if data.ratings is None else data.ratings[rows][order].astype(np.float32),
        num_items=items.cardinality,
        events=None if data.row_side is None else data.row_side.take(rows[order]),
        request_starts=None if data.requests is None else request_starts(offsets, data.requests[rows][order]),
    )
    return sequences, users, items


def request_starts(offsets: np.ndarray, requests: np.ndarray) -> np.ndarray:
    """offsets: [U+1] int64 the users' rows; requests: [N] raw request ids in sequence order -> [N]
    int64 the first row of each row's request: a run of a user's consecutive rows of one id."""
    first = np.ones(len(requests), dtype=bool)
    first[1:] = requests[1:] != requests[:-1]
    first[offsets[:-1][offsets[:-1] < len(requests)]] = True  # a user's first event begins a request
    starts = np.flatnonzero(first)
    return starts[np.cumsum(first) - 1]


def window_starts(begins: np.ndarray, ends: np.ndarray, max_len: int, block: int = 1) -> np.ndarray:
    """[R] start of the window of each range ``begins[r]:ends[r]``: its most recent ``max_len``
    rows, the oldest dropped in whole blocks of ``block`` (``gr.jagged_rows.evicted_prefix``)."""
    return begins + evicted_prefix(ends - begins, max_len, block)
