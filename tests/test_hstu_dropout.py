"""HSTU's dropout: nn.Dropout's distribution with a cheaper CPU mask."""

import pytest
import torch

from gr.hstu.dropout import Dropout


def test_dropout_keeps_one_minus_p_of_elements_scaled_and_its_gradient_uses_the_same_mask():
    torch.manual_seed(0)
    drop = Dropout(0.2).train()
    x = torch.ones(400, 500, requires_grad=True)
    y = drop(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.8) < 0.005  # 200k draws: 4 sigma is ~0.0036
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1.25))
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() * 1.25)


def test_dropout_is_the_identity_in_eval_and_at_p_zero_and_keeps_the_dtype():
    x = torch.randn(8, 4, dtype=torch.bfloat16)
    assert Dropout(0.5).eval()(x) is x
    assert Dropout(0.0).train()(x) is x
    assert Dropout(0.5).train()(x).dtype == torch.bfloat16


def test_dropout_refuses_a_probability_outside_zero_one():
    with pytest.raises(ValueError, match="0 <= p < 1, got 1.0"):
        Dropout(1.0)
