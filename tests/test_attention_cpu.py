"""The CPU fast path: work proportional to sum(L_i^2), bounded memory at L = 4096, and
"auto" choosing it for CPU tensors (its results: tests/test_attention_conformance.py)."""

import pytest
import torch

from gr.hstu.kernels.attention import RelativeBias, hstu_attention, resolve_backend
from gr.hstu.kernels.attention.common import AttentionCall
from gr.hstu.kernels.attention.cost import score_elements
from gr.hstu.kernels.attention.cpu import QUERY_CHUNK, cpu_hstu_attention

pytestmark = pytest.mark.attention


def offsets_of(lengths):
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])


def test_auto_picks_the_device_backend():
    assert resolve_backend("auto", "cpu") == "cpu"
    assert resolve_backend("auto", "cuda") == "triton"
    assert resolve_backend("auto", "npu") == "ascend"
    assert resolve_backend("pytorch", "cuda") == "pytorch"


def test_unknown_backend_is_refused_with_the_choices():
    x = torch.zeros(2, 1, 4)
    with pytest.raises(ValueError, match="unknown backend 'cuda'.*cpu.*triton"):
        hstu_attention(x, x, x, torch.tensor([0, 2]), 2, backend="cuda")


def test_scored_work_follows_sum_of_squares_not_padding():
    """One 2048-long sequence among 63 short ones: padding to [B, Lmax, Lmax] would score
    ~30x more than the causal pairs; the grouped, chunked path stays within 1.4x of them."""
    g = torch.Generator().manual_seed(0)
    lengths = [2048] + torch.randint(1, 200, (63,), generator=g).tolist()
    offsets = offsets_of(lengths)
    causal_pairs = sum(n * (n + 1) // 2 for n in lengths)
    scored = score_elements(offsets, None, heads=1)
    assert causal_pairs <= scored <= 1.4 * causal_pairs
    assert 64 * 2048 * 2048 > 30 * scored


def test_targets_and_window_shrink_the_scored_work():
    offsets = offsets_of([1024])
    hist, targets = 768, 256
    # targets meet the history and themselves only: ~hist^2 / 2 + targets * hist, not 1024^2 / 2
    assert score_elements(offsets, torch.tensor([targets]), heads=1) <= 1.3 * (hist * hist / 2 + targets * hist)
    assert score_elements(offsets, None, heads=1, max_attn_len=64) < 0.6 * score_elements(offsets, None, heads=1)


def test_memory_stays_bounded_at_4096_and_matches_reference():
    """Backward keeps only the inputs (scores are recomputed chunk by chunk, each chunk at most
    TILE_ELEMENTS scores), while the result equals the padded reference."""
    length, heads, dim = 4096, 1, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(length, heads, dim, generator=g) for _ in range(3))
    pos_w = torch.randn(length + 1, generator=g) * 0.1
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, pos_w)]
    offsets = offsets_of([length])
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rab = RelativeBias(leaves[3])
        out = cpu_hstu_attention(AttentionCall(*leaves[:3], offsets, length, alpha=0.3, rab=rab))
    assert sum(saved) < 64 * length * heads * dim * 4  # O(L), not O(L^2) = 64 MB per [L, L] fp32
    grads = torch.autograd.grad(out.square().sum(), leaves)
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v, pos_w)]
    ref_rab = RelativeBias(ref_leaves[3])
    ref = hstu_attention(*ref_leaves[:3], offsets, length, alpha=0.3, rab=ref_rab, backend="pytorch")
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_leaves)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4 * float(want.abs().max()))


def outputs_and_grads(backend, tensors, timestamps, offsets, num_targets, **options):
    """Output and gradients of q, k, v, position and time weights under a fixed cotangent."""
    leaves = [x.clone().requires_grad_(True) for x in tensors]
    rab = RelativeBias(leaves[3], leaves[4], timestamps)
    max_len = int((offsets[1:] - offsets[:-1]).max())
    out = hstu_attention(*leaves[:3], offsets, max_len, num_targets=num_targets, rab=rab, backend=backend, **options)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return [out.detach(), *torch.autograd.grad((out * cotangent).sum(), leaves)]


def random_inputs(lengths, time_span, pos_buckets=400, time_buckets=64):
    """q, k, v [T, 1, 8], position and time bias weights; sorted timestamps in [0, time_span) per sequence."""
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, 1, 8, generator=g) for _ in range(3))
    weights = [torch.randn(n, generator=g) for n in (pos_buckets, time_buckets)]
    timestamps = torch.cat([torch.sort(torch.randint(0, time_span, (n,), generator=g)).values for n in lengths])
    return [q, k, v, *weights], timestamps


def assert_all_close(got, want):
    for name, a, b in zip(["out", "dq", "dk", "dv", "dpos_w", "dtime_w"], got, want):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4 * float(b.abs().max()), msg=name)


def test_chunks_past_the_first_with_context_window_and_targets_match_reference():
    """Sequences longer than QUERY_CHUNK: later chunks meet the contextual keys apart from their
    window's keys, and targets sit in a later chunk than some of their history."""
    lengths = [2 * QUERY_CHUNK + 44, QUERY_CHUNK + 12, 7]
    tensors, timestamps = random_inputs(lengths, 10**7)
    offsets, num_targets = offsets_of(lengths), torch.tensor([20, 3, 2])
    options = dict(alpha=0.3, silu_scale=None, contextual_len=5, max_attn_len=40)
    got = outputs_and_grads("cpu", tensors, timestamps, offsets, num_targets, **options)
    want = outputs_and_grads("pytorch", tensors, timestamps, offsets, num_targets, **options)
    assert_all_close(got, want)


@pytest.mark.parametrize("time_span", [10**6, 5 * 10**9])
def test_time_bias_is_exact_whether_timestamps_span_more_than_int32_or_not(time_span):
    """Deltas are taken in int32 when the timestamps span less than 2^31 s, else in int64."""
    lengths = [QUERY_CHUNK + 30, 50]
    tensors, timestamps = random_inputs(lengths, time_span)
    timestamps = timestamps + 10**12  # absolute epoch offsets must not matter
    offsets = offsets_of(lengths)
    options = dict(alpha=0.3, silu_scale=0.02)
    got = outputs_and_grads("cpu", tensors, timestamps, offsets, None, **options)
    want = outputs_and_grads("pytorch", tensors, timestamps, offsets, None, **options)
    assert_all_close(got, want)


def test_bf16_inputs_run_the_matmuls_in_bf16_and_stay_close_to_fp32(monkeypatch):
    """Unfused kernel (GR_CPU_FUSED=0), bf16 q, k, v: it multiplies in bf16 (fp32 accumulation inside
    the matmuls), so
    its output is not the fp32 result rounded once; it stays within 2% (of the largest entry)
    of the fp32 kernel on the same rounded inputs, gradients within 3%. Sequences of 300 and
    260 tokens span three query chunks, so k/v gradients are summed over chunks (kept in

    Measured here: ~0.5% output and gradients, <= 0.4% bias gradients."""
    monkeypatch.setenv("GR_CPU_FUSED", "0")
    g = torch.Generator().manual_seed(3)
    lengths = [300, 260, 40]
    assert max(lengths) > 2 * QUERY_CHUNK
    offsets = offsets_of(lengths)
    total = int(offsets[-1])
    q, k, v = (torch.randn(total, 2, 16, generator=g).mul(0.5).bfloat16().float() for _ in range(3))
    timestamps = torch.randint(0, 10**6, (total,), generator=g).sort().values
    weights = (torch.randn(301, generator=g) * 0.1, torch.randn(64, generator=g) * 0.1)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [x.to(dtype, copy=True).requires_grad_(True) for x in (q, k, v)]
        bias = [w.clone().requires_grad_(True) for w in weights]
        rab = RelativeBias(bias[0], bias[1], timestamps)
        out = cpu_hstu_attention(AttentionCall(*leaves, offsets, 300, silu_scale=1 / 300, rab=rab))
        assert out.dtype == dtype
        out.float().mul(torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        results[dtype] = (out, [x.grad for x in leaves], [w.grad for w in bias])
    out32, grads32, bias32 = results[torch.float32]
    out16, grads16, bias16 = results[torch.bfloat16]
    assert not torch.equal(out16, out32.bfloat16())  # computed in bf16, not upcast and rounded at the end

    def close(got, want, tolerance):
        return (got.float() - want).abs().max() <= tolerance * want.abs().max()

    assert close(out16, out32, 0.02)
    assert all(g.dtype == torch.bfloat16 and close(g, want, 0.03) for g, want in zip(grads16, grads32))
    assert all(g.dtype == torch.float32 and close(g, want, 0.01) for g, want in zip(bias16, bias32))


def test_a_workspace_shares_one_batch_layout_across_layers_with_equal_results():
    """Two "layers" (their own bias weights) on one batch through one AttentionWorkspace: the CPU
    backend builds the batch's layout once (the second call finds it), and outputs and every
    gradient equal those computed without a workspace."""
    from gr.hstu.kernels.attention import AttentionWorkspace

    g = torch.Generator().manual_seed(3)
    offsets = offsets_of([70, 5, 140, 33])
    total = int(offsets[-1])
    timestamps = torch.randint(0, 10**6, (total,), generator=g).sort().values
    q, k, v = (torch.randn(total, 2, 8, generator=g) for _ in range(3))
    weights = [(torch.randn(141, generator=g) * 0.1, torch.randn(64, generator=g) * 0.1) for _ in range(2)]

    def run(workspace):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        params = [(p.clone().requires_grad_(True), t.clone().requires_grad_(True)) for p, t in weights]
        x = leaves[0]
        for pos_w, time_w in params:
            rab = RelativeBias(pos_w, time_w, timestamps)
            x = hstu_attention(x, leaves[1], leaves[2], offsets, 140, rab=rab, backend="cpu", workspace=workspace)
        x.square().sum().backward()
        return [x.detach(), *(t.grad for t in leaves), *(w.grad for pair in params for w in pair)]

    workspace = AttentionWorkspace(offsets)
    shared = run(workspace)
    entries = workspace._entries
    assert list(entries) == ["cpu"] and len(entries["cpu"].layouts) > 0
    for got, want in zip(shared, run(None)):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="another batch's seq_offsets"):
        hstu_attention(q, k, v, offsets.clone(), 140, backend="cpu", workspace=workspace)


def test_the_layout_cache_stays_within_its_budget_and_results_do_not_change(monkeypatch):
    """With a budget smaller than the batch's layouts some chunks are rebuilt on every use: the
    kept elements stay within the budget and outputs and gradients equal the unbounded cache's.
    The fused tiles (where they build) then run the chunks in several calls, none of them kept,
    instead of one kept call."""
    from gr.hstu.kernels.attention import AttentionWorkspace, cpu
    from gr.ops.native import native_ops

    g = torch.Generator().manual_seed(4)
    offsets = offsets_of([300, 40, 260])
    total = int(offsets[-1])
    timestamps = torch.randint(0, 10**6, (total,), generator=g).sort().values
    tensors = [torch.randn(total, 1, 8, generator=g) for _ in range(3)]
    weights = (torch.randn(301, generator=g) * 0.1, torch.randn(64, generator=g) * 0.1)

    def run():
        leaves = [x.clone().requires_grad_(True) for x in (*tensors, *weights)]
        workspace = AttentionWorkspace(offsets)
        rab = RelativeBias(leaves[3], leaves[4], timestamps)
        out = hstu_attention(*leaves[:3], offsets, 300, rab=rab, backend="cpu", workspace=workspace)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        return workspace._entries["cpu"], [out.detach(), *grads]

    unbounded, expected = run()
    monkeypatch.setattr(cpu, "LAYOUT_CACHE_ELEMENTS", unbounded.cached_elements // 3)
    bounded, got = run()
    assert 0 < bounded.cached_elements <= unbounded.cached_elements // 3
    assert len(bounded.layouts) < len(unbounded.layouts)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    if native_ops("gr_cpu_fused") is not None:
        assert [len(calls) for calls in unbounded.fused_calls.values()] == [1] and bounded.fused_calls == {}


def test_batches_without_targets_share_the_position_layouts_of_equal_chunks():
    """A second batch whose sequences pad to the same lengths finds every chunk's masks and
    position indices made by the first (they depend on no batch data); a batch with targets,
    one sequence per group included, makes its own, and all three match the reference."""
    from gr.hstu.kernels.attention import AttentionWorkspace, cpu

    g = torch.Generator().manual_seed(6)

    def run(lengths, targets=None):
        offsets = offsets_of(lengths)
        total = int(offsets[-1])
        tensors = [torch.randn(total, 1, 8, generator=g) for _ in range(3)]
        timestamps = torch.randint(0, 10**6, (total,), generator=g).sort().values
        num_targets = torch.tensor(targets) if targets else None
        workspace = AttentionWorkspace(offsets)
        options = dict(pos_buckets=160, time_buckets=32)
        for backend, space in (("cpu", workspace), ("pytorch", None)):
            weights = (torch.linspace(-0.2, 0.2, options["pos_buckets"]), torch.linspace(0.1, -0.1, 32))
            rab = RelativeBias(*weights, timestamps)
            out = hstu_attention(
                *tensors, offsets, 160, num_targets=num_targets, rab=rab, backend=backend, workspace=space
            )
            if backend == "cpu":
                got = out
        torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-5)

    cpu._shared_positions.cache_clear()
    run([150, 40, 90])
    first = cpu._shared_positions.cache_info()
    run([140, 33, 70])  # the same padded lengths: 160, 64 and 96
    second = cpu._shared_positions.cache_info()
    assert first.misses > 0 and second.misses == first.misses and second.hits == first.hits + first.misses
    run([150, 40], targets=[3, 2])
    assert cpu._shared_positions.cache_info().misses == first.misses


@pytest.mark.parametrize("backend", ["cpu", "pytorch"])
def test_sequences_batched_together_may_lie_further_apart_than_int64_holds(backend):
    """Two users whose histories lie 2^63 s apart or more (each one's own span small) score as
    each alone: the batch's rebased times may wrap, but deltas are only taken within a
    sequence, where the wrap cancels. (A span of 2^63 s within one user's request is refused
    before it reaches a kernel: ``gr.timestamps.check_time_span``.)"""
    g = torch.Generator().manual_seed(5)
    lengths = [6, 5]
    offsets = offsets_of(lengths)
    q, k, v = (torch.randn(11, 2, 8, generator=g) for _ in range(3))
    early = -(2**62) - 10**9 + torch.arange(6) * 1000
    late = 2**62 + 10**9 + torch.arange(5) * 7
    timestamps = torch.cat([early, late])
    query_times = timestamps + torch.tensor([0, 0, 5, 0, 0, 9000, 0, 0, 0, 3, 30])
    rab = RelativeBias(torch.randn(7, generator=g), torch.randn(40, generator=g), timestamps, "log", query_times)
    both = hstu_attention(q, k, v, offsets, 6, alpha=0.5, rab=rab, backend=backend)
    for start, end in ((0, 6), (6, 11)):
        alone_rab = RelativeBias(
            rab.position_weights, rab.time_weights, timestamps[start:end], "log", query_times[start:end]
        )
        alone = hstu_attention(
            q[start:end],
            k[start:end],
            v[start:end],
            offsets_of([end - start]),
            6,
            alpha=0.5,
            rab=alone_rab,
            backend=backend,
        )
        torch.testing.assert_close(both[start:end], alone, rtol=1e-5, atol=1e-6)
