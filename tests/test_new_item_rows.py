"""Where ``gr items add`` places a new item's row on a tower export (``gr.export.new_item_rows``):
its direction is that of the trained items nearest its features, the gain of the id rows at the
mean query over such directions is fitted against log1p(count) over the trained items, a new row of
unit norm turns its direction towards (or away from) the mean query until its cosine there gains
what a trained item of its count gains, and one shift for every new row gives them the top-10 slots
of the served queries that trained items of their counts take."""

import numpy as np
import pytest

from gr.export import new_item_rows
from gr.export.new_item_rows import (
    MAX_COSINE,
    GainFit,
    expected_rates,
    exposure_shift,
    fit_gain,
    neighbour_directions,
    place,
    placed_rows,
    top_bars,
    top_rates,
)


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


def _exposure_case(seed: int):
    """Trained items whose vectors are their features' direction turned towards the mean query by a
    gain that grows with their counts plus a spread of their own, served queries around the mean,
    and new items of those features and counts: (features_only, counts, mean_query, queries,
    trained, trained_counts, new_features, new_counts)."""
    rng = np.random.default_rng(seed)
    d, m, n, s = 8, 400, 60, 300
    u = _unit(rng.normal(size=d))
    queries = _unit(u + 0.8 * rng.normal(size=(s, d)) / np.sqrt(d))
    mean_query = queries.mean(0)
    features_only = rng.normal(size=(m + n, d))
    counts = rng.integers(0, 300, size=m + n)
    target = _unit(features_only) @ mean_query - 0.3 + 0.06 * np.log1p(counts) + 0.1 * rng.normal(size=m + n)
    limit = MAX_COSINE * np.linalg.norm(mean_query)
    trained = _turned(features_only[:m], mean_query, np.clip(target[:m], -limit, limit))
    return features_only[:m], counts[:m], mean_query, queries, trained, counts[:m], features_only[m:], counts[m:]


def _taken(features_only, counts, mean_query, fit, queries, trained) -> float:
    """The top-10 slots of ``queries`` the rows placed by ``fit`` take, summed over the rows."""
    rows = placed_rows(features_only, counts, mean_query, fit)
    return float(top_rates(queries, rows, top_bars(queries, trained)).sum())


def test_the_shift_gives_new_items_the_top_10_slots_trained_items_of_their_counts_take():
    trained_features, _, mean_query, queries, trained, trained_counts, features, counts = _exposure_case(3)
    fit = fit_gain(mean_query, trained, trained_features, trained_counts)
    shift = exposure_shift(features, counts, mean_query, fit, queries, trained, trained_counts)
    bars = top_bars(queries, trained)
    want = expected_rates(trained_counts, top_rates(queries, trained, bars), counts).sum()
    unshifted = _taken(features, counts, mean_query, fit, queries, trained)
    shifted = _taken(features, counts, mean_query, GainFit(fit.alpha, fit.beta, shift), queries, trained)
    assert abs(unshifted - want) > 0.2 * want  # the fit alone misses the tail that fills a top 10
    assert np.sign(shift) == np.sign(want - unshifted) and shifted <= want < shifted + 2.0 / len(queries) * len(counts)
    # one shift for every new item: their order at the mean query is the fit's
    np.testing.assert_allclose(
        placed_rows(features, counts, mean_query, GainFit(fit.alpha, fit.beta, shift)) @ mean_query,
        np.clip(_unit(features) @ mean_query + fit.gain(counts) + shift, -0.99 * np.linalg.norm(mean_query), None),
        atol=1e-6,
    )


def test_a_new_items_expected_top_rate_is_that_of_the_trained_items_nearest_its_count():
    trained_counts = np.concatenate([np.full(100, 2), np.full(100, 500)])
    rates = np.concatenate([np.full(100, 0.001), np.full(100, 0.05)])
    found = expected_rates(trained_counts, rates, np.array([0, 2, 3, 480, 5000]))
    np.testing.assert_allclose(found, [0.001, 0.001, 0.001, 0.05, 0.05])
    np.testing.assert_allclose(expected_rates(trained_counts[:10], rates[:10], np.array([7])), [0.001])


def test_each_querys_bar_is_its_tenth_best_trained_cosine_and_the_rates_of_the_trained_items_fill_it():
    _, _, _, queries, trained, _, _, _ = _exposure_case(4)
    bars = top_bars(queries, trained)
    cosines = queries @ _unit(trained).T
    np.testing.assert_allclose(bars, np.sort(cosines, axis=1)[:, -10])
    assert top_rates(queries, trained, bars).sum() == pytest.approx(10.0)


def test_a_new_items_direction_is_the_count_weighted_mean_direction_of_its_nearest_trained_items(monkeypatch):
    rng = np.random.default_rng(5)
    trained_features = np.array([[1.0, 0, 0], [0.9, 0.1, 0], [0.8, 0, 0.2], [0.3, 1.0, 0], [0, 0, 1.0]])
    trained = rng.normal(size=(5, 3))
    counts = np.array([10, 0, 100, 5, 5])
    # at most a tenth of the trained items: of five, the nearest alone
    found = neighbour_directions(np.array([[2.0, 0.1, 0.1]]), trained_features, trained, counts)
    np.testing.assert_allclose(found[0], _unit(trained[0]), atol=1e-9)
    monkeypatch.setattr(new_item_rows, "NEIGHBOURHOOD_SHARE", 1)
    found = neighbour_directions(np.array([[2.0, 0.1, 0.1]]), trained_features, trained, counts, neighbours=3)
    weights = np.log1p(counts[:3]) + 1e-6
    np.testing.assert_allclose(found[0], _unit(weights @ _unit(trained[:3])), atol=1e-9)
    # a trained item is left out of its own neighbours: item 0's are 1, 2 and 3
    own = neighbour_directions(trained_features[:1], trained_features, trained, counts, np.array([0]), 3)
    weights = np.log1p(counts[1:4]) + 1e-6
    np.testing.assert_allclose(own[0], _unit(weights @ _unit(trained[1:4])), atol=1e-9)
    # no neighbours: the feature-only vectors' own directions
    alone = neighbour_directions(trained_features, trained_features, trained, counts, np.arange(5), neighbours=0)
    np.testing.assert_allclose(alone, _unit(trained_features), atol=1e-12)


def test_scores_held_in_blocks_give_what_whole_matrices_give(monkeypatch):
    trained_features, counts, mean_query, queries, trained, _, features, new_counts = _exposure_case(6)
    whole = (
        top_bars(queries, trained),
        neighbour_directions(features, trained_features, trained, counts),
        neighbour_directions(trained_features[:50], trained_features, trained, counts, np.arange(50)),
    )
    whole_rates = top_rates(queries, trained, whole[0])
    monkeypatch.setattr(new_item_rows, "BLOCK", 1000)  # a few rows a block
    np.testing.assert_array_equal(top_bars(queries, trained), whole[0])
    np.testing.assert_array_equal(top_rates(queries, trained, whole[0]), whole_rates)
    np.testing.assert_allclose(neighbour_directions(features, trained_features, trained, counts), whole[1], atol=1e-12)
    np.testing.assert_allclose(
        neighbour_directions(trained_features[:50], trained_features, trained, counts, np.arange(50)),
        whole[2],
        atol=1e-12,
    )


def test_place_turns_the_neighbours_directions_by_the_fit_over_the_trained_items_own_neighbours(monkeypatch):
    monkeypatch.setattr(new_item_rows, "FIT_SAMPLE", 100)
    trained_features, counts, mean_query, queries, trained, _, features, new_counts = _exposure_case(7)
    rows, fit = place(features, new_counts, trained, trained_features, counts, mean_query, queries)
    sample = np.unique(np.linspace(0, len(trained) - 1, 100).round().astype(np.int64))
    own = neighbour_directions(trained_features[sample], trained_features, trained, counts, sample)
    want_fit = fit_gain(mean_query, trained[sample], own, counts[sample])
    directions = neighbour_directions(features, trained_features, trained, counts)
    shift = exposure_shift(directions, new_counts, mean_query, want_fit, queries, trained, counts)
    assert fit == GainFit(want_fit.alpha, want_fit.beta, shift) and shift != 0.0
    np.testing.assert_allclose(rows, placed_rows(directions, new_counts, mean_query, fit), atol=1e-7)
    unshifted, fit_without = place(features, new_counts, trained, trained_features, counts, mean_query, None)
    assert fit_without == want_fit  # no served queries: the fit alone
    np.testing.assert_allclose(unshifted, placed_rows(directions, new_counts, mean_query, want_fit), atol=1e-7)
    # no neighbours: the fit over the trained items' own feature-only vectors, as for a new item's
    alone, fit_alone = place(features, new_counts, trained, trained_features, counts, mean_query, None, neighbours=0)
    want_alone = fit_gain(mean_query, trained[sample], trained_features[sample], counts[sample])
    assert (fit_alone.alpha, fit_alone.beta) == pytest.approx((want_alone.alpha, want_alone.beta), abs=1e-12)
    np.testing.assert_allclose(alone, placed_rows(features, new_counts, mean_query, fit_alone), atol=1e-7)


def test_of_trained_items_with_the_same_features_the_more_counted_is_the_neighbour():
    rng = np.random.default_rng(3)
    features = np.tile(rng.standard_normal((1, 6)), (4, 1))  # four trained items, one set of features
    trained = rng.standard_normal((4, 6))
    counts = np.array([3, 40, 7, 0])
    got = neighbour_directions(features[:1] * 2.0, features, trained, counts, neighbours=1)
    np.testing.assert_allclose(got[0], trained[1] / np.linalg.norm(trained[1]))
