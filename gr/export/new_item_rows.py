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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MEAN_QUERY_SAMPLE = 4096
MAX_COSINE = 0.99  # a target cosine of 1 would collapse every new row onto the mean query


@dataclass(frozen=True)
class GainFit:
    """The id row's gain at the mean query against log1p(count): ``alpha + beta * log1p(count)``."""

    alpha: float
    beta: float

    def gain(self, counts: np.ndarray) -> np.ndarray:
        """counts: [n] int64 -> [n] float64."""
        return self.alpha + self.beta * np.log1p(counts.astype(np.float64))


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
