"""The Triton kernels are launched by keyword from one argument assembly: for every launch of
both variants (CUDA grid, NPU work list) the names it passes are exactly the kernel's
parameters, and a launch missing one is an error instead of shifted arguments."""

import pytest
import torch

pytest.importorskip("triton")

from gr.hstu.kernels.attention import AttentionCall  # noqa: E402
from gr.hstu.kernels.attention.ascend_triton import AscendLayout  # noqa: E402
from gr.hstu.kernels.attention.triton.blocks import attention_kernel  # noqa: E402
from gr.hstu.kernels.attention.triton.cuda import CudaLayout  # noqa: E402
from gr.hstu.kernels.attention.triton.host import (  # noqa: E402
    backward_launches,
    forward_launch,
    layout_args,
    prepare_inputs,
    row_block,
    strides,
)
from gr.hstu.kernels.attention.triton.tuning import TileConfig  # noqa: E402

pytestmark = pytest.mark.attention


def _launches():
    q, k = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    v = torch.randn(5, 2, 32)
    inputs = prepare_inputs(AttentionCall(q, k, v, torch.tensor([0, 2, 5]), 3), "triton")
    return [
        forward_launch(q, k, v, inputs, True),
        *backward_launches(q, k, v, torch.randn_like(v), inputs, True),
    ], inputs


def test_strides_are_named_after_each_tensor():
    x = torch.zeros(4, 3, 8)
    y = torch.zeros(4, 8, 3).transpose(1, 2)
    assert strides(q=x, do=y) == {"stride_qt": 24, "stride_qh": 8, "stride_dot": 24, "stride_doh": 1}


@pytest.mark.parametrize("layout", [CudaLayout(None), AscendLayout((16, 32), 2)], ids=["cuda", "ascend"])
def test_every_launch_passes_exactly_the_kernel_parameters(layout):
    launches, inputs = _launches()
    config = TileConfig(16, 32)
    assert [launch.name for launch in launches] == ["forward", "backward_dq", "backward_dkv"]
    for launch in launches:
        _, work = layout.work(launch, inputs, row_block(launch, config))
        names = [*launch.args, *work, *layout_args(config, layout.ub_tables, inputs)]
        assert len(names) == len(set(names)), launch.name
        assert sorted(names) == sorted(launch.kernel.arg_names), launch.name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter's launch on CPU tensors")
def test_launch_without_an_argument_is_an_error():
    (launch, *_), inputs = _launches()
    config = TileConfig(16, 16)
    grid, work = CudaLayout(None).work(launch, inputs, 16)
    args = dict(launch.args, **work, **layout_args(config, False, inputs))
    del args["stride_kt"]
    with pytest.raises(TypeError, match="stride_kt"):
        attention_kernel[grid](**args)
