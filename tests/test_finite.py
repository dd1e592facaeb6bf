"""gr.utils.finite: the training step's fused gradient check agrees with the per-tensor one;
weights are checked in chunks."""

import pytest
import torch

from gr.utils import finite
from gr.utils.finite import gradients_finite, non_finite


def grads(dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in ((201, 50), (50,), (200, 50), (1,))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_element_in_any_gradient_is_found(dtype, bad):
    for index in range(4):
        tensors = grads(dtype)
        tensors[index].view(-1)[-1] = bad
        assert not gradients_finite(tensors)
        assert non_finite([(str(i), t) for i, t in enumerate(tensors)]) == [str(index)]


def test_finite_gradients_pass_and_keep_their_values_bitwise():
    tensors, before = grads(), grads()
    tensors.append(torch.tensor([-0.0, 3.4e38, 1e-45]))
    before.append(tensors[-1].clone())
    assert gradients_finite(tensors)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(tensors, before))


def test_gradients_of_several_dtypes_and_integer_tensors_are_each_checked():
    mixed = [*grads(), *grads(torch.bfloat16), torch.arange(4)]
    assert gradients_finite(mixed)
    mixed[5].view(-1)[0] = float("nan")
    assert not gradients_finite(mixed)
    assert gradients_finite([])


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "scalar"])
def test_a_weight_is_checked_in_chunks_and_a_bad_element_in_any_chunk_is_found(monkeypatch, layout):
    monkeypatch.setattr(finite, "CHECK_CHUNK_ELEMENTS", 7)  # chunks that split rows, and many of them
    for index in (0, 60, 102, 199):
        weight = torch.randn(20, 10)
        weight.view(-1)[index] = float("nan")
        if layout == "transposed":
            weight = weight.T  # not contiguous: checked by leading rows
        elif layout == "scalar":
            weight = weight.view(-1)[index]
        assert not finite.all_finite(weight) and non_finite([("w", weight)]) == ["w"]
    assert finite.all_finite(torch.randn(20, 10).T) and finite.all_finite(torch.tensor(1.0))
