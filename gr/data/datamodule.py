"""SequenceDataModule: one LightningDataModule for every source, task and split."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import lightning
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from gr.data import mappings
from gr.data.batching import (
    BatchPlan,
    Corpus,
    RankingBatches,
    RetrievalEvalBatches,
    RetrievalTrainBatches,
    SplitBatches,
    identity_collate,
    ranking_cuts,
    request_cuts,
    trainable_users,
)
from gr.data.config import DataConfig
from gr.data.features import ITEM_ID, FeatureSpec, SideFeatures
from gr.data.mappings import IdMap
from gr.data.prepared.manifest import SUMMARY_KEYS, prepared_directory
from gr.data.prepared.reader import PreparedData
from gr.data.prepared.stream import EpochLoader, PreparedSplit
from gr.data.readers import SIDE_SUMMARY, read_source, side_table_summary
from gr.data.sampling import check_room
from gr.data.sequences import EVALUATED, build_sequences, configured_split
from gr.jagged_rows import concat_ranges

log = logging.getLogger(__name__)
NEW_IDS = ("extend", "unknown")  # what becomes of ids a model's maps lack (SequenceDataModule)


class SequenceDataModule(lightning.LightningDataModule):
    """Reads ``config.source``, builds per-user sequences, and serves leave-one-out splits
    as ``GRInput`` batches for ``config.task`` ("retrieval" or "ranking").

    After ``setup()``: ``num_users``, ``num_items``, ``tasks`` (ranking label names),
    ``feature_spec()``, ``popularity()``, ``save_mappings(dir)``, ``summary`` (what was read and
    kept: rows, duplicates dropped or kept, users, items, interactions). With several ranks (the
    trainer's, else an initialised torch.distributed group's), the module shards batches
    itself (run Lightning with ``use_distributed_sampler=False``).

    With ``data.prepared`` (or a ``data.path`` naming a prepared directory) nothing raw is read:
    maps and side features come from the directory (``prepared``), each rank streams its own shards
    (``gr.data.prepared.stream``) and ``corpus`` stays None; the batches are those of raw reading.
    """

    def __init__(
        self,
        config: Union[DataConfig, Mapping[str, Any]],
        eviction_block: int = 1,
        base_maps: Optional[Mapping[str, IdMap]] = None,
        new_ids: str = "extend",
    ) -> None:
        """base_maps: a trained model's maps ({"items"|feature: IdMap}): the ids they know keep their
        dense ids. new_ids: what becomes of the ids they lack: "extend" (a warm start: appended,
        new rows) or "unknown" (evaluating the model, which has no row for them: events of a new
        item are left out, logged and counted in ``summary["unknown_items"]``; a new value of a
        side feature is its unknown id 0; a prepared dataset with new ids is refused)."""
        super().__init__()
        if new_ids not in NEW_IDS:
            raise ValueError(f"SequenceDataModule.new_ids: expected one of {list(NEW_IDS)}, got {new_ids!r}")
        self.base_maps = dict(base_maps or {})  # never renumbered
        self.new_ids = new_ids
        self.config = config if isinstance(config, DataConfig) else DataConfig.from_dict(config)
        self.eviction_block = eviction_block  # histories over max_seq_len drop whole blocks (HSTUConfig)
        self.corpus: Optional[Corpus] = None
        self.prepared: Optional[PreparedData] = None
        self.user_map: Optional[IdMap] = None
        self.item_map: Optional[IdMap] = None
        self.item_features = SideFeatures()
        self.user_features = SideFeatures()
        self.event_features = SideFeatures()
        self.splits: Dict[str, SplitBatches] = {}
        self.summary: Dict[str, Any] = {}

    # ---- setup ----------------------------------------------------------------------------
    def setup(self, stage: Optional[str] = None) -> None:
        if self.corpus is not None or self.prepared is not None:
            return
        directory = prepared_directory(self.config)
        if directory is None and self.config.since_append is not None:
            raise ValueError(
                f"data.since_append: reads the shards of a prepared dataset's appends; data.path "
                f"{self.config.path} is not a prepared dataset (set data.prepared: DIR)"
            )
        if directory is None:
            self._setup_raw()
        else:
            self._setup_prepared(directory)

    def _setup_raw(self) -> None:
        config = self.config
        data = read_source(config)
        base, extend = self.base_maps, self.new_ids == "extend"
        unknown = None
        if not extend and "items" in base:
            base["items"].check_kind(data.items, f"{data.source}: column {config.columns.item!r}")
            unknown = base["items"].encode(data.items, unknown=-1) < 0
        sequences, self.user_map, self.item_map = build_sequences(
            data, config.min_seq_len, config.min_item_interactions, base.get("items"), unknown, config.columns.item
        )
        sequences.split = configured_split(sequences, config)
        sides = side_table_summary(
            config, {"users": data.user_side, "items": data.item_side}, {"users": self.user_map, "items": self.item_map}
        )
        self.corpus = Corpus(
            sequences=sequences,
            item_features=SideFeatures.align(
                data.item_side if config.item_features else None, self.item_map, base, extend
            ),
            user_features=SideFeatures.align(
                data.user_side if config.user_features else None, self.user_map, base, extend
            ),
            event_features=SideFeatures.align(sequences.events, IdMap(np.arange(len(sequences.items))), base, extend),
        )
        self.item_features = self.corpus.item_features
        self.user_features = self.corpus.user_features
        self.event_features = self.corpus.event_features
        dropped = data.duplicates if data.duplicates_dropped else 0
        self._set_summary(
            {
                "source": data.source,
                "rows_read": len(data.users) + dropped,
                "duplicates_dropped": dropped,
                "duplicates_kept": data.duplicates - dropped,
                "users": sequences.num_users,
                "items": sequences.num_items,
                "interactions": len(sequences.items),
                **({} if unknown is None else {"unknown_items": _unknown_items(data.source, data.items, unknown)}),
                **sides,
            }
        )
        ranking = config.ranking
        counts = None
        if sequences.request_starts is not None:
            row_users, cuts, counts = request_cuts(sequences, ranking.positives_per_sample, ranking.samples_per_user)
        else:
            row_users, cuts = ranking_cuts(sequences, ranking.positives_per_sample, ranking.samples_per_user)
        self._check(
            len(row_users) if config.task == "ranking" else len(trainable_users(sequences)),
            {split: len(sequences.evaluated_users(split)) for split in EVALUATED},
            {split: len(sequences.targets(split)[0]) for split in EVALUATED},
            sequences.ratings is not None,
            lambda: int(self._corpus().sampler.distinct_seen.max()),
        )
        self.splits = (
            self._retrieval_splits() if config.task == "retrieval" else self._ranking_splits(row_users, cuts, counts)
        )

    def _setup_prepared(self, directory: Path) -> None:
        config = self.config
        data = PreparedData(directory, config, self.base_maps)
        self.prepared = data
        self.user_map, self.item_map = data.user_map, data.item_map
        self.item_features, self.user_features = data.item_features, data.user_features
        self.event_features = data.event_features
        if self.new_ids == "unknown":
            base = self.base_maps
            grown = {k: m.cardinality - base[k].cardinality for k, m in self.id_maps().items() if k in base}
            new = {k: n for k, n in grown.items() if n}
            if new:
                raise ValueError(
                    f"data.prepared: {directory} has ids the model has no row for (new ids per map: {new}); "
                    "evaluate the model on the raw data.path, which leaves the events of new items out, "
                    "or warm start it on these data"
                )
        summary = {
            key: data.manifest.summary[key] for key in (*SUMMARY_KEYS, SIDE_SUMMARY) if key in data.manifest.summary
        }
        self._set_summary({**summary, "items": self.num_items, "prepared": str(directory)})
        self._check(
            int(data.counts["train"].sum()),
            data.evaluated_users,
            {split: int(data.counts[split].sum()) for split in EVALUATED},
            data.manifest.has_ratings,
            lambda: data.max_seen,
        )

    def _set_summary(self, read: Dict[str, Any]) -> None:
        self.summary = {**read, "split": self.config.split_summary()}
        counts = (read["users"], read["items"], read["interactions"])
        log.info("%s: %d users, %d items, %d interactions", read["source"], *counts)

    def _check(
        self,
        train: int,
        evaluated: Dict[str, int],
        targets: Dict[str, int],
        has_ratings: bool,
        most_seen: Callable[[], int],
    ) -> None:
        """ValueError (one line naming the key) when the split leaves nothing to train or evaluate,
        or ranking asks for what the data lacks. train: training samples; evaluated / targets:
        {"val"|"test": users with a target / targets}; most_seen(): the most distinct items of one
        user (ranking's room)."""
        config = self.config
        if config.split == "time":
            self.summary["evaluated_users"] = evaluated
            self.summary["evaluated_targets"] = targets
            empty = [s for s, n in evaluated.items() if n == 0]
            if empty and empty[0] == "val" and config.val_start is not None:
                raise ValueError(
                    f"data.val_start: no user has a val target (an event before {config.val_start} and one at or "
                    f"after it, before data.split_time {config.split_time})"
                )
            if empty:
                needed = 1 if empty[0] == "val" else 2
                raise ValueError(
                    f"data.split_time: no user has a {empty[0]} target (an event before {config.split_time} and "
                    f"{needed} at or after it, before data.split_end when set)"
                )
        if config.task == "retrieval":
            if train == 0:
                where = {
                    "leave_one_out": "before its last two (>= 4 interactions)",
                    "time": "before data.split_time",
                    "none": "at all",
                }[config.split]
                start = "" if config.train_start is None else ", the later at or after data.train_start"
                raise ValueError(f"{config.source}: no user has 2 training events {where}{start}; nothing to train on")
            return
        ranking = config.ranking
        if not has_ratings and ranking.candidates == "impressions":
            raise ValueError(
                f"data.ranking.candidates: impressions labels each shown item from data.columns.rating; "
                f"{config.path or config.source} has no such column (set data.columns.rating to the label column)"
            )
        if not has_ratings and any(t.min_rating is not None for t in ranking.tasks):
            raise ValueError(
                f"data.ranking.tasks: {config.source} has no ratings; drop min_rating tasks "
                f"(got {[t.name for t in ranking.tasks]})"
            )
        seen = most_seen()
        check_room(self.num_items, seen, ranking.num_negatives, "data.ranking.num_negatives")
        check_room(self.num_items, seen, ranking.eval_num_negatives, "data.ranking.eval_num_negatives")
        if train == 0:
            raise ValueError(
                f"data.ranking.positives_per_sample: no user has {ranking.positives_per_sample + 1} training events"
            )

    def _retrieval_splits(self) -> Dict[str, SplitBatches]:
        config, corpus = self.config, self._corpus()
        return {
            "train": RetrievalTrainBatches(corpus, config.max_seq_len, config.seed, self.eviction_block),
            **{
                split: RetrievalEvalBatches(
                    corpus, split, config.max_seq_len, config.seed, config.eval_exclude, self.eviction_block
                )
                for split in ("val", "test")
            },
        }

    def _ranking_splits(
        self, row_users: np.ndarray, cuts: np.ndarray, counts: Optional[np.ndarray] = None
    ) -> Dict[str, SplitBatches]:
        """row_users / cuts: [R] the training samples (``ranking_cuts``; with request ids ``request_cuts``,
        counts: [R] each one's impressions); a held-out impression's history ends before its request."""
        config, corpus, ranking = self.config, self._corpus(), self.config.ranking
        sequences = corpus.sequences
        splits: Dict[str, SplitBatches] = {
            "train": RankingBatches(
                corpus,
                "train",
                config.max_seq_len,
                config.seed,
                row_users,
                cuts,
                ranking.positives_per_sample,
                ranking.num_negatives,
                ranking.tasks,
                eviction_block=self.eviction_block,
                counts=counts,
            )
        }
        for code, split in enumerate(("val", "test"), start=1):
            users, targets = sequences.targets(split)
            rng = np.random.default_rng([config.seed, code])
            table = corpus.sampler.sample(users, ranking.eval_num_negatives, rng).astype(np.int32)
            splits[split] = RankingBatches(
                corpus,
                split,
                config.max_seq_len,
                config.seed,
                users,
                targets,
                1,
                ranking.eval_num_negatives,
                ranking.tasks,
                negative_table=table,
                eviction_block=self.eviction_block,
                history_ends=None if sequences.request_starts is None else sequences.request_starts[targets],
            )
        return splits

    # ---- what a model is built from ---------------------------------------------------------
    def _corpus(self) -> Corpus:
        if self.corpus is None:
            raise RuntimeError("SequenceDataModule: call setup() first (a prepared dataset has no corpus)")
        return self.corpus

    def _maps(self) -> Tuple[IdMap, IdMap]:
        if self.user_map is None or self.item_map is None:
            raise RuntimeError("SequenceDataModule: call setup() first")
        return self.user_map, self.item_map

    @property
    def num_items(self) -> int:
        return self._maps()[1].cardinality

    @property
    def num_users(self) -> int:
        return self._maps()[0].cardinality

    @property
    def tasks(self) -> Tuple[str, ...]:
        """Ranking label names (one per task); empty for retrieval."""
        return self.config.label_names()

    def feature_spec(self) -> FeatureSpec:
        items, users, events = self.item_features, self.user_features, self.event_features
        return FeatureSpec(
            sequence={ITEM_ID: self.num_items, **items.cardinalities(), **events.cardinalities()},
            common={**users.cardinalities(), **users.list_cardinalities()},
            token_dense={**items.dims(), **events.dims()},
            common_dense=users.dims(),
            event_features=[*events.cardinalities(), *events.list_cardinalities(), *events.dims()],
            token_lists={**items.list_cardinalities(), **events.list_cardinalities()},
        )

    def popularity(self) -> torch.Tensor:
        """[num_items] int64: how often each item occurs in the training parts (of the configured split)."""
        if self.prepared is not None:
            return torch.from_numpy(self.prepared.popularity.copy())
        sequences = self._corpus().sequences
        ends = sequences.train_ends()
        train_items = sequences.items[concat_ranges(sequences.starts, ends - sequences.starts)]
        return torch.from_numpy(np.bincount(train_items, minlength=self.num_items).astype(np.int64))

    # ---- mappings ---------------------------------------------------------------------------
    def id_maps(self) -> Dict[str, IdMap]:
        """{"users" | "items" | categorical side feature: its raw<->dense map}."""
        user_map, item_map = self._maps()
        features = {k: v for f in self._sides() for k, v in f.vocabularies.items()}
        return {"users": user_map, "items": item_map, **features}

    def save_mappings(self, directory: str) -> None:
        """Write ``id_maps()`` into ``directory``."""
        dense = {k: v for f in self._sides() for k, v in f.dense_columns.items()}
        mappings.save_mappings(directory, self.id_maps(), dense)

    def _sides(self) -> Tuple[SideFeatures, SideFeatures, SideFeatures]:
        """The item, user and event side features."""
        return self.item_features, self.user_features, self.event_features

    @staticmethod
    def load_mappings(directory: str) -> Tuple[Dict[str, IdMap], Dict[str, List[str]]]:
        """({"users"|"items"|feature: IdMap}, {dense feature: column names}) from ``save_mappings``."""
        return mappings.load_mappings(directory)

    # ---- loaders ------------------------------------------------------------------------------
    def _rank(self) -> Tuple[int, int]:
        """(rank, world size): the trainer's, else an initialised process group's, else (0, 1)."""
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        if dist.is_initialized():  # under torchrun without Lightning (e.g. a benchmark)
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _loader(self, split: str) -> DataLoader:
        config = self.config
        if split != "train" and not config.validates:
            raise ValueError(f"data.split: 'none' holds no {split} events out (every event trains)")
        rank, world = self._rank()
        if self.prepared is not None:
            trainer = self.trainer
            dataset = PreparedSplit(self.prepared, split, rank, world, self.eviction_block)
            epoch_of = None if trainer is None else (lambda: trainer.current_epoch)
            return EpochLoader(dataset, config.num_workers, epoch_of)
        self._corpus()
        plan = BatchPlan(
            len(self.splits[split]),
            config.batch_size if split == "train" else config.eval_batch_size,
            shuffle=split == "train",
            seed=config.seed,
            rank=rank,
            world_size=world,
            groups=None if split == "train" else self.splits[split].groups(),
        )
        return DataLoader(
            self.splits[split],
            batch_size=None,
            sampler=plan,
            # torch's stub has collate_fn take a list; with batch_size=None it takes each (built) batch
            collate_fn=identity_collate,  # type: ignore[arg-type]
            num_workers=config.num_workers,
            persistent_workers=config.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")


def _unknown_items(source: object, items: np.ndarray, unknown: np.ndarray) -> Dict[str, int]:
    """{"items", "events"}: the items a model has no row for and their events (``unknown``: [N] bool
    over the events ``items``: [N]), which its evaluation leaves out; a warning when there are any."""
    counts = {"items": len(np.unique(items[unknown])), "events": int(unknown.sum())}
    if counts["events"]:
        log.warning(
            "%s: left out %d events of items the model has no row for (%d items, new since it was "
            "trained; a warm start on these data learns them)",
            source,
            counts["events"],
            counts["items"],
        )
    return counts
