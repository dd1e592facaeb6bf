"""SequenceDataModule: one LightningDataModule for every source, task and split."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

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
)
from gr.data.config import DataConfig
from gr.data.features import ITEM_ID, FeatureSpec, SideFeatures
from gr.data.mappings import IdMap
from gr.data.readers import read_source
from gr.data.sampling import UnseenSampler
from gr.data.sequences import build_sequences, time_split
from gr.jagged import concat_ranges

log = logging.getLogger(__name__)


class SequenceDataModule(lightning.LightningDataModule):
    """Reads ``config.source``, builds per-user sequences, and serves leave-one-out splits
    as ``GRInput`` batches for ``config.task`` ("retrieval" or "ranking").

    After ``setup()``: ``num_users``, ``num_items``, ``tasks`` (ranking label names),
    ``feature_spec()``, ``popularity()``, ``save_mappings(dir)``, ``summary`` (what was read and
    kept: rows, duplicates dropped or kept, users, items, interactions). With several ranks (the
    trainer's, else an initialised torch.distributed group's), the module shards batches
    itself (run Lightning with ``use_distributed_sampler=False``).
    """

    def __init__(
        self,
        config: Union[DataConfig, Mapping[str, Any]],
        eviction_block: int = 1,
        base_maps: Optional[Mapping[str, IdMap]] = None,
    ) -> None:
        super().__init__()
        self.base_maps = dict(base_maps or {})  # a warm start's maps: extended, never renumbered
        self.config = config if isinstance(config, DataConfig) else DataConfig.from_dict(config)
        self.eviction_block = eviction_block  # histories over max_seq_len drop whole blocks (HSTUConfig)
        self.corpus: Optional[Corpus] = None
        self.user_map: Optional[IdMap] = None
        self.item_map: Optional[IdMap] = None
        self.splits: Dict[str, SplitBatches] = {}
        self.summary: Dict[str, Any] = {}

    # ---- setup ----------------------------------------------------------------------------
    def setup(self, stage: Optional[str] = None) -> None:
        if self.corpus is not None:
            return
        config = self.config
        data = read_source(config)
        base = self.base_maps
        sequences, self.user_map, self.item_map = build_sequences(
            data, config.min_seq_len, config.min_item_interactions, base.get("items")
        )
        if config.split == "time":
            assert config.split_time is not None  # DataConfig requires it with the time split
            sequences.split = time_split(sequences, config.split_time, config.split_end, config.train_start)
        self.corpus = Corpus(
            sequences=sequences,
            item_features=SideFeatures.align(data.item_side if config.item_features else None, self.item_map, base),
            user_features=SideFeatures.align(data.user_side if config.user_features else None, self.user_map, base),
            sampler=UnseenSampler(sequences),
            event_features=SideFeatures.align(sequences.events, IdMap(np.arange(len(sequences.items))), base),
        )
        log.info(
            "%s: %d users, %d items, %d interactions",
            data.source,
            sequences.num_users,
            sequences.num_items,
            len(sequences.items),
        )
        dropped = data.duplicates if data.duplicates_dropped else 0
        self.summary = {
            "source": data.source,
            "rows_read": len(data.users) + dropped,
            "duplicates_dropped": dropped,
            "duplicates_kept": data.duplicates - dropped,
            "users": sequences.num_users,
            "items": sequences.num_items,
            "interactions": len(sequences.items),
            "split": config.split_summary(),
        }
        if config.split == "time":
            self.summary["evaluated_users"] = {s: len(sequences.evaluated_users(s)) for s in ("val", "test")}
            empty = [s for s, n in self.summary["evaluated_users"].items() if n == 0]
            if empty:
                needed = 1 if empty[0] == "val" else 2
                raise ValueError(
                    f"data.split_time: no user has a {empty[0]} target (an event before {config.split_time} and "
                    f"{needed} at or after it, before data.split_end when set)"
                )
        self.splits = self._retrieval_splits() if config.task == "retrieval" else self._ranking_splits()

    def _retrieval_splits(self) -> Dict[str, SplitBatches]:
        config, corpus = self.config, self._corpus()
        train = RetrievalTrainBatches(corpus, config.max_seq_len, config.seed, self.eviction_block)
        if len(train) == 0:
            raise ValueError(
                f"{config.source}: no user has 2 training events (needs >= 4 interactions); nothing to train on"
            )
        return {
            "train": train,
            **{
                split: RetrievalEvalBatches(
                    corpus, split, config.max_seq_len, config.seed, config.eval_exclude, self.eviction_block
                )
                for split in ("val", "test")
            },
        }

    def _ranking_splits(self) -> Dict[str, SplitBatches]:
        config, corpus, ranking = self.config, self._corpus(), self.config.ranking
        sequences = corpus.sequences
        if sequences.ratings is None and any(t.min_rating is not None for t in ranking.tasks):
            raise ValueError(
                f"data.ranking.tasks: {config.source} has no ratings; drop min_rating tasks "
                f"(got {[t.name for t in ranking.tasks]})"
            )
        corpus.sampler.check_room(ranking.num_negatives, "data.ranking.num_negatives")
        corpus.sampler.check_room(ranking.eval_num_negatives, "data.ranking.eval_num_negatives")
        positives = ranking.positives_per_sample
        # Training cuts tile each user's training part from its end, `positives` events apart,
        # keeping >= 1 history event before each cut and each cut at or after the user's label start.
        ends = sequences.train_ends()
        room = ends - np.maximum(sequences.starts + 1, sequences.label_starts())
        per_user = np.clip(np.minimum(ranking.samples_per_user, room // positives), 0, None)
        row_users = np.repeat(np.arange(sequences.num_users), per_user)
        cuts = ends[row_users] - positives * (concat_ranges(np.zeros_like(per_user), per_user) + 1)
        if len(row_users) == 0:
            raise ValueError(f"data.ranking.positives_per_sample: no user has {positives + 1} training events")
        splits: Dict[str, SplitBatches] = {
            "train": RankingBatches(
                corpus,
                "train",
                config.max_seq_len,
                config.seed,
                row_users,
                cuts,
                positives,
                ranking.num_negatives,
                ranking.tasks,
                eviction_block=self.eviction_block,
            )
        }
        for code, split in enumerate(("val", "test"), start=1):
            users = sequences.evaluated_users(split)
            rng = np.random.default_rng([config.seed, code])
            table = corpus.sampler.sample(users, ranking.eval_num_negatives, rng).astype(np.int32)
            splits[split] = RankingBatches(
                corpus,
                split,
                config.max_seq_len,
                config.seed,
                users,
                sequences.targets(split)[users],
                1,
                ranking.eval_num_negatives,
                ranking.tasks,
                negative_table=table,
                eviction_block=self.eviction_block,
            )
        return splits

    # ---- what a model is built from ---------------------------------------------------------
    def _corpus(self) -> Corpus:
        if self.corpus is None:
            raise RuntimeError("SequenceDataModule: call setup() first")
        return self.corpus

    @property
    def num_items(self) -> int:
        return self._corpus().sequences.num_items

    @property
    def num_users(self) -> int:
        return self._corpus().sequences.num_users

    @property
    def tasks(self) -> Tuple[str, ...]:
        """Ranking label names (one per task); empty for retrieval."""
        return self.config.label_names()

    def feature_spec(self) -> FeatureSpec:
        corpus = self._corpus()
        events = corpus.event_features
        users = corpus.user_features
        return FeatureSpec(
            sequence={ITEM_ID: self.num_items, **corpus.item_features.cardinalities(), **events.cardinalities()},
            common={**users.cardinalities(), **users.list_cardinalities()},
            token_dense={**corpus.item_features.dims(), **events.dims()},
            common_dense=users.dims(),
            event_features=[*events.cardinalities(), *events.list_cardinalities(), *events.dims()],
            token_lists={**corpus.item_features.list_cardinalities(), **events.list_cardinalities()},
        )

    def popularity(self) -> torch.Tensor:
        """[num_items] int64: how often each item occurs in the training parts (leave-one-out)."""
        sequences = self._corpus().sequences
        ends = sequences.train_ends()
        train_items = sequences.items[concat_ranges(sequences.starts, ends - sequences.starts)]
        return torch.from_numpy(np.bincount(train_items, minlength=self.num_items).astype(np.int64))

    # ---- mappings ---------------------------------------------------------------------------
    def save_mappings(self, directory: str) -> None:
        """Write raw<->dense maps of users, items and categorical side features into ``directory``."""
        corpus = self._corpus()
        assert self.user_map is not None and self.item_map is not None  # set with the corpus
        maps = {
            "users": self.user_map,
            "items": self.item_map,
            **corpus.item_features.vocabularies,
            **corpus.user_features.vocabularies,
            **corpus.event_features.vocabularies,
        }
        columns = {
            **corpus.item_features.dense_columns,
            **corpus.user_features.dense_columns,
            **corpus.event_features.dense_columns,
        }
        mappings.save_mappings(directory, maps, columns)

    @staticmethod
    def load_mappings(directory: str) -> Tuple[Dict[str, IdMap], Dict[str, List[str]]]:
        """({"users"|"items"|feature: IdMap}, {dense feature: column names}) from ``save_mappings``."""
        return mappings.load_mappings(directory)

    # ---- loaders ------------------------------------------------------------------------------
    def _loader(self, split: str) -> DataLoader:
        self._corpus()
        dataset = self.splits[split]
        config = self.config
        if self.trainer is not None:
            rank, world = self.trainer.global_rank, self.trainer.world_size
        elif dist.is_initialized():  # under torchrun without Lightning (e.g. a benchmark)
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = 0, 1
        plan = BatchPlan(
            len(dataset),
            config.batch_size if split == "train" else config.eval_batch_size,
            shuffle=split == "train",
            seed=config.seed,
            rank=rank,
            world_size=world,
        )
        return DataLoader(
            dataset,
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
