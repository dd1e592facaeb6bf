import pytest

from gr import HSTUConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_heads=0), "num_heads"),
        (dict(hidden_dim=-4), "hidden_dim"),
        (dict(num_layers=1.5), "num_layers"),
        (dict(dropout=1.0), "dropout"),
        (dict(input_dropout=-0.1), "input_dropout"),
        (dict(attn_norm="mean"), "attn_norm"),
        (dict(time_bucketing="linear"), "time_bucketing"),
        (dict(kernel_backend="cuda"), "kernel_backend"),
        (dict(attn_alpha=0.0), "attn_alpha"),
        (dict(max_attn_len=-1), "max_attn_len"),
        (dict(contextual_len=300, max_seq_len=200), "contextual_len"),
        (dict(position_embedding="yes"), "position_embedding"),
        (dict(layer_norm_eps=0), "layer_norm_eps"),
        (dict(position_buckets=-1), "position_buckets"),
    ],
)
def test_invalid_field_is_named_in_the_error(kwargs, field):
    with pytest.raises(ValueError, match=rf"HSTUConfig\.{field}"):
        HSTUConfig(**kwargs)


def test_unknown_key_from_a_config_file_is_named():
    with pytest.raises(ValueError, match=r"model\.hstu: unknown key\(s\) \['num_head'\]"):
        HSTUConfig.from_dict({"num_head": 2}, where="model.hstu")


def test_round_trip_and_derived_values():
    cfg = HSTUConfig(attention_dim=16, max_seq_len=50)
    assert HSTUConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.alpha == pytest.approx(0.25)
    assert cfg.num_position_buckets == 51
    assert HSTUConfig(position_buckets=0).num_position_buckets == 0
