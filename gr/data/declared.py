"""The features a data config declares, known before any file is read.

``declared_spec(config)`` is the FeatureSpec the data will provide, by name: the declared
columns of CSV/Parquet (``data.columns``) or a built-in source's side features (switched by
``data.item_features`` / ``data.user_features``; MovieLens genres as ``data.genres`` says, ML-100K's
release years as ``data.release_year`` does).
Cardinalities are placeholders (1) and the dims of features a built-in source derives from its
files (MovieLens genres) nominal: what it
is for is checking, before the data loads, that the model's tables and modules read exactly the
declared features (``gr.train.build.check_declared_features``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Tuple

from gr.data.config import RELEASE_YEAR, DataConfig
from gr.data.features import ITEM_ID, FeatureSpec

UNKNOWN_CARDINALITY = 1
GENRES = "item_genres"
ML_USER_FEATURES = ("user_age", "user_gender", "user_occupation")


@dataclass(frozen=True)
class SourceFeatures:
    """A built-in source's side features: categorical item/user ones, dense item ones {name: dim}."""

    item: Tuple[str, ...] = ()
    item_dense: Dict[str, int] = field(default_factory=dict)
    user: Tuple[str, ...] = ()


SOURCE_FEATURES = {
    "synthetic": SourceFeatures(item=("item_category",), user=("user_age", "user_gender")),
    "ml-100k": SourceFeatures(item_dense={GENRES: 19}, user=ML_USER_FEATURES),
    "ml-1m": SourceFeatures(item_dense={GENRES: 18}, user=ML_USER_FEATURES),
    "ml-20m": SourceFeatures(item_dense={GENRES: 20}),
    "amazon": SourceFeatures(),
}


def declared_spec(config: DataConfig) -> FeatureSpec:
    """The features ``config`` makes the data provide (names exact; see the module docstring)."""
    columns = config.columns
    if config.source in SOURCE_FEATURES:
        source = SOURCE_FEATURES[config.source]
        item, item_dense, user = source.item, source.item_dense, source.user
        event: Tuple[str, ...] = ()
        event_dense: Dict[str, int] = {}
        user_dense: Dict[str, int] = {}
    else:
        item, user, event = columns.item_features, columns.user_features, columns.token_features
        item_dense = {name: len(group) for name, group in columns.item_dense.items()}
        user_dense = {name: len(group) for name, group in columns.user_dense.items()}
        event_dense = {name: len(group) for name, group in columns.token_dense.items()}
    lists: Tuple[str, ...] = columns.list_features
    if config.genres == "list" and GENRES in item_dense:  # MovieLens genre names: a list-valued item feature
        item_dense = {name: dim for name, dim in item_dense.items() if name != GENRES}
        item, lists = (*item, GENRES), (GENRES,)
    if config.release_year:  # MovieLens-100K's release years: a categorical item feature
        item = (*item, RELEASE_YEAR)
    if not config.item_features:
        item, item_dense = (), {}
    if not config.user_features:
        user, user_dense = (), {}
    return FeatureSpec(
        sequence={name: UNKNOWN_CARDINALITY for name in (ITEM_ID, *item, *event) if name not in lists},
        common={name: UNKNOWN_CARDINALITY for name in user},
        token_dense={**item_dense, **event_dense},
        common_dense=user_dense,
        event_features=[*event, *event_dense],
        token_lists={name: UNKNOWN_CARDINALITY for name in (*item, *event) if name in lists},
    )
