"""The synthetic dataset: deterministic, well-formed, and predictable from the previous item."""

import numpy as np

from gr.data.config import SyntheticConfig
from gr.data.sequences import build_sequences
from gr.data.synthetic import generate_synthetic
from gr.jagged_rows import concat_ranges

SMALL = SyntheticConfig(num_users=300, num_items=200, min_len=10, max_len=40)


def test_same_seed_same_data_other_seed_other_data():
    a, b, c = (generate_synthetic(SMALL, seed) for seed in (3, 3, 4))
    for name in ("users", "items", "timestamps", "ratings"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.items, c.items)


def test_sequences_are_well_formed_with_side_features():
    data = generate_synthetic(SMALL, 0)
    seqs, users, items = build_sequences(data)
    assert seqs.num_users == 300 and seqs.lengths.min() >= 10 and seqs.lengths.max() <= 40
    owner = np.repeat(np.arange(seqs.num_users), seqs.lengths)
    same_user = owner[1:] == owner[:-1]
    assert (np.diff(seqs.timestamps)[same_user] > 0).all()
    pairs = owner * seqs.num_items + seqs.items
    assert len(np.unique(pairs)) == len(pairs)  # no repeated item within a user
    assert set(np.unique(data.ratings).tolist()) <= {1.0, 2.0, 3.0, 4.0, 5.0}
    assert set(data.user_side.categorical) == {"user_age", "user_gender"}
    assert data.item_side.categorical["item_category"].max() < SMALL.num_categories


def hit_rate_at_10(scores, seqs):
    """scores: [U, I] -> share of users whose test item ranks in the top 10, history excluded."""
    _, targets = seqs.targets("test")
    hits = 0
    for user, target in enumerate(targets):
        row = scores[user].astype(float).copy()
        row[seqs.items[seqs.offsets[user] : target]] = -np.inf
        hits += int((row > row[seqs.items[target]]).sum() < 10)
    return hits / len(targets)


def test_previous_item_predicts_the_next_far_better_than_popularity():
    seqs, _, _ = build_sequences(generate_synthetic(SyntheticConfig(num_users=400), 0))
    ends = seqs.train_ends()
    train = concat_ranges(seqs.starts, ends - seqs.starts)
    popularity = np.bincount(seqs.items[train], minlength=seqs.num_items).astype(float)
    follows = train[:-1][np.diff(train) == 1]  # consecutive training events of one user
    transitions = np.zeros((seqs.num_items, seqs.num_items))
    np.add.at(transitions, (seqs.items[follows], seqs.items[follows + 1]), 1.0)
    previous = seqs.items[seqs.targets("test")[1] - 1]
    popular = hit_rate_at_10(np.tile(popularity, (seqs.num_users, 1)), seqs)
    sequential = hit_rate_at_10(transitions[previous] + 1e-3 * popularity, seqs)
    assert sequential > 2 * popular, (sequential, popular)


def top_follower_accuracy(config):
    """Share of consecutive events whose next item is the previous item's most frequent follower."""
    seqs, _, _ = build_sequences(generate_synthetic(config, 0))
    pairs = np.flatnonzero(np.diff(np.repeat(np.arange(seqs.num_users), seqs.lengths)) == 0)
    transitions = np.zeros((seqs.num_items, seqs.num_items))
    np.add.at(transitions, (seqs.items[pairs], seqs.items[pairs + 1]), 1.0)
    return float((transitions.argmax(1)[seqs.items[pairs]] == seqs.items[pairs + 1]).mean())


def test_ranked_successors_make_the_most_frequent_follower_the_likely_next_item():
    base = dict(num_users=300, num_items=200, min_len=10, max_len=40, taste_weight=0.5, transition_weight=6.0)
    flat = top_follower_accuracy(SyntheticConfig(**base))
    ranked = top_follower_accuracy(SyntheticConfig(**base, successor_decay=0.3))
    assert ranked > 0.5 and ranked > flat + 0.15, (ranked, flat)
