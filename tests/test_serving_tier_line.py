"""Where a served model fetches histories from a tier rather than encoding them (gr.serving.tier_line,
``gr serve --tier-min-tokens auto``): measured by history length until fetching costs less, on a
copy of the engine, leaving the tier and the engine's pages as they were."""

import math

import pytest

from gr.export import export_model
from gr.hstu import HSTU
from gr.hstu.cache import CachedHSTU
from gr.hstu.config import HSTUConfig
from gr.hstu.paged import PagePool
from gr.serving import Ranker
from gr.serving.shared_tier import SqliteTier
from gr.serving.tier_line import FIRST_LENGTH, MARGIN, NEW_TOKENS, first_cheaper, measure_tier_line
from helpers.models import DENSE_DIMS, build_ranking_model


def test_the_line_is_the_shortest_length_whose_fetch_costs_less_by_the_margin():
    assert MARGIN > 1
    assert first_cheaper({16: (1.0, 2.0), 32: (1.5, 1.4), 64: (3.0, 1.0)}) == 64  # 32: cheaper, not by the margin
    assert first_cheaper({16: (1.0, 2.0), 32: (1.5, 1.4 / MARGIN - 1e-9), 64: (3.0, 1.0)}) == 32
    assert first_cheaper({64: (3.0, 1.0), 16: (1.0, 0.5)}) == 16
    assert first_cheaper({16: (1.0, 2.0), 32: (1.0, 1.0)}) is None
    assert first_cheaper({}) is None


@pytest.mark.parametrize("query_time", ["token", "next_event"])
def test_the_measurement_doubles_the_length_until_fetching_pays_and_leaves_no_trace(tmp_path, query_time):
    config = HSTUConfig(
        hidden_dim=16, num_layers=2, num_heads=2, attention_dim=8, linear_dim=8, max_seq_len=80, query_time=query_time
    )
    engine = CachedHSTU(HSTU(config).eval(), PagePool(config, 64, 4))
    tier = SqliteTier(tmp_path / "tier.sqlite", 2**26)
    line = measure_tier_line(engine, tier, page_size=4)
    lengths = sorted(line.costs)
    assert lengths[0] == FIRST_LENGTH and all(b == 2 * a for a, b in zip(lengths, lengths[1:]))
    assert lengths[-1] <= config.max_seq_len - NEW_TOKENS
    assert all(0 < cost < math.inf for pair in line.costs.values() for cost in pair)
    assert line.min_tokens == first_cheaper(line.costs)
    if line.min_tokens is None:  # measured up to the longest history that takes the new tokens
        assert 2 * lengths[-1] > config.max_seq_len - NEW_TOKENS
    else:  # no length past the line
        assert line.min_tokens == lengths[-1]
    assert tier.nbytes() == 0  # the measurement's entry purged
    assert engine.pool is not None and engine.pool.used == 0  # measured on pages of its own
    assert "tier line: histories fetched" in line.describe()


def test_a_ranker_with_tiers_measures_its_line_and_one_without_does_not(tmp_path):
    model = build_ranking_model(max_seq_len=40)
    path = export_model(model, tmp_path / "export", dense_dims=DENSE_DIMS)
    tier = SqliteTier(tmp_path / "tier.sqlite", 2**26)
    ranker = Ranker.load(path, page_size=4, tiers=[tier], tier_min_tokens="auto")
    line = ranker.tier_line
    assert line is not None and line.costs
    longest = ranker.model.engine.config.max_seq_len
    assert ranker.cache.min_tokens == (longest + 1 if line.min_tokens is None else line.min_tokens)
    assert tier.nbytes() == 0
    assert Ranker.load(path, page_size=4, tier_min_tokens="auto").tier_line is None  # no tier: nothing to measure
    assert Ranker.load(path, page_size=4, tiers=[tier], tier_min_tokens=8).cache.min_tokens == 8
    with pytest.raises(ValueError, match="tier_min_tokens"):
        Ranker.load(path, tiers=[tier], tier_min_tokens="sometimes")
