"""gr_gemm, the small-tile GEMM inside the fused CPU kernels (gr/ops/csrc/gr_gemm.h), against torch.matmul:
every layout, the tails of its register blocks, more depth than one pass, and BLAS's beta contract;
in fp32 and in bf16 math (operands rounded to bf16, sums in fp32)."""

import pytest
import torch

from helpers.native import required_ops, x86_only

pytestmark = x86_only


@pytest.fixture(scope="module")
def ops(request):
    return required_ops(request, "gr_cpu_gemm")


def operands(m, n, k, trans_a, trans_b, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn((k, m) if trans_a else (m, k), generator=g)
    b = torch.randn((n, k) if trans_b else (k, n), generator=g)
    return a, b


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (7, 15, 3), (8, 16, 25), (9, 33, 50), (32, 200, 50), (13, 50, 300)])
def test_gemm_equals_matmul_on_every_layout_and_tail(ops, trans_a, trans_b, m, n, k):
    a, b = operands(m, n, k, trans_a, trans_b)
    c = torch.randn(m, n)
    expected = 0.5 * (a.T if trans_a else a) @ (b.T if trans_b else b) + 2.0 * c
    ops.gemm(a, b, c, trans_a, trans_b, 0.5, 2.0)
    torch.testing.assert_close(c, expected, rtol=1e-5, atol=1e-4 * k**0.5)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("m, n, k", [(37, 50, 50), (8, 18, 300), (128, 20, 200), (16, 52, 7)])
def test_last_columns_on_the_row_lanes_give_the_bits_of_a_wider_product(ops, trans_a, trans_b, m, n, k):
    """Up to 4 columns past a multiple of 16 (N = 50: 48 + 2) are computed with the rows on the
    register lanes; each element is the same sum in the same order as when those columns sit inside a
    register of 16 columns of a wider product (here 64 columns, the first n the same)."""
    a, b = operands(m, 64, k, trans_a, trans_b)
    narrow_b = b[:n] if trans_b else b[:, :n]
    c_old = torch.randn(m, 64)
    c_narrow, c_wide = c_old[:, :n].clone(), c_old.clone()
    ops.gemm(a, narrow_b, c_narrow, trans_a, trans_b, 0.5, 2.0)
    ops.gemm(a, b, c_wide, trans_a, trans_b, 0.5, 2.0)
    assert torch.equal(c_narrow, c_wide[:, :n])
    expected = 0.5 * (a.T if trans_a else a) @ (narrow_b.T if trans_b else narrow_b) + 2.0 * c_old[:, :n]
    torch.testing.assert_close(c_narrow, expected, rtol=1e-5, atol=1e-4 * k**0.5)


def test_gemm_reads_strided_rows_and_writes_only_its_block(ops):
    """Operands are row slices of wider tensors (as the kernels' q, k, v views of one projection are);
    the columns of c outside the product keep their values."""
    a = torch.randn(20, 70)[:, 10:60]  # [20, 50], row stride 70
    b = torch.randn(33, 90)[:, 5:55]  # [33, 50], row stride 90
    out = torch.full((20, 40), 7.0)
    c = out[:, :33]
    ops.gemm(a, b, c, False, True, 1.0, 0.0)
    torch.testing.assert_close(c, a @ b.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(out[:, 33:], torch.full((20, 7), 7.0))


def test_beta_zero_does_not_read_c_and_empty_depth_scales_c(ops):
    a, b = operands(9, 17, 5, False, False)
    c = torch.full((9, 17), float("nan"))
    ops.gemm(a, b, c, False, False, 1.0, 0.0)
    torch.testing.assert_close(c, a @ b, rtol=1e-5, atol=1e-5)
    c = torch.full((4, 6), 3.0)
    ops.gemm(torch.empty(4, 0), torch.empty(0, 6), c, False, False, 1.0, 0.5)
    assert torch.equal(c, torch.full((4, 6), 1.5))


def test_results_repeat_bitwise_whatever_the_alignment(ops):
    """The summation order is fixed: the same values at another address give the same bits."""
    a, b = operands(32, 200, 50, False, True)
    c1 = torch.empty(32, 200)
    ops.gemm(a, b, c1, False, True, 1.0, 0.0)
    shifted = torch.empty(32 * 50 + 3)[3:].view(32, 50)  # 12 bytes off the allocation's alignment
    shifted.copy_(a)
    c2 = torch.empty(32, 200)
    ops.gemm(shifted, b, c2, False, True, 1.0, 0.0)
    assert torch.equal(c1, c2)


@pytest.mark.parametrize("n, k", [(1, 1), (16, 16), (17, 50), (200, 25), (5, 33)])
def test_transpose_equals_torch(ops, n, k):
    x = torch.randn(n, k + 3)[:, :k]  # strided rows
    assert torch.equal(ops.transpose(x), x.T.contiguous())


def bf16_rounded(x):
    return x.bfloat16().double()


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize(
    "m, n, k", [(1, 1, 1), (7, 15, 3), (8, 16, 25), (9, 33, 50), (32, 200, 26), (13, 50, 301), (130, 20, 40)]
)
def test_bf16_math_is_the_fp32_sum_of_bf16_rounded_products(ops, trans_a, trans_b, m, n, k):
    """Odd depths (a last pair half empty), two passes of depth (k > 256), more rows than one packed
    block (m > 128), column tails, strided rows and BLAS's alpha and beta. Where this build has no bf16
    instructions, bf16 math is fp32 math (the same bits)."""
    a, b = operands(m, n, k, trans_a, trans_b)
    a = torch.cat([a, torch.randn(a.shape[0], 3)], 1)[:, : a.shape[1]]  # rows 3 floats apart past their end
    c_old = torch.randn(m, n)
    c = c_old.clone()
    ops.gemm(a, b, c, trans_a, trans_b, 0.5, 2.0, True)
    if not ops.bf16_instructions():
        fp32 = c_old.clone()
        ops.gemm(a, b, fp32, trans_a, trans_b, 0.5, 2.0)
        assert torch.equal(c, fp32)
        return
    op_a, op_b = (a.T if trans_a else a), (b.T if trans_b else b)
    expected = 0.5 * bf16_rounded(op_a) @ bf16_rounded(op_b) + 2.0 * c_old.double()
    magnitude = 0.5 * op_a.abs().double() @ op_b.abs().double() + 2.0 * c_old.abs().double()
    assert ((c.double() - expected).abs() <= 1e-6 * magnitude).all()  # exact products, fp32 sums
    if k > 1:  # the rounding shows against fp32 operands: bf16 keeps 8 of fp32's 24 bits
        exact = 0.5 * op_a.double() @ op_b.double() + 2.0 * c_old.double()
        assert (c.double() - exact).abs().max() > 1e-4


def test_bf16_math_repeats_bitwise_whatever_the_alignment(ops):
    a, b = operands(32, 200, 50, False, True)
    c1, c2 = torch.empty(32, 200), torch.empty(32, 200)
    ops.gemm(a, b, c1, False, True, 1.0, 0.0, True)
    shifted = torch.empty(32 * 50 + 3)[3:].view(32, 50)
    shifted.copy_(a)
    ops.gemm(shifted, b, c2, False, True, 1.0, 0.0, True)
    assert torch.equal(c1, c2)


def test_bad_shapes_are_refused_with_what_was_expected(ops):
    with pytest.raises(RuntimeError, match=r"shapes do not chain: op\(a\) \[2, 3\], op\(b\) \[4, 5\]"):
        ops.gemm(torch.zeros(2, 3), torch.zeros(4, 5), torch.zeros(2, 5), False, False, 1.0, 0.0)
