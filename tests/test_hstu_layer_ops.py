"""gr.hstu.kernels.layer_ops: the HSTU layer's input projection, output and LayerNorm-gate-dropout, and the
stack's input, fused on CPU (gr.ops.native), equal in values and gradients to PyTorch's ops, with
dropout masks from gr.ops.random; what each keeps for backward is what its ``cost`` says."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from gr.hstu import HSTU, HSTUConfig
from gr.hstu.dropout import Dropout
from gr.hstu.kernels.layer_ops import combine, cost, norm_mul_dropout, project, stack_input
from gr.ops import random as rng
from gr.ops.native import native_ops
from helpers.native import X86, skip_without_bf16_instructions

native_only = pytest.mark.skipif(not X86, reason="the native kernels are built for x86-64 only")


def norm_inputs(dtype=torch.float32):
    """x [300, 50], u: the first 50 columns of a [300, 200] projection (row stride 200), a LayerNorm
    with random affine weights."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 50, generator=g).to(dtype).requires_grad_(True)
    projection = torch.randn(300, 200, generator=g).to(dtype).requires_grad_(True)
    norm = nn.LayerNorm(50)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(50, generator=g))
        norm.bias.copy_(torch.randn(50, generator=g))
    return x, projection, norm


def reference(x, u, norm, keep, p):
    y = F.layer_norm(x, (x.shape[-1],), norm.weight, norm.bias, norm.eps)
    y = y if u is None else y * u
    return y if keep is None else y * keep / (1 - p)


@native_only
@pytest.mark.parametrize("gated", [False, True], ids=["norm", "norm-gate"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_norm_mul_dropout_equals_pytorch_in_value_and_gradients(monkeypatch, gated, p):
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    x, projection, norm = norm_inputs()
    u = projection[:, :50] if gated else None
    dropout = Dropout(p).train()
    torch.manual_seed(7)
    y = norm_mul_dropout(x, norm, u, dropout)
    torch.manual_seed(7)
    keep = rng.keep_mask(x.shape, p, x.device) if p > 0 else None
    expected = reference(x, u, norm, keep, p)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    leaves = [x, projection, norm.weight, norm.bias]
    got = torch.autograd.grad((y * cotangent).sum(), leaves, allow_unused=True)
    want = torch.autograd.grad((expected * cotangent).sum(), leaves, allow_unused=True)
    for a, b in zip(got, want):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@native_only
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_norm_under_bf16_autocast_gives_pytorchs_dtype_computed_in_fp32(monkeypatch, x_dtype):
    """Autocast leaves LayerNorm in its input's dtype on CPU: bf16 rows give bf16 (rounded once from
    fp32 here, so as close to the fp32 result as PyTorch's, to fp32 rounding), fp32 rows gated by bf16
    U fp32."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    x, projection, norm = norm_inputs()
    x, u = x.detach().to(x_dtype).requires_grad_(True), projection.detach()[:, :50].bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm_mul_dropout(x, norm, u)
        expected = norm(x) * u
    assert y.dtype == expected.dtype == x_dtype
    exact = reference(x.float(), u.float(), norm, None, 0.0)
    assert (y.float() - exact).abs().max() <= (expected.float() - exact).abs().max() + 1e-5
    (dx,) = torch.autograd.grad(y.float().sum(), x)
    assert dx.dtype == x_dtype


def test_norm_falls_back_to_pytorch_for_float64_and_without_the_kernels(monkeypatch):
    x, projection, norm = norm_inputs()
    for setting, dtype in (("auto", torch.float64), ("0", torch.float32)):
        monkeypatch.setenv("GR_CPU_FUSED", setting)
        norm = norm.to(dtype)
        xd, u = x.detach().to(dtype), projection.detach()[:, :50].to(dtype)
        with torch.profiler.profile() as profile:
            y = norm_mul_dropout(xd, norm, u)
        assert not any(e.key.startswith("gr_cpu_layer") for e in profile.key_averages())
        torch.testing.assert_close(y, reference(xd, u, norm, None, 0.0))


@native_only
def test_projection_equals_pytorch_and_passes_gradients_of_unused_parts_as_zero(monkeypatch):
    """300 rows: two blocks and a partial one. The last part gets no gradient (None in backward)."""
    x, _, norm = norm_inputs()
    linear = nn.Linear(50, 200)
    sizes = [50, 50, 60, 40]
    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("GR_CPU_FUSED", setting)
        parts = project(x, norm, linear, sizes)
        assert [p.shape[1] for p in parts] == sizes
        weights = [torch.randn(p.shape, generator=torch.Generator().manual_seed(3 + i)) for i, p in enumerate(parts)]
        loss = sum((p * w).sum() for p, w in zip(parts[:3], weights[:3]))
        leaves = [x, norm.weight, norm.bias, linear.weight, linear.bias]
        results[setting] = (parts, torch.autograd.grad(loss, leaves))
    for got, want in zip(results["1"][0], results["0"][0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(results["1"][1], results["0"][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@native_only
def test_projection_keeps_its_silu_gradient_only_when_backward_will_run(monkeypatch):
    """The fused forward returns SiLU'(pre) for backward, in the same contiguous [T, n_i] parts as
    SiLU(pre), or no parts when asked not to; ``project`` asks for it only when backward will run
    (not under no_grad, as in serving), and the values are the same either way."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    x, _, norm = norm_inputs()
    linear = nn.Linear(50, 200)
    ops = native_ops("gr_cpu_layer")
    weights = (norm.weight, norm.bias, norm.eps, linear.weight, linear.bias)
    args = (x.detach(), *(w.detach() if isinstance(w, torch.Tensor) else w for w in weights))
    sizes = [60, 40, 100]
    y, silu_grad, _, _ = ops.projection_forward(*args, sizes, True)
    y_served, nothing, _, _ = ops.projection_forward(*args, sizes, False)
    pre = linear(F.layer_norm(x, (50,), norm.weight, norm.bias, norm.eps)).detach().requires_grad_(True)
    (want,) = torch.autograd.grad(F.silu(pre).sum(), pre)
    assert [p.shape for p in y] == [p.shape for p in silu_grad] == [(x.shape[0], n) for n in sizes]
    assert all(p.is_contiguous() for p in y + silu_grad)
    torch.testing.assert_close(torch.cat(silu_grad, dim=1), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat(y, dim=1), F.silu(pre.detach()), rtol=1e-4, atol=1e-5)
    assert nothing == []
    for served, kept in zip(y_served, y):
        torch.testing.assert_close(served, kept, rtol=0, atol=0)

    asked = []

    class Recording:
        def __getattr__(self, name):
            op = getattr(ops, name)
            if name != "projection_forward":
                return op
            return lambda *a: asked.append(a[7]) or op(*a)  # keep_grad

    monkeypatch.setattr("gr.hstu.kernels.layer_ops.native_ops", lambda namespace: Recording())
    with torch.no_grad():
        served = project(x, norm, linear, [100, 100])
    trained = project(x, norm, linear, [100, 100])
    assert asked == [False, True]
    for got, want in zip(served, trained):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_projection_under_autocast_without_the_native_kernels_runs_pytorchs_bf16_linear(monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", "0")
    x, _, norm = norm_inputs()
    linear = nn.Linear(50, 200)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        parts = project(x, norm, linear, [100, 100])
    assert all(p.dtype == torch.bfloat16 for p in parts)


def bf16_product(x, weight):
    """x [T, n] @ weight [m, n]^T from bf16-rounded operands, summed exactly: bf16 math's product."""
    return (x.detach().bfloat16().double() @ weight.detach().bfloat16().double().T).float()


@native_only
def test_projection_under_bf16_autocast_runs_fused_on_bf16_rounded_operands(monkeypatch):
    """The fused projection's GEMM in bf16 math: LN(x) and W rounded to bf16, fp32 sums; the parts stay
    fp32, and the gradients flow through the same kernels."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    skip_without_bf16_instructions()
    x, _, norm = norm_inputs()
    linear = nn.Linear(50, 200)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.profiler.profile() as profile:
        parts = project(x, norm, linear, [100, 100])
    assert "gr_cpu_layer::projection_forward" in {e.key for e in profile.key_averages()}
    assert all(p.dtype == torch.float32 for p in parts)
    normed = F.layer_norm(x, (50,), norm.weight, norm.bias, norm.eps)
    want = F.silu(bf16_product(normed, linear.weight) + linear.bias)
    torch.testing.assert_close(torch.cat(parts, 1), want.detach(), rtol=1e-4, atol=1e-5)
    fp32 = torch.cat(project(x, norm, linear, [100, 100]), 1)
    assert not torch.equal(torch.cat(parts, 1), fp32)
    dx_bf16, dw_bf16 = torch.autograd.grad(torch.cat(parts, 1).sum(), [x, linear.weight])
    dx, dw = torch.autograd.grad(fp32.sum(), [x, linear.weight])
    torch.testing.assert_close(dx_bf16, dx, rtol=0.02, atol=0.02 * dx.abs().max().item())
    torch.testing.assert_close(dw_bf16, dw, rtol=0.02, atol=0.02 * dw.abs().max().item())


@native_only
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_combine_equals_pytorch_in_value_and_gradients(monkeypatch, p):
    """x + linear(dropout(LN(a) * u)) with u a strided view, over two blocks and a partial one."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    a, projection, norm = norm_inputs()
    x = torch.randn(300, 32, generator=torch.Generator().manual_seed(8), requires_grad=True)
    u, linear, dropout = projection[:, :50], nn.Linear(50, 32), Dropout(p).train()
    torch.manual_seed(9)
    out = combine(x, a, u, norm, dropout, linear)
    torch.manual_seed(9)
    keep = rng.keep_mask(a.shape, p, a.device) if p > 0 else None
    expected = x + linear(reference(a, u, norm, keep, p))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(10))
    leaves = [x, a, projection, norm.weight, norm.bias, linear.weight, linear.bias]
    got = torch.autograd.grad((out * cotangent).sum(), leaves)
    want = torch.autograd.grad((expected * cotangent).sum(), leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_combine_under_autocast_without_the_native_kernels_runs_pytorchs_bf16_linear(monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", "0")
    a, projection, norm = norm_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.profiler.profile() as profile:
            out = combine(torch.randn(300, 32), a, projection[:, :50], norm, Dropout(0.0), nn.Linear(50, 32))
    assert out.dtype == torch.float32  # the fp32 residual plus the bf16 linear
    assert not any("output_forward" in e.key for e in profile.key_averages())


@native_only
def test_combine_under_bf16_autocast_runs_fused_on_bf16_rounded_operands(monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    skip_without_bf16_instructions()
    a, projection, norm = norm_inputs()
    x, u, linear = torch.randn(300, 32), projection[:, :50], nn.Linear(50, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.profiler.profile() as profile:
        out = combine(x, a, u, norm, Dropout(0.0), linear)
    assert "gr_cpu_layer::output_forward" in {e.key for e in profile.key_averages()}
    assert out.dtype == torch.float32
    want = x + bf16_product(reference(a, u, norm, None, 0.0), linear.weight) + linear.bias
    torch.testing.assert_close(out, want.detach(), rtol=1e-4, atol=1e-5)
    assert not torch.equal(out, combine(x, a, u, norm, Dropout(0.0), linear))


@native_only
def test_an_hstu_training_step_runs_the_fused_layer_ops_and_matches_pytorch(monkeypatch):
    """The stack's training forward and backward use the fused ops (with dropout off the two paths
    compute the same function) and give PyTorch's output and gradients."""
    config = HSTUConfig(hidden_dim=32, num_layers=2, num_heads=2, attention_dim=8, linear_dim=16, max_seq_len=64,
                        dropout=0.0, input_dropout=0.0)  # fmt: skip
    x = torch.randn(100, 32, generator=torch.Generator().manual_seed(4))
    offsets, timestamps = torch.tensor([0, 40, 100]), torch.arange(100) * 60
    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("GR_CPU_FUSED", setting)
        torch.manual_seed(0)
        stack = HSTU(config).train()
        with torch.profiler.profile() as profile:
            out = stack(x, offsets, 60, timestamps)
            out.square().sum().backward()
        names = {e.key for e in profile.key_averages()}
        assert ("gr_cpu_layer::projection_backward" in names) == (setting == "1")
        assert ("gr_cpu_layer::output_backward" in names) == (setting == "1")
        results[setting] = (out.detach(), [p.grad for p in stack.parameters()])
    torch.testing.assert_close(results["1"][0], results["0"][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results["1"][1], results["0"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@native_only
def test_the_fused_stack_gives_every_thread_count_the_same_output_and_gradients(monkeypatch):
    """Blocks of rows (and attention's sequences) go to whichever thread is free, and weight
    gradients are summed per slot of work, then in slot order: the stack's output and every
    parameter's gradient are bitwise the same on 1, 2 and 3 threads. 4,580 tokens: 36 blocks of
    rows, two to a slot."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    config = HSTUConfig(hidden_dim=32, num_layers=2, num_heads=2, attention_dim=8, linear_dim=16, max_seq_len=256)
    lengths = torch.tensor([(37 * i) % 256 + 1 for i in range(40)])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    x = torch.randn(int(offsets[-1]), 32, generator=torch.Generator().manual_seed(6))
    timestamps = torch.arange(int(offsets[-1])) * 60
    torch.manual_seed(0)
    stack = HSTU(config).train()
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            torch.manual_seed(1)  # the same dropout masks
            stack.zero_grad()
            out = stack(x, offsets, 256, timestamps)
            out.square().sum().backward()
            results.append([out.detach()] + [p.grad.clone() for p in stack.parameters()])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, results[0]))


@native_only
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("scale", [1.0, 50**0.5])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_stack_input_is_bitwise_pytorchs_ops_in_value_and_gradients(monkeypatch, p, scale, autocast):
    """dropout(x * scale + table[rows]): the same roundings forward, and backward the table's rows
    summed in token order as index_add_ sums them; autocast leaves all of it in fp32."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 50, generator=g).requires_grad_(True)
    table = torch.randn(201, 50, generator=g).requires_grad_(True)
    rows = torch.randint(0, 201, (1000,), generator=g)
    dropout = Dropout(p).train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        torch.manual_seed(3)
        y = stack_input(x, scale, table, rows, dropout)
        torch.manual_seed(3)
        expected = dropout(x * scale + table.index_select(0, rows))
    assert y.dtype == torch.float32 and torch.equal(y, expected)
    cotangent = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, [x, table], cotangent)
    want = torch.autograd.grad(expected, [x, table], cotangent)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@native_only
def test_stack_input_refuses_rows_outside_the_table(monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    x, table = torch.randn(4, 50), torch.randn(201, 50)
    with pytest.raises(RuntimeError, match=r"rows must lie in \[0, 201\)"):
        stack_input(x, 1.0, table, torch.tensor([0, 1, 201, 2]), Dropout(0.0))


def allocated_per_row(op, rows: int, width: int) -> float:
    """Bytes per row that ``op(T)`` leaves allocated (torch's CPU memory profiler): the difference
    between T = 2 * rows and T = rows (made afresh for each), over ``rows``; ``width``: op's input width."""
    allocated = {}
    for length in (rows, 2 * rows):
        torch.manual_seed(0)
        x = torch.randn(length, width, requires_grad=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = op(x)
        allocated[length] = sum(e.self_cpu_memory_usage for e in prof.events())
        del out
    return (allocated[2 * rows] - allocated[rows]) / rows


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("fused", ["0", pytest.param("1", marks=native_only)], ids=["pytorch", "native"])
def test_each_op_keeps_for_backward_what_its_cost_says(monkeypatch, fused, p):
    """fp32, per row: ``project`` leaves its kept tensors (its outputs among them); ``combine`` and
    ``stack_input`` their kept tensors and their output 4D, less (``combine``) the attention rows 4A
    it is given and keeps."""
    monkeypatch.setenv("GR_CPU_FUSED", fused)
    d, a, width = 48, 32, 128
    norm, linear = nn.LayerNorm(d), nn.Linear(d, width)
    kept = allocated_per_row(lambda x: project(x, norm, linear, [32, 32, 32, 32]), 256, d)
    assert kept == cost.project_bytes(d, width, 4)
    attention_norm, output, dropout = nn.LayerNorm(a), nn.Linear(a, d), Dropout(p).train()
    attention, u = torch.randn(512, a, requires_grad=True), torch.randn(512, a, requires_grad=True)
    kept = allocated_per_row(
        lambda x: combine(x, attention[: len(x)], u[: len(x)], attention_norm, dropout, output), 256, d
    )
    assert kept == cost.combine_bytes(a, p, 4) - 4 * a + 4 * d
    table, rows = torch.randn(513, d, requires_grad=True), torch.arange(512)
    kept = allocated_per_row(lambda x: stack_input(x, 2.0, table, rows[: len(x)], dropout), 256, d)
    assert kept == (cost.stack_input_mask_bytes(d) if p > 0 else 0) + 4 * d
