"""trainer.precision: bf16-mixed runs the training step under bf16 autocast on CPU (HSTU and
DNNs included) with fp32 master weights, and its loss tracks the fp32 run's."""
import pytest
import torch

from gr.hstu import HSTU, HSTUConfig
from gr.train import load_trained_model, train
from gr.train.config import TrainConfig
from tiny_runs import recipe, step_losses

ONE_EPOCH = ("trainer.max_epochs", 1)


def test_bf16_mixed_loss_tracks_fp32_and_keeps_fp32_weights(tmp_path):
    """Same data, seeds and steps. bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 0.2%
    per op) and the loss averages over many tokens; measured here the losses differ by
    <= 0.1%. Tolerance 1%: a step taken wrongly or not at all moves the loss by >10% here."""
    runs = {}
    for precision in ("32-true", "bf16-mixed"):
        train(TrainConfig.from_dict(recipe(ONE_EPOCH, ("trainer.precision", precision))), tmp_path / precision)
        runs[precision] = step_losses(tmp_path / precision)
    fp32, bf16 = runs["32-true"], runs["bf16-mixed"]
    assert len(fp32) >= 4 and fp32[-1] < 0.8 * fp32[0]
    assert bf16 != fp32  # the step really ran in lower precision
    assert bf16 == pytest.approx(fp32, rel=0.01)
    model, config = load_trained_model(tmp_path / "bf16-mixed")
    assert config.trainer.precision == "bf16-mixed"
    assert {p.dtype for p in model.hstu.parameters()} == {torch.float32}


def test_bf16_autocast_runs_hstu_projections_in_bf16_with_fp32_parameters_and_residual():
    hstu = HSTU(HSTUConfig(hidden_dim=16, num_layers=2, attention_dim=8, linear_dim=8, max_seq_len=20,
                           time_buckets=0))
    projected = []
    for layer in hstu.layers:
        for linear in (layer.uvqk, layer.output):
            linear.register_forward_hook(lambda module, args, out: projected.append(out.dtype))
    x, offsets = torch.randn(12, 16), torch.tensor([0, 5, 12])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hstu(x, offsets, 7)
    out.pow(2).mean().backward()
    assert projected == [torch.bfloat16] * 4
    assert out.dtype == torch.float32  # the residual stream adds bf16 updates to fp32 inputs
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in hstu.parameters())


@pytest.mark.parametrize("precision, error", [
    ("16-mixed", "trainer.precision: '16-mixed'.*gpu"),
    ("bf16", r"trainer.precision: expected one of \['32-true', 'bf16-mixed', '16-mixed'\]"),
])
def test_precision_is_validated_when_the_config_is_read(precision, error):
    with pytest.raises(ValueError, match=error):
        recipe(("trainer.precision", precision))
