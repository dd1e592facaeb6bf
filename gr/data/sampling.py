"""Negative candidates: items a user never interacted with, distinct within a sample."""

from __future__ import annotations

import numpy as np

from gr.data.sequences import UserSequences

MAX_ROUNDS = 200


class UnseenSampler:
    """Draws items uniformly from the catalogue, redrawing seen items and repeats.

    "Seen" means anywhere in the user's whole sequence (held-out items included), so a
    sampled item is never a false negative.
    """

    def __init__(self, sequences: UserSequences) -> None:
        self.num_items = sequences.num_items
        owners = np.repeat(np.arange(sequences.num_users, dtype=np.int64), sequences.lengths)
        self.seen_keys = np.unique(owners * self.num_items + sequences.items)  # [S] sorted user*I + item
        self.distinct_seen = np.bincount(self.seen_keys // self.num_items, minlength=sequences.num_users)

    def check_room(self, count: int, key: str) -> None:
        """Raise ValueError (naming the config ``key``) when some user has fewer than ``count`` unseen items."""
        check_room(self.num_items, int(self.distinct_seen.max()), count, key)

    def _is_seen(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        keys = users * self.num_items + items
        index = np.minimum(np.searchsorted(self.seen_keys, keys), len(self.seen_keys) - 1)
        return self.seen_keys[index] == keys

    def sample(self, users: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
        """users: [R] int64 dense ids -> [R, count] int64 items, unseen by the row's user, distinct per row."""
        users = np.asarray(users, dtype=np.int64)
        items = rng.integers(0, self.num_items, size=(len(users), count))
        if count == 0:
            return items
        owners = np.broadcast_to(users[:, None], items.shape)
        for _ in range(MAX_ROUNDS):
            bad = self._is_seen(owners, items) | _repeats(items)
            if not bad.any():
                return items
            items[bad] = rng.integers(0, self.num_items, size=int(bad.sum()))
        raise RuntimeError(
            f"could not draw {count} distinct unseen items in {MAX_ROUNDS} rounds; lower the number of negatives"
        )


def check_room(num_items: int, most_seen: int, count: int, key: str) -> None:
    """Raise ValueError (naming the config ``key``) when ``count`` negatives do not fit beside a user
    who saw ``most_seen`` distinct items of the ``num_items``."""
    room = num_items - most_seen
    if count > room:
        raise ValueError(
            f"{key}: {count} negatives per sample, but a user has only {room} unseen items "
            f"in a catalogue of {num_items}"
        )


def _repeats(items: np.ndarray) -> np.ndarray:
    """[R, C] bool: True where the item already occurs earlier in its row."""
    order = np.argsort(items, axis=1, kind="stable")
    ordered = np.take_along_axis(items, order, axis=1)
    repeat_sorted = np.zeros_like(ordered, dtype=bool)
    repeat_sorted[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    out = np.zeros_like(repeat_sorted)
    np.put_along_axis(out, order, repeat_sorted, axis=1)
    return out
