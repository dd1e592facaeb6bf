"""Where ``gr items add`` places a new item's row on a tower export (``gr.export.new_item_rows``):
the id row's gain at the mean query is fitted against log1p(count) over the trained items, and a
new row of unit norm turns its features' direction towards (or away from) the mean query until
its cosine there gains what a trained item of its count gains."""

import numpy as np
import pytest

from gr.export.new_item_rows import MAX_COSINE, GainFit, fit_gain, placed_rows


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=-1, keepdims=True)


def test_the_fit_recovers_the_gain_of_the_id_rows_against_log_counts():
    rng = np.random.default_rng(0)
    d, m = 8, 200
    mean_query = 0.7 * _unit(rng.normal(size=d))
    features_only = rng.normal(size=(m, d))
    counts = rng.integers(0, 500, size=m)
    counts[:5] = 0  # items never counted are left out of the fit
    gain = -0.3 + 0.05 * np.log1p(counts)
    gain[:5] = 9.0
    # each trained vector: its features' direction turned so its mean-query score gains ``gain``
    target = np.clip(_unit(features_only) @ mean_query + gain, -MAX_COSINE * 0.7, MAX_COSINE * 0.7)
    trained = _turned(features_only, mean_query, target)
    found = fit_gain(mean_query, trained, features_only, counts)
    seen = counts > 0
    want_beta, want_alpha = np.polyfit(np.log1p(counts[seen]), (target - _unit(features_only) @ mean_query)[seen], 1)
    assert found.alpha == pytest.approx(want_alpha, abs=1e-9) and found.beta == pytest.approx(want_beta, abs=1e-9)
    assert found.alpha == pytest.approx(-0.3, abs=0.05) and found.beta == pytest.approx(0.05, abs=0.01)


def _turned(rows: np.ndarray, mean_query: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Unit rows in the plane of each row and the mean query, at mean-query score ``target``."""
    u = _unit(mean_query)
    cos = np.clip(target / np.linalg.norm(mean_query), -1, 1)
    across = _unit(_unit(rows) - (_unit(rows) @ u)[:, None] * u)
    return cos[:, None] * u + np.sqrt(1 - cos**2)[:, None] * across


def test_a_placed_row_gains_the_fitted_score_at_the_mean_query_and_keeps_its_features_direction():
    rng = np.random.default_rng(1)
    mean_query = 0.6 * _unit(rng.normal(size=6))
    features_only = rng.normal(size=(50, 6)) * 3.0
    counts = rng.integers(0, 100, size=50)
    fit = GainFit(-0.2, 0.04)
    rows = placed_rows(features_only, counts, mean_query, fit).astype(np.float64)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-6)
    want = np.clip(_unit(features_only) @ mean_query + fit.gain(counts), -0.99 * 0.6, 0.99 * 0.6)
    np.testing.assert_allclose(rows @ mean_query, want, atol=1e-6)
    u = _unit(mean_query)
    across_row = _unit(rows - (rows @ u)[:, None] * u)
    across_features = _unit(features_only - (features_only @ u)[:, None] * u)
    np.testing.assert_allclose(np.sum(across_row * across_features, axis=1), 1.0, atol=1e-6)


def test_a_new_item_never_counted_scores_below_its_features_alone_when_the_fit_says_so():
    rng = np.random.default_rng(2)
    mean_query = 0.7 * _unit(rng.normal(size=4))
    features_only = rng.normal(size=(20, 4))
    rows = placed_rows(features_only, np.zeros(20, dtype=np.int64), mean_query, GainFit(-0.3, 0.07))
    assert (rows @ mean_query < _unit(features_only) @ mean_query).all()
    same = placed_rows(features_only, np.zeros(20, dtype=np.int64), np.zeros(4), GainFit(-0.3, 0.07))
    np.testing.assert_allclose(same, _unit(features_only), atol=1e-6)
