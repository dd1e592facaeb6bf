"""gr.ops.random: dropout keep masks and uniform integers, counter-based on CPU with the native kernels
(torch's generators otherwise), seeded from torch's generators so runs repeat."""

import pytest
import torch

from gr.ops import random as rng
from gr.ops.native import native_ops
from helpers.native import X86

CPU = torch.device("cpu")


@pytest.fixture(params=["0", "auto"], ids=["torch", "native-if-built"])
def setting(request, monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", request.param)
    return request.param


def test_keep_mask_keeps_one_minus_p_and_repeats_under_the_same_seed(setting):
    torch.manual_seed(3)
    mask = rng.keep_mask((500, 400), 0.2, CPU)
    assert mask.shape == (500, 400) and mask.dtype == torch.bool
    assert abs(mask.float().mean().item() - 0.8) < 0.004  # 200k draws: 4 sigma is ~0.0036
    torch.manual_seed(3)
    assert torch.equal(rng.keep_mask((500, 400), 0.2, CPU), mask)
    assert not torch.equal(rng.keep_mask((500, 400), 0.2, CPU), mask)  # the seed draw moved the generator on


def test_keep_mask_rows_are_independent(setting):
    """Neighbouring elements and rows are uncorrelated: the kept fractions of pairs are (1 - p)^2."""
    torch.manual_seed(4)
    mask = rng.keep_mask((1000, 200), 0.5, CPU).float()
    for both in ((mask[:, 1:] * mask[:, :-1]).mean(), (mask[1:] * mask[:-1]).mean()):
        assert abs(both.item() - 0.25) < 0.004


def test_randint_is_uniform_in_range_and_repeats_from_the_generator(setting):
    draws = rng.randint(37, (2000, 100), torch.Generator().manual_seed(5))
    assert draws.dtype == torch.int64 and draws.shape == (2000, 100)
    assert int(draws.min()) == 0 and int(draws.max()) == 36
    counts = torch.bincount(draws.flatten(), minlength=37).double()
    expected = draws.numel() / 37
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 80  # 36 degrees of freedom: P(chi2 > 80) < 1e-4
    assert torch.equal(rng.randint(37, (2000, 100), torch.Generator().manual_seed(5)), draws)
    assert not torch.equal(rng.randint(37, (2000, 100), torch.Generator().manual_seed(6)), draws)


def test_randint_beyond_32_bits_takes_torch_path():
    draws = rng.randint(2**40, (1000,), torch.Generator().manual_seed(0))
    assert int(draws.max()) >= 2**32  # a 32-bit draw could not reach it


@pytest.mark.skipif(not X86, reason="the native kernels are built for x86-64 only")
def test_native_draws_do_not_depend_on_the_thread_count(monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    ops = native_ops("gr_cpu_random")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.keep_mask(300_000, 0.3, 11), ops.randint(300_000, 1000, 11)
        torch.set_num_threads(2)
        two = ops.keep_mask(300_000, 0.3, 11), ops.randint(300_000, 1000, 11)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def _splitmix64(seed: int, i: int) -> int:
    """Draw i of a call (gr/ops/random/random.cpp's contract), in Python integers."""
    full = (1 << 64) - 1
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & full
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & full
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & full
    return z ^ (z >> 31)


@pytest.mark.skipif(not X86, reason="the native kernels are built for x86-64 only")
@pytest.mark.parametrize("n, p, seed", [(37, 0.3, 2**61 + 12345), (8, 0.5, 7), (70_001, 0.1, 99)])
def test_native_keep_mask_is_the_splitmix64_draw_of_each_index(monkeypatch, n, p, seed):
    """Element i is kept iff the top 32 bits of draw i reach p * 2^32, whatever the vector width and
    the threads' split (70,001 draws go to two threads, the second starting at 35,001: off a multiple of 8)."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = native_ops("gr_cpu_random").keep_mask(n, p, seed).tolist()
    finally:
        torch.set_num_threads(threads)
    threshold = int(p * 4294967296.0)
    assert got == [int((_splitmix64(seed, i) >> 32) >= threshold) for i in range(n)]


@pytest.mark.skipif(not X86, reason="the native kernels are built for x86-64 only")
def test_native_ops_refuse_bad_arguments(monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    ops = native_ops("gr_cpu_random")
    with pytest.raises(RuntimeError, match="0 <= p < 1"):
        ops.keep_mask(10, 1.0, 0)
    with pytest.raises(RuntimeError, match="0 < high <= 2\\^32"):
        ops.randint(10, 0, 0)
