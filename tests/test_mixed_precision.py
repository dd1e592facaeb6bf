"""trainer.precision: bf16-mixed runs the training step under bf16 autocast on CPU (HSTU and
DNNs included) with fp32 master weights, and its loss tracks the fp32 run's."""

import pytest
import torch

from gr.hstu import HSTU, HSTUConfig
from gr.ops.native import native_ops
from gr.ops.sampled_softmax import sampled_softmax_loss
from gr.train import load_trained_model, train
from gr.train.config import TrainConfig
from helpers.native import bf16_instructions
from helpers.runs import recipe, step_losses

ONE_EPOCH = ("trainer.max_epochs", 1)


def bf16_rounds() -> bool:
    """Whether bf16 autocast rounds anything here: PyTorch's ops, or gr's fused kernels built with
    AVX-512 BF16 (without it their bf16 math is fp32 math, and results equal fp32's)."""
    return native_ops("gr_cpu_layer") is None or bf16_instructions()


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
    if bf16_rounds():
        assert bf16 != fp32  # the step really ran in lower precision
    assert bf16 == pytest.approx(fp32, rel=0.01)
    model, config = load_trained_model(tmp_path / "bf16-mixed")
    assert config.trainer.precision == "bf16-mixed"
    assert {p.dtype for p in model.hstu.parameters()} == {torch.float32}


def test_bf16_autocast_without_the_native_kernels_runs_hstu_projections_in_bf16(monkeypatch):
    """PyTorch's ops under autocast: the projections are bf16 nn.Linear calls, with fp32 parameters and residual."""
    monkeypatch.setenv("GR_CPU_FUSED", "0")
    hstu = HSTU(HSTUConfig(hidden_dim=16, num_layers=2, attention_dim=8, linear_dim=8, max_seq_len=20, time_buckets=0))
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


@pytest.mark.parametrize(
    "precision, error",
    [
        ("16-mixed", "trainer.precision: '16-mixed'.*gpu"),
        ("bf16", r"trainer.precision: expected one of \['32-true', 'bf16-mixed', '16-mixed'\]"),
    ],
)
def test_precision_is_validated_when_the_config_is_read(precision, error):
    with pytest.raises(ValueError, match=error):
        recipe(("trainer.precision", precision))


def _stack_and_data(seed: int = 0):
    """An HSTU stack with position and time bias (2 layers, 2 heads), a jagged batch of 12
    sequences up to 150 tokens (two query chunks), and an item table of 300 rows."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    config = HSTUConfig(
        hidden_dim=32,
        num_layers=2,
        num_heads=2,
        attention_dim=16,
        linear_dim=16,
        max_seq_len=150,
        dropout=0.0,
        input_dropout=0.0,
    )
    lengths = torch.randint(20, 151, (12,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    total = int(offsets[-1])
    items = torch.randint(0, 300, (total,), generator=g)
    timestamps = torch.randint(1, 86_400, (total,), generator=g).cumsum(0)
    return HSTU(config), torch.nn.Embedding(300, 32), items, offsets, timestamps


def _forward_loss(stack, table, items, offsets, timestamps, generator):
    """Sampled softmax (64 negatives per token) of each token's next item, as retrieval trains."""
    h = stack(table(items), offsets, int((offsets[1:] - offsets[:-1]).max()), timestamps)
    last = torch.zeros(items.numel(), dtype=torch.bool)
    last[offsets[1:] - 1] = True
    queries = torch.nn.functional.normalize(h[~last], dim=-1)
    negatives = torch.randint(0, 300, (queries.shape[0], 64), generator=generator)
    vectors = torch.nn.functional.normalize(table.weight, dim=-1)
    return sampled_softmax_loss(queries, vectors, items[1:][~last[:-1]], negatives, 0.05)


def test_bf16_autocast_forward_and_gradients_stay_close_to_fp32():
    """HSTU + sampled softmax, fp32 against bf16 autocast on the same weights and data (the
    projections' and attention's matmuls in bf16). With gr's fused CPU kernels (bf16 math, fp32
    activations), measured here: the same loss to fp32 rounding, gradients within 0.8% of their
    largest entry. With PyTorch's ops (GR_CPU_FUSED=0, bf16 activations): loss within 0.02%,
    gradients within ~1%, except the attention LayerNorm's (``attn_norm``, up to ~6%). Asserted:
    0.5%, 2% and 10%; and that some gradient differs from fp32's where bf16 runs (PyTorch's ops, or
    the fused kernels built with AVX-512 BF16; without it their bf16 math is fp32 math)."""
    results = {}
    for bf16 in (False, True):
        stack, table, items, offsets, timestamps = _stack_and_data()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = _forward_loss(stack, table, items, offsets, timestamps, torch.Generator().manual_seed(0))
        loss.backward()
        results[bf16] = (loss.item(), {n: p.grad for n, p in [*stack.named_parameters(), ("table", table.weight)]})
    if bf16_rounds():
        assert any(not torch.equal(results[True][1][name], want) for name, want in results[False][1].items())
    assert results[True][0] == pytest.approx(results[False][0], rel=0.005)
    for name, want in results[False][1].items():
        got = results[True][1][name]
        assert got.dtype == torch.float32
        tolerance = 0.10 if ".attn_norm." in name else 0.02
        assert (got - want).abs().max() <= tolerance * want.abs().max(), name


def test_twenty_bf16_training_steps_track_the_fp32_losses():
    """20 AdamW steps (lr 1e-2) from the same weights on the same batch and negatives: the loss
    falls by > 30% (11.1 -> 6.2) and the bf16 run's loss stays within 1% of the fp32 run's at
    every step (measured here: <= 0.07%). A step lost or taken wrongly moves it by more."""
    losses = {}
    for bf16 in (False, True):
        stack, table, items, offsets, timestamps = _stack_and_data()
        optimizer = torch.optim.AdamW([*stack.parameters(), *table.parameters()], lr=1e-2)
        generator = torch.Generator().manual_seed(0)
        losses[bf16] = []
        for _ in range(20):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = _forward_loss(stack, table, items, offsets, timestamps, generator)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[bf16].append(loss.item())
    fp32, bf16 = losses[False], losses[True]
    assert fp32[-1] < 0.7 * fp32[0]
    if bf16_rounds():
        assert bf16 != fp32
    assert bf16 == pytest.approx(fp32, rel=0.01)
