"""DataConfig: the YAML ``data:`` section, validated before any file is read."""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import InitVar, dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from gr.timestamps import iso_text_seconds
from gr.utils.config_checks import (
    BOOL,
    NAME,
    NAMES,
    NUMBER,
    Check,
    Section,
    checked,
    int_at_least,
    is_int,
    known_keys,
    list_of,
    number_in,
    one_of,
    optional,
    require,
)

ITEM_ID = "item_id"  # the token feature every sequence has: its item (a reserved feature name)
RELEASE_YEAR = "item_year"  # MovieLens-100K's release year of each item (data.release_year)
SPLITS = ("leave_one_out", "time", "none")
TEST_EVENTS = ("next", "all")
SPLIT_TIMES = ("split_time", "split_end", "train_start", "replay_start", "val_start")  # times: seconds or ISO 8601
TRAIN_TIMES = ("train_start", "replay_start")  # the times data.split none reads too
UTC_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
SECONDS: Check = (is_int, "an integer number of seconds, or an ISO 8601 date or time (UTC unless it has an offset)")


def iso_seconds(value: Any) -> Any:
    """An ISO 8601 date or time (text, as ``gr.timestamps.iso_text_seconds`` reads it, or the date /
    datetime YAML reads from an unquoted one) -> its Unix seconds, floored; UTC unless it carries an
    offset. Anything else unchanged, for the field's check to judge."""
    if isinstance(value, str):
        seconds = iso_text_seconds(value)
        return value if seconds is None else seconds
    if isinstance(value, datetime.datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=datetime.timezone.utc)
        return (aware - UTC_EPOCH) // datetime.timedelta(seconds=1)
    if isinstance(value, datetime.date):
        return iso_seconds(datetime.datetime(value.year, value.month, value.day))
    return value


def iso_text(seconds: int) -> str:
    """Unix ``seconds`` as an ISO 8601 UTC date (at midnight) or date and time, with the seconds:
    ``2001-01-01 (978307200)``; the seconds alone when they lie past the dates Python writes."""
    try:
        moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return str(seconds)
    text = moment.date().isoformat() if moment.time() == datetime.time() else moment.isoformat().replace("+00:00", "Z")
    return f"{text} ({seconds})"


SOURCES = ("synthetic", "ml-100k", "ml-1m", "ml-20m", "amazon", "csv", "parquet")
TASKS = ("retrieval", "ranking")
EVAL_EXCLUDES = ("history", "window")
CANDIDATES = ("sampled", "impressions")  # data.ranking.candidates
MAX_SYNTHETIC_ITEMS = 10_000
DELIMITER: Check = (
    (lambda v: isinstance(v, str) and len(v) == 1 and v not in '\n\r"'),
    "one character (not a quote or newline)",
)
TASK_LIST: Check = ((lambda v: isinstance(v, (list, tuple)) and len(v) > 0), "a non-empty list of {name, min_rating}")
DENSE_GROUPS: Check = (
    (
        lambda v: (
            isinstance(v, Mapping)
            and all(NAME[0](k) and (NAME[0](c) or list_of(NAME, non_empty=True)[0](c)) for k, c in v.items())
        )
    ),
    "a mapping {feature name: column or [columns]} (float columns)",
)
SEPARATOR: Check = (
    (lambda v: isinstance(v, str) and len(v) >= 1 and not any(c in v for c in '\n\r"')),
    "a non-empty string (not a quote or newline)",
)
TABLE_SOURCES = ("csv", "parquet")
MOVIELENS_SOURCES = ("ml-100k", "ml-1m", "ml-20m")
GENRE_LAYOUTS = ("multi_hot", "list")
DECLARED_FEATURES = ("user_features", "item_features", "token_features", "token_dense", "item_dense", "user_dense")
SIDES = {"users": "user", "items": "item"}  # data.users / data.items -> whose features they hold


@dataclass(frozen=True)
class ColumnConfig(Section):
    """Column names of a generic CSV/Parquet file of (user, item, timestamp[, rating, features]).

    timestamp: integer or float seconds (a Parquet timestamp column also works).
    Declared features, each named after its column (categorical) or its key (dense):
    user_features: categorical user columns -> per-request common ids (``GRInput.common_ids``);
    item_features: categorical item columns -> per-token ids (``GRInput.sequence_ids``);
    token_features: categorical columns of the interaction row itself (e.g. action type,
        device) -> per-token ids; candidate tokens, which have no row, take id 0 (unknown);
    token_dense: {feature: [float columns]} of the interaction row -> ``GRInput.token_dense``
        [T, d]; candidate tokens take zeros;
    item_dense: {feature: [float columns]} of the item -> ``GRInput.token_dense`` [T, d];
    user_dense: {feature: [float columns]} of the user -> ``GRInput.common_dense`` [B, d].
    rating: the column ranking tasks read their labels from (``data.ranking.tasks``); it may
        also be one token feature (categorical or dense): history tokens then carry it, while
        candidates, which have no row, take the unknown id (zeros), so no label leaks.
    request: the column naming the request (a page load) each impression was shown in, under
        ``data.ranking.candidates: impressions``: a user's consecutive rows of one request are
        shown together, so a training sample's candidates are one request's impressions and every
        impression's history ends before its request (none of the request's own); a prepared
        dataset carries the ids in its shards (``gr.data.prepared.manifest``).
    list_features: the declared categorical columns (of any of the three kinds) that hold a list
        of values per cell (a movie's genres): a CSV cell splits on ``list_separator`` (an empty
        cell is an empty list), a Parquet column is list<string> or list<int>. A list feature
        of the row or item gives each token one bag of ids (``GRInput.token_lists``, pooled by
        a table of kind ``token_bag``); one of the user, a bag per request (``common_ids``).
    A user's (item's) values are taken from its last row in the file. Each categorical
    feature needs a table in ``model.tables`` (``num_embeddings: null``: sized from the data).
    A dense feature may name one column (d = 1) instead of a list.
    """

    user: str = checked("user_id", NAME)
    item: str = checked("item_id", NAME)
    timestamp: str = checked("timestamp", NAME)
    rating: Optional[str] = checked(None, optional(NAME))
    request: Optional[str] = checked(None, optional(NAME))
    user_features: Tuple[str, ...] = checked((), NAMES)
    item_features: Tuple[str, ...] = checked((), NAMES)
    token_features: Tuple[str, ...] = checked((), NAMES)
    token_dense: Dict[str, Tuple[str, ...]] = checked({}, DENSE_GROUPS)
    item_dense: Dict[str, Tuple[str, ...]] = checked({}, DENSE_GROUPS)
    user_dense: Dict[str, Tuple[str, ...]] = checked({}, DENSE_GROUPS)
    list_features: Tuple[str, ...] = checked((), NAMES)
    list_separator: str = checked("|", SEPARATOR)
    delimiter: str = checked(",", DELIMITER)
    where: InitVar[str] = "data.columns"

    def __post_init__(self, where: str) -> None:
        self.validate(where)
        for name in ("token_dense", "item_dense", "user_dense"):
            groups = {k: (c,) if isinstance(c, str) else tuple(c) for k, c in getattr(self, name).items()}
            object.__setattr__(self, name, groups)
        roles: Dict[str, List[str]] = {}  # column -> the keys that name it
        for key, column in self.column_roles():
            roles.setdefault(column, []).append(f"{where}.{key}")
        for column, keys in roles.items():
            if len(keys) > 1 and not self._label_and_token_feature(keys, where):
                raise ValueError(
                    f"{where}: column {column!r} is used twice ({' and '.join(keys)}); each column has one role, "
                    f"except that the rating may also be one token feature ({where}.token_features or "
                    f"{where}.token_dense)"
                )
        undeclared = [c for c in self.list_features if c not in self.categorical_columns()]
        if undeclared or len(set(self.list_features)) != len(self.list_features):
            raise ValueError(
                f"{where}.list_features: {list(self.list_features)} must name distinct declared categorical columns "
                f"(user_features, item_features, token_features: {self.categorical_columns()})"
            )
        if self.list_separator == self.delimiter:
            raise ValueError(
                f"{where}.list_separator: {self.list_separator!r} is the delimiter; a list's values need another"
            )
        names = self.feature_names()
        clashes = sorted({n for n in names if names.count(n) > 1 or n == ITEM_ID})
        if clashes:
            raise ValueError(
                f"{where}: feature name(s) {clashes} used twice or reserved ({ITEM_ID!r}); categorical "
                f"features are named after their column, dense ones after their key (features: {names})"
            )

    @staticmethod
    def _label_and_token_feature(keys: List[str], where: str) -> bool:
        """Whether ``keys`` (the keys naming one column) are the rating and one token feature: the
        ranking label read from a column that the model also reads per token."""
        token_keys = (f"{where}.token_features", f"{where}.token_dense.")
        return len(keys) == 2 and keys[0] == f"{where}.rating" and keys[1].startswith(token_keys)

    def column_roles(self) -> List[Tuple[str, str]]:
        """[(key, column)] of every column this config reads, e.g. ``("token_dense.watch", "watch_ratio")``."""
        roles = [("user", self.user), ("item", self.item), ("timestamp", self.timestamp)]
        roles += [("rating", self.rating)] if self.rating else []
        roles += [("request", self.request)] if self.request else []
        for key in ("user_features", "item_features", "token_features"):
            roles += [(key, column) for column in getattr(self, key)]
        for key in ("token_dense", "item_dense", "user_dense"):
            roles += [(f"{key}.{name}", column) for name, group in getattr(self, key).items() for column in group]
        return roles

    def categorical_columns(self) -> List[str]:
        """The declared categorical columns (user, item and row features)."""
        return [*self.user_features, *self.item_features, *self.token_features]

    def dense_columns(self) -> List[str]:
        """Every column of the declared dense features (row, item and user)."""
        return [
            c for group in (self.token_dense, self.item_dense, self.user_dense) for cs in group.values() for c in cs
        ]

    def feature_names(self) -> List[str]:
        """Every declared feature's name, categorical and dense."""
        return [
            *self.user_features,
            *self.item_features,
            *self.token_features,
            *self.token_dense,
            *self.item_dense,
            *self.user_dense,
        ]

    def declared(self) -> List[str]:
        """The keys of this section that declare features (non-empty)."""
        return [key for key in DECLARED_FEATURES if getattr(self, key)]

    def side_columns(self, side: str) -> List[Tuple[str, str]]:
        """[(key, column)] of the declared features of ``side`` ("user" | "item"), categorical then
        dense, e.g. ``("user_dense.age", "age")``."""
        return [(k, c) for k, c in self.column_roles() if k.startswith((f"{side}_features", f"{side}_dense."))]

    def without_side(self, side: str) -> "ColumnConfig":
        """These columns without the declared features of ``side`` ("user" | "item"): what the events
        hold when a side table gives them."""
        moved = {c for _, c in self.side_columns(side)}
        cleared: Dict[str, Any] = {f"{side}_features": (), f"{side}_dense": {}}
        return dataclasses.replace(
            self, **cleared, list_features=tuple(c for c in self.list_features if c not in moved)
        )


@dataclass(frozen=True)
class SideTableConfig(Section):
    """A side table of features keyed by id: ``data.users`` (user features) or ``data.items`` (item
    features). A plain string is its ``path``.

    path: a CSV or Parquet file, or a directory or glob of them (as ``data.path`` reads partitions);
    key: its id column (null: the events' id column, ``data.columns.user`` / ``data.columns.item``).
    """

    path: str = checked(None, NAME)
    key: Optional[str] = checked(None, optional(NAME))
    where: InitVar[str] = "data.users"

    def __post_init__(self, where: str) -> None:
        self.validate(where)

    @classmethod
    def from_value(cls, value: Any, where: str) -> "SideTableConfig":
        """``data.users`` / ``data.items`` as YAML gives it: a path, or a mapping {path, key}."""
        if isinstance(value, cls):
            return value
        return cls(path=value, where=where) if isinstance(value, str) else cls.from_dict(value, where)


@dataclass(frozen=True)
class SyntheticConfig(Section):
    """The built-in synthetic dataset (see ``gr.data.synthetic``).

    Each next item is drawn by a softmax over unseen items of
    ``taste_weight * <user taste, item> + similarity_weight * <previous item, item>
    + category_stickiness * [same category as previous] + transition_weight * successor_decay^r
    [the r-th successor of the previous item] + popularity_skew * log-Zipf popularity``.
    successor_decay < 1 ranks each item's successors (a sparse Markov chain whose most likely next
    item is predictable: what speculative generation drafts from); 1 weighs them alike.
    """

    num_users: int = checked(1000, int_at_least(1))
    num_items: int = checked(500, int_at_least(2))
    num_categories: int = checked(12, int_at_least(1))
    min_len: int = checked(20, int_at_least(1))
    max_len: int = checked(80, int_at_least(1))
    latent_dim: int = checked(8, int_at_least(1))
    successors: int = checked(3, int_at_least(0))
    taste_weight: float = checked(2.0, NUMBER)
    similarity_weight: float = checked(1.0, NUMBER)
    category_stickiness: float = checked(1.0, NUMBER)
    transition_weight: float = checked(4.0, NUMBER)
    successor_decay: float = checked(1.0, number_in(0.0, 1.0, open_low=True))
    popularity_skew: float = checked(1.0, NUMBER)
    where: InitVar[str] = "data.synthetic"

    def __post_init__(self, where: str) -> None:
        self.validate(where)
        require(f"{where}.max_len", self.max_len, int_at_least(self.min_len))
        if self.num_items > MAX_SYNTHETIC_ITEMS:
            raise ValueError(
                f"{where}.num_items: at most {MAX_SYNTHETIC_ITEMS} (the generator keeps an "
                f"[items, items] transition matrix), got {self.num_items}"
            )
        if self.max_len > self.num_items:
            raise ValueError(f"{where}.max_len: {self.max_len} exceeds num_items {self.num_items} (items never repeat)")
        if self.successors >= self.num_items:
            raise ValueError(
                f"{where}.successors: expected fewer than num_items ({self.num_items}), got {self.successors}"
            )


@dataclass(frozen=True)
class TaskConfig(Section):
    """One ranking task. min_rating None: "the candidate is the real next item" (1) vs a
    sampled unseen item (0); a number: the real item's rating >= min_rating (sampled items: 0)."""

    name: str = checked(None, NAME)
    min_rating: Optional[float] = checked(None, optional(NUMBER))
    where: InitVar[str] = "data.ranking.tasks"

    def __post_init__(self, where: str) -> None:
        self.validate(where)
        if self.name in ("user",):
            raise ValueError(f"{where}.name: 'user' is a reserved label name")

    @classmethod
    def from_dict(cls, values: Any, where: str) -> "TaskConfig":
        values = known_keys(cls, values, where)
        if "name" not in values:
            raise ValueError(f"{where}.name: required")
        return cls(**values, where=where)


@dataclass(frozen=True)
class RankingConfig(Section):
    """Target-aware ranking samples: history + candidates (real next items and sampled unseen items).

    Training: per user, up to ``samples_per_user`` cut points taken from the end of the
    training part; each sample = the history before the cut + the next
    ``positives_per_sample`` real items + ``num_negatives`` sampled items.
    Validation/test: the history before the held-out item + that item + ``eval_num_negatives``
    sampled items (drawn once, from ``seed``).
    candidates: "sampled" (as above) or "impressions": every event is an item the user was shown,
    labelled by ``data.columns.rating`` (each task's ``min_rating``, required, thresholds it: a 0/1
    click column takes ``min_rating: 1``); the candidates are the shown items alone, the shown but
    not liked ones the negatives, and no item is sampled (both negative counts are 0).
    """

    candidates: str = checked("sampled", one_of(*CANDIDATES))
    positives_per_sample: int = checked(4, int_at_least(1))
    samples_per_user: int = checked(4, int_at_least(1))
    num_negatives: int = checked(16, int_at_least(0))
    eval_num_negatives: int = checked(99, int_at_least(0))
    tasks: Tuple[TaskConfig, ...] = checked((TaskConfig("watch"), TaskConfig("like", 4.0)), TASK_LIST)
    where: InitVar[str] = "data.ranking"

    def __post_init__(self, where: str) -> None:
        self.validate(where)
        tasks = tuple(
            t if isinstance(t, TaskConfig) else TaskConfig.from_dict(t, f"{where}.tasks[{i}]")
            for i, t in enumerate(self.tasks)
        )
        names = [t.name for t in tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}.tasks: duplicate task names {names}")
        object.__setattr__(self, "tasks", tasks)
        if self.candidates == "impressions":
            for key in ("num_negatives", "eval_num_negatives"):
                if getattr(self, key):
                    raise ValueError(
                        f"{where}.{key}: candidates: impressions samples no items (the shown items not liked are "
                        f"the negatives); expected 0 or no key, got {getattr(self, key)}"
                    )
            unlabelled = [t.name for t in tasks if t.min_rating is None]
            if unlabelled:
                raise ValueError(
                    f"{where}.tasks: candidates: impressions labels each shown item from data.columns.rating; "
                    f"give every task a min_rating (missing for {unlabelled})"
                )

    @classmethod
    def from_dict(cls, values: Any, where: str) -> "RankingConfig":
        """Build from the ``data.ranking`` mapping; under ``candidates: impressions`` the negative
        counts default to 0."""
        values = known_keys(cls, values, where)
        if values.get("candidates") == "impressions":
            values = {"num_negatives": 0, "eval_num_negatives": 0, **values}
        return cls(**values, where=where)


@dataclass(frozen=True)
class DataConfig(Section):
    """What to read and how to batch it.

    source: "synthetic" (built-in, no path) | "ml-100k" | "ml-1m" | "ml-20m" (path: the
    unpacked directory) | "amazon" (path: ratings_<Category>.csv) | "csv" | "parquet"
    (path: the file; columns say which column is what).
    max_seq_len: longest history fed to the model (the most recent items are kept).
    batch_size / eval_batch_size: samples per step over all ranks (each rank takes its share),
    so torchrun runs the schedule of one process; a retrieval evaluation batch counts sequences (a
    user's targets that share one, under ``test_events: all``, count once).
    min_seq_len: users with fewer interactions are dropped (at least 2: a history and a target;
    leave-one-out needs 3: a training, a validation and a test event).
    min_item_interactions: items with fewer interactions are dropped first.
    eval_exclude: items not ranked at evaluation: the user's whole "history" before the
    target, or only the items in the model's input "window" (the HSTU paper's protocol).
    item_features / user_features: emit side features when the source has them.
    genres: how the MovieLens readers give an item's genres (``item_genres``): "multi_hot"
        ([T, G] floats per token) or "list" (a list-valued item feature: the genre names, one
        bag of ids per token, read by a ``token_bag`` table).
    release_year: MovieLens-100K only (needs item_features): each item's release year from u.item's
        release date as the categorical item feature ``item_year``: the year itself from 1990 on, the
        decade before ("1980s"), "unknown" for an empty date (``gr.data.readers.release_year_buckets``).
    keep_duplicates: keep rows that repeat an earlier row's user, item and timestamp (by
    default they are dropped, and the run's metrics.json counts them under "data").
    split: "leave_one_out" (each user's last event is its test target, the one before its
    validation target) or "time": events before ``split_time`` (seconds) train; each user's
    first event in [split_time, split_end) is its validation target and the second its test
    target (``gr.data.sequences``); ``train_start``: training samples predict only events at or
    after it (earlier ones are history), e.g. the new day of a warm start; or "none": every event
    trains (a retrain on all the data up to now), nothing is validated or tested (``train_start``
    as in the time split; the run's last checkpoint is its best). ``replay``: the share of users
    (in [0, 1], a fixed sample per ``seed``: ``gr.data.sequences.replayed_users``) whose training
    events before ``train_start`` (from ``replay_start`` on, when given) are predicted again, next to
    the new day; it never reaches a validation or test event. ``val_start`` (time split only):
    every event in [val_start, split_time) is a validation target instead (with every earlier event
    as history, the user's targets averaged first) and none of them trains, so a warm start is
    judged on the latest part of its new day; the test targets stay those without it. ``test_events``: "next"
    (the test target is each user's event after its validation event) or "all" (every later
    event in [split_time, split_end) is a test target, with every earlier event as history: a
    whole day judged; retrieval metrics average each user's targets first, so each user counts
    once as under leave-one-out; ranking's AUC is over every candidate).
    prepared: a directory ``gr data prepare`` wrote from this source (``gr.data.prepared``): training
    streams its shards instead of reading ``path`` (which may then be left out); a ``path`` naming
    such a directory streams it too. The keys that shape what is prepared (source, columns,
    filters, features, the side tables' id columns) must match the preparing config's; splits,
    batches and seeds are free.
    users / items: a side table of the users' (items') features keyed by id (``SideTableConfig``):
    every declared user (item) feature is then read from it, none from the events (a declared
    column found in both, or missing from the side table, is refused); an id of the events that
    it lacks takes the unknown value, a row whose id the kept events lack is unused (both
    counted in the summary).
    shuffle_buffer: users a rank holds to shuffle prepared training samples (memory grows with it); one
        holding every user, on one rank with at most one worker, orders them as raw reading does.
    since_append: N reads only the shards of a prepared dataset's appends N, N+1, ... (numbered from
        1, ``gr data prepare --append``): the users with an event since, whole histories; ``train_start``
        defaults to append N's first event and may not be earlier.
    """

    source: str = checked("synthetic", one_of(*SOURCES))
    path: Optional[str] = checked(None, optional(NAME))
    prepared: Optional[str] = checked(None, optional(NAME))
    shuffle_buffer: int = checked(4096, int_at_least(1))
    since_append: Optional[int] = checked(None, optional(int_at_least(1)))
    task: str = checked("retrieval", one_of(*TASKS))
    max_seq_len: int = checked(50, int_at_least(1))
    batch_size: int = checked(128, int_at_least(1))
    eval_batch_size: int = checked(256, int_at_least(1))
    num_workers: int = checked(0, int_at_least(0))
    seed: int = checked(0, int_at_least(0))
    min_seq_len: int = checked(3, int_at_least(2))
    min_item_interactions: int = checked(1, int_at_least(1))
    eval_exclude: str = checked("history", one_of(*EVAL_EXCLUDES))
    item_features: bool = checked(True, BOOL)
    user_features: bool = checked(True, BOOL)
    keep_duplicates: bool = checked(False, BOOL)
    split: str = checked("leave_one_out", one_of(*SPLITS))
    split_time: Optional[int] = checked(None, optional(SECONDS))
    split_end: Optional[int] = checked(None, optional(SECONDS))
    train_start: Optional[int] = checked(None, optional(SECONDS))
    replay: float = checked(0.0, number_in(0.0, 1.0))
    replay_start: Optional[int] = checked(None, optional(SECONDS))
    val_start: Optional[int] = checked(None, optional(SECONDS))
    test_events: str = checked("next", one_of(*TEST_EVENTS))
    genres: str = checked("multi_hot", one_of(*GENRE_LAYOUTS))
    release_year: bool = checked(False, BOOL)
    columns: ColumnConfig = field(default_factory=ColumnConfig)
    users: Optional[SideTableConfig] = None
    items: Optional[SideTableConfig] = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    ranking: RankingConfig = field(default_factory=RankingConfig)
    where: InitVar[str] = "data"

    def __post_init__(self, where: str) -> None:
        dated = any(getattr(self, key) is not None and not is_int(getattr(self, key)) for key in SPLIT_TIMES)
        for key in SPLIT_TIMES:  # an ISO 8601 date or time becomes its seconds, as the run's config.yaml keeps it
            object.__setattr__(self, key, iso_seconds(getattr(self, key)))
        self.validate(where)
        if self.source == "synthetic":
            if self.path is not None:
                raise ValueError(f"{where}.path: the synthetic source reads no file; remove path (got {self.path!r})")
            if self.prepared is not None:
                raise ValueError(
                    f"{where}.prepared: the synthetic source is generated in memory, never prepared; remove prepared "
                    f"(got {self.prepared!r})"
                )
        elif self.prepared is None:
            require(f"{where}.path", self.path, NAME)
        for name, section in (("columns", ColumnConfig), ("synthetic", SyntheticConfig), ("ranking", RankingConfig)):
            value = getattr(self, name)
            if not isinstance(value, section):
                object.__setattr__(self, name, section.from_dict(value, f"{where}.{name}"))
        self._check_split(where, iso_text if dated else str)
        self._check_side_tables(where)
        self._check_requests(where)
        declared = self.columns.declared()
        for side in ("item", "user"):
            switched_off = [k for k in (f"{side}_features", f"{side}_dense") if getattr(self.columns, k)]
            if switched_off and not getattr(self, f"{side}_features"):
                raise ValueError(
                    f"{where}.{side}_features: false switches off the declared {where}.columns.{switched_off[0]}; "
                    f"set it to true or remove the declaration"
                )
        if declared and self.source not in TABLE_SOURCES:
            raise ValueError(
                f"{where}.columns.{declared[0]}: only the {' and '.join(TABLE_SOURCES)} sources read declared "
                f"columns; {self.source!r} has its own features (data.item_features / data.user_features)"
            )
        if self.genres != "multi_hot" and self.source not in MOVIELENS_SOURCES:
            raise ValueError(
                f"{where}.genres: only the MovieLens sources ({', '.join(MOVIELENS_SOURCES)}) have genres; "
                f"{self.source!r} declares list features in data.columns.list_features"
            )
        if self.release_year and (self.source != "ml-100k" or not self.item_features):
            got = f"source {self.source!r}" if self.source != "ml-100k" else "item_features false"
            raise ValueError(
                f"{where}.release_year: only MovieLens-100K's item features (data.source ml-100k, "
                f"data.item_features true) have release dates; got {got}"
            )

    def _check_requests(self, where: str) -> None:
        """``columns.request`` groups impressions: ranking from impressions of a csv or parquet source."""
        if self.columns.request is None:
            return
        if self.task != "ranking" or self.ranking.candidates != "impressions":
            raise ValueError(
                f"{where}.columns.request: groups impressions into requests; it needs {where}.task ranking with "
                f"{where}.ranking.candidates impressions (got task {self.task!r}, "
                f"candidates {self.ranking.candidates!r})"
            )
        if self.source not in TABLE_SOURCES:
            raise ValueError(
                f"{where}.columns.request: only the {' and '.join(TABLE_SOURCES)} sources read a request column "
                f"(got source {self.source!r})"
            )

    def _check_side_tables(self, where: str) -> None:
        """``data.users`` / ``data.items`` built, read only by a table source declaring their side's features."""
        for key, side in SIDES.items():
            value = getattr(self, key)
            if value is None:
                continue
            object.__setattr__(self, key, SideTableConfig.from_value(value, f"{where}.{key}"))
            if self.source not in TABLE_SOURCES:
                raise ValueError(
                    f"{where}.{key}: only the {' and '.join(TABLE_SOURCES)} sources read side tables; "
                    f"{self.source!r} has its own (data.{side}_features)"
                )
            if not self.columns.side_columns(side):
                raise ValueError(
                    f"{where}.{key}: declares no {side} feature to read from {getattr(self, key).path} "
                    f"(name its columns in {where}.columns.{side}_features or {side}_dense)"
                )

    def side_table(self, key: str) -> Optional[SideTableConfig]:
        """``data.users`` or ``data.items`` (``key``), or None."""
        value = getattr(self, key)
        assert value is None or isinstance(value, SideTableConfig)  # __post_init__ built it
        return value

    def side_key(self, key: str) -> str:
        """The id column of the side table ``key`` ("users" | "items"): its ``key``, else the events'."""
        table = self.side_table(key)
        assert table is not None
        return table.key or (self.columns.user if key == "users" else self.columns.item)

    def event_columns(self) -> ColumnConfig:
        """The columns the events hold: ``columns`` without the features a side table gives (every
        declared user feature with ``data.users``, every item feature with ``data.items``)."""
        columns = self.columns
        for key, side in SIDES.items():
            columns = columns.without_side(side) if getattr(self, key) is not None else columns
        return columns

    def _check_split(self, where: str, shown: Callable[[int], str]) -> None:
        """shown: how a time is written in messages (as dates when the config gave dates)."""
        time_keys = [k for k in SPLIT_TIMES if getattr(self, k) is not None]
        time_keys += ["test_events"] if self.test_events != "next" else []
        if self.split == "leave_one_out" and time_keys:
            raise ValueError(f"{where}.{time_keys[0]}: only data.split 'time' reads it (the split is leave_one_out)")
        if self.split == "leave_one_out" and self.min_seq_len < 3:
            raise ValueError(
                f"{where}.min_seq_len: leave-one-out needs 3 events per user (a training, a validation and a test "
                f"event); got {self.min_seq_len} (data.split time or none keeps users with 2)"
            )
        self._check_replay(where, shown)
        if self.split == "none":
            cut_keys = [k for k in time_keys if k not in TRAIN_TIMES]
            if cut_keys:
                raise ValueError(
                    f"{where}.{cut_keys[0]}: only data.split 'time' reads it (the split is none: every event trains)"
                )
            return
        if self.split_time is None:
            if self.split == "time":
                raise ValueError(f"{where}.split_time: required by data.split 'time' (the cut, in seconds)")
            return
        cut = shown(self.split_time)
        if self.split_end is not None and self.split_end <= self.split_time:
            raise ValueError(f"{where}.split_end: expected after split_time {cut}, got {shown(self.split_end)}")
        if self.train_start is not None and self.train_start >= self.split_time:
            raise ValueError(f"{where}.train_start: expected before split_time {cut}, got {shown(self.train_start)}")
        if self.val_start is None:
            return
        if self.val_start >= self.split_time:
            raise ValueError(f"{where}.val_start: expected before split_time {cut}, got {shown(self.val_start)}")
        if self.train_start is not None and self.val_start <= self.train_start:
            raise ValueError(
                f"{where}.val_start: expected after train_start {shown(self.train_start)} (the new day's events "
                f"before it train), got {shown(self.val_start)}"
            )

    def _check_replay(self, where: str, shown: Callable[[int], str]) -> None:
        if self.replay and self.train_start is None:
            raise ValueError(
                f"{where}.replay: replays the events before data.train_start, which is not set; set it "
                f"(the new day's first second) or data.replay 0 (got {self.replay})"
            )
        if self.replay_start is None:
            return
        if not self.replay:
            raise ValueError(f"{where}.replay_start: is read only with data.replay above 0 (got {self.replay})")
        assert self.train_start is not None  # data.replay above needs it
        if self.replay_start >= self.train_start:
            raise ValueError(
                f"{where}.replay_start: expected before train_start {shown(self.train_start)}, "
                f"got {shown(self.replay_start)}"
            )

    @property
    def validates(self) -> bool:
        """Whether the split holds validation and test targets out (all but ``split: none``)."""
        return self.split != "none"

    def split_summary(self) -> Dict[str, Any]:
        """The split as metrics name it: {"kind": ...} plus the times it reads (and its test events)."""
        summary = {"kind": self.split, **{k: getattr(self, k) for k in SPLIT_TIMES if getattr(self, k) is not None}}
        summary.update({"replay": self.replay} if self.replay else {})
        return {**summary, "test_events": self.test_events} if self.split == "time" else summary

    def inputs(self) -> List[Tuple[str, str]]:
        """[(config key, path), ...] of the files and directories this data section reads."""
        sides = [(key, table.path) for key in SIDES if (table := self.side_table(key)) is not None]
        inputs = [("path", self.path), ("prepared", self.prepared), *sides]
        return [(f"data.{key}", path) for key, path in inputs if path]

    def label_names(self) -> Tuple[str, ...]:
        """The ranking tasks' label names; empty for retrieval."""
        return tuple(t.name for t in self.ranking.tasks) if self.task == "ranking" else ()

    @classmethod
    def from_dict(cls, values: Any, where: str = "data") -> "DataConfig":
        """Build from the YAML ``data:`` mapping; any bad or unknown key raises ValueError naming it."""
        return cls(**known_keys(cls, values, where), where=where)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
