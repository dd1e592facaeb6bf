"""The Triton kernels are launched by keyword: the host-side argument dicts name exactly the
kernels' parameters, and a launch missing one is an error instead of shifted arguments."""

import pytest
import torch

pytest.importorskip("triton")

from gr.hstu.kernels import ascend_triton, triton_attention  # noqa: E402
from gr.hstu.kernels.triton_common import flags, prepare_inputs, scalar_args, strides, table_args  # noqa: E402

pytestmark = pytest.mark.attention


def _inputs():
    q, k = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    v = torch.randn(5, 2, 32)
    offsets = torch.tensor([0, 2, 5])
    inputs = prepare_inputs(q, k, v, offsets, 3, None, 0, 0, 1.0, None, None, "triton")
    return q, k, v, inputs


def test_strides_are_named_after_each_tensor():
    x = torch.zeros(4, 3, 8)
    y = torch.zeros(4, 8, 3).transpose(1, 2)
    assert strides(q=x, do=y) == {"stride_qt": 24, "stride_qh": 8, "stride_dot": 24, "stride_doh": 1}


@pytest.mark.parametrize(
    "kernel, own",
    [
        (triton_attention._forward_kernel, {"Q", "K", "V", "DO", "Out", "stride_ot", "stride_oh"}),
        (triton_attention._backward_dq_kernel, {"Q", "K", "V", "DO", "DQ", "stride_dqt", "stride_dqh"}),
        (ascend_triton._forward_kernel, {"Q", "K", "V", "DO", "Out", "stride_ot", "stride_oh"}),
    ],
    ids=["cuda-forward", "cuda-dq", "ascend-forward"],
)
def test_host_argument_names_match_the_kernel_parameters(kernel, own):
    """Every name the host passes is a kernel parameter (and no parameter is left out besides
    the launch's own switches), so a renamed parameter fails here before it fails on a device."""
    q, k, v, inputs = _inputs()
    host = {*table_args(inputs), *scalar_args(inputs, q, v), *strides(q=q, k=k, v=v, do=q), *flags(inputs, q, v, True)}
    params = set(kernel.arg_names)
    assert host <= params, sorted(host - params)
    launch_only = {
        "H",
        "AUTOTUNE_MAX_LEN",
        "BLOCK_M",
        "BLOCK_N",
        "POS_WINDOW",
        "TIME_TABLE",
        "THR_TABLE",
        "TileSeq",
        "TileStart",
        "num_tiles",
    }
    assert params - host - own <= launch_only, sorted(params - host - own - launch_only)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter's launch on CPU tensors")
def test_launch_without_an_argument_is_an_error():
    q, k, v, inputs = _inputs()
    out = torch.empty(5, 2, 32)
    args = dict(
        Q=q,
        K=k,
        V=v,
        DO=q,
        Out=out,
        **table_args(inputs),
        **strides(q=q, k=k, v=v, do=q, o=out),
        **scalar_args(inputs, q, v),
    )
    del args["stride_kt"]
    meta = dict(flags(inputs, q, v, True), H=2, AUTOTUNE_MAX_LEN=4, BLOCK_M=16, BLOCK_N=16)
    with pytest.raises(TypeError, match="stride_kt"):
        triton_attention._forward_kernel[(4, 1)](**args, **meta)
