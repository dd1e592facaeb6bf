"""The fused CPU attention tiles: used on x86-64, equal to the unfused kernel, bf16 inputs computed in
fp32, GEMMs in bf16 math under bf16 autocast.
Their results against the reference over every mask and bias case: tests/test_attention_conformance.py;
building, loading and GR_CPU_FUSED: tests/test_native.py."""

import pytest
import torch

from gr.hstu.kernels.attention import AttentionWorkspace, RelativeBias, hstu_attention
from gr.ops.native import native_ops
from helpers.native import X86, skip_without_bf16_instructions

pytestmark = pytest.mark.attention


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


def assert_fused_equals_unfused(monkeypatch, **batch) -> None:
    """attention_and_grads(fp32, **batch) of the fused tiles equals the unfused kernel's to fp32 rounding."""
    monkeypatch.setenv("GR_CPU_FUSED", "0")
    want_out, want_grads = attention_and_grads(torch.float32, **batch)
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    got_out, got_grads = attention_and_grads(torch.float32, **batch)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
def test_fused_tiles_build_and_run_here(monkeypatch):
    """On x86-64 with a compiler (this suite's machines) the tiles build: the conformance suite's
    "cpu" backend is the fused one, not silently the fallback."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    assert native_ops("gr_cpu_fused") is not None
    with torch.profiler.profile() as profile:
        attention_and_grads(torch.float32)
    names = {event.key for event in profile.key_averages()}
    assert {"gr_cpu_fused::forward_chunks", "gr_cpu_fused::backward_chunks"} <= names


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
@pytest.mark.parametrize("targets", [None, [4, 0, 7, 2, 1]])
def test_fused_equals_unfused_within_fp32_rounding(monkeypatch, targets):
    """Sequences of 300 and 260 tokens span three query chunks and many row blocks."""
    assert_fused_equals_unfused(monkeypatch, targets=targets)


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
@pytest.mark.parametrize("lengths", [(300, 33), (420, 33)], ids=["heads-share-the-bias", "too-long-to-share"])
def test_two_heads_equal_unfused_whether_or_not_they_share_the_bias(monkeypatch, lengths):
    """Heads share a sequence's bias and dS sums up to kSharedBias (2^16) score elements a head: the
    300-token sequence's ~47k share them, the 420-token one's ~92k take each head's own."""
    assert_fused_equals_unfused(monkeypatch, lengths=lengths)


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
def test_fused_tiles_give_every_thread_count_the_same_results(monkeypatch):
    """The sequences of a batch go to whichever thread is free, a slot of sequences at a time; each
    sequence's heads and query chunks stay in one slot (the k and v gradients it accumulates have
    one writer) and the bias gradients are summed per slot, then in slot order. So out and every
    gradient are bitwise the same on 1, 2 and 3 threads, and from run to run."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    lengths = (300, 1, 97, 260, 33, 180, 5, 64, 140)  # one to three query chunks, nine groups
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 3):
            torch.set_num_threads(count)
            results.append(attention_and_grads(torch.float32, lengths=lengths))
    finally:
        torch.set_num_threads(threads)
    (want_out, want_grads), others = results[0], results[1:]
    for got_out, got_grads in others:
        assert torch.equal(got_out, want_out)
        assert all(torch.equal(got, want) for got, want in zip(got_grads, want_grads))


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
def test_fused_tiles_write_every_row_of_outputs_that_start_uninitialised(monkeypatch):
    """When one call's chunks hold every row, out, dq, dk and dv start uninitialised and the tiles
    write each row: started as NaN instead, they equal a zero-initialised run, rows that see no key
    (the 40 tokens of a sequence of targets only, grouped with a 50-token one that has history) and
    key rows no query reads (targets) included."""
    from gr.hstu.kernels.attention import cpu

    monkeypatch.setenv("GR_CPU_FUSED", "1")
    lengths, targets = (300, 1, 97, 260, 40, 50), [4, 0, 7, 2, 40, 3]
    want_out, want_grads = attention_and_grads(torch.float32, lengths=lengths, targets=targets)
    started = []

    def nan_rows(shape, written):
        started.append(written)
        return torch.full(shape, float("nan")) if written else torch.zeros(shape)

    monkeypatch.setattr(cpu, "_new_rows", nan_rows)
    got_out, got_grads = attention_and_grads(torch.float32, lengths=lengths, targets=targets)
    assert started == [True] * 4  # out, then dq, dk, dv
    assert torch.equal(got_out, want_out)
    assert all(torch.equal(got, want) for got, want in zip(got_grads, want_grads))


class _Tiles:
    """``_FusedAttention``'s backward as a ctx whose kept tiles are ``tiles``, the rest ctx's own."""

    def __init__(self, ctx, tiles):
        self._ctx, self.saved_tensors = ctx, (*ctx.saved_tensors[:-1], tiles)

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def record_kept_tiles(monkeypatch, change=lambda tiles: tiles) -> list:
    """The tiles each ``_FusedAttention`` backward finds kept (None: none), after ``change``."""
    from gr.hstu.kernels.attention import cpu

    kept, backward = [], cpu._FusedAttention.backward

    def recording_backward(ctx, grad_out):
        kept.append(ctx.saved_tensors[-1])
        return backward(_Tiles(ctx, change(kept[-1])), grad_out)

    monkeypatch.setattr(cpu._FusedAttention, "backward", staticmethod(recording_backward))
    return kept


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
@pytest.mark.parametrize("targets", [None, [4, 0, 7, 2, 1]])
def test_backward_from_the_tiles_forward_kept_equals_backward_that_makes_them_again(monkeypatch, targets):
    """Forward keeps each row block's weights and SiLU' (up to ``SAVED_TILE_FLOATS``); backward reads
    them instead of computing scores, bias and SiLU again: bitwise the same gradients as with none kept."""
    from gr.hstu.kernels.attention import cpu

    monkeypatch.setenv("GR_CPU_FUSED", "1")
    kept = record_kept_tiles(monkeypatch)
    want_out, want_grads = attention_and_grads(torch.float32, targets=targets)
    monkeypatch.setattr(cpu, "SAVED_TILE_FLOATS", 0)
    got_out, got_grads = attention_and_grads(torch.float32, targets=targets)
    assert kept[0] is not None and kept[0].numel() > 0 and kept[1] is None
    assert torch.equal(got_out, want_out)
    assert all(torch.equal(got, want) for got, want in zip(got_grads, want_grads))


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
def test_kept_tiles_are_two_floats_per_score_of_each_row_block_within_the_limit(monkeypatch):
    """A 64-token sequence, 2 heads: its row blocks of 32 see 32 and 64 keys, so (32 * 32 + 32 * 64)
    * 2 heads * 2 floats = 12,288 floats, which the estimate (``gr.hstu.kernels.attention.cost``) counts too;
    a limit below that keeps none."""
    from gr.hstu.kernels.attention import cost, cpu

    monkeypatch.setenv("GR_CPU_FUSED", "1")
    kept = record_kept_tiles(monkeypatch)
    attention_and_grads(torch.float32, lengths=(64,))
    monkeypatch.setattr(cpu, "SAVED_TILE_FLOATS", 12287)
    attention_and_grads(torch.float32, lengths=(64,))
    assert kept[0].numel() == 12288 and kept[1] is None
    assert cost.saved_tile_bytes(heads=2, tokens=64, max_attn_len=0) == 4 * 12288


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
def test_tiles_are_kept_only_for_a_backward_to_come(monkeypatch):
    """Evaluation and serving (no_grad, or nothing that requires grad) do not make or keep tiles."""
    from gr.hstu.kernels.attention import cpu

    monkeypatch.setenv("GR_CPU_FUSED", "1")
    asked, forward = [], cpu._FusedAttention.forward

    def recording_forward(ctx, *args):
        asked.append(args[-2])  # keep_tiles
        return forward(ctx, *args)

    monkeypatch.setattr(cpu._FusedAttention, "forward", staticmethod(recording_forward))
    offsets = offsets_of([64, 30])
    q, k, v = (torch.randn(94, 2, 16) for _ in range(3))
    pos_w = torch.randn(301).requires_grad_(True)  # a parameter, as in a model under evaluation
    rab = RelativeBias(pos_w, None, None)

    def attend(*qkv):
        return hstu_attention(*qkv, offsets, 64, rab=rab, backend="cpu", workspace=AttentionWorkspace(offsets))

    with torch.no_grad():
        attend(q, k, v)
    attend(q, k, v).sum().backward()  # the bias weights still want a gradient
    rab = RelativeBias(pos_w.detach(), None, None)
    attend(q, k, v)
    assert asked == [False, True, False]


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
def test_backward_refuses_kept_tiles_of_another_size(monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    record_kept_tiles(monkeypatch, change=lambda tiles: tiles[:-1])
    with pytest.raises(RuntimeError, match="saved must be forward_chunks' contiguous fp32 tiles of the same chunks"):
        attention_and_grads(torch.float32, lengths=(64,))


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


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
def test_fused_tiles_under_bf16_autocast_multiply_in_bf16_math(monkeypatch):
    """fp32 q, k, v under CPU autocast to bf16 stay fp32, and the tiles' GEMMs round their operands to
    bf16 (gr.ops.native.cpu_bf16_math), forward and backward: output and gradients differ from the fp32
    run's, by less than 2% of their largest entry (measured: ~0.3%); backward from the tiles forward
    kept equals backward that makes them again, bitwise."""
    from gr.hstu.kernels.attention import cpu

    monkeypatch.setenv("GR_CPU_FUSED", "1")
    skip_without_bf16_instructions()
    out32, grads32 = attention_and_grads(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out16, grads16 = attention_and_grads(torch.float32)
        monkeypatch.setattr(cpu, "SAVED_TILE_FLOATS", 0)
        again_out, again_grads = attention_and_grads(torch.float32)
    assert out16.dtype == torch.float32 and not torch.equal(out16, out32)
    torch.testing.assert_close(out16, out32, rtol=0, atol=0.02 * float(out32.abs().max()))
    for got, want in zip(grads16, grads32):
        assert got.dtype == torch.float32 and not torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 * float(want.abs().max()))
    assert torch.equal(again_out, out16)
    assert all(torch.equal(got, want) for got, want in zip(again_grads, grads16))


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
@pytest.mark.parametrize("bucketing, buckets", [("log", 40), ("sqrt", 40), ("sqrt", 300)])
def test_time_buckets_are_exact_where_a_query_sees_the_key_and_zero_elsewhere(bucketing, buckets):
    """Rows [m0, m1) against keys [lo, hi) of two sequences (lengths 70 and 45 of a padded 80):
    visible pairs (key index <= the query's, or a contextual key) hold ``time_bucket``'s exact
    bucket; future keys and padding rows or keys hold 0, a valid index the mask zeroes. One byte
    each up to 256 buckets, else int32."""
    from gr.hstu.kernels.attention.common import time_bucket, time_bucket_thresholds

    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([70, 45])
    times = torch.randint(0, 10**8, (2, 80), generator=g).sort(1).values
    query_times = times + torch.randint(0, 10**5, (2, 80), generator=g)
    m0, m1, lo, hi, contextual = 32, 64, 8, 64, 12
    thresholds = time_bucket_thresholds(bucketing, buckets, torch.device("cpu"))
    got = native_ops("gr_cpu_fused").time_buckets(
        query_times, times, lengths, m0, m1, lo, hi, contextual, thresholds, bucketing == "sqrt"
    )
    rows = torch.arange(m0, m1).view(1, -1, 1)
    cols = torch.arange(lo, hi).view(1, 1, -1)
    exact = time_bucket(query_times[:, m0:m1, None] - times[:, None, lo:hi], bucketing, buckets)
    seen = ((cols <= rows) | (cols < contextual)) & (rows < lengths.view(-1, 1, 1)) & (cols < lengths.view(-1, 1, 1))
    assert got.dtype == (torch.uint8 if buckets <= 256 else torch.int32) and got.shape == (2, m1 - m0, hi - lo)
    assert 0 < int(seen.sum()) < seen.numel() and bool((exact[seen] > 0).any())
    assert torch.equal(got.long(), torch.where(seen, exact, 0))


@pytest.mark.skipif(not X86, reason="the fused tiles are built for x86-64 only")
@pytest.mark.parametrize("bucketing", ["log", "sqrt"])
def test_time_buckets_are_exact_on_both_sides_of_every_bucket_edge(bucketing):
    """The kernel corrects its log/sqrt estimate only near a bucket edge: |dt| on both sides of
    every edge (the integers around each threshold) and 20,000 log-uniform |dt| up to 10^16 all
    get ``time_bucket``'s bucket, as do negative dt."""
    from gr.hstu.kernels.attention.common import time_bucket, time_bucket_thresholds

    buckets = 128
    thresholds = time_bucket_thresholds(bucketing, buckets, torch.device("cpu")).double()
    edges = thresholds[1:-1][thresholds[1:-1].isfinite()].ceil().long()
    around = torch.cat([edges - 2, edges - 1, edges, edges + 1])
    spread = torch.exp(torch.rand(20_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 37).long()
    deltas = torch.cat([around, spread, -spread[:1000]]).clamp(min=-(2**62), max=2**62)
    key_times = deltas.view(1, -1)
    query_times = torch.zeros_like(key_times)
    n = deltas.numel()  # every key contextual: row 0 sees all of them
    got = native_ops("gr_cpu_fused").time_buckets(
        query_times, key_times, torch.tensor([n]), 0, 1, 0, n, n, thresholds.float(), bucketing == "sqrt"
    )
    want = time_bucket(deltas, bucketing, buckets)
    assert int((want > 60).sum()) > 1000 and int((want < 10).sum()) > 100
    assert torch.equal(got[0, 0].long(), want)
