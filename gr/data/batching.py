"""Cutting splits into ``GRInput`` batches, vectorised with numpy.

A DataLoader here is built with ``batch_size=None`` and a ``BatchPlan`` sampler: the
sampler yields one ``BatchKey`` (epoch, batch number, sample rows) per batch and the
split's dataset builds the whole batch at once. Randomness (negative candidates) is
seeded by (seed, split, epoch, batch number), so batches do not depend on worker count.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, Iterator, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from gr.data.config import TaskConfig
from gr.data.features import ITEM_ID, SideFeatures
from gr.data.sampling import UnseenSampler
from gr.data.sequences import UserSequences, window_starts
from gr.jagged import offsets_from_lengths
from gr.jagged_rows import JaggedRows, concat_ranges
from gr.model import GRInput
from gr.sparse.keyed_jagged import KeyedJaggedTensor

SPLIT_CODES = {"train": 0, "val": 1, "test": 2}


@dataclass(frozen=True)
class BatchKey:
    """One batch to build: sample rows of the split, and the (epoch, number) that seed it."""

    epoch: int
    number: int
    rows: np.ndarray


class BatchPlan(Sampler):
    """Yields this rank's ``BatchKey``s for one split, one epoch at a time.

    ``batch_size`` is the global batch: rows per step over all ranks, so a run takes the same
    steps of the same size on any number of ranks. Rows are shuffled from (seed, epoch) and
    dealt round-robin to the ``world_size`` ranks when ``shuffle``; else (evaluation) each rank
    takes a contiguous run of them. Each rank's rows are cut into ceil(num_rows / batch_size)
    batches (about batch_size / world_size rows each), so every rank steps equally often and no
    row repeats. ``groups`` ([num_rows] int64, non-decreasing; evaluation only): rows that share a
    sequence (``SplitBatches.groups``) stay in one batch, and ``batch_size`` counts groups instead
    of rows. Lightning calls ``set_epoch`` before each training epoch.
    """

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        shuffle: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        groups: Optional[np.ndarray] = None,
    ) -> None:
        if shuffle and groups is not None:
            raise ValueError("BatchPlan: groups keep evaluation rows together; training rows are shuffled")
        # the first row of each unit dealt out (a row, or a group of rows), then num_rows
        self.bounds = (
            np.arange(num_rows + 1) if groups is None else np.flatnonzero(np.r_[True, np.diff(groups) != 0, True])
        )
        units = len(self.bounds) - 1
        if units < world_size:
            raise ValueError(f"BatchPlan: {units} samples cannot feed {world_size} ranks")
        if batch_size < world_size:
            raise ValueError(
                f"BatchPlan: a global batch of {batch_size} cannot feed {world_size} ranks "
                "(data.batch_size and data.eval_batch_size count samples over all ranks)"
            )
        self.num_rows, self.batch_size, self.shuffle, self.seed = num_rows, batch_size, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil((len(self.bounds) - 1) / self.batch_size)

    def __iter__(self) -> Iterator[BatchKey]:
        if self.shuffle:
            order = epoch_generator(self.seed, self.epoch).permutation(self.num_rows)
            batches = np.array_split(order[self.rank :: self.world_size], len(self))
        else:
            mine = np.array_split(np.arange(len(self.bounds) - 1), self.world_size)[self.rank]
            batches = [
                np.arange(self.bounds[units[0]], self.bounds[units[-1] + 1]) if len(units) else units
                for units in np.array_split(mine, len(self))
            ]
        for i, rows in enumerate(batches):
            yield BatchKey(self.epoch, i * self.world_size + self.rank, rows)


def epoch_generator(seed: int, epoch: int, rank: int = 0, worker: int = 0) -> np.random.Generator:
    """The generator that orders an epoch's training samples: seeded by (seed, epoch) for raw reading's
    one order of every rank's samples (``BatchPlan``) and for a prepared dataset's rank 0 worker 0,
    which thus permute the same samples alike; by (seed, epoch, rank, worker) for a prepared
    dataset's other streams."""
    return np.random.default_rng([seed, epoch] if rank == worker == 0 else [seed, epoch, rank, worker])


def identity_collate(batch: GRInput) -> GRInput:
    """DataLoader collate_fn for batches that are already built."""
    return batch


@dataclass
class Corpus:
    """What every split's batches are cut from. event_features: the features of each event
    (row) of ``sequences``, looked up by flat event index. user_ids: [U] int64 the dataset's dense
    id of each user of ``sequences`` (None: the same ids), for a corpus of some users only (a chunk
    of a prepared dataset): batches then carry these ids and look user features up by them."""

    sequences: UserSequences
    item_features: SideFeatures
    user_features: SideFeatures
    event_features: SideFeatures = field(default_factory=SideFeatures)
    user_ids: Optional[np.ndarray] = None

    @cached_property
    def sampler(self) -> UnseenSampler:
        """Negative candidates for these users (built on first use: retrieval never draws them)."""
        return UnseenSampler(self.sequences)

    def dataset_users(self, users: np.ndarray) -> np.ndarray:
        """users: [B] int64 users of ``sequences`` -> [B] int64 their dense ids in the dataset."""
        return users if self.user_ids is None else self.user_ids[users]


def trainable_users(sequences: UserSequences) -> np.ndarray:
    """[U'] the users with a retrieval training sample: >= 2 training events, the last at or after
    the first row a sample may predict."""
    ends = sequences.train_ends()
    return np.flatnonzero((ends - sequences.starts >= 2) & (ends - 1 >= sequences.label_starts()))


def ranking_cuts(sequences: UserSequences, positives: int, samples_per_user: int) -> Tuple[np.ndarray, np.ndarray]:
    """The ranking training samples: (row_users [R] int64, cuts [R] int64 flat rows).

    Cuts tile each user's training part from its end, ``positives`` events apart, keeping >= 1
    history event before each cut and each cut at or after the user's label start; at most
    ``samples_per_user`` per user."""
    ends = sequences.train_ends()
    room = ends - np.maximum(sequences.starts + 1, sequences.label_starts())
    per_user = np.clip(np.minimum(samples_per_user, room // positives), 0, None)
    row_users = np.repeat(np.arange(sequences.num_users), per_user)
    cuts = ends[row_users] - positives * (concat_ranges(np.zeros_like(per_user), per_user) + 1)
    return row_users, cuts


def request_cuts(sequences: UserSequences, positives: int, samples_per_user: int) -> Tuple[np.ndarray, ...]:
    """The ranking training samples when impressions come in requests: (row_users [R] int64, cuts [R]
    int64 flat rows, counts [R] int64). A sample's candidates are one request's first ``counts``
    impressions (at most ``positives``, the part in training), its history the events before the
    request; each request starting in a user's label part, after its first event, is one; a user's
    last ``samples_per_user``."""
    starts = sequences.request_starts
    assert starts is not None  # read with data.columns.request
    rows = np.arange(len(starts))
    owner = np.repeat(np.arange(sequences.num_users), sequences.lengths)
    boundaries = np.flatnonzero(starts == rows)  # every request's first row, a user's first among them
    first = np.maximum(sequences.starts + 1, sequences.label_starts())[owner[boundaries]]
    train_ends = sequences.train_ends()[owner[boundaries]]
    kept = (boundaries >= first) & (boundaries < train_ends)
    cuts, users = boundaries[kept], owner[boundaries[kept]]
    per_user = np.bincount(users, minlength=sequences.num_users)
    first_of_user = np.cumsum(per_user) - per_user  # users are in order: each user's cuts are consecutive
    from_end = per_user[users] - (np.arange(len(users)) - first_of_user[users])  # 1: the user's last request
    last = from_end <= samples_per_user
    return users[last], cuts[last], request_counts(sequences, users[last], cuts[last], positives)


def request_counts(sequences: UserSequences, users: np.ndarray, cuts: np.ndarray, positives: int) -> np.ndarray:
    """users / cuts: [R] int64 training samples of ``request_cuts`` (each cut a request's first row)
    -> [R] int64 their candidates: the request's impressions in the user's training part, at most
    ``positives``."""
    starts = sequences.request_starts
    assert starts is not None  # read with data.columns.request
    ends = np.searchsorted(starts, cuts, side="right")  # one past each request: starts never decrease
    return np.minimum(np.minimum(ends, sequences.train_ends()[users]) - cuts, positives)


def assemble(
    corpus: Corpus,
    users: np.ndarray,
    items: np.ndarray,
    timestamps: np.ndarray,
    query_times: np.ndarray,
    lengths: np.ndarray,
    num_targets: Optional[np.ndarray],
    labels: Dict[str, np.ndarray],
    events: np.ndarray,
) -> GRInput:
    """One jagged batch -> GRInput with every feature the corpus has.

    users: [B] int64 users of ``corpus.sequences`` (batches carry their dataset ids,
    ``Corpus.dataset_users``); items: [T] int64 dense item ids per token;
    timestamps: [T] int64; query_times: [T] int64, the time of the event each token
    predicts (``GRInput.query_times``); lengths: [B] tokens per sequence (targets included);
    num_targets: [B] trailing candidate tokens, or None; labels: {name: array};
    events: [T] int64 flat event row of each token, -1 for a candidate (no event: its event
    features are id 0, unknown, and zeros; its event list features empty bags).
    List-valued item and event features become ``token_lists`` (one bag per token), list-valued
    user features bags of ``common_ids``; without list features neither costs anything.
    """
    lengths_t = torch.from_numpy(lengths.astype(np.int64))
    users = corpus.dataset_users(users)
    item_features, event_features = corpus.item_features, corpus.event_features
    known = events >= 0
    rows = np.where(known, events, 0)
    sequence_keys = [ITEM_ID, *item_features.categorical, *event_features.categorical]
    sequence_values = [
        items,
        *(column[items] for column in item_features.categorical.values()),
        *(np.where(known, column[rows], 0) for column in event_features.categorical.values()),
    ]
    token_dense = {name: torch.from_numpy(matrix[items]) for name, matrix in item_features.dense.items()}
    for name, matrix in event_features.dense.items():
        token_dense[name] = torch.from_numpy(np.where(known[:, None], matrix[rows], np.float32(0)))
    token_lists = None
    if item_features.lists or event_features.lists:
        bags = {name: rows.take(items) for name, rows in item_features.lists.items()}
        bags.update({name: rows.take(np.where(known, events, -1)) for name, rows in event_features.lists.items()})
        token_lists = _keyed_bags(bags)
    user_features = corpus.user_features
    common_ids = None
    if user_features.lists:
        bags = {
            name: JaggedRows.from_lengths(np.ones(len(users), dtype=np.int64), column[users])
            for name, column in user_features.categorical.items()
        }
        bags.update({name: rows.take(users) for name, rows in user_features.lists.items()})
        common_ids = _keyed_bags(bags)
    elif user_features.categorical:
        common_ids = KeyedJaggedTensor(
            keys=list(user_features.categorical),
            values=torch.from_numpy(np.concatenate([column[users] for column in user_features.categorical.values()])),
            lengths=torch.ones(len(users) * len(user_features.categorical), dtype=torch.int64),
        )
    return GRInput(
        seq_offsets=offsets_from_lengths(lengths_t),
        max_seq_len=int(lengths.max()),
        timestamps=torch.from_numpy(timestamps.astype(np.int64)),
        query_times=torch.from_numpy(query_times.astype(np.int64)),
        num_targets=None if num_targets is None else torch.from_numpy(num_targets.astype(np.int64)),
        sequence_ids=KeyedJaggedTensor(
            keys=sequence_keys,
            values=torch.from_numpy(np.concatenate(sequence_values).astype(np.int64)),
            lengths=lengths_t.repeat(len(sequence_keys)),
        ),
        token_dense=token_dense,
        common_ids=common_ids,
        token_lists=token_lists,
        common_dense={name: torch.from_numpy(matrix[users]) for name, matrix in user_features.dense.items()},
        labels={
            "user": torch.from_numpy(users.astype(np.int64)),
            **{name: torch.from_numpy(value) for name, value in labels.items()},
        },
    )


def _keyed_bags(bags: Dict[str, JaggedRows]) -> KeyedJaggedTensor:
    """{feature: S bags of int64 ids} -> one KJT of stride S, keys in the mapping's order."""
    return KeyedJaggedTensor(
        keys=list(bags),
        values=torch.from_numpy(np.concatenate([rows.values for rows in bags.values()]).astype(np.int64)),
        lengths=torch.from_numpy(np.concatenate([rows.lengths() for rows in bags.values()])),
    )


class SplitBatches(Dataset, abc.ABC):
    """A split's samples; ``dataset[BatchKey]`` is the built batch of the key's rows."""

    def __init__(self, corpus: Corpus, split: str, max_seq_len: int, seed: int, eviction_block: int = 1) -> None:
        self.corpus, self.split, self.max_seq_len, self.seed = corpus, split, max_seq_len, seed
        self.eviction_block = eviction_block

    def windows(self, begins: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """[R] start of each history's window (``window_starts`` with this split's eviction block)."""
        return window_starts(begins, ends, self.max_seq_len, self.eviction_block)

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of samples (rows) in the split."""

    def groups(self) -> Optional[np.ndarray]:
        """[rows] int64 non-decreasing: the sequence each row's sample shares with its neighbours
        (``BatchPlan`` keeps a group in one batch and counts groups); None: a sequence each."""
        return None

    @abc.abstractmethod
    def build(self, rows: np.ndarray, rng: np.random.Generator) -> GRInput:
        """rows: [B] int64 sample indices -> the batch."""

    def __getitem__(self, key: BatchKey) -> GRInput:
        rng = np.random.default_rng([self.seed, SPLIT_CODES[self.split], key.epoch, key.number])
        return self.build(np.asarray(key.rows, dtype=np.int64), rng)


class RetrievalTrainBatches(SplitBatches):
    """Autoregressive next-item samples: one per user with >= 2 training events.

    Input: the most recent ``max_seq_len + 1`` training events minus the last;
    ``labels["next_item"]``: [T] the event after each token; ``labels["first_item"]``: [B] the
    sequence's first item when it is the user's first event (the window holds the whole history)
    and may be predicted (at or after the user's label start), else -1: what a user with no
    history does first (``task.retrieval.new_user_query``).
    """

    def __init__(self, corpus: Corpus, max_seq_len: int, seed: int, eviction_block: int = 1) -> None:
        super().__init__(corpus, "train", max_seq_len, seed, eviction_block)
        self.users = trainable_users(corpus.sequences)

    def __len__(self) -> int:
        return len(self.users)

    def build(self, rows: np.ndarray, rng: np.random.Generator) -> GRInput:
        seqs = self.corpus.sequences
        users = self.users[rows]
        last = seqs.train_ends()[users] - 1  # the last training event is only a label
        starts = self.windows(seqs.starts[users], last)
        lengths = last - starts
        index = concat_ranges(starts, lengths)
        next_item = seqs.items[index + 1]
        label_starts = seqs.label_starts()[users]
        if seqs.split is not None:  # events before a user's label start are history alone
            next_item = np.where(index + 1 >= np.repeat(label_starts, lengths), next_item, -1)
        first = (starts == seqs.starts[users]) & (starts >= label_starts)
        first_item = np.where(first, seqs.items[starts], -1)
        return assemble(
            self.corpus,
            users,
            seqs.items[index],
            seqs.timestamps[index],
            seqs.timestamps[index + 1],
            lengths,
            None,
            {"next_item": next_item, "first_item": first_item},
            index,
        )


class RetrievalEvalBatches(SplitBatches):
    """One sample per held-out event: the history before it (most recent ``max_seq_len``).

    A batch's samples of one user whose windows start at the same event (consecutive targets,
    ``data.test_events: all``) share one sequence: the window up to the last of them. HSTU is
    causal, so the output at the token before each target is the one its own sequence would end
    with: one forward scores them all. labels, per target (S of them, in the rows' order):
    ``target_item`` [S]; ``query_index`` [S] the flat token row of the target's query (the token
    before it); ``exclude_offsets`` [S+1] and ``exclude_items`` [E]: the distinct items not to rank
    (the whole history before the target, or only its input window when ``exclude == "window"``),
    never the target itself; ``user`` [B] stays per sequence. ``groups``: the rows of one sequence,
    which an evaluation ``BatchPlan`` keeps in one batch.
    """

    def __init__(
        self, corpus: Corpus, split: str, max_seq_len: int, seed: int, exclude: str, eviction_block: int = 1
    ) -> None:
        super().__init__(corpus, split, max_seq_len, seed, eviction_block)
        self.exclude = exclude
        self.users, self.targets = corpus.sequences.targets(split)

    def __len__(self) -> int:
        return len(self.users)

    def groups(self) -> np.ndarray:
        return np.cumsum(self._opens(self.users, self.targets)) - 1

    def _opens(self, users: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """[S] bool: whether each of these targets (in this order) opens a sequence: its user's or
        window's first, or one not after the target before it."""
        starts = self.windows(self.corpus.sequences.starts[users], targets)
        opens = np.ones(len(users), dtype=bool)
        opens[1:] = (users[1:] != users[:-1]) | (starts[1:] != starts[:-1]) | (targets[1:] <= targets[:-1])
        return opens

    def build(self, rows: np.ndarray, rng: np.random.Generator) -> GRInput:
        seqs = self.corpus.sequences
        users, targets = self.users[rows], self.targets[rows]
        starts = self.windows(seqs.starts[users], targets)
        opens = self._opens(users, targets)
        sequence = np.cumsum(opens) - 1
        closes = np.r_[opens[1:], True]
        lengths = targets[closes] - starts[opens]
        index = concat_ranges(starts[opens], lengths)
        query_index = (np.cumsum(lengths) - lengths)[sequence] + targets - 1 - starts
        target_items = seqs.items[targets]
        owner, excluded = self._excluded(
            sequence, targets, (starts if self.exclude == "window" else seqs.starts[users])
        )
        keep = excluded != target_items[owner]
        owner, excluded = owner[keep], excluded[keep]
        exclude_offsets = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=len(users)))])
        # The token after each input token is the next one, then the target: its time is the request's.
        return assemble(
            self.corpus,
            users[opens],
            seqs.items[index],
            seqs.timestamps[index],
            seqs.timestamps[index + 1],
            lengths,
            None,
            {
                "target_item": target_items,
                "query_index": query_index,
                "exclude_offsets": exclude_offsets.astype(np.int64),
                "exclude_items": excluded,
            },
            index,
        )

    def _excluded(self, sequence: np.ndarray, targets: np.ndarray, begins: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The distinct items of each target's rows ``begins .. target - 1`` (the targets of one
        sequence share their begin): (owner [E] int64 the target's index, items [E] int64), by target,
        each target's in the order they first occur. Each sequence's span is scanned once: a target's items are the
        first occurrences in its sequence's span before it."""
        items = self.corpus.sequences.items
        opens = np.r_[True, sequence[1:] != sequence[:-1]]
        first = begins[opens]
        spans = targets[np.r_[opens[1:], True]] - first
        span_rows = concat_ranges(first, spans)
        span_offsets = np.cumsum(spans) - spans
        keys = np.repeat(np.arange(len(first)), spans) * self.corpus.sequences.num_items + items[span_rows]
        firsts = np.sort(np.unique(keys, return_index=True)[1])  # span positions, sequence by sequence
        low = np.searchsorted(firsts, span_offsets[sequence])
        high = np.searchsorted(firsts, span_offsets[sequence] + targets - begins)
        owner = np.repeat(np.arange(len(targets)), high - low)
        return owner, items[span_rows[firsts[concat_ranges(low, high - low)]]]


class RankingBatches(SplitBatches):
    """Target-aware samples: a history + candidate tokens (real next events, then sampled items).

    Each row is (user, cut): the history is the most recent ``max_seq_len`` events before
    the cut, the candidates the ``positives`` events from the cut on plus ``negatives``
    unseen items, all stamped with the cut event's time. Labels per candidate, one per
    task: real event vs sampled (no ``min_rating``) or real event rated >= ``min_rating``.
    ``negative_table`` [rows, negatives] fixes the negatives (evaluation); None draws them per batch.
    counts: [rows] int64 each row's real events (``request_cuts``: a request's), instead of
    ``positives`` for all; history_ends: [rows] int64 where each history ends instead of the cut
    (an impression's request start, when ``data.columns.request`` groups them).
    """

    def __init__(
        self,
        corpus: Corpus,
        split: str,
        max_seq_len: int,
        seed: int,
        row_users: np.ndarray,
        cuts: np.ndarray,
        positives: int,
        negatives: int,
        tasks: Sequence[TaskConfig],
        negative_table: Optional[np.ndarray] = None,
        eviction_block: int = 1,
        counts: Optional[np.ndarray] = None,
        history_ends: Optional[np.ndarray] = None,
    ) -> None:
        super().__init__(corpus, split, max_seq_len, seed, eviction_block)
        self.row_users, self.cuts = row_users, cuts
        self.positives, self.negatives, self.tasks = positives, negatives, tuple(tasks)
        self.negative_table = negative_table
        self.counts = np.full(len(cuts), positives, dtype=np.int64) if counts is None else counts
        self.history_ends = cuts if history_ends is None else history_ends

    def __len__(self) -> int:
        return len(self.row_users)

    def build(self, rows: np.ndarray, rng: np.random.Generator) -> GRInput:
        seqs = self.corpus.sequences
        users, cuts, counts, ends = self.row_users[rows], self.cuts[rows], self.counts[rows], self.history_ends[rows]
        starts = self.windows(seqs.starts[users], ends)
        history = ends - starts
        positive_rows = concat_ranges(cuts, counts)  # [sum counts], row by row
        if self.negative_table is not None:
            negatives = self.negative_table[rows].astype(np.int64)
        else:
            negatives = self.corpus.sampler.sample(users, self.negatives, rng)
        num_candidates = counts + negatives.shape[1]  # [R]: each row's real events, then its negatives
        lengths = history + num_candidates
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        history_slots = concat_ranges(offsets[:-1], history)
        candidate_slots = concat_ranges(offsets[:-1] + history, num_candidates)
        real_slots = concat_ranges(offsets[:-1] + history, counts)
        negative_slots = concat_ranges(offsets[:-1] + history + counts, np.full(len(rows), negatives.shape[1]))
        history_rows = concat_ranges(starts, history)
        items = np.empty(int(offsets[-1]), dtype=np.int64)
        times = np.empty(int(offsets[-1]), dtype=np.int64)
        events = np.full(int(offsets[-1]), -1, dtype=np.int64)  # candidates have no event (row) features
        events[history_slots] = history_rows
        items[history_slots], items[real_slots] = seqs.items[history_rows], seqs.items[positive_rows]
        items[negative_slots] = negatives.ravel()
        times[history_slots] = seqs.timestamps[history_rows]
        times[candidate_slots] = np.repeat(seqs.timestamps[cuts], num_candidates)
        query_times = times.copy()  # the last history token's next event is the history's end: the request
        query_times[history_slots] = seqs.timestamps[history_rows + 1]
        candidate_offsets = np.concatenate([[0], np.cumsum(num_candidates)])
        real_candidates = concat_ranges(candidate_offsets[:-1], counts)  # the real events among the candidates
        labels = {}
        for task in self.tasks:
            label = np.zeros(int(candidate_offsets[-1]), dtype=np.float32)
            if task.min_rating is None:
                label[real_candidates] = 1.0
            else:
                assert seqs.ratings is not None  # a min_rating task needs ratings (the datamodule checks)
                label[real_candidates] = seqs.ratings[positive_rows] >= task.min_rating
            labels[task.name] = label
        return assemble(self.corpus, users, items, times, query_times, lengths, num_candidates, labels, events)
