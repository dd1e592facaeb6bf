"""One rank's batches of a prepared dataset, streamed row group by row group.

Layout: rank r of W reads the row groups ``PreparedData.rank_groups`` deals it (shards r, r+W, ...;
row groups r, r+W, ... when there are fewer shards than ranks); DataLoader worker w of K reads its
rank's row groups w, w+K, ... (no more workers than steps). Every rank takes the same number of steps
(``PreparedData.steps``): a rank with fewer samples takes smaller batches, its samples split into that
many near-equal batches, shared among its workers in proportion to their samples. Every sample of a
split is in exactly one batch of one rank.

Order: evaluation reads row groups in order and batches their samples in that order. Training, per
epoch, from (data.seed, epoch, rank, worker) (``epoch_generator``): shards in a permuted order, each
shard's row groups permuted, and samples drawn at random from a buffer (``SampleBuffer``) of about
``data.shuffle_buffer`` users: whenever fewer than half of them still have samples to give, whole row
groups top it up and its samples are shuffled again. It holds at most max(shuffle_buffer, a batch's
users) + one row group's users. A buffer of at least the users of the worker's row groups reads them
in order and permutes all their samples at once, which on rank 0's only worker is raw reading's
order: the same samples, in the same order, permuted by the same generator as ``BatchPlan``.

Batches are built by the raw module's classes (``gr.data.batching``) on a Corpus of the buffered
users, seeded by (seed, split, epoch, batch number) as there; ranking evaluation negatives are drawn
per row group from (seed, split, shard, row group), so they depend on neither ranks nor workers.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data.dataloader import _BaseDataLoaderIter

from gr.data.batching import (
    SPLIT_CODES,
    BatchKey,
    Corpus,
    RankingBatches,
    RetrievalEvalBatches,
    RetrievalTrainBatches,
    SplitBatches,
    epoch_generator,
    identity_collate,
    request_counts,
)
from gr.data.interactions import DataFormatError
from gr.data.prepared.reader import PreparedData, RowGroup, UserRows
from gr.model import GRInput


class SampleBuffer:
    """Users read from row groups (in the given order) and their samples not batched yet.

    capacity: users to hold before drawing at random (0: no shuffling, samples in reading order).
    Held: ``rows`` (UserRows), and per pending sample ``owners`` [P] int64 (its user's position in
    ``rows``), ``cuts`` [P] int64 (its cut relative to the user's first event), ``negatives`` [P, K]
    int32 (ranking evaluation's fixed negatives) or None. ``peak_users``: the most users ever held.
    """

    def __init__(
        self,
        data: PreparedData,
        split: str,
        groups: Sequence[int],
        capacity: int = 0,
        rng: Optional[np.random.Generator] = None,
    ) -> None:
        self.data, self.split, self.capacity, self.rng = data, split, capacity, rng
        self.positions = list(groups)  # positions in data.row_groups, read in this order
        self._scan = data.scan([data.row_groups[p] for p in self.positions])
        self._next = 0
        self.rows: Optional[UserRows] = None
        self.owners = np.zeros(0, dtype=np.int64)
        self.cuts = np.zeros(0, dtype=np.int64)
        self.negatives: Optional[np.ndarray] = None
        self.remaining = np.zeros(0, dtype=np.int64)  # [held users] pending samples of each
        self.pending_users = 0  # held users with a pending sample
        self.corpus: Optional[Corpus] = None
        self.peak_users = 0

    @property
    def held_users(self) -> int:
        return 0 if self.rows is None else len(self.rows.users)

    def take(self, count: int) -> Tuple[Corpus, np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """The next ``count`` samples: (corpus of the held users, owners [count] int64 users of it,
        cuts [count] int64 flat rows of it, negatives [count, K] int32 or None)."""
        if self._needs_top_up(count):
            self._top_up(count)
        assert self.corpus is not None  # built by the top-up
        owners, cuts = self.owners[:count], self.cuts[:count] + self.corpus.sequences.starts[self.owners[:count]]
        negatives = None if self.negatives is None else self.negatives[:count]
        users, taken = np.unique(owners, return_counts=True)
        self.remaining[users] -= taken
        self.pending_users -= int(np.count_nonzero(self.remaining[users] == 0))
        self.owners, self.cuts = self.owners[count:], self.cuts[count:]
        self.negatives = None if self.negatives is None else self.negatives[count:]
        return self.corpus, owners, cuts, negatives

    def _needs_top_up(self, count: int) -> bool:
        if len(self.owners) < count or self.corpus is None:
            return True
        more = self._next < len(self.positions)
        return more and self.capacity > 0 and self.pending_users < self.capacity // 2

    def _top_up(self, count: int) -> None:
        """Drop the users with no pending sample, read row groups until ``count`` samples and
        ``capacity`` users are held (or none is left), reshuffle (training), rebuild the corpus."""
        rows, owners, cuts, negatives = [], [self.owners], [self.cuts], [self.negatives]
        if self.rows is not None:
            keep = np.flatnonzero(self.remaining)
            rows.append(self.rows.take(keep))
            owners[0] = np.searchsorted(keep, self.owners)
        held, pending = sum(len(r.users) for r in rows), len(self.owners)
        while (pending < count or held < self.capacity) and self._next < len(self.positions):
            group, read = next(self._scan)
            kept, users, relative, drawn = self._samples(self.positions[self._next], group, read)
            rows.append(kept)
            owners.append(held + users)
            cuts.append(relative)
            negatives.append(drawn)
            held, pending = held + len(kept.users), pending + len(users)
            self._next += 1
            self.peak_users = max(self.peak_users, held)
        if pending < count or not rows:
            raise DataFormatError(
                self.data.directory,
                f"{self.split}: the shards hold fewer samples than counted when opened (changed since?)",
            )
        self.rows = UserRows.concat(rows) if len(rows) > 1 else rows[0]
        self.owners, self.cuts = np.concatenate(owners), np.concatenate(cuts)
        present = [n for n in negatives if n is not None]
        self.negatives = np.concatenate(present) if present else None
        self.remaining = np.bincount(self.owners, minlength=len(self.rows.users))
        self.pending_users = int(np.count_nonzero(self.remaining))
        if self.rng is not None:
            order = self.rng.permutation(len(self.owners))
            self.owners, self.cuts = self.owners[order], self.cuts[order]
            self.negatives = None if self.negatives is None else self.negatives[order]
        self.corpus = self.data.corpus(self.rows)

    def _samples(
        self, position: int, group: RowGroup, rows: UserRows
    ) -> Tuple[UserRows, np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """One row group's users that have ``split`` samples, and those samples: (the users' rows,
        owners [S] int64 positions in them, cuts [S] int64 relative to the user's first event,
        negatives [S, K] int32 or None)."""
        data, split = self.data, self.split
        corpus = data.corpus(rows)
        users, cuts = data.samples(corpus.sequences, split)
        if len(users) != data.counts[split][position]:
            raise DataFormatError(
                data.shard_path(group),
                f"row group {group.index}: {len(users)} {split} samples, {data.counts[split][position]} when "
                "counted (changed since opened?)",
            )
        negatives = None
        if split != "train" and data.config.task == "ranking":
            rng = np.random.default_rng([data.config.seed, SPLIT_CODES[split], group.shard, group.index])
            negatives = corpus.sampler.sample(users, data.config.ranking.eval_num_negatives, rng).astype(np.int32)
        keep = np.unique(users)
        return rows.take(keep), np.searchsorted(keep, users), cuts - corpus.sequences.starts[users], negatives


class PreparedSplit(IterableDataset):
    """One rank's batches of ``split`` (``GRInput``s); ``len``: the steps every rank takes.

    The epoch (training order) is set with ``set_epoch`` before a pass, in shared memory so that
    persistent DataLoader workers see it (``EpochLoader`` does it)."""

    def __init__(self, data: PreparedData, split: str, rank: int, world: int, eviction_block: int = 1) -> None:
        self.data, self.split, self.rank, self.world = data, split, rank, world
        self.eviction_block = eviction_block
        self.groups = data.rank_groups(rank, world)
        self.steps = data.steps(split, world)
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[GRInput]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        yield from self.batches(int(self.epoch) if self.split == "train" else 0, worker, workers)

    def worker_plans(self, workers: int) -> List[Tuple[List[int], int, int]]:
        """Per worker: (its row groups' positions, its steps, the rank's number of its first batch)."""
        active = max(1, min(workers, self.steps, len(self.groups)))
        parts = [self.groups[w::active] for w in range(active)] + [[] for _ in range(workers - active)]
        counts = np.array([int(self.data.counts[self.split][part].sum()) for part in parts], dtype=np.int64)
        steps = apportion(self.steps, counts)
        firsts = np.concatenate([[0], np.cumsum(steps)[:-1]])
        return [(part, int(s), int(f)) for part, s, f in zip(parts, steps, firsts)]

    def batches(self, epoch: int, worker: int = 0, workers: int = 1) -> Iterator[GRInput]:
        """The batches of worker ``worker`` of ``workers`` in ``epoch`` (training order; evaluation ignores it)."""
        data, config = self.data, self.data.config
        positions, steps, first = self.worker_plans(workers)[worker]
        samples = int(data.counts[self.split][positions].sum())
        sizes = [samples // steps + (i < samples % steps) for i in range(steps)] if steps else []
        train = self.split == "train"
        rng = epoch_generator(config.seed, epoch, self.rank, worker) if train else None
        capacity = config.shuffle_buffer if train else 0
        whole = capacity >= sum(data.row_groups[p].users for p in positions)  # one top-up reads them all
        order = shuffled(positions, data.row_groups, rng) if rng is not None and not whole else positions
        buffer = SampleBuffer(data, self.split, order, capacity, rng)
        for i, size in enumerate(sizes):
            corpus, owners, cuts, negatives = buffer.take(size)
            dataset, rows = self._dataset(corpus, owners, cuts, negatives)
            yield dataset[BatchKey(epoch, (first + i) * self.world + self.rank, rows)]

    def _dataset(
        self, corpus: Corpus, owners: np.ndarray, cuts: np.ndarray, negatives: Optional[np.ndarray]
    ) -> Tuple[SplitBatches, np.ndarray]:
        """The split's batch class over ``corpus`` and the rows of its samples ``owners`` / ``cuts``."""
        config, split = self.data.config, self.split
        if config.task == "ranking":
            ranking, train = config.ranking, split == "train"
            requests = corpus.sequences.request_starts  # a request's impressions: one sample, one history
            counts = history_ends = None
            if requests is not None and train:
                counts = request_counts(corpus.sequences, owners, cuts, ranking.positives_per_sample)
            elif requests is not None:
                history_ends = requests[cuts]
            dataset: SplitBatches = RankingBatches(
                corpus,
                split,
                config.max_seq_len,
                config.seed,
                owners,
                cuts,
                ranking.positives_per_sample if train else 1,
                ranking.num_negatives if train else ranking.eval_num_negatives,
                ranking.tasks,
                negative_table=negatives,
                eviction_block=self.eviction_block,
                counts=counts,
                history_ends=history_ends,
            )
            return dataset, np.arange(len(owners))
        if split == "train":
            train_batches = RetrievalTrainBatches(corpus, config.max_seq_len, config.seed, self.eviction_block)
            return train_batches, np.searchsorted(train_batches.users, owners)
        eval_batches = RetrievalEvalBatches(
            corpus, split, config.max_seq_len, config.seed, config.eval_exclude, self.eviction_block
        )
        return eval_batches, np.searchsorted(eval_batches.targets, cuts)  # targets ascend: users' rows in order


def shuffled(positions: Sequence[int], groups: Sequence[RowGroup], rng: np.random.Generator) -> List[int]:
    """``positions`` (of ``groups``) reordered: shards in a random order, each one's row groups too."""
    shards: Dict[int, List[int]] = {}
    for position in positions:
        shards.setdefault(groups[position].shard, []).append(position)
    keys = list(shards)
    return [p for k in rng.permutation(len(keys)) for p in rng.permutation(shards[keys[k]]).tolist()]


def apportion(total: int, counts: np.ndarray) -> np.ndarray:
    """Split ``total`` steps over parts holding ``counts`` ([K] int64) samples: [K] int64 summing to
    ``total``, each part with samples getting 1 .. counts[k] steps, about in proportion (the largest
    batch as small as it can be), a part without samples none. Needs
    (parts with samples) <= total <= counts.sum()."""
    counts = np.asarray(counts, dtype=np.int64)
    steps = np.minimum(counts, np.maximum(counts > 0, np.floor(total * counts / max(1, counts.sum())))).astype(np.int64)
    while steps.sum() < total:  # one more step where batches are largest
        room = np.where(steps < counts, counts / np.maximum(steps, 1), -1.0)
        steps[int(np.argmax(room))] += 1
    while steps.sum() > total:  # one less where batches are smallest
        room = np.where(steps > 1, counts / np.maximum(steps, 1), np.inf)
        steps[int(np.argmin(room))] -= 1
    return steps


class EpochLoader(DataLoader):
    """A DataLoader over a ``PreparedSplit`` that gives it the epoch before each pass (its workers
    too): ``epoch_of()`` when given (the trainer's current epoch), else the last ``set_epoch``'s."""

    def __init__(self, dataset: PreparedSplit, num_workers: int, epoch_of: Optional[Callable[[], int]] = None) -> None:
        super().__init__(
            dataset,
            batch_size=None,
            # torch's stub has collate_fn take a list; with batch_size=None it takes each (built) batch
            collate_fn=identity_collate,  # type: ignore[arg-type]
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
        )
        self.epoch_of = epoch_of
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> _BaseDataLoaderIter:
        split = self.dataset
        assert isinstance(split, PreparedSplit)
        split.set_epoch(self.epoch_of() if self.epoch_of is not None else self.epoch)
        return super().__iter__()
