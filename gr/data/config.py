"""DataConfig: the YAML ``data:`` section, validated before any file is read."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, dataclass, field
from typing import Any, Mapping, Optional, Tuple

SOURCES = ("synthetic", "ml-100k", "ml-1m", "ml-20m", "amazon", "csv", "parquet")
TASKS = ("retrieval", "ranking")
EVAL_EXCLUDES = ("history", "window")
MAX_SYNTHETIC_ITEMS = 10_000


def _check_int(where: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: expected an int >= {minimum}, got {value!r}")


def _check_number(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")


def _check_choice(where: str, value: Any, choices: Tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{where}: expected one of {list(choices)}, got {value!r}")


def _check_bool(where: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: expected true or false, got {value!r}")


def _check_name(where: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: expected a non-empty string, got {value!r}")


def _names(where: str, value: Any) -> Tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{where}: expected a list of column names, got {value!r}")
    for i, name in enumerate(value):
        _check_name(f"{where}[{i}]", name)
    return tuple(value)


def _known_keys(cls: type, values: Any, where: str) -> dict:
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: expected a mapping of keys to values, got {type(values).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(known)}")
    return dict(values)


@dataclass(frozen=True)
class ColumnConfig:
    """Column names of a generic CSV/Parquet file of (user, item, timestamp[, rating, side features]).

    timestamp: integer or float seconds (a Parquet timestamp column also works).
    user_features / item_features: categorical columns; a user's (item's) value is
    taken from its last row in the file.
    """

    user: str = "user_id"
    item: str = "item_id"
    timestamp: str = "timestamp"
    rating: Optional[str] = None
    user_features: Tuple[str, ...] = ()
    item_features: Tuple[str, ...] = ()
    delimiter: str = ","
    where: InitVar[str] = "data.columns"

    def __post_init__(self, where: str) -> None:
        for name in ("user", "item", "timestamp"):
            _check_name(f"{where}.{name}", getattr(self, name))
        if self.rating is not None:
            _check_name(f"{where}.rating", self.rating)
        object.__setattr__(self, "user_features", _names(f"{where}.user_features", self.user_features))
        object.__setattr__(self, "item_features", _names(f"{where}.item_features", self.item_features))
        if not isinstance(self.delimiter, str) or len(self.delimiter) != 1 or self.delimiter in "\n\r\"":
            raise ValueError(f"{where}.delimiter: expected one character (not a quote or newline), got {self.delimiter!r}")
        used = [self.user, self.item, self.timestamp, *([self.rating] if self.rating else []),
                *self.user_features, *self.item_features]
        if len(set(used)) != len(used):
            raise ValueError(f"{where}: a column is used twice in {used}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "data.columns") -> "ColumnConfig":
        return cls(**_known_keys(cls, values, where), where=where)


@dataclass(frozen=True)
class SyntheticConfig:
    """The built-in synthetic dataset (see ``gr.data.synthetic``).

    Each next item is drawn by a softmax over unseen items of
    ``taste_weight * <user taste, item> + similarity_weight * <previous item, item>
    + category_stickiness * [same category as previous] + transition_weight * [a successor
    of the previous item] + popularity_skew * log-Zipf popularity``.
    """

    num_users: int = 1000
    num_items: int = 500
    num_categories: int = 12
    min_len: int = 20
    max_len: int = 80
    latent_dim: int = 8
    successors: int = 3
    taste_weight: float = 2.0
    similarity_weight: float = 1.0
    category_stickiness: float = 1.0
    transition_weight: float = 4.0
    popularity_skew: float = 1.0
    where: InitVar[str] = "data.synthetic"

    def __post_init__(self, where: str) -> None:
        for name, minimum in (("num_users", 1), ("num_items", 2), ("num_categories", 1), ("min_len", 1),
                              ("latent_dim", 1), ("successors", 0)):
            _check_int(f"{where}.{name}", getattr(self, name), minimum)
        _check_int(f"{where}.max_len", self.max_len, self.min_len)
        if self.num_items > MAX_SYNTHETIC_ITEMS:
            raise ValueError(f"{where}.num_items: at most {MAX_SYNTHETIC_ITEMS} (the generator keeps an "
                             f"[items, items] transition matrix), got {self.num_items}")
        if self.max_len > self.num_items:
            raise ValueError(f"{where}.max_len: {self.max_len} exceeds num_items {self.num_items} (items never repeat)")
        if self.successors >= self.num_items:
            raise ValueError(f"{where}.successors: expected fewer than num_items ({self.num_items}), got {self.successors}")
        for name in ("taste_weight", "similarity_weight", "category_stickiness", "transition_weight", "popularity_skew"):
            _check_number(f"{where}.{name}", getattr(self, name))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "data.synthetic") -> "SyntheticConfig":
        return cls(**_known_keys(cls, values, where), where=where)


@dataclass(frozen=True)
class TaskConfig:
    """One ranking task. min_rating None: "the candidate is the real next item" (1) vs a
    sampled unseen item (0); a number: the real item's rating >= min_rating (sampled items: 0)."""

    name: str
    min_rating: Optional[float] = None
    where: InitVar[str] = "data.ranking.tasks"

    def __post_init__(self, where: str) -> None:
        _check_name(f"{where}.name", self.name)
        if self.name in ("user",):
            raise ValueError(f"{where}.name: 'user' is a reserved label name")
        if self.min_rating is not None:
            _check_number(f"{where}.min_rating", self.min_rating)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str) -> "TaskConfig":
        values = _known_keys(cls, values, where)
        if "name" not in values:
            raise ValueError(f"{where}.name: required")
        return cls(**values, where=where)


@dataclass(frozen=True)
class RankingConfig:
    """Target-aware ranking samples: history + candidates (real next items and sampled unseen items).

    Training: per user, up to ``samples_per_user`` cut points taken from the end of the
    training part; each sample = the history before the cut + the next
    ``positives_per_sample`` real items + ``num_negatives`` sampled items.
    Validation/test: the history before the held-out item + that item + ``eval_num_negatives``
    sampled items (drawn once, from ``seed``).
    """

    positives_per_sample: int = 4
    samples_per_user: int = 4
    num_negatives: int = 16
    eval_num_negatives: int = 99
    tasks: Tuple[TaskConfig, ...] = (TaskConfig("watch"), TaskConfig("like", 4.0))
    where: InitVar[str] = "data.ranking"

    def __post_init__(self, where: str) -> None:
        _check_int(f"{where}.positives_per_sample", self.positives_per_sample, 1)
        _check_int(f"{where}.samples_per_user", self.samples_per_user, 1)
        _check_int(f"{where}.num_negatives", self.num_negatives, 0)
        _check_int(f"{where}.eval_num_negatives", self.eval_num_negatives, 0)
        if not isinstance(self.tasks, (list, tuple)) or not self.tasks:
            raise ValueError(f"{where}.tasks: expected a non-empty list of {{name, min_rating}}, got {self.tasks!r}")
        tasks = tuple(
            t if isinstance(t, TaskConfig) else TaskConfig.from_dict(t, f"{where}.tasks[{i}]")
            for i, t in enumerate(self.tasks)
        )
        names = [t.name for t in tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}.tasks: duplicate task names {names}")
        object.__setattr__(self, "tasks", tasks)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "data.ranking") -> "RankingConfig":
        return cls(**_known_keys(cls, values, where), where=where)


@dataclass(frozen=True)
class DataConfig:
    """What to read and how to batch it.

    source: "synthetic" (built-in, no path) | "ml-100k" | "ml-1m" | "ml-20m" (path: the
    unpacked directory) | "amazon" (path: ratings_<Category>.csv) | "csv" | "parquet"
    (path: the file; columns say which column is what).
    max_seq_len: longest history fed to the model (the most recent items are kept).
    batch_size / eval_batch_size: samples per step over all ranks (each rank takes its share),
    so torchrun runs the schedule of one process.
    min_seq_len: users with fewer interactions are dropped (leave-one-out needs >= 3).
    min_item_interactions: items with fewer interactions are dropped first.
    eval_exclude: items not ranked at evaluation: the user's whole "history" before the
    target, or only the items in the model's input "window" (the HSTU paper's protocol).
    item_features / user_features: emit side features when the source has them.
    """

    source: str = "synthetic"
    path: Optional[str] = None
    task: str = "retrieval"
    max_seq_len: int = 50
    batch_size: int = 128
    eval_batch_size: int = 256
    num_workers: int = 0
    seed: int = 0
    min_seq_len: int = 3
    min_item_interactions: int = 1
    eval_exclude: str = "history"
    item_features: bool = True
    user_features: bool = True
    columns: ColumnConfig = field(default_factory=ColumnConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    ranking: RankingConfig = field(default_factory=RankingConfig)
    where: InitVar[str] = "data"

    def __post_init__(self, where: str) -> None:
        _check_choice(f"{where}.source", self.source, SOURCES)
        _check_choice(f"{where}.task", self.task, TASKS)
        _check_choice(f"{where}.eval_exclude", self.eval_exclude, EVAL_EXCLUDES)
        if self.source == "synthetic":
            if self.path is not None:
                raise ValueError(f"{where}.path: the synthetic source reads no file; remove path (got {self.path!r})")
        else:
            _check_name(f"{where}.path", self.path)
        for name, minimum in (("max_seq_len", 1), ("batch_size", 1), ("eval_batch_size", 1), ("num_workers", 0),
                              ("seed", 0), ("min_seq_len", 3), ("min_item_interactions", 1)):
            _check_int(f"{where}.{name}", getattr(self, name), minimum)
        for name in ("item_features", "user_features"):
            _check_bool(f"{where}.{name}", getattr(self, name))
        for name, section in (("columns", ColumnConfig), ("synthetic", SyntheticConfig), ("ranking", RankingConfig)):
            value = getattr(self, name)
            if not isinstance(value, section):
                object.__setattr__(self, name, section.from_dict(value, f"{where}.{name}"))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "data") -> "DataConfig":
        """Build from the YAML ``data:`` mapping; any bad or unknown key raises ValueError naming it."""
        return cls(**_known_keys(cls, values, where), where=where)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
