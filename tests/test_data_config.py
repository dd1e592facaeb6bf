"""DataConfig: every bad key is named as data.<key> before any file is read."""

import pytest

from gr.data.config import DataConfig


@pytest.mark.parametrize(
    "values, key",
    [
        ({"source": "movielens"}, r"data\.source"),
        ({"source": "ml-1m"}, r"data\.path"),
        ({"path": "/tmp/x"}, r"data\.path: the synthetic source reads no file"),
        ({"task": "ctr"}, r"data\.task"),
        ({"max_seq_len": 0}, r"data\.max_seq_len"),
        ({"batch_size": 2.5}, r"data\.batch_size"),
        ({"min_seq_len": 1}, r"data\.min_seq_len: expected an int >= 2"),
        ({"min_seq_len": 2}, r"data\.min_seq_len: leave-one-out needs 3 events per user"),
        ({"eval_exclude": "all"}, r"data\.eval_exclude"),
        ({"item_features": "yes"}, r"data\.item_features"),
        ({"synthetic": {"num_users": 0}}, r"data\.synthetic\.num_users"),
        ({"synthetic": {"min_len": 30, "max_len": 20}}, r"data\.synthetic\.max_len"),
        ({"synthetic": {"num_items": 20_000}}, r"data\.synthetic\.num_items: at most"),
        ({"ranking": {"num_negatives": -1}}, r"data\.ranking\.num_negatives"),
        ({"ranking": {"tasks": [{"name": "like", "min_rating": "high"}]}}, r"data\.ranking\.tasks\[0\]\.min_rating"),
        ({"ranking": {"tasks": [{"min_rating": 4}]}}, r"data\.ranking\.tasks\[0\]\.name: required"),
        ({"ranking": {"tasks": [{"name": "a"}, {"name": "a"}]}}, r"data\.ranking\.tasks: duplicate"),
        (
            {"columns": {"user": "id", "item": "id"}},
            r"data\.columns: column 'id' is used twice \(data\.columns\.user and data\.columns\.item\)",
        ),
        ({"columns": {"delimiter": "::"}}, r"data\.columns\.delimiter"),
        ({"columns": {"user_features": "country"}}, r"data\.columns\.user_features"),
        (
            {"source": "ml-1m", "path": "x", "release_year": True},
            r"data\.release_year: only MovieLens-100K's item features .* got source 'ml-1m'",
        ),
        (
            {"source": "ml-100k", "path": "x", "release_year": True, "item_features": False},
            r"data\.release_year: .* got item_features false",
        ),
    ],
)
def test_invalid_value_is_named(values, key):
    with pytest.raises(ValueError, match=key):
        DataConfig.from_dict(values)


@pytest.mark.parametrize(
    "values, where",
    [
        ({"max_len": 3}, r"data: unknown key\(s\) \['max_len'\]"),
        ({"synthetic": {"users": 3}}, r"data\.synthetic: unknown key\(s\) \['users'\]"),
        ({"ranking": {"tasks": [{"name": "a", "x": 1}]}}, r"data\.ranking\.tasks\[0\]: unknown key\(s\) \['x'\]"),
    ],
)
def test_unknown_keys_are_named(values, where):
    with pytest.raises(ValueError, match=where):
        DataConfig.from_dict(values)


def test_defaults_are_the_synthetic_retrieval_recipe_and_round_trip():
    config = DataConfig.from_dict({"ranking": {"tasks": [{"name": "watch"}, {"name": "like", "min_rating": 4}]}})
    assert config.source == "synthetic" and config.task == "retrieval" and config.eval_exclude == "history"
    assert [t.name for t in config.ranking.tasks] == ["watch", "like"]
    assert DataConfig.from_dict(config.to_dict()) == config


def test_sections_given_as_mappings_are_validated_in_place():
    assert DataConfig(synthetic={"num_users": 5}).synthetic.num_users == 5
    with pytest.raises(ValueError, match=r"data\.ranking: expected a mapping"):
        DataConfig(ranking=3)
