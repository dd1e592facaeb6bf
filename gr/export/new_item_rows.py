"""Where ``gr items add`` points a new item's row on an export with an item tower.

A new item has no trained id row, so its feature-only vector ``f`` (the tower's encoder of its
features) lacks what a trained item's id row adds to its scores. Two things of it are recovered:

* where it points (``neighbour_directions``): the encoder gives every item of the same features one
  vector, the average of what the queries learned of such items. The trained items nearest a new
  item in feature-only vectors (cosine; ``NEIGHBOURS`` of them, at most a tenth of the trained
  items) hold what the queries learned of items like it, and the mean of their trained vectors'
  directions, weighted by ``log1p`` of their counts (a popular item's row is the better learned),
  is the new item's direction ``g``.
* how far towards the queries (its gain, growing with its popularity: a popular item's id row pulls
  it towards the queries). The export's item encoder file holds the mean served query ``q`` [d]
  (the mean of the normalised retrieval queries of up to ``MEAN_QUERY_SAMPLE`` validation events).
  Over the trained items with a count ``n > 0`` (up to ``FIT_SAMPLE`` of them), the gain of their
  vector over their own neighbours' direction (themselves left out) at the mean query, ``q . (v_hat
  - g_hat)`` (``v``: the trained vector, ``_hat``: L2-normalised, as the catalogue scores), is
  fitted by least squares as ``alpha + beta * log1p(n)``. A new item with count ``n``
  (``item_popularity``; 0 without one) then gets the row of unit norm in the plane of ``g_hat`` and
  ``u = q / |q|`` whose cosine with ``u`` is ``u . g_hat + (alpha + beta * log1p(n)) / |q|``
  (clipped to ``MAX_COSINE``): its score at the mean query is what a trained item of its neighbours
  and count would score there, while its direction away from ``u`` is its neighbours'.

Serving reads the row like any other (no score term of its own). An item never seen (n = 0) takes
the gain fitted for the least popular trained items: where that is negative, a new item scores
below a trained item of the same neighbours at the mean query.

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

Cost: the neighbour search and the top-10 bars compare (the new items, up to ``FIT_SAMPLE``
trained items, and the served queries) with every trained item, in blocks of ``BLOCK`` scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

MEAN_QUERY_SAMPLE = 4096
MAX_COSINE = 0.99  # a target cosine of 1 would collapse every new row onto the mean query
EXPOSURE_TOP = 10  # the top of each served query's ranking whose slots new items are calibrated to take
COUNT_NEIGHBOURS = 50  # the trained items, nearest in count, whose top-10 rate a new item's count expects
SHIFT_BOUND = 1.0  # the largest shift of the gain either way (a score at the mean query: at most 1 apart)
SHIFT_STEPS = 30  # bisection steps: the shift to within 2 * SHIFT_BOUND / 2**30
NEIGHBOURS = 100  # the trained items nearest in feature-only vectors whose directions a new item takes
NEIGHBOURHOOD_SHARE = 10  # ... and at most this share of them (1/10), so a small catalogue's stay near
FIT_SAMPLE = 4096  # the most trained items the gain is fitted over (evenly spaced rows)
BLOCK = 1 << 22  # the most scores (float64) held at once
TIE_BREAK = 1e-9  # at most this added to a cosine, by count, to order trained items of the same features


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


def evenly_spaced(count: int, most: int) -> np.ndarray:
    """[min(count, most)] int64: evenly spaced indices into ``count`` rows, first and last included."""
    return np.unique(np.linspace(0, count - 1, min(most, count)).round().astype(np.int64))


def _blocks(rows: int, width: int) -> List[slice]:
    """Blocks of ``rows`` rows, each of at most ``BLOCK`` scores of ``width`` (at least one row)."""
    step = max(1, BLOCK // max(width, 1))
    return [slice(start, start + step) for start in range(0, rows, step)]


def top_rates(queries: np.ndarray, rows: np.ndarray, bars: np.ndarray) -> np.ndarray:
    """queries: [S, d] unit served queries, rows: [n, d] item rows, bars: [S] each query's bar ->
    [n] float64 the fraction of the queries whose cosine with each row's direction reaches the bar."""
    unit_rows = _unit(rows.astype(np.float64))
    reached = np.zeros(len(rows))
    for block in _blocks(len(queries), len(rows)):
        reached += ((queries[block].astype(np.float64) @ unit_rows.T) >= bars[block, None]).sum(0)
    return reached / len(queries)


def top_bars(queries: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """queries: [S, d], trained: [M, d] the trained items' vectors -> [S] float64 each query's
    ``EXPOSURE_TOP``-th best cosine with them (its worst, with fewer items)."""
    unit_trained = _unit(trained.astype(np.float64))
    top = min(EXPOSURE_TOP, len(trained))
    bars = np.empty(len(queries))
    for block in _blocks(len(queries), len(trained)):
        scores = queries[block].astype(np.float64) @ unit_trained.T
        bars[block] = torch.topk(torch.from_numpy(scores), top, dim=1).values[:, -1].numpy()
    return bars


def neighbour_directions(
    features_only: np.ndarray,
    trained_features: np.ndarray,
    trained: np.ndarray,
    trained_counts: np.ndarray,
    themselves: Optional[np.ndarray] = None,
    neighbours: int = NEIGHBOURS,
) -> np.ndarray:
    """features_only: [n, d] items' feature-only vectors; trained_features, trained: [M, d] the
    trained items' feature-only and trained vectors; trained_counts: [M] int64; themselves: [n] the
    trained row each item is (left out of its own neighbours), or None for new items -> [n, d]
    float64 unit rows: the ``log1p(count)``-weighted mean direction of the trained vectors of the
    ``neighbours`` trained items nearest each item's feature-only vector in cosine (at most a
    ``NEIGHBOURHOOD_SHARE``-th of them, at least one; evenly weighted where none was counted; of
    items equally near, the more counted first); with ``neighbours`` 0, the feature-only vectors'
    own directions."""
    share = max(1, len(trained) // NEIGHBOURHOOD_SHARE)
    k = min(neighbours, share, len(trained) - (themselves is not None))
    if k < 1:
        return _unit(features_only.astype(np.float64))
    unit_features, directions = _unit(trained_features.astype(np.float64)), _unit(trained.astype(np.float64))
    weights = np.log1p(trained_counts.astype(np.float64)) + 1e-6
    # items of the same features tie exactly: the more counted (the better learned) goes first
    tie_break = TIE_BREAK * weights / weights.max()
    out = np.empty(features_only.shape, dtype=np.float64)
    for block in _blocks(len(features_only), len(trained)):
        similarity = _unit(features_only[block].astype(np.float64)) @ unit_features.T + tie_break
        if themselves is not None:
            similarity[np.arange(len(similarity)), themselves[block]] = -np.inf
        nearest = torch.topk(torch.from_numpy(similarity), k, dim=1).indices.numpy()  # far faster than argpartition
        out[block] = np.einsum("nk,nkd->nd", weights[nearest], directions[nearest])
    return _unit(out)


def place(
    features_only: np.ndarray,
    counts: np.ndarray,
    trained: np.ndarray,
    trained_features: np.ndarray,
    trained_counts: np.ndarray,
    mean_query: np.ndarray,
    queries: Optional[np.ndarray],
    neighbours: int = NEIGHBOURS,
) -> Tuple[np.ndarray, GainFit]:
    """features_only: [n, d] new items' feature-only vectors, counts: [n] int64; trained,
    trained_features: [M, d] the trained items' vectors and feature-only vectors, trained_counts:
    [M] int64; mean_query: [d]; queries: [S, d] the served queries or None -> ([n, d] float32 unit
    rows, the fit with its shift): the module docstring's placement (no shift without queries; with
    ``neighbours`` 0, from the feature-only vectors' own directions)."""
    sample = evenly_spaced(len(trained), FIT_SAMPLE)
    own = neighbour_directions(trained_features[sample], trained_features, trained, trained_counts, sample, neighbours)
    fit = fit_gain(mean_query, trained[sample], own, trained_counts[sample])
    directions = neighbour_directions(features_only, trained_features, trained, trained_counts, None, neighbours)
    if queries is not None and len(directions):
        fit = GainFit(
            fit.alpha,
            fit.beta,
            exposure_shift(directions, counts, mean_query, fit, queries, trained, trained_counts),
        )
    return placed_rows(directions, counts, mean_query, fit), fit


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
    more, matched over up to ``FIT_SAMPLE`` of the new items, evenly spaced."""
    bars = top_bars(queries, trained)
    # one shift for all: matched on up to FIT_SAMPLE of the new items (each bisection step scores them)
    sample = evenly_spaced(len(features_only), FIT_SAMPLE)
    features_only, counts = features_only[sample], counts[sample]
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
