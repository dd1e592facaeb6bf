"""Reading a prepared dataset: its maps and side features whole, its shards one row group at a time.

``PreparedData`` opens DIR for a data config: the manifest (``read_manifest``, checked against the
config's hash), the files beside the shards verified against their checksums, the maps
(``load_mappings``; a warm start's maps extended by them, so known ids keep theirs), the item and
user side tables aligned with the stored vocabularies (``SideFeatures.align`` with them as ``base``:
the codes raw reading gives). Then one pass over every row group reads only ``items`` (and
``timestamps`` under the time split, ``requests`` with ``data.columns.request``) to count each row
group's samples per split and the training items' popularity. What it holds grows with the users
and items (maps, side features) and the row groups (counts), never with the interactions.

Each shard is verified (sha256) the first time this process opens it, and each row group decoded
is checked (consecutive users, timestamps in order: ``check_shard_order``); errors name the shard.

A dataset appended to (``gr data prepare --append``) is read as its shards then each append's, a
user's row in a later shard superseding its earlier ones (``owner``: the shard of each user's last
row, from the appends' ``user`` columns); ``data.since_append: N`` reads the shards of appends N.. only.
A dataset never appended to reads as before: no owners, nothing skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gr.data.batching import Corpus, ranking_cuts, request_cuts, trainable_users
from gr.data.config import DataConfig
from gr.data.features import SideFeatures
from gr.data.interactions import DataFormatError, SideTable
from gr.data.mappings import IdMap, load_mappings
from gr.data.prepared.manifest import (
    ITEMS,
    ITEMS_TABLE,
    MANIFEST,
    MAPS,
    RATINGS,
    REQUESTS,
    SIDE_KEY,
    TIMESTAMPS,
    USER,
    USERS_TABLE,
    check_shard_order,
    event_column,
    read_manifest,
    verify_file,
)
from gr.data.sampling import UnseenSampler
from gr.data.sequences import EVALUATED, SPLITS, UserSequences, configured_split, request_starts
from gr.jagged_rows import JaggedRows, concat_ranges

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowGroup:
    """One row group of one shard, the unit ranks and workers are dealt: users
    ``first_user .. first_user+users-1``, or (``first_user`` None: an append's) ``users`` increasing ids,
    not counting those a later shard supersedes."""

    shard: int
    index: int
    first_user: Optional[int]
    users: int


@dataclass
class UserRows:
    """Decoded users of a prepared dataset (a row group, or several).

    users: [U] int64 dense user ids; offsets: [U+1] int64, user u owns events ``offsets[u]:offsets[u+1]``
    items: [N] int64 dense item ids; timestamps: [N] int64; ratings: [N] float32 or None
    events: the features of each event ([N] rows, aligned with the dataset's vocabularies)
    requests: [N] str raw request ids (``data.columns.request``), or None
    """

    users: np.ndarray
    offsets: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray
    ratings: Optional[np.ndarray]
    events: SideFeatures
    requests: Optional[np.ndarray] = None

    def take(self, index: np.ndarray) -> "UserRows":
        """The users ``index`` ([U'] int64 positions), in that order."""
        lengths = np.diff(self.offsets)[index]
        rows = concat_ranges(self.offsets[:-1][index], lengths)
        return UserRows(
            self.users[index],
            _offsets(lengths),
            self.items[rows],
            self.timestamps[rows],
            None if self.ratings is None else self.ratings[rows],
            self.events.take(rows),
            None if self.requests is None else self.requests[rows],
        )

    @classmethod
    def concat(cls, parts: Sequence["UserRows"]) -> "UserRows":
        """The users of ``parts``, one part after another."""
        ratings = [p.ratings for p in parts if p.ratings is not None]
        requests = [p.requests for p in parts if p.requests is not None]
        return cls(
            np.concatenate([p.users for p in parts]),
            _offsets(np.concatenate([np.diff(p.offsets) for p in parts])),
            np.concatenate([p.items for p in parts]),
            np.concatenate([p.timestamps for p in parts]),
            np.concatenate(ratings) if len(ratings) == len(parts) else None,
            SideFeatures.concat([p.events for p in parts]),
            np.concatenate(requests) if len(requests) == len(parts) else None,
        )


class PreparedData:
    """A prepared dataset opened for ``config`` (the module docstring says what is read and checked).

    user_map / item_map: the dataset's ids (item_map extended from ``base_maps["items"]`` on a warm
    start); vocabularies: {feature: IdMap}; item_features / user_features: aligned side features;
    event_features: the event features with no rows (names, vocabularies, dims); row_groups: every
    row group in shard order; counts: {split: [row groups] int64 samples}; evaluated_users: {"val" |
    "test": users with a target}; popularity: [num_items]
    int64 training items; max_seen: the most distinct items of one user (ranking's negatives room).
    """

    def __init__(self, directory: Path, config: DataConfig, base_maps: Mapping[str, IdMap]) -> None:
        self.manifest = read_manifest(directory, config)
        self.shards = self.manifest.shards_since(config.since_append or 0)
        self.prepared_shards = 0 if config.since_append else len(self.manifest.shards)  # before the appends'
        self.config = self._since_append(config)
        self._verified: Set[str] = set()
        for relpath in self.manifest.current_files():  # maps and side tables: small, read whole now
            self._verify(relpath)
        maps, columns = load_mappings(str(self.manifest.path(self.manifest.current(MAPS))))
        self.dense_columns = columns
        self.user_map = maps.pop("users")
        stored_items = maps.pop("items")
        base_items = base_maps.get("items")
        self.item_map = (
            stored_items if base_items is None else base_items.extended(stored_items.raw, stored_items.source)
        )
        # stored dense item id -> this run's (None: the same), when a warm start's map comes first
        self.item_codes = None if base_items is None else self.item_map.encode(stored_items.raw)
        self.num_stored_items = stored_items.cardinality
        self.vocabularies = {
            name: base_maps[name].extended(vocabulary.raw, vocabulary.source) if name in base_maps else vocabulary
            for name, vocabulary in maps.items()
        }
        self.item_features = self._side_features(ITEMS_TABLE, self.item_map, config.item_features)
        self.user_features = self._side_features(USERS_TABLE, self.user_map, config.user_features)
        no_ids = IdMap(np.zeros(0, dtype=np.int64))
        self.event_features = SideFeatures.align(self._no_events(), no_ids, self.vocabularies)
        self._append_users: Dict[int, np.ndarray] = {}  # an append's shard -> [users] its user column
        self.owner = self._owners()
        self.row_groups = self._row_groups()
        self.counts: Dict[str, np.ndarray] = {}
        self.popularity = np.zeros(self.item_map.cardinality, dtype=np.int64)
        self.max_seen = 0
        self.evaluated_users = {split: 0 for split in EVALUATED}
        self._count()

    @property
    def directory(self) -> Path:
        return self.manifest.directory

    def _since_append(self, config: DataConfig) -> DataConfig:
        """``config`` with ``train_start`` at append N's first event when ``data.since_append: N`` leaves
        it out; ValueError when it is earlier (the users without a later event are not read)."""
        if config.since_append is None:
            return config
        first = self.manifest.appends[config.since_append - 1].first_timestamp
        if config.train_start is None:
            log.info("data.since_append %d: data.train_start %d, its first event", config.since_append, first)
            return dataclasses.replace(config, train_start=first)
        if config.train_start < first:
            raise ValueError(
                f"data.train_start: with data.since_append {config.since_append} expected at or after its first "
                f"event, {first} (the users without a later event are not read), got {config.train_start}"
            )
        return config

    @property
    def num_items(self) -> int:
        return self.item_map.cardinality

    # ---- files ---------------------------------------------------------------------------------
    def _verify(self, relpath: str) -> None:
        """Check ``relpath``'s sha256 against the manifest, once per process."""
        if relpath not in self._verified:
            verify_file(self.manifest, relpath)
            self._verified.add(relpath)

    def open_shard(self, shard: int) -> pq.ParquetFile:
        """Shard ``shard``'s Parquet file, verified; DataFormatError naming it when it does not hold
        the row groups and users the manifest lists."""
        entry = self.shards[shard]
        self._verify(entry.path)
        path = self.manifest.path(entry.path)
        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as error:
            raise DataFormatError(path, f"not a readable Parquet file ({error})") from None
        metadata = parquet.metadata
        if metadata.num_row_groups != entry.row_groups or metadata.num_rows != entry.users:
            raise DataFormatError(
                path,
                f"holds {metadata.num_rows} users in {metadata.num_row_groups} row groups, the manifest lists "
                f"{entry.users} in {entry.row_groups} (prepare the dataset again)",
            )
        return parquet

    def _owners(self) -> Optional[np.ndarray]:
        """[num_users] int64: the shard (position in ``shards``) of each user's last row, -1 for none;
        None when no shard supersedes another's rows (no append read)."""
        if len(self.shards) == self.prepared_shards:
            return None
        owner = np.full(self.user_map.cardinality, -1, dtype=np.int64)
        for shard, entry in enumerate(self.shards):
            if shard < self.prepared_shards:
                owner[entry.first_user : entry.first_user + entry.users] = shard
            else:
                self._append_users[shard] = self._column_users(shard)
                owner[self._append_users[shard]] = shard
        return owner

    def _column_users(self, shard: int) -> np.ndarray:
        """[users] int64: the ``user`` column of an append's shard."""
        path = self.manifest.path(self.shards[shard].path)
        try:
            column = self.open_shard(shard).read(columns=[USER])[USER].combine_chunks()
        except (pa.ArrowException, OSError) as error:
            raise DataFormatError(path, f"column {USER!r}: not readable ({error})") from None
        users = _values(path, USER, column)
        check_shard_order(path, users, np.zeros(len(users) + 1, np.int64), users[:0], self.user_map, None)
        return users

    def _row_groups(self) -> List[RowGroup]:
        """Every shard's row groups in order (the users of each from the shard's footer; of an append's
        shard, those no later shard supersedes); row groups left with no user are left out."""
        groups = []
        for shard, entry in enumerate(self.shards):
            metadata = self.open_shard(shard).metadata
            consecutive = shard < self.prepared_shards
            first = entry.first_user
            users = self._append_users.get(shard)
            start = 0
            for index in range(metadata.num_row_groups):
                rows = metadata.row_group(index).num_rows
                if self.owner is None:
                    current = rows
                elif consecutive:
                    current = int((self.owner[first + start : first + start + rows] == shard).sum())
                else:
                    assert users is not None
                    current = int((self.owner[users[start : start + rows]] == shard).sum())
                if current:
                    groups.append(RowGroup(shard, index, first + start if consecutive else None, current))
                start += rows
        return groups

    def shard_path(self, group: RowGroup) -> Path:
        return self.manifest.path(self.shards[group.shard].path)

    # ---- side features ---------------------------------------------------------------------------
    def _side_features(self, relpath: str, ids: IdMap, wanted: bool) -> SideFeatures:
        """The side table ``relpath`` aligned with ``ids`` and the vocabularies (none: no features)."""
        relpath = self.manifest.current(relpath)
        if not wanted or relpath not in self.manifest.current_files():
            return SideFeatures()
        path = self.manifest.path(relpath)
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as error:
            raise DataFormatError(path, f"not a readable Parquet file ({error})") from None
        if SIDE_KEY not in table.column_names:
            raise DataFormatError(path, f"lacks the column {SIDE_KEY!r} (the raw id)")
        keys = _values(path, SIDE_KEY, table[SIDE_KEY].combine_chunks())
        features = {name: table[name].combine_chunks() for name in table.column_names if name != SIDE_KEY}
        return SideFeatures.align(self._side_table(path, keys, features), ids, self.vocabularies)

    def _side_table(self, path: Path, keys: np.ndarray, columns: Mapping[str, pa.Array]) -> SideTable:
        """keys: [M] raw ids; columns: {feature: [M] arrow values}: a scalar is a categorical value,
        a list of floats a dense feature's d values, a list of ids or strings a list feature's values."""
        categorical: Dict[str, np.ndarray] = {}
        dense: Dict[str, np.ndarray] = {}
        lists: Dict[str, JaggedRows] = {}
        for name, column in columns.items():
            if column.null_count:
                raise DataFormatError(path, f"column {name!r}: {column.null_count} null values")
            if not _is_list(column.type):
                categorical[name] = _values(path, name, column)
                continue
            lengths = pc.list_value_length(column).to_numpy().astype(np.int64)
            flat = pc.list_flatten(column)
            if pa.types.is_floating(flat.type):
                width = len(self.dense_columns.get(name, ()))
                if not (lengths == width).all():
                    raise DataFormatError(
                        path, f"column {name!r}: expected {width} values per row ({MAPS}/{name}.columns.tsv)"
                    )
                dense[name] = flat.to_numpy().astype(np.float32).reshape(len(keys), width)
            else:
                lists[name] = JaggedRows.from_lengths(lengths, _values(path, name, flat))
        return SideTable(keys, categorical, dense, {name: self.dense_columns[name] for name in dense}, lists)

    def _no_events(self) -> SideTable:
        """The event features of the manifest with no rows (their names, vocabularies, dims)."""
        none = np.zeros(0, dtype=np.int64)
        table = SideTable(none)
        for name, kind in self.manifest.event_features.items():
            if kind == "dense":
                table.dense[name] = np.zeros((0, len(self.dense_columns.get(name, ()))), dtype=np.float32)
                table.dense_columns[name] = self.dense_columns.get(name, [])
            elif kind == "list":
                table.lists[name] = JaggedRows(np.zeros(1, dtype=np.int64), self._vocabulary(name).raw[:0])
            else:
                table.categorical[name] = self._vocabulary(name).raw[:0]
        return table

    def _vocabulary(self, name: str) -> IdMap:
        if name not in self.vocabularies:
            raise DataFormatError(
                self.directory / MANIFEST, f"event_features: {name!r} has no vocabulary in {MAPS}/ (prepare again)"
            )
        return self.vocabularies[name]

    # ---- row groups ------------------------------------------------------------------------------
    def read(self, parquet: pq.ParquetFile, group: RowGroup, full: bool = True) -> UserRows:
        """Row group ``group`` of its shard (``parquet``, from ``open_shard``), decoded and checked.
        full=False reads only what counting needs: items, request ids, and timestamps under the time
        split or with a train start (else the timestamps are zeros)."""
        path = self.shard_path(group)
        timed = full or self.config.split == "time" or self.config.train_start is not None
        requested = self.config.columns.request is not None
        columns = [USER, ITEMS, *([TIMESTAMPS] if timed else []), *([REQUESTS] if requested else [])]
        if full:
            columns += [RATINGS] * self.manifest.has_ratings
            columns += [event_column(name) for name in self.manifest.event_features]
        try:
            table = parquet.read_row_group(group.index, columns=columns)
        except (pa.ArrowException, OSError) as error:
            raise DataFormatError(path, f"row group {group.index}: not readable ({error})") from None
        users = _values(path, USER, table[USER].combine_chunks())
        lengths, items = self._list(path, table, ITEMS)
        offsets = _offsets(lengths)
        if len(items) and (items.min() < 0 or items.max() >= self.num_stored_items):
            raise DataFormatError(path, f"column {ITEMS!r}: dense item ids outside 0 .. {self.num_stored_items - 1}")
        timestamps = self._aligned(path, table, TIMESTAMPS, lengths) if timed else np.zeros(len(items), np.int64)
        check_shard_order(path, users, offsets, timestamps, self.user_map, group.first_user)
        ratings = self._aligned(path, table, RATINGS, lengths).astype(np.float32) if RATINGS in columns else None
        requests = self._aligned(path, table, REQUESTS, lengths) if requested else None
        events = self._events(path, table, lengths) if full else SideFeatures()
        if self.item_codes is not None:
            items = self.item_codes[items]
        rows = UserRows(users.astype(np.int64), offsets, items, timestamps, ratings, events, requests)
        if self.owner is not None:
            rows = rows.take(np.flatnonzero(self.owner[rows.users] == group.shard))
        return rows

    def _events(self, path: Path, table: pa.Table, lengths: np.ndarray) -> SideFeatures:
        """The ``event:<F>`` columns of a row group (one value per event of each user: ``lengths``
        [U]) as the event features of its [N] events, coded by the dataset's vocabularies."""
        schema = self.event_features
        events = SideFeatures(vocabularies=schema.vocabularies, dense_columns=schema.dense_columns)
        for name, kind in self.manifest.event_features.items():
            column = event_column(name)
            values = self._aligned_list(path, table, column, lengths)
            if kind == "categorical":
                events.categorical[name] = self._codes(path, column, values, name)
            elif kind == "list":
                bags = pc.list_value_length(values).to_numpy().astype(np.int64)
                codes = self._codes(path, column, pc.list_flatten(values), name)
                events.lists[name] = JaggedRows.from_lengths(bags, codes)
            else:
                width = schema.dense[name].shape[1]
                matrix = _values(path, column, pc.list_flatten(values)).astype(np.float32)
                if len(matrix) != width * len(values):
                    raise DataFormatError(path, f"column {column!r}: expected {width} values per event")
                events.dense[name] = matrix.reshape(len(values), width)
        return events

    def _codes(self, path: Path, column: str, values: pa.Array, name: str) -> np.ndarray:
        """[V] raw values of feature ``name`` -> [V] int64 ids of its vocabulary (each distinct value
        looked up once); a value the vocabulary lacks is a DataFormatError naming the column."""
        if values.null_count:
            raise DataFormatError(path, f"column {column!r}: {values.null_count} null values")
        encoded = pc.dictionary_encode(values)
        distinct = _values(path, column, encoded.dictionary)
        ids = self.vocabularies[name].encode(distinct, unknown=-1)
        if (ids < 0).any():
            raise DataFormatError(
                path, f"column {column!r}: value {distinct[ids < 0][0]!r} is not in {MAPS}/{name}.tsv (prepare again)"
            )
        return ids[encoded.indices.to_numpy()]

    def _list(self, path: Path, table: pa.Table, name: str) -> Tuple[np.ndarray, np.ndarray]:
        """A list column -> ([U] int64 lengths, [N] values)."""
        column = table[name].combine_chunks()
        if not _is_list(column.type) or column.null_count:
            raise DataFormatError(path, f"column {name!r}: expected a list per user without nulls, got {column.type}")
        return pc.list_value_length(column).to_numpy().astype(np.int64), _values(path, name, pc.list_flatten(column))

    def _aligned(self, path: Path, table: pa.Table, name: str, lengths: np.ndarray) -> np.ndarray:
        """A list column holding one value per event (as many per user as ``items``) -> [N] values."""
        return _values(path, name, self._aligned_list(path, table, name, lengths))

    def _aligned_list(self, path: Path, table: pa.Table, name: str, lengths: np.ndarray) -> pa.Array:
        """A list column holding one value per event -> its [N] values, as Arrow."""
        column = table[name].combine_chunks()
        self._check_lengths(path, name, column, lengths)
        flat = pc.list_flatten(column)
        if flat.null_count:
            raise DataFormatError(path, f"column {name!r}: {flat.null_count} null values")
        return flat

    @staticmethod
    def _check_lengths(path: Path, name: str, column: pa.Array, lengths: np.ndarray) -> None:
        if not _is_list(column.type) or column.null_count:
            raise DataFormatError(path, f"column {name!r}: expected a list per user without nulls, got {column.type}")
        found = pc.list_value_length(column).to_numpy()
        bad = np.flatnonzero(found != lengths)
        if len(bad):
            row = int(bad[0])
            raise DataFormatError(
                path, f"column {name!r}: row {row} holds {int(found[row])} values for {int(lengths[row])} items"
            )

    def scan(self, groups: Sequence[RowGroup], full: bool = True) -> Iterator[Tuple[RowGroup, UserRows]]:
        """(row group, its rows) of ``groups`` in that order, each shard opened once per visit."""
        shard, parquet = -1, None
        for group in groups:
            if group.shard != shard or parquet is None:
                shard, parquet = group.shard, self.open_shard(group.shard)
            yield group, self.read(parquet, group, full)

    # ---- samples ---------------------------------------------------------------------------------
    def corpus(self, rows: UserRows) -> Corpus:
        """``rows`` as a Corpus of their own (the configured split applied; batches carry the dataset's user
        ids; with request ids, each event's request start)."""
        starts = None if rows.requests is None else request_starts(rows.offsets, rows.requests)
        sequences = UserSequences(
            rows.offsets, rows.items, rows.timestamps, rows.ratings, self.num_items, request_starts=starts
        )
        sequences.split = configured_split(sequences, self.config, user_ids=rows.users)
        return Corpus(sequences, self.item_features, self.user_features, rows.events, user_ids=rows.users)

    def samples(self, sequences: UserSequences, split: str) -> Tuple[np.ndarray, np.ndarray]:
        """The ``split`` samples of ``sequences``, as the raw module makes them: (users [R] int64,
        cuts [R] int64 flat rows: an evaluation sample's target, a ranking training sample's first
        candidate event (with request ids, its request's first), a retrieval training sample's
        user's start)."""
        config = self.config
        if split == "train" and config.task == "ranking":
            ranking = config.ranking
            if sequences.request_starts is not None:
                users, cuts, _ = request_cuts(sequences, ranking.positives_per_sample, ranking.samples_per_user)
                return users, cuts
            return ranking_cuts(sequences, ranking.positives_per_sample, ranking.samples_per_user)
        if split == "train":
            users = trainable_users(sequences)
            return users, sequences.starts[users]
        return sequences.targets(split)

    def _count(self) -> None:
        """The counting pass (module docstring): ``counts``, ``evaluated_users``, ``popularity``, ``max_seen``."""
        counts = {split: np.zeros(len(self.row_groups), dtype=np.int64) for split in SPLITS}
        for position, (_, rows) in enumerate(self.scan(self.row_groups, full=False)):
            sequences = self.corpus(rows).sequences
            for split in SPLITS:
                counts[split][position] = len(self.samples(sequences, split)[0])
            for split in EVALUATED:  # a user's rows are in one row group: its users are counted once
                self.evaluated_users[split] += len(sequences.evaluated_users(split))
            ends = sequences.train_ends()
            train_items = sequences.items[concat_ranges(sequences.starts, ends - sequences.starts)]
            self.popularity += np.bincount(train_items, minlength=self.num_items)
            if self.config.task == "ranking" and sequences.num_users:
                self.max_seen = max(self.max_seen, int(UnseenSampler(sequences).distinct_seen.max()))
        self.counts = counts
        log.info(
            "%s: %s samples per split over %d row groups of %d shards",
            self.directory,
            {split: int(c.sum()) for split, c in counts.items()},
            len(self.row_groups),
            len(self.shards),
        )

    # ---- layout ----------------------------------------------------------------------------------
    def rank_groups(self, rank: int, world: int) -> List[int]:
        """Positions (in ``row_groups``) of rank ``rank``'s row groups: those of shards rank, rank+world,
        ... when there are at least ``world`` shards, else row groups rank, rank+world, ..."""
        shards = len(self.shards)
        if shards >= world:
            return [i for i, group in enumerate(self.row_groups) if group.shard % world == rank]
        if len(self.row_groups) < world:
            raise ValueError(
                f"data.prepared: {self.directory} has {len(self.row_groups)} row groups, too few for {world} ranks "
                "(prepare it with fewer users per shard)"
            )
        return list(range(rank, len(self.row_groups), world))

    def steps(self, split: str, world: int) -> int:
        """Batches every rank takes in ``split``: the largest rank's ceil(samples / its share of the
        global batch). ValueError when a rank has fewer samples than that (a batch would be empty)."""
        config = self.config
        batch = config.batch_size if split == "train" else config.eval_batch_size
        key = "data.batch_size" if split == "train" else "data.eval_batch_size"
        if batch < world:
            raise ValueError(
                f"{key}: a global batch of {batch} cannot feed {world} ranks (it counts samples over all ranks)"
            )
        per_rank = math.ceil(batch / world)
        samples = [int(self.counts[split][self.rank_groups(rank, world)].sum()) for rank in range(world)]
        steps = max(math.ceil(n / per_rank) for n in samples)
        short = [rank for rank, n in enumerate(samples) if n < steps]
        if short:
            raise ValueError(
                f"data.prepared: rank {short[0]} of {world} has {samples[short[0]]} {split} samples in its shards, "
                f"fewer than the {steps} steps every rank takes (ranks' samples: {samples}); prepare more, "
                "smaller shards (gr data prepare --users-per-shard) or train on fewer ranks"
            )
        return steps


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """[U] int64 lengths -> [U+1] int64 offsets from 0."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def _values(path: Path, name: str, column: pa.Array) -> np.ndarray:
    """Arrow values without nulls -> numpy: integers as int64, floats as they are, strings as str."""
    if column.null_count:
        raise DataFormatError(path, f"column {name!r}: {column.null_count} null values")
    kind = column.type
    if pa.types.is_integer(kind):
        return column.to_numpy().astype(np.int64)
    if pa.types.is_floating(kind):
        return column.to_numpy()
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return column.to_numpy(zero_copy_only=False).astype(str)
    raise DataFormatError(path, f"column {name!r}: expected integers, floats or strings, got type {kind}")
