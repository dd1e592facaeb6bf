"""The fused CPU attention tiles: built and used on x86-64, equal to the unfused kernel, bf16 computed in
fp32, switchable by GR_CPU_FUSED, and a failed build falls back (or fails loudly when required).
Their results against the reference over every mask and bias case: tests/test_attention_conformance.py."""

import logging
import platform

import pytest
import torch

from gr.hstu.kernels import AttentionWorkspace, RelativeBias, cpu_fused, hstu_attention
from gr.hstu.kernels.cpu_fused import fused_ops, fused_setting

pytestmark = pytest.mark.attention
X86 = platform.machine() in ("x86_64", "AMD64")


def offsets_of(lengths):
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])


def attention_and_grads(dtype, lengths=(300, 1, 97, 260, 33), targets=None, heads=2):
    """Output and gradients of q, k, v and both bias weights on a fixed batch of ``dtype`` inputs."""
    g = torch.Generator().manual_seed(5)
    offsets = offsets_of(list(lengths))
    total = int(offsets[-1])
    # values a bf16 can hold, so that every dtype runs on the same inputs
    q, k, v = (torch.randn(total, heads, 16, generator=g).bfloat16().to(dtype).requires_grad_(True) for _ in range(3))
    pos_w, time_w = (torch.randn(n, generator=g).mul(0.1).requires_grad_(True) for n in (301, 64))
    timestamps = torch.randint(0, 10**7, (total,), generator=g).sort().values
    rab = RelativeBias(pos_w, time_w, timestamps)
    num_targets = torch.tensor(targets) if targets is not None else None
    out = hstu_attention(
        q, k, v, offsets, max(lengths), num_targets=num_targets, alpha=0.3, rab=rab, backend="cpu",
        workspace=AttentionWorkspace(offsets),
    )  # fmt: skip
    cotangent = torch.randn(out.shape, generator=g).bfloat16().float()  # exact in either dtype
    grads = torch.autograd.grad((out.float() * cotangent).sum(), [q, k, v, pos_w, time_w])
    return out.detach(), grads


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
def test_fused_tiles_build_and_run_here(monkeypatch):
    """On x86-64 with a compiler (this suite's machines) the tiles build: the conformance suite's
    "cpu" backend is the fused one, not silently the fallback."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    assert fused_ops() is not None
    with torch.profiler.profile() as profile:
        attention_and_grads(torch.float32)
    names = {event.key for event in profile.key_averages()}
    assert {"gr_cpu_fused::forward_chunk", "gr_cpu_fused::backward_chunk"} <= names


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
@pytest.mark.parametrize("targets", [None, [4, 0, 7, 2, 1]])
def test_fused_equals_unfused_within_fp32_rounding(monkeypatch, targets):
    """Sequences of 300 and 260 tokens span three query chunks and many row blocks."""
    monkeypatch.setenv("GR_CPU_FUSED", "0")
    want_out, want_grads = attention_and_grads(torch.float32, targets=targets)
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    got_out, got_grads = attention_and_grads(torch.float32, targets=targets)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
def test_fused_tiles_compute_bf16_inputs_in_fp32(monkeypatch):
    """bf16 q, k, v are widened once: output and q, k, v gradients are the fp32 results rounded once."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    out16, grads16 = attention_and_grads(torch.bfloat16)
    out32, grads32 = attention_and_grads(torch.float32)
    assert out16.dtype == torch.bfloat16 and torch.equal(out16, out32.bfloat16())
    for got, want in zip(grads16[:3], grads32[:3]):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
    for got, want in zip(grads16[3:], grads32[3:]):  # bias gradients: fp32, summed across threads
        torch.testing.assert_close(got, want)


def test_the_setting_is_validated(monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", "yes")
    with pytest.raises(ValueError, match="GR_CPU_FUSED: expected 'auto', '0' or '1', got 'yes'"):
        fused_setting()
    monkeypatch.setenv("GR_CPU_FUSED", "0")
    assert fused_ops() is None


def test_a_broken_source_fails_to_build_with_the_compiler_error(tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="Error building extension"):
        cpu_fused.build("gr_test_broken_source", broken, tmp_path / "extensions")


def test_a_failed_build_falls_back_with_the_reason_logged_or_fails_when_required(monkeypatch, caplog):
    def failing_build(name, source, directory):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(cpu_fused, "build", failing_build)
    with caplog.at_level(logging.WARNING, logger="gr.hstu.kernels.cpu_fused"):
        assert cpu_fused._load_once.__wrapped__() == (None, "no C++ compiler found")  # uncached
    assert "no C++ compiler found); using the unfused kernel" in caplog.text
    monkeypatch.setattr(cpu_fused, "_load_once", lambda: (None, "no C++ compiler found"))
    monkeypatch.setenv("GR_CPU_FUSED", "auto")
    assert fused_ops() is None
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    with pytest.raises(RuntimeError, match="GR_CPU_FUSED=1 but the fused CPU attention did not build: no C"):
        fused_ops()


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
def test_loading_the_tiles_keeps_subnormal_floats(monkeypatch):
    """They are compiled with -ffast-math but not linked with it: crtfastmath would set flush-to-zero for
    the whole process and silently zero every subnormal float from then on."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    assert fused_ops() is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert float(tiny * 1.0) > 0.0
