"""Where ``gr items add`` points a new item's row on an export with an item tower.

A new item has no trained id row, so its feature-only vector ``f`` (the tower's encoder of its
features) lacks what a trained item's id row adds to its scores; how much that is grows with the
item's popularity (a popular item's id row pulls it towards the queries). The export's item encoder
file holds the mean served query ``q`` [d] (the mean of the normalised retrieval queries of up to
``MEAN_QUERY_SAMPLE`` validation events). Over the trained items with a count ``n > 0``, the gain
of the id row at the mean query, ``q . (v_hat - f_hat)`` (``v``: the trained vector, ``_hat``:
L2-normalised, as the catalogue scores), is fitted by least squares as ``alpha + beta * log1p(n)``.
A new item with count ``n`` (``item_popularity``; 0 without one) then gets the row of unit norm in
the plane of ``f_hat`` and ``u = q / |q|`` whose cosine with ``u`` is ``u . f_hat + (alpha + beta *
log1p(n)) / |q|`` (clipped to ``MAX_COSINE``): its score at the mean query is what a trained item of
its features and count would score there, while its direction away from ``u`` is its features'.
Serving reads the row like any other (no score term of its own). An item never seen (n = 0) takes
the gain fitted for the least popular trained items: where that is negative, a new item scores
below a trained item of the same features at the mean query.

The fit matches a new item's score at the mean query, but a top 10 is filled by the tail of each
query's scores, and a least-squares fit gives every new item the mean gain of its count (none of
the spread of the trained items' gains around it), so new rows alone reach fewer top 10s than
trained items of their counts. Where the encoder file also holds the served queries the mean was
taken over (``SERVED_QUERIES`` [S, d]), one shift common to every new item is added to the fitted
gain: the one at which the new rows take as many top-``EXPOSURE_TOP`` slots of those queries
(each query's bar: its ``EXPOSURE_TOP``-th best trained cosine) as trained items of their counts
take (``expected_rates``: the mean rate of the ``COUNT_NEIGHBOURS`` trained items nearest in
count). One shift keeps the new items' order among themselves (features and counts) as the fit
gives it and moves only their level against the trained items.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MEAN_QUERY_SAMPLE = 4096
MAX_COSINE = 0.99  # a target cosine of 1 would collapse every new row onto the mean query
EXPOSURE_TOP = 10  # the top of each served query's ranking whose slots new items are calibrated to take
COUNT_NEIGHBOURS = 50  # the trained items, nearest in count, whose top-10 rate a new item's count expects
SHIFT_BOUND = 1.0  # the largest shift of the gain either way (a score at the mean query: at most 1 apart)
SHIFT_STEPS = 30  # bisection steps: the shift to within 2 * SHIFT_BOUND / 2**30


@dataclass(frozen=True)
class GainFit:
    """The id row's gain at the mean query against log1p(count): ``alpha + beta * log1p(count)``."""

    alpha: float
    beta: float
    shift: float = 0.0  # added to every gain: the new rows' level against the trained ones (module docstring)

    def gain(self, counts: np.ndarray) -> np.ndarray:
        """counts: [n] int64 -> [n] float64."""
        return self.alpha + self.shift + self.beta * np.log1p(counts.astype(np.float64))


def _unit(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return rows / np.maximum(norms, 1e-12)


def fit_gain(mean_query: np.ndarray, trained: np.ndarray, features_only: np.ndarray, counts: np.ndarray) -> GainFit:
    """mean_query: [d]; trained, features_only: [M, d] the trained items' vectors and their
    feature-only vectors; counts: [M] int64 -> the least-squares fit over the items counted at least
    once (zero gain when fewer than two distinct counts)."""
    gain = (_unit(trained.astype(np.float64)) - _unit(features_only.astype(np.float64))) @ mean_query
    seen = counts > 0
    x = np.log1p(counts[seen].astype(np.float64))
    if len(np.unique(x)) < 2:
        return GainFit(0.0, 0.0)
    beta, alpha = np.polyfit(x, gain[seen], 1)
    return GainFit(float(alpha), float(beta))


def placed_rows(features_only: np.ndarray, counts: np.ndarray, mean_query: np.ndarray, fit: GainFit) -> np.ndarray:
    """features_only: [n, d] new items' feature-only vectors, counts: [n] int64 -> [n, d] float32
    unit rows (module docstring); a vector along the mean query keeps its direction."""
    scale = float(np.linalg.norm(mean_query))
    f = _unit(features_only.astype(np.float64))
    if scale == 0.0:
        return f.astype(np.float32)
    u = mean_query / scale
    along = f @ u
    target = np.clip(along + fit.gain(counts) / scale, -MAX_COSINE, MAX_COSINE)
    across = f - along[:, None] * u
    width = np.linalg.norm(across, axis=1)
    turned = target[:, None] * u + np.sqrt(1.0 - target**2)[:, None] * across / np.maximum(width, 1e-12)[:, None]
    return np.where((width > 1e-6)[:, None], turned, f).astype(np.float32)


def top_rates(queries: np.ndarray, rows: np.ndarray, bars: np.ndarray) -> np.ndarray:
    """queries: [S, d] unit served queries, rows: [n, d] item rows, bars: [S] each query's bar ->
    [n] float64 the fraction of the queries whose cosine with each row's direction reaches the bar."""
    scores = queries.astype(np.float64) @ _unit(rows.astype(np.float64)).T
    return (scores >= bars[:, None]).mean(0)


def top_bars(queries: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """queries: [S, d], trained: [M, d] the trained items' vectors -> [S] float64 each query's
    ``EXPOSURE_TOP``-th best cosine with them (its worst, with fewer items)."""
    scores = queries.astype(np.float64) @ _unit(trained.astype(np.float64)).T
    top = min(EXPOSURE_TOP, scores.shape[1])
    return np.partition(scores, scores.shape[1] - top, axis=1)[:, scores.shape[1] - top]


def expected_rates(trained_counts: np.ndarray, trained_rates: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """trained_counts: [M] int64, trained_rates: [M] their top rates, counts: [n] int64 -> [n] float64
    the mean rate of the ``COUNT_NEIGHBOURS`` trained items nearest each count in log1p(count) (all of
    them when fewer)."""
    order = np.argsort(trained_counts, kind="stable")
    logs = np.log1p(trained_counts[order].astype(np.float64))
    cumulative = np.concatenate([[0.0], np.cumsum(trained_rates[order])])
    width = min(COUNT_NEIGHBOURS, len(order))
    x = np.log1p(counts.astype(np.float64))
    position = np.searchsorted(logs, x)
    # the nearest ``width`` form the window [start, start + width): the start whose ends are balanced
    low = np.clip(position - width, 0, len(order) - width)
    high = np.clip(position, 0, len(order) - width)
    while (low < high).any():
        middle = (low + high) // 2
        end = np.minimum(middle + width, len(order) - 1)  # past the end only where low == high (done)
        right = x - logs[middle] > logs[end] - x
        low, high = np.where((low < high) & right, middle + 1, low), np.where((low < high) & ~right, middle, high)
    return (cumulative[low + width] - cumulative[low]) / width


def exposure_shift(
    features_only: np.ndarray,
    counts: np.ndarray,
    mean_query: np.ndarray,
    fit: GainFit,
    queries: np.ndarray,
    trained: np.ndarray,
    trained_counts: np.ndarray,
) -> float:
    """features_only: [n, d] new items' feature-only vectors, counts: [n] int64, queries: [S, d] the
    served queries, trained: [M, d] the trained items' vectors, trained_counts: [M] int64 -> the shift
    of ``fit``'s gain at which the new rows take as many top slots of ``queries`` as trained items of
    their counts (module docstring): the largest in [-SHIFT_BOUND, SHIFT_BOUND] at which they take no
    more."""
    bars = top_bars(queries, trained)
    want = float(expected_rates(trained_counts, top_rates(queries, trained, bars), counts).sum())

    def taken(shift: float) -> float:
        rows = placed_rows(features_only, counts, mean_query, GainFit(fit.alpha, fit.beta, shift))
        return float(top_rates(queries, rows, bars).sum())

    low, high = -SHIFT_BOUND, SHIFT_BOUND
    if taken(high) <= want:
        return high
    for _ in range(SHIFT_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if taken(middle) <= want else (low, middle)
    return low
