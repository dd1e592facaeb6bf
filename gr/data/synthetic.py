"""The built-in synthetic dataset: deterministic, sequential, learnable.

Items belong to categories and carry latent vectors near their category's centroid;
each item has a few "successor" items of its own category (think sequels), ranked: the r-th
successor's bonus is ``transition_weight * successor_decay ** r``, so with ``successor_decay`` < 1
the items form a sparse Markov chain whose likeliest next item is known from the previous one
(the structure speculative generation drafts from, docs/generation.md). Users have
an age bucket and a gender; each (age, gender) group prefers some categories, and a
user's taste vector is built from two favourite categories. A user's next item is drawn
(without repeats) from a softmax over the catalogue of

    taste_weight * <taste, item> + similarity_weight * <previous item, item>
    + category_stickiness * [same category as the previous item]
    + transition_weight * successor_decay^r [the r-th successor of the previous item]
    + popularity_skew * log-Zipf popularity,

so the previous item predicts the next one much better than popularity does. Ratings
(1..5) grow with the taste/item affinity; timestamps strictly increase per user.
"""

from __future__ import annotations

import numpy as np

from gr.data.config import SyntheticConfig
from gr.data.interactions import Interactions, SideTable

NUM_AGE_BUCKETS = 7
NUM_GENDERS = 2
START_TIME = 1_600_000_000  # seconds; users start within START_SPREAD of it
START_SPREAD = 180 * 86_400
MEAN_GAP = 6 * 3600
USER_BLOCK = 2048  # users walked at once (bounds the [users, items] score matrix)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def generate_synthetic(config: SyntheticConfig, seed: int) -> Interactions:
    """Interactions for ``config.num_users`` users, ids 1-based ints, in (user, time) order.

    Side features: items ``item_category``; users ``user_age`` and ``user_gender``.
    """
    rng = np.random.default_rng([seed, 0x5EED])
    num_users, num_items, num_categories = config.num_users, config.num_items, config.num_categories

    centroids = _unit(rng.normal(size=(num_categories, config.latent_dim)))
    category_share = rng.dirichlet(np.full(num_categories, 2.0))
    item_category = rng.choice(num_categories, size=num_items, p=category_share)
    item_vectors = _unit(centroids[item_category] + 0.5 * rng.normal(size=(num_items, config.latent_dim)))
    popularity = -config.popularity_skew * np.log1p(rng.permutation(num_items)).astype(np.float64)
    successors = np.zeros((num_items, config.successors), dtype=np.int64)
    for item in range(num_items):
        pool = np.flatnonzero(item_category == item_category[item])
        pool = pool[pool != item]
        if len(pool) < config.successors:
            pool = np.delete(np.arange(num_items), item)
        successors[item] = rng.choice(pool, size=config.successors, replace=False)
    world = _World(config, item_vectors, item_category, popularity, successors)

    ages = rng.integers(0, NUM_AGE_BUCKETS, size=num_users)
    genders = rng.integers(0, NUM_GENDERS, size=num_users)
    group_preference = rng.dirichlet(np.full(num_categories, 0.3), size=NUM_AGE_BUCKETS * NUM_GENDERS)
    group = ages * NUM_GENDERS + genders
    cumulative = np.cumsum(group_preference, axis=1)[group]  # [U, C]: inverse-CDF draw of 2 favourites
    favourites = np.minimum((rng.random((num_users, 2, 1)) > cumulative[:, None, :]).sum(-1), num_categories - 1)
    tastes = _unit(centroids[favourites].sum(1) + 0.3 * rng.normal(size=(num_users, config.latent_dim)))
    lengths = rng.integers(config.min_len, config.max_len + 1, size=num_users)

    sequence = np.concatenate(
        [world.walk(tastes[start : start + USER_BLOCK], rng) for start in range(0, num_users, USER_BLOCK)]
    )
    users = np.arange(num_users)
    keep = np.arange(config.max_len)[None, :] < lengths[:, None]  # [U, max_len]
    user_rows = np.repeat(users, lengths)
    item_rows = sequence[keep]
    gaps = np.floor(rng.exponential(MEAN_GAP, size=(num_users, config.max_len))).astype(np.int64) + 60
    times = START_TIME + rng.integers(0, START_SPREAD, size=num_users)[:, None] + np.cumsum(gaps, axis=1)
    affinity = np.einsum("nd,nd->n", tastes[user_rows], item_vectors[item_rows])
    affinity = (affinity - affinity.mean()) / (affinity.std() + 1e-9)
    ratings = np.clip(np.rint(3.2 + 1.2 * affinity + 0.6 * rng.normal(size=affinity.shape)), 1, 5)
    return Interactions(
        users=user_rows + 1,
        items=item_rows + 1,
        timestamps=times[keep],
        ratings=ratings.astype(np.float32),
        user_side=SideTable(users + 1, categorical={"user_age": ages, "user_gender": genders}),
        item_side=SideTable(np.arange(num_items) + 1, categorical={"item_category": item_category}),
        source="synthetic",
    )


class _World:
    """The item catalogue a user walks through (see the module docstring)."""

    def __init__(
        self,
        config: SyntheticConfig,
        item_vectors: np.ndarray,
        item_category: np.ndarray,
        popularity: np.ndarray,
        successors: np.ndarray,
    ) -> None:
        self.config = config
        self.item_vectors = item_vectors  # [I, d]
        self.popularity = popularity  # [I]
        # transition[i, j]: the score item j gets right after item i
        transition = config.similarity_weight * item_vectors @ item_vectors.T
        transition += config.category_stickiness * (item_category[:, None] == item_category[None, :])
        ranked = config.transition_weight * config.successor_decay ** np.arange(successors.shape[1])
        transition[np.arange(len(successors))[:, None], successors] += ranked
        self.transition = transition.astype(np.float32)  # [I, I]

    def walk(self, tastes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """tastes: [U, d] -> [U, max_len] item indices, no repeats within a row."""
        num_users, max_len = tastes.shape[0], self.config.max_len
        rows = np.arange(num_users)
        base = (self.config.taste_weight * tastes @ self.item_vectors.T + self.popularity).astype(np.float32)
        seen = np.zeros(base.shape, dtype=bool)
        sequence = np.zeros((num_users, max_len), dtype=np.int64)
        for step in range(max_len):
            scores = base + self.transition[sequence[:, step - 1]] if step else base.copy()
            scores[seen] = -np.inf
            weights = np.cumsum(np.exp(scores - scores.max(axis=1, keepdims=True)), axis=1)  # softmax CDF
            draw = (1.0 - rng.random((num_users, 1))) * weights[:, -1:]  # in (0, total]
            choice = (weights < draw).sum(axis=1)  # the first item whose CDF reaches the draw
            sequence[:, step] = choice
            seen[rows, choice] = True
        return sequence
