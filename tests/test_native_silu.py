"""gr_silu, the SiLU inside the fused CPU kernels (gr/ops/csrc/gr_silu.h), against the exact SiLU and its
gradient in float64: across the range where its exponential is computed, at the clamp, and on every
row length's last partial vector."""

import pytest
import torch

from helpers.native import required_ops, x86_only

pytestmark = x86_only


@pytest.fixture(scope="module")
def ops(request):
    return required_ops(request, "gr_cpu_silu")


def exact(z: torch.Tensor):
    z = z.double()
    sig = torch.sigmoid(z)
    return z * sig, sig * (1 + z * (1 - sig))


def test_silu_and_its_gradient_are_within_a_few_ulp_of_the_exact_ones(ops):
    z = torch.linspace(-87.0, 87.0, 400_003)
    y, grad = ops.silu(z)
    want_y, want_grad = exact(z)
    # relative to the value, and absolutely where the value is near zero (SiLU's zero at z = 0, the
    # gradient's near z = -1.28): what rounding the inputs to fp32 already costs. SiLU' = sig (1 + z (1 -
    # sig)) multiplies the rounding of sig by z: its absolute error may grow with |z| (fp32 can hold no
    # sig closer to 1 than 6e-8, and at z = 85 1 - sig is 1e-37).
    assert ((y.double() - want_y).abs() <= 1e-6 * want_y.abs() + 1e-7).all()
    assert ((grad.double() - want_grad).abs() <= 1e-6 * want_grad.abs() + 1e-7 * (1 + z.double().abs())).all()


def test_silu_past_the_clamp_saturates_without_overflow_or_nan(ops):
    z = torch.tensor([-1e30, -1000.0, -100.0, 100.0, 1000.0, 1e30])
    y, grad = ops.silu(z)
    assert torch.isfinite(y).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(y[3:], z[3:])  # SiLU(z) = z for large z
    torch.testing.assert_close(grad[3:], torch.ones(3))
    assert (y[:3].abs() <= 1e-30).all() and (grad[:3].abs() <= 1e-30).all()


@pytest.mark.parametrize("n", [1, 15, 16, 17, 50, 200])
def test_every_length_gives_the_values_of_a_longer_row(ops, n):
    """The last, partial vector of a row is computed like the others (bitwise with AVX-512, whose tail
    is a masked vector; to rounding in builds without it, where the compiler's tail is scalar)."""
    z = torch.randn(256, generator=torch.Generator().manual_seed(n)) * 4
    y, grad = ops.silu(z[:n].contiguous())
    y_all, grad_all = ops.silu(z)
    torch.testing.assert_close(y, y_all[:n], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(grad, grad_all[:n], rtol=1e-6, atol=1e-12)
