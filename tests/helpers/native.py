"""gr's fused CPU kernels in tests: where they are built, and their ops with a failed build an error."""

import platform

import pytest

from gr.native import native_ops

X86 = platform.machine() in ("x86_64", "AMD64")
x86_only = pytest.mark.skipif(not X86, reason="the fused kernels are built for x86-64 only")


def required_ops(request: pytest.FixtureRequest, namespace: str) -> object:
    """``torch.ops.<namespace>`` with GR_CPU_FUSED=1 for the requesting fixture's scope (a failed build
    raises instead of falling back)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("GR_CPU_FUSED", "1")
    request.addfinalizer(mp.undo)
    return native_ops(namespace)
