"""Conformance of the cached-attention op (serving): every backend's rows for new tokens equal
the one-pass ``hstu_attention`` reference over each request's history followed by its new
tokens, with B requests in one call; draft trees equal chains. Forward only.

Runs on the test suite's device (``GR_TEST_DEVICE``, else detected), like the training
attention conformance suite: on CPU the Triton backends run through Triton's interpreter, on a
CUDA or NPU host the compiled kernels and the vendor op run on the device. The reference rows are
computed on CPU."""

import numpy as np
import pytest
import torch

from gr.hstu.kernels.attention import RelativeBias, hstu_attention
from gr.hstu.kernels.cached_attention import PagedCache, PageTables, common, hstu_cached_attention
from gr.ops.native import native_ops
from helpers.backends import DEVICE, KERNEL_BACKENDS

pytestmark = pytest.mark.attention

BACKENDS = ["pytorch", *KERNEL_BACKENDS]
CACHE_LENGTHS = [5, 0, 9, 1]
NEW_LENGTHS = [3, 2, 4, 1]
HEADS, DA, DL = 2, 8, 6

CASES = {
    "plain": dict(options=dict(alpha=0.4, silu_scale=None)),
    "pos+log-time": dict(pos_buckets=30, time_buckets=24, options=dict(alpha=0.3, silu_scale=1 / 20)),
    "next-event-times,sqrt": dict(
        pos_buckets=30, time_buckets=40, bucketing="sqrt", query_times=True, options=dict(alpha=0.3, silu_scale=None)
    ),
    "context,window": dict(pos_buckets=30, options=dict(alpha=0.5, silu_scale=None, contextual_len=2, max_attn_len=3)),
}


def problem(
    seed=0,
    pos_buckets=0,
    time_buckets=0,
    bucketing="log",
    query_times=False,
    cache_lengths=CACHE_LENGTHS,
    new_lengths=NEW_LENGTHS,
    dims=(HEADS, DA, DL),
):
    """Random requests: per request a cached history and new tokens, joined one after the other;
    dims: (heads, Da, Dl)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [c + n for c, n in zip(cache_lengths, new_lengths)]
    total = sum(lengths)
    heads, da, dl = dims
    q, k = (torch.randn(total, heads, da, generator=g) for _ in range(2))
    v = torch.randn(total, heads, dl, generator=g)
    ts = torch.cat([torch.sort(torch.randint(0, 10**6, (n,), generator=g)).values for n in lengths])
    query_ts = ts + torch.randint(0, 10**4, ts.shape, generator=g) if query_times else None
    pos_w = torch.randn(pos_buckets, generator=g) if pos_buckets else None
    time_w = torch.randn(time_buckets, generator=g) if time_buckets else None
    return dict(
        q=q,
        k=k,
        v=v,
        ts=ts,
        query_ts=query_ts,
        pos_w=pos_w,
        time_w=time_w,
        bucketing=bucketing,
        cache_lengths=cache_lengths,
        new_lengths=new_lengths,
    )


def split(p):
    """Rows of the cached and of the new tokens in the joined layout."""
    cache_rows, new_rows, start = [], [], 0
    for c, n in zip(p["cache_lengths"], p["new_lengths"]):
        cache_rows += range(start, start + c)
        new_rows += range(start + c, start + c + n)
        start += c + n
    return torch.tensor(cache_rows, dtype=torch.long), torch.tensor(new_rows, dtype=torch.long)


def bias(p, rows=None):
    if p["pos_w"] is None and p["time_w"] is None:
        return None
    pick = (lambda x: x) if rows is None else (lambda x: None if x is None else x[rows])
    timed = p["time_w"] is not None
    return RelativeBias(
        p["pos_w"],
        p["time_w"],
        pick(p["ts"]) if timed else None,
        p["bucketing"],
        pick(p["query_ts"]) if timed else None,
    )


def reference_rows(p, new_tokens, options):
    lengths = torch.tensor([c + n for c, n in zip(p["cache_lengths"], p["new_lengths"])])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    targets = torch.tensor(p["new_lengths"]) if new_tokens == "targets" else None
    out = hstu_attention(
        p["q"],
        p["k"],
        p["v"],
        offsets,
        int(lengths.max()),
        num_targets=targets,
        rab=bias(p),
        backend="pytorch",
        **options,
    )
    return out[split(p)[1]]


def cached(p, new_tokens, backend, options, **extra):
    cache_rows, new_rows = split(p)
    offsets = lambda lengths: torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])  # noqa: E731
    dev = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    rab = bias(p, new_rows)
    if rab is not None:
        rab = RelativeBias(
            dev(rab.position_weights),
            dev(rab.time_weights),
            dev(rab.timestamps),
            rab.time_bucketing,
            dev(rab.query_times),
        )
    out = hstu_cached_attention(
        dev(p["q"][new_rows]),
        dev(p["k"][new_rows]),
        dev(p["v"][new_rows]),
        dev(offsets(p["new_lengths"])),
        dev(p["k"][cache_rows].transpose(0, 1)),
        dev(p["v"][cache_rows].transpose(0, 1)),
        dev(offsets(p["cache_lengths"])),
        new_tokens=new_tokens,
        rab=rab,
        cache_timestamps=dev(p["ts"][cache_rows]),
        backend=backend,
        **options,
        **extra,
    )
    return out.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("new_tokens", ["targets", "history"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_rows_equal_the_one_pass_reference(backend, new_tokens, case):
    spec = dict(CASES[case])
    options = spec.pop("options")
    p = problem(**spec)
    want = reference_rows(p, new_tokens, options)
    got = cached(p, new_tokens, backend, options)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("new_tokens", ["targets", "history"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_layers_sharing_a_setup_get_each_call_alone_to_the_bit(backend, new_tokens, case):
    """Two "layers" of one pass (their own q/k/v, caches and bias weights, the same requests and
    times) sharing a ``CachedSetup`` get what each call gets alone."""
    spec = dict(CASES[case])
    options = spec.pop("options")
    layers = [problem(seed=seed, **spec) for seed in (1, 2)]
    for p in layers[1:]:  # the pass's requests and times are the first layer's
        p["ts"], p["query_ts"] = layers[0]["ts"], layers[0]["query_ts"]
    setup = common.CachedSetup()
    shared = [cached(p, new_tokens, backend, options, setup=setup) for p in layers]
    assert setup.validated
    for p, got in zip(layers, shared):
        assert torch.equal(got, cached(p, new_tokens, backend, options))
    assert not torch.equal(shared[0], shared[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_draft_tree_branch_equals_the_chain_it_stands_for(backend):
    """New history tokens 0 -> 1 and 0 -> 2 (siblings at depth 2): each branch's rows equal the
    history mode's rows for that chain; siblings never see each other."""
    p = problem(seed=3, pos_buckets=30, time_buckets=24, cache_lengths=[6], new_lengths=[3])
    p["ts"][-1] = p["ts"][-2]  # the siblings share a time, as generated tokens of one request do
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    positions = torch.tensor([6, 7, 7])
    tree = cached(
        p, "history", backend, dict(alpha=0.3), positions=positions.to(DEVICE), block_visible=visible.to(DEVICE)
    )
    chain = cached(p, "history", backend, dict(alpha=0.3))
    torch.testing.assert_close(tree[:2], chain[:2], rtol=1e-4, atol=1e-5)
    p["q"][-2], p["k"][-2], p["v"][-2] = p["q"][-1], p["k"][-1], p["v"][-1]  # the chain through branch 2
    chain2 = cached(p, "history", backend, dict(alpha=0.3))
    torch.testing.assert_close(tree[2], chain2[1], rtol=1e-4, atol=1e-5)


def test_bad_shapes_and_modes_are_named_errors():
    p = problem()
    with pytest.raises(ValueError, match="new_tokens must be one of"):
        cached(p, "candidates", "pytorch", {})
    with pytest.raises(ValueError, match="cache_k must be"):
        hstu_cached_attention(
            p["q"][:2],
            p["k"][:2],
            p["v"][:2],
            torch.tensor([0, 2]),
            torch.zeros(3, 4, DA),
            torch.zeros(3, 4, DL),
            torch.tensor([0, 4]),
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_request_cache_tensors_equal_one_jagged_cache(backend):
    """Callers may pass each request's cache as its own tensor (no copy into one jagged tensor)."""
    p = problem(pos_buckets=30, time_buckets=24)
    cache_rows, new_rows = split(p)
    bounds = np.cumsum([0, *p["cache_lengths"]])
    keys, values, ts = p["k"][cache_rows].transpose(0, 1), p["v"][cache_rows].transpose(0, 1), p["ts"][cache_rows]
    per_request = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    offsets = lambda lengths: torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])  # noqa: E731
    rab = bias(p, new_rows)
    common = dict(new_tokens="targets", rab=rab, backend=backend, alpha=0.3)
    args = (p["q"][new_rows], p["k"][new_rows], p["v"][new_rows], offsets(p["new_lengths"]))
    jagged = hstu_cached_attention(*args, keys, values, offsets(p["cache_lengths"]), cache_timestamps=ts, **common)
    listed = hstu_cached_attention(
        *args,
        [keys[:, s] for s in per_request],
        [values[:, s] for s in per_request],
        offsets(p["cache_lengths"]),
        cache_timestamps=[ts[s] for s in per_request],
        **common,
    )
    torch.testing.assert_close(listed, jagged, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cache_k must be"):
        hstu_cached_attention(
            *args,
            [keys[:, s] for s in per_request[:-1]],
            values,
            offsets(p["cache_lengths"]),
            cache_timestamps=ts,
            **common,
        )


def paged(cache, lengths, page_size, seed):
    """``cache`` [H, C, D] (jagged over ``lengths``) written into a fragmented pool: each request's pages
    scattered at random among more pages than needed, the unused ones full of garbage."""
    g = torch.Generator().manual_seed(seed)
    pages_each = [-(-n // page_size) for n in lengths]
    total = sum(pages_each) + 3
    order = torch.randperm(total, generator=g)
    pool = torch.randn(cache.shape[0], total * page_size, cache.shape[2], generator=g)
    tables, start, used = [], 0, 0
    for n, count in zip(lengths, pages_each):
        table = order[used : used + count]
        used += count
        rows = (table.view(-1, 1) * page_size + torch.arange(page_size)).flatten()[:n]
        pool[:, rows] = cache[:, start : start + n]
        tables.append(table)
        start += n
    return pool, tables


def paged_kv(p, page_size, seed):
    """-> the problem's cached keys [H, C, Da] and values [H, C, Dl] as tensors, the same in fragmented
    pools (``paged``; K and V through one set of page tables), and those tables."""
    cache_rows, _ = split(p)
    keys, values = p["k"][cache_rows].transpose(0, 1), p["v"][cache_rows].transpose(0, 1)
    pool_k, tables = paged(keys, p["cache_lengths"], page_size, seed=seed)
    pool_v, _ = paged(values, p["cache_lengths"], page_size, seed=seed)
    return keys, values, pool_k, pool_v, tables


# every page size on the fast backends; one that leaves partial pages on the interpreted kernels; the
# cpu backend also without its fused kernel (GR_CPU_FUSED=0: PyTorch matmuls over pages read into tensors)
PAGED = [(b, size) for b in BACKENDS for size in ((1, 4, 16) if b in ("pytorch", "cpu") else (4,))]
PAGED += [("cpu-unfused", 4)] if "cpu" in BACKENDS else []


@pytest.mark.parametrize("backend,page_size", PAGED)
@pytest.mark.parametrize("new_tokens", ["targets", "history"])
def test_paged_cache_equals_the_same_cache_as_tensors_to_the_bit(backend, new_tokens, page_size, monkeypatch):
    """K/V read through random page tables of a fragmented pool give the unpaged answer exactly."""
    if backend == "cpu-unfused":
        monkeypatch.setenv("GR_CPU_FUSED", "0")
        backend = "cpu"
    p = problem(pos_buckets=30, time_buckets=24, cache_lengths=[5, 0, 17, 1], new_lengths=[3, 2, 4, 1])
    cache_rows, new_rows = split(p)
    keys, values, pool_k, pool_v, tables = paged_kv(p, page_size, seed=page_size)
    offsets = lambda lengths: torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])  # noqa: E731
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    rab = bias(p, new_rows)
    rab = RelativeBias(dev(rab.position_weights), dev(rab.time_weights), dev(rab.timestamps), rab.time_bucketing, None)
    args = [dev(t) for t in (p["q"][new_rows], p["k"][new_rows], p["v"][new_rows], offsets(p["new_lengths"]))]
    common = dict(new_tokens=new_tokens, rab=rab, backend=backend, alpha=0.3, cache_timestamps=dev(p["ts"][cache_rows]))
    want = hstu_cached_attention(*args, dev(keys), dev(values), dev(offsets(p["cache_lengths"])), **common)
    page_tables = PageTables([dev(t) for t in tables], page_size)
    got = hstu_cached_attention(
        *args,
        PagedCache(dev(pool_k), page_tables),
        PagedCache(dev(pool_v), page_tables),
        dev(offsets(p["cache_lengths"])),
        **common,
    )
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=0)


@pytest.mark.skipif(DEVICE != "cpu" or native_ops("gr_cpu_cached") is None, reason="the fused CPU kernel is not built")
@pytest.mark.parametrize("new", [1, 2, 3, 70])  # dot products (1, 2), GEMM tiles (3), two row tiles (70)
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("new_tokens", ["targets", "history"])
def test_the_fused_cpu_kernel_reads_pages_where_they_lie_with_the_bits_of_tensors(
    new, page_size, new_tokens, monkeypatch
):
    """The cpu backend's fused kernel over random page tables of a fragmented pool, with caches across
    several key tiles (256 keys) and a masked window: the answer of the same K/V as one jagged tensor
    and as per-request tensors, bit for bit, without reading any request's pages into a tensor; all
    within float tolerance of the one-pass reference."""
    cache_lengths, new_lengths = [300, 0, 17, 513], [new, 2, new, 1]
    p = problem(seed=new, pos_buckets=40, time_buckets=24, cache_lengths=cache_lengths, new_lengths=new_lengths,
                dims=(2, 20, 36))  # fmt: skip
    options = dict(alpha=0.3, silu_scale=None, contextual_len=3, max_attn_len=400)
    cache_rows, new_rows = split(p)
    keys, values, pool_k, pool_v, tables = paged_kv(p, page_size, seed=page_size)
    offsets = lambda lengths: torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])  # noqa: E731
    bounds = offsets(cache_lengths).tolist()
    per_request = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    args = (p["q"][new_rows], p["k"][new_rows], p["v"][new_rows], offsets(new_lengths))
    common_args = dict(new_tokens=new_tokens, rab=bias(p, new_rows), backend="cpu")
    common_args["cache_timestamps"] = p["ts"][cache_rows]
    jagged = hstu_cached_attention(*args, keys, values, offsets(cache_lengths), **common_args, **options)
    listed = hstu_cached_attention(
        *args, [keys[:, s] for s in per_request], [values[:, s] for s in per_request], offsets(cache_lengths),
        **common_args, **options,
    )  # fmt: skip

    def no_gather(*_args, **_kwargs):
        raise AssertionError("a request's pages were read into a tensor")

    monkeypatch.setattr(common.PagedCache, "read", no_gather)
    monkeypatch.setattr(common.PagedCache, "rows", no_gather)
    page_tables = PageTables(tables, page_size)
    got = hstu_cached_attention(
        *args, PagedCache(pool_k, page_tables), PagedCache(pool_v, page_tables), offsets(cache_lengths),
        **common_args, **options,
    )  # fmt: skip
    torch.testing.assert_close(got, jagged, rtol=0, atol=0)
    torch.testing.assert_close(listed, jagged, rtol=0, atol=0)
    torch.testing.assert_close(got, reference_rows(p, new_tokens, options), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_request_pages_among_tensors_equal_one_jagged_cache(backend, monkeypatch):
    """A batch whose users are partly paged (each its own page table into a fragmented pool) and partly
    in tensors, as after a pool filled in the middle of a batch: the jagged answer, bit for bit; the
    fused CPU kernel reads the pages where they lie (no request's pages read into a tensor)."""
    p = problem(pos_buckets=30, time_buckets=24, cache_lengths=[5, 0, 17, 9], new_lengths=[3, 2, 4, 1])
    cache_rows, new_rows = split(p)
    keys, values, pool_k, pool_v, tables = paged_kv(p, 4, seed=1)
    offsets = lambda lengths: torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])  # noqa: E731
    bounds = offsets(p["cache_lengths"]).tolist()
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    own_tables = [PageTables([dev(t)], 4) for t in tables]
    mixed_k = [PagedCache(dev(pool_k), own_tables[0]), dev(keys[:, 5:5]), PagedCache(dev(pool_k), own_tables[2])]
    mixed_v = [PagedCache(dev(pool_v), own_tables[0]), dev(values[:, 5:5]), PagedCache(dev(pool_v), own_tables[2])]
    mixed_k.append(dev(keys[:, bounds[3] :]))
    mixed_v.append(dev(values[:, bounds[3] :]))
    rab = bias(p, new_rows)
    rab = RelativeBias(dev(rab.position_weights), dev(rab.time_weights), dev(rab.timestamps), rab.time_bucketing, None)
    args = [dev(t) for t in (p["q"][new_rows], p["k"][new_rows], p["v"][new_rows], offsets(p["new_lengths"]))]
    common_args = dict(new_tokens="history", rab=rab, backend=backend, alpha=0.3)
    common_args["cache_timestamps"] = dev(p["ts"][cache_rows])
    want = hstu_cached_attention(*args, dev(keys), dev(values), dev(offsets(p["cache_lengths"])), **common_args)
    if backend == "cpu" and native_ops("gr_cpu_cached") is not None:
        monkeypatch.setattr(common.PagedCache, "read", lambda *_: pytest.fail("pages read into a tensor"))
    got = hstu_cached_attention(*args, mixed_k, mixed_v, dev(offsets(p["cache_lengths"])), **common_args)
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=0)


def composed_layer(call, ops):
    """The PyTorch composition the cpu backend's ``cached_layer`` op stands for: per request its new
    tokens' own part by PyTorch ops, every request's cached part by ``cached_forward``, then the sum
    and the normaliser."""
    from gr.hstu.kernels.cached_attention import cpu

    kept = cpu._setup(call)
    q, k, v, rab = call.q, call.k, call.v, call.rab
    biases, masks, own_parts = [], [], []
    for own in kept.requests:
        new, cached = own.request.new, own.request.cache.stop - own.request.cache.start
        qh = q[new].transpose(0, 1) * call.alpha
        kh, vh = k[new].transpose(0, 1), v[new].transpose(0, 1)
        bias_ = None if own.bias is None or rab is None else own.bias.bias(rab)
        if call.new_tokens == "targets":
            self_logits = (qh * kh).sum(-1)
            if own.self_bias is not None and rab is not None:
                self_logits = self_logits + own.self_bias.bias(rab).to(self_logits.dtype)
            own_parts.append(torch.nn.functional.silu(self_logits).unsqueeze(-1) * vh)
        else:
            block = torch.matmul(qh, kh.transpose(1, 2))
            if bias_ is not None:
                block = block + bias_[:, cached:].to(block.dtype)
                bias_ = bias_[:, :cached]
            own_parts.append(torch.matmul(torch.nn.functional.silu(block) * own.new_visible.to(block.dtype), vh))
        biases.append(None if bias_ is None else bias_.to(torch.float32).contiguous())
        masks.append(own.cache_visible)
    pools_k, pools_v, index, starts, block_offsets, sizes = cpu._layout(call, kept)
    fused = ops.cached_forward(
        q, pools_k, pools_v, kept.new_bounds, kept.lengths, index, starts, block_offsets, sizes, float(call.alpha),
        biases, masks,
    )  # fmt: skip
    out = v.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for own, own_part in zip(kept.requests, own_parts):
        attn = fused[own.request.new] + own_part.transpose(0, 1)
        attn.mul_(own.norm.to(attn.dtype))
        out[own.request.new] = attn
    return out


def random_layer_call(seed):
    """A random cached-attention call for the cpu backend: targets or history, 1-5 requests of 0-40
    cached and 1-9 new tokens (sometimes 0), any of the bias parts (sometimes fp64 weights), a window
    and contextual tokens or not, K/V as one jagged tensor, per-request tensors, a fragmented page
    pool or per-request pages."""
    g = np.random.default_rng(seed)
    count = int(g.integers(1, 6))
    cache_lengths = [int(c) for c in g.integers(0, 41, count)]
    new_lengths = [int(n) if g.random() > 0.1 else 0 for n in g.integers(1, 10, count)]
    pos_buckets, time_buckets = [int(g.choice([0, 30])), int(g.choice([0, 24]))]
    p = problem(
        seed=seed, pos_buckets=pos_buckets, time_buckets=time_buckets, bucketing=str(g.choice(["log", "sqrt"])),
        query_times=bool(g.random() < 0.5), cache_lengths=cache_lengths, new_lengths=new_lengths, dims=(2, 8, 6),
    )  # fmt: skip
    if g.random() < 0.2:  # weights of another dtype than q's
        p["pos_w"], p["time_w"] = (None if w is None else w.double() for w in (p["pos_w"], p["time_w"]))
    cache_rows, new_rows = split(p)
    offsets = lambda lengths: torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])  # noqa: E731
    page_size = int(g.integers(1, 9))
    keys, values, pool_k, pool_v, tables = paged_kv(p, page_size, seed=seed)
    bounds = offsets(cache_lengths).tolist()
    kind = str(g.choice(["tensor", "requests", "pages", "request pages"]))
    if kind == "tensor":
        cache_k, cache_v = keys, values
    elif kind == "requests":
        cache_k = [keys[:, a:b] for a, b in zip(bounds, bounds[1:])]
        cache_v = [values[:, a:b] for a, b in zip(bounds, bounds[1:])]
    elif kind == "pages":
        shared = PageTables(tables, page_size)
        cache_k, cache_v = PagedCache(pool_k, shared), PagedCache(pool_v, shared)
    else:
        own_tables = [PageTables([t], page_size) for t in tables]
        cache_k, cache_v = [PagedCache(pool_k, t) for t in own_tables], [PagedCache(pool_v, t) for t in own_tables]
    options = dict(
        alpha=float(g.uniform(0.1, 1.0)),
        silu_scale=None if g.random() < 0.5 else float(g.uniform(0.01, 0.2)),
        contextual_len=int(g.choice([0, 0, 2, 5])),
        max_attn_len=int(g.choice([0, 0, 3, 12])),
    )
    call = common.CachedAttentionCall(
        p["q"][new_rows], p["k"][new_rows], p["v"][new_rows], offsets(new_lengths), cache_k, cache_v,
        offsets(cache_lengths), new_tokens=str(g.choice(["targets", "history"])), rab=bias(p, new_rows),
        cache_timestamps=p["ts"][cache_rows], **options,
    )  # fmt: skip
    call.validate()
    return call


@pytest.mark.skipif(DEVICE != "cpu" or native_ops("gr_cpu_cached") is None, reason="the fused CPU kernel is not built")
@pytest.mark.parametrize("seed", range(48))
def test_the_fused_cpu_layer_op_is_its_pytorch_composition_to_the_bit(seed):
    """The cpu backend's one op per call (``gr_cpu_cached.cached_layer``: own parts, bias, cached part,
    sum, normaliser) gives the bits of the PyTorch composition it replaces, over random calls."""
    from gr.hstu.kernels.cached_attention import cpu

    call = random_layer_call(seed)
    ops = native_ops("gr_cpu_cached")
    want = composed_layer(call, ops)
    calls = []
    spy = type("Spy", (), {"cached_layer": lambda _, *a: calls.append(a) or ops.cached_layer(*a)})()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "native_ops", lambda _: spy)
        got = cpu.cpu_hstu_cached_attention(call)
    assert len(calls) == 1  # the fused op ran, once
    assert torch.equal(got, want)


@pytest.mark.parametrize("per_request", [False, True], ids=["pages", "per-request pages"])
def test_a_page_table_too_short_for_its_tokens_is_a_named_error(per_request):
    p = problem(cache_lengths=[5], new_lengths=[2])
    cache_rows, new_rows = split(p)
    tables = PageTables([torch.tensor([0])], 4)  # 4 slots for 5 tokens
    cache_k, cache_v = PagedCache(torch.zeros(HEADS, 8, DA), tables), PagedCache(torch.zeros(HEADS, 8, DL), tables)
    with pytest.raises(ValueError, match="cache_k: request 0's page table"):
        hstu_cached_attention(
            p["q"][new_rows],
            p["k"][new_rows],
            p["v"][new_rows],
            torch.tensor([0, 2]),
            [cache_k] if per_request else cache_k,
            [cache_v] if per_request else cache_v,
            torch.tensor([0, 5]),
        )


def _no_gather(monkeypatch):
    """Reading any request's pages into a tensor, or running the training kernel over cache + new
    tokens, fails the test."""

    def fail(*_args, **_kwargs):
        raise AssertionError("a request's pages were read into a tensor, or the call ran by_concat")

    monkeypatch.setattr(common.PagedCache, "read", fail)
    monkeypatch.setattr(common.PagedCache, "rows", fail)
    monkeypatch.setattr("gr.hstu.kernels.cached_attention.triton.concat_hstu_cached_attention", fail)


@pytest.mark.skipif("triton" not in KERNEL_BACKENDS, reason="triton runs on CUDA or under its interpreter on CPU")
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("new_tokens", ["targets", "history"])
def test_the_triton_kernel_reads_pages_where_they_lie_with_the_bits_of_tensors(page_size, new_tokens, monkeypatch):
    """The triton backend's kernel over random page tables of a fragmented pool (requests of 0 to 70
    cached tokens: two key tiles; up to 20 new ones: two query tiles; a masked window and a context):
    the answer of the same K/V as one jagged tensor bit for bit, and of per-request pages of that pool,
    without reading any request's pages into a tensor; all within float tolerance of the one-pass
    reference."""
    cache_lengths, new_lengths = [70, 0, 17, 33, 1], [3, 20, 1, 17, 2]
    p = problem(seed=page_size, pos_buckets=40, time_buckets=24, query_times=True, cache_lengths=cache_lengths,
                new_lengths=new_lengths, dims=(2, 20, 36))  # fmt: skip
    options = dict(alpha=0.3, silu_scale=None, contextual_len=3, max_attn_len=40)
    cache_rows, new_rows = split(p)
    keys, values, pool_k, pool_v, tables = paged_kv(p, page_size, seed=page_size)
    offsets = lambda lengths: torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])  # noqa: E731
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    rab = bias(p, new_rows)
    rab = RelativeBias(dev(rab.position_weights), dev(rab.time_weights), dev(rab.timestamps), rab.time_bucketing,
                       dev(rab.query_times))  # fmt: skip
    args = [dev(t) for t in (p["q"][new_rows], p["k"][new_rows], p["v"][new_rows], offsets(new_lengths))]
    keywords = dict(new_tokens=new_tokens, rab=rab, backend="triton", cache_timestamps=dev(p["ts"][cache_rows]))
    cache_offsets = dev(offsets(cache_lengths))
    _no_gather(monkeypatch)
    jagged = hstu_cached_attention(*args, dev(keys), dev(values), cache_offsets, **keywords, **options)
    page_tables = PageTables([dev(t) for t in tables], page_size)
    got = hstu_cached_attention(
        *args, PagedCache(dev(pool_k), page_tables), PagedCache(dev(pool_v), page_tables), cache_offsets,
        **keywords, **options,
    )  # fmt: skip
    own = [PageTables([dev(t)], page_size) for t in tables]
    per_request = hstu_cached_attention(
        *args, [PagedCache(dev(pool_k), t) for t in own], [PagedCache(dev(pool_v), t) for t in own], cache_offsets,
        **keywords, **options,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), jagged.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(per_request.cpu(), jagged.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(got.cpu(), reference_rows(p, new_tokens, options), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif("triton" not in KERNEL_BACKENDS, reason="triton runs on CUDA or under its interpreter on CPU")
def test_the_triton_kernel_takes_bf16_pages_as_it_takes_bf16_tensors():
    """bf16 K/V in pages and in a tensor: one answer bit for bit, near the fp32 reference."""
    cache_lengths, new_lengths = [9, 0, 21], [2, 3, 1]
    p = problem(seed=7, pos_buckets=30, cache_lengths=cache_lengths, new_lengths=new_lengths)
    cache_rows, new_rows = split(p)
    keys, values, pool_k, pool_v, tables = paged_kv(p, 4, seed=2)
    offsets = lambda lengths: torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])  # noqa: E731
    half = lambda x: x.to(DEVICE, torch.bfloat16)  # noqa: E731
    rab = RelativeBias(p["pos_w"].to(DEVICE))
    args = [half(p["q"][new_rows]), half(p["k"][new_rows]), half(p["v"][new_rows]), offsets(new_lengths).to(DEVICE)]
    keywords = dict(new_tokens="targets", rab=rab, backend="triton", alpha=0.4)
    page_tables = PageTables([t.to(DEVICE) for t in tables], 4)
    cache_offsets = offsets(cache_lengths).to(DEVICE)
    tensors = hstu_cached_attention(*args, half(keys), half(values), cache_offsets, **keywords)
    pages = hstu_cached_attention(
        *args, PagedCache(half(pool_k), page_tables), PagedCache(half(pool_v), page_tables), cache_offsets, **keywords
    )
    assert pages.dtype == torch.bfloat16
    torch.testing.assert_close(pages.cpu(), tensors.cpu(), rtol=0, atol=0)
    want = reference_rows(p, "targets", dict(alpha=0.4))
    torch.testing.assert_close(pages.float().cpu(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(DEVICE != "cpu" or native_ops("gr_cpu_cached") is None, reason="the fused CPU kernel is not built")
def test_a_layer_whose_bias_weights_miss_the_pass_buckets_is_a_named_error():
    """The pass's buckets come from its first call's weights: a later call with fewer position weights
    is an error naming the request and the bucket, not a read past the weights."""
    p = problem(pos_buckets=30, cache_lengths=[9], new_lengths=[3])
    setup = common.CachedSetup()
    cached(p, "history", "cpu", dict(alpha=0.3), setup=setup)
    p["pos_w"] = p["pos_w"][:5]
    with pytest.raises(RuntimeError, match="request 0's position bucket .* is out of its 5 weights"):
        cached(p, "history", "cpu", dict(alpha=0.3), setup=setup)


@pytest.mark.skipif("cpu" not in KERNEL_BACKENDS, reason="the cpu backend runs on CPU tensors")
def test_a_cpu_call_that_needs_gradients_gets_the_references():
    """The fused op is forward only: a call whose q, k, v or bias weights require grad runs PyTorch ops,
    and its gradients (bias weights included) are the reference's."""
    p = problem(seed=6, pos_buckets=30, cache_lengths=[5, 0, 300], new_lengths=[3, 2, 4])
    cache_rows, new_rows = split(p)
    offsets = lambda lengths: torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])  # noqa: E731
    grads = []
    for backend in ("cpu", "pytorch"):
        q, k, v = (x[new_rows].clone().requires_grad_() for x in (p["q"], p["k"], p["v"]))
        weights = p["pos_w"].clone().requires_grad_()
        out = hstu_cached_attention(
            q, k, v, offsets(p["new_lengths"]), p["k"][cache_rows].transpose(0, 1),
            p["v"][cache_rows].transpose(0, 1), offsets(p["cache_lengths"]), new_tokens="history",
            rab=RelativeBias(weights), backend=backend, alpha=0.3,
        )  # fmt: skip
        out.square().sum().backward()
        grads.append([x.grad for x in (q, k, v, weights)])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(DEVICE != "cpu" or native_ops("gr_cpu_cached") is None, reason="the fused CPU kernel is not built")
@pytest.mark.parametrize("new_tokens", ["targets", "history"])
def test_the_cpu_backend_under_bf16_autocast_runs_pytorch_ops_near_the_reference(new_tokens, monkeypatch):
    """Under CPU autocast to bf16 the fused op (fp32 math) is not called; the PyTorch ops' answer is
    within bf16 rounding of the fp32 reference."""
    from gr.hstu.kernels.cached_attention import cpu

    refusing = type("Refusing", (), {"cached_layer": lambda *_: pytest.fail("the fused op ran under bf16 autocast")})()
    monkeypatch.setattr(cpu, "native_ops", lambda _: refusing)
    spec = dict(CASES["pos+log-time"])
    options = spec.pop("options")
    p = problem(**spec)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cached(p, new_tokens, "cpu", options)
    torch.testing.assert_close(got.float(), reference_rows(p, new_tokens, options), rtol=0.05, atol=0.05)


@pytest.mark.skipif("triton" not in KERNEL_BACKENDS, reason="triton runs on CUDA or under its interpreter on CPU")
def test_a_triton_call_that_needs_gradients_gets_the_references():
    """The kernel is forward only: a call whose q, k, v require grad runs the training kernel, and its
    gradients are the reference's."""
    p = problem(seed=5, pos_buckets=30)
    cache_rows, new_rows = split(p)
    offsets = lambda lengths: torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])  # noqa: E731
    grads = []
    for backend in ("triton", "pytorch"):
        q, k, v = (x[new_rows].to(DEVICE).requires_grad_() for x in (p["q"], p["k"], p["v"]))
        out = hstu_cached_attention(
            q, k, v, offsets(p["new_lengths"]).to(DEVICE), p["k"][cache_rows].transpose(0, 1).to(DEVICE),
            p["v"][cache_rows].transpose(0, 1).to(DEVICE), offsets(p["cache_lengths"]).to(DEVICE),
            rab=RelativeBias(p["pos_w"].to(DEVICE)), backend=backend, alpha=0.3,
        )  # fmt: skip
        out.square().sum().backward()
        grads.append([x.grad.cpu() for x in (q, k, v)])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif("triton" not in KERNEL_BACKENDS, reason="triton runs on CUDA or under its interpreter on CPU")
@pytest.mark.parametrize("new_tokens", ["targets", "history"])
def test_the_triton_kernel_over_a_batch_with_nothing_cached_is_the_reference(new_tokens):
    p = problem(seed=2, pos_buckets=30, time_buckets=24, cache_lengths=[0, 0], new_lengths=[2, 3])
    options = dict(alpha=0.3, silu_scale=None)
    got = cached(p, new_tokens, "triton", options)
    torch.testing.assert_close(got, reference_rows(p, new_tokens, options), rtol=1e-4, atol=1e-5)
