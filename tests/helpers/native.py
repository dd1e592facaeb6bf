"""gr's fused CPU kernels in tests: where they are built, and their ops with a failed build an error."""

import platform

import pytest

from gr.ops.native import native_ops

X86 = platform.machine() in ("x86_64", "AMD64")
x86_only = pytest.mark.skipif(not X86, reason="the fused kernels are built for x86-64 only")


def required_ops(request: pytest.FixtureRequest, namespace: str) -> object:
    """``torch.ops.<namespace>`` with GR_CPU_FUSED=1 for the requesting fixture's scope (a failed build
    raises instead of falling back)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("GR_CPU_FUSED", "1")
    request.addfinalizer(mp.undo)
    return native_ops(namespace)


def bf16_instructions() -> bool:
    """Whether gr's native kernels are built here with AVX-512 BF16: their bf16 math then rounds the
    operands to bf16; a build without the instructions computes it in fp32 (tests/test_native_gemm.py)."""
    ops = native_ops("gr_cpu_gemm") if X86 else None
    return ops is not None and bool(ops.bf16_instructions())


def skip_without_bf16_instructions() -> None:
    if not bf16_instructions():
        pytest.skip("this build of gr's kernels has no AVX-512 BF16: its bf16 math is fp32 math")
