import dataclasses
import inspect

import pytest
import torch

from gr import HSTUConfig
from gr.hstu.kernels.attention import AttentionCall, AttentionOptions, hstu_attention
from gr.hstu.kernels.cached_attention import CachedAttentionCall, hstu_cached_attention


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


def test_attention_options_carry_each_attention_field_of_the_config():
    cfg = HSTUConfig(attention_dim=16, max_seq_len=50, contextual_len=3, max_attn_len=7)
    assert cfg.attention_options() == AttentionOptions(contextual_len=3, max_attn_len=7, alpha=0.25, silu_scale=1 / 50)
    per_length = HSTUConfig(attn_alpha=0.5, attn_norm="seq_len")
    assert per_length.attention_options() == AttentionOptions(alpha=0.5, silu_scale=None)


def test_attention_options_are_keywords_of_both_attention_ops_and_fields_of_their_calls():
    """Same names and defaults everywhere, so ``**options.keywords()`` passes a layer's options whole
    and ``AttentionOptions.of`` reads them back from either call."""
    defaults = AttentionOptions().keywords()
    assert list(defaults) == ["contextual_len", "max_attn_len", "alpha", "silu_scale"]
    for op in (hstu_attention, hstu_cached_attention):
        parameters = inspect.signature(op).parameters
        assert {name: parameters[name].default for name in defaults} == defaults, op.__name__
        assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in defaults), op.__name__
    for call in (AttentionCall, CachedAttentionCall):
        assert {f.name: f.default for f in dataclasses.fields(call) if f.name in defaults} == defaults, call.__name__
    options = AttentionOptions(contextual_len=2, max_attn_len=5, alpha=0.3, silu_scale=None)
    q, offsets = torch.zeros(3, 1, 4), torch.tensor([0, 3])
    assert AttentionOptions.of(AttentionCall(q, q, q, offsets, 3, **options.keywords())) == options
    cached = CachedAttentionCall(q, q, q, offsets, q.transpose(0, 1), q.transpose(0, 1), offsets, **options.keywords())
    assert AttentionOptions.of(cached) == options
