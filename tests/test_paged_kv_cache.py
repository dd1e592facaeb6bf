"""The paged KV cache (gr.hstu.paged): an engine whose caches live in a page pool answers exactly as
one whose caches are tensors, extending writes only the new tokens, and pages come back when no
cache holds them."""

import threading

import pytest
import torch
from test_serving_hstu_cache import CASES, REQUEST_TIME, make_engine, tokens

from gr.hstu.cache import CachedHSTU
from gr.hstu.kernels.cached_attention import PagedCache, PageTables
from gr.hstu.kernels.cached_attention.common import LAYOUTS_KEPT
from gr.hstu.paged import PagePool
from gr.ops.native import native_ops
from gr.serving.user_cache import UserCache
from helpers.backends import DEVICE, KERNEL_BACKENDS


def paged_twin(engine: CachedHSTU, pages: int, page_size: int = 4) -> CachedHSTU:
    """The same HSTU with a page pool."""
    return CachedHSTU(engine.hstu, PagePool(engine.config, pages, page_size))


def fragment(pool: PagePool, seed: int = 0) -> list:
    """Hold every other page in a shuffled order (a pool after some evictions); -> the holders."""
    g = torch.Generator().manual_seed(seed)
    taken = pool._take(pool.pages)
    assert taken is not None
    kept = [pool._table([p], 0) for p in taken[1::2]]
    pool._free = [taken[i] for i in torch.randperm(len(taken), generator=g).tolist() if i % 2 == 0]
    return kept


def same_kv(got, want):
    assert got.length == want.length and got.committed == want.committed
    for i in range(len(want.keys)):
        for mine, ref in zip(got.layer(i), want.layer(i)):
            torch.testing.assert_close(mine, ref, rtol=0, atol=0)
    torch.testing.assert_close(got.timestamps, want.timestamps, rtol=0, atol=0)


# every case on the CPU backends; one on the triton kernel under Triton's interpreter (the engines are on CPU)
ENGINES = CASES + ([dict(CASES[2], kernel_backend="triton")] if DEVICE == "cpu" and "triton" in KERNEL_BACKENDS else [])


@pytest.mark.parametrize("case", ENGINES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_a_paged_engine_encodes_extends_and_scores_as_the_unpaged_one_to_the_bit(case):
    """Users encoded together into a fragmented pool, extended by 0..5 tokens (partial and whole
    pages), then scored: K/V, outputs and scores equal the unpaged engine's exactly."""
    plain = make_engine(**case)
    engine = paged_twin(plain, pages=64)
    held = fragment(engine.pool)
    lengths, added = [30, 1, 0, 12, 5], [4, 2, 0, 1, 5]
    users = [tokens(n + k + 3, 0, seed=s) for s, (n, k) in enumerate(zip(lengths, added))]

    def first(e):
        return e.encode_batch(
            [x[:n] for (x, _), n in zip(users, lengths)], [t[:n] for (_, t), n in zip(users, lengths)]
        )

    paged, unpaged = first(engine), first(plain)
    for (got, got_hidden), (want, want_hidden) in zip(paged, unpaged):
        assert got.paged is not None and not got.keys
        same_kv(got, want)
        torch.testing.assert_close(got_hidden, want_hidden, rtol=0, atol=0)
    grow = [b for b, (c, _) in enumerate(unpaged) if plain.can_extend(c)]

    def step(e, caches):
        return e.extend_batch(
            [caches[b][0] for b in grow],
            [users[b][0][lengths[b] : lengths[b] + added[b]] for b in grow],
            [users[b][1][lengths[b] : lengths[b] + added[b]] for b in grow],
        )

    grown, grown_plain = step(engine, paged), step(plain, unpaged)
    for (got, got_hidden), (want, want_hidden) in zip(grown, grown_plain):
        same_kv(got, want)
        torch.testing.assert_close(got_hidden, want_hidden, rtol=0, atol=0)
    counts = torch.tensor([2, 0, 3, 1, 1][: len(grow)])
    candidates = torch.randn(int(counts.sum()), 16, generator=torch.Generator().manual_seed(9))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    times = torch.full((int(counts.sum()),), REQUEST_TIME)
    request_times = [REQUEST_TIME] * len(grow)
    got = engine.score_batch([c for c, _ in grown], candidates, offsets, times, 3, request_times)
    want = plain.score_batch([c for c, _ in grown_plain], candidates, offsets, times, 3, request_times)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert held  # the fragmenting pages stay held throughout


def test_extending_writes_only_the_new_tokens_into_the_last_page():
    """The prefix's pages are shared, not copied: the extension's page table starts with the base's
    pages, and only pages for the new tokens are taken."""
    plain = make_engine(num_heads=2)
    engine = paged_twin(plain, pages=16, page_size=4)
    x, ts = tokens(12, 0)
    base = engine.encode(x[:6], ts[:6])  # pages 0, 1 (two slots of page 1 used)
    assert base.paged.pages == (0, 1) and engine.pool.used == 2
    grown = engine.extend(base, x[6:11], ts[6:11])  # slots 2, 3 of page 1, then page 2
    assert grown.paged.pages == (0, 1, 2) and engine.pool.used == 3
    same_kv(grown, plain.extend(plain.encode(x[:6], ts[:6]), x[6:11], ts[6:11]))


def test_two_extensions_of_one_history_copy_its_last_page_instead_of_sharing_its_free_slots():
    plain = make_engine(num_heads=2)
    engine = paged_twin(plain, pages=16, page_size=4)
    x, ts = tokens(12, 0)
    y = torch.randn(3, 16)
    base = engine.encode(x[:6], ts[:6])
    first = engine.extend(base, x[6:8], ts[6:8])
    second = engine.extend(base, y[:2], ts[6:8])  # another continuation: must not overwrite the first's slots
    assert first.paged.pages[1] == base.paged.pages[1] != second.paged.pages[1]
    unpaged = plain.encode(x[:6], ts[:6])
    same_kv(first, plain.extend(unpaged, x[6:8], ts[6:8]))
    same_kv(second, plain.extend(unpaged, y[:2], ts[6:8]))
    same_kv(base, plain.encode(x[:6], ts[:6]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_encoding_or_extending_and_settling_in_one_pass_pages_as_tensors_and_leaves_the_cache_free_to_grow(case):
    """encode_settled_batch, then extend_settled_batch, in a fragmented pool equal the unpaged
    engine's to the bit; the settled token's K/V, written after the cache's, never reach it:
    extending the extension again (its next request) equals the unpaged engine's too."""
    plain = make_engine(**case)
    engine = paged_twin(plain, pages=64)
    held = fragment(engine.pool)
    lengths, added = [30, 6, 12], [3, 1, 0]
    users = [tokens(n + k + 2, 0, seed=s) for s, (n, k) in enumerate(zip(lengths, added))]
    request_times = [REQUEST_TIME + b for b in range(len(users))]

    def run(e):
        first = e.encode_settled_batch(
            [x[:n] for (x, _), n in zip(users, lengths)], [t[:n] for (_, t), n in zip(users, lengths)], request_times
        )
        bases = [cache for (cache, _), _ in first]
        ends = [n + k for n, k in zip(lengths, added)]
        both = e.extend_settled_batch(
            bases,
            [x[n:end] for (x, _), n, end in zip(users, lengths, ends)],
            [t[n:end] for (_, t), n, end in zip(users, lengths, ends)],
            request_times,
        )
        again = e.extend_batch(
            [extended for (extended, _), _ in both],
            [x[end : end + 2] for (x, _), end in zip(users, ends)],
            [t[end : end + 2] for (_, t), end in zip(users, ends)],
        )
        return first + both, again

    (both, again), (both_plain, again_plain) = run(engine), run(plain)
    for ((extended, hidden), (settled, last)), ((want, want_hidden), (want_settled, want_last)) in zip(
        both, both_plain
    ):
        same_kv(extended, want)
        same_kv(settled, want_settled)
        assert torch.equal(hidden, want_hidden) and torch.equal(last, want_last)
    for (got, got_hidden), (want, want_hidden) in zip(again, again_plain):
        same_kv(got, want)
        assert torch.equal(got_hidden, want_hidden)
    assert held


def test_pages_return_to_the_pool_when_no_cache_holds_them():
    engine = paged_twin(make_engine(num_heads=2), pages=8, page_size=4)
    x, ts = tokens(12, 0)
    base = engine.encode(x[:6], ts[:6])
    grown = engine.extend(base, x[6:11], ts[6:11])
    assert engine.pool.used == 3
    del base  # its pages are grown's prefix: still held
    assert engine.pool.used == 3
    del grown  # freed at once (no reference cycle holds a history)
    assert engine.pool.used == 0 and engine.pool.free == 8


def test_a_full_pool_calls_on_full_then_keeps_the_history_unpaged():
    """A pool with no room: on_full is asked to free pages; when it cannot, the cache is the
    unpaged one, with the same answers."""
    plain = make_engine(num_heads=2)
    engine = paged_twin(plain, pages=3, page_size=4)
    x, ts = tokens(20, 0)
    kept = [engine.encode(x[:8], ts[:8])]  # 2 of the 3 pages
    calls = []

    def on_full() -> bool:
        calls.append(len(kept))
        if not kept:
            return False
        kept.pop()
        return True

    engine.pool.on_full = on_full
    mid = engine.encode(x[:10], ts[:10])  # 3 pages: the first history is evicted for it
    assert calls == [1] and mid.paged is not None
    big = engine.encode(x[:16], ts[:16])  # 4 pages: more than the pool holds
    assert big.paged is None and big.keys
    same_kv(big, plain.encode(x[:16], ts[:16]))
    grown = engine.extend(mid, x[10:14], ts[10:14])  # no page free while mid holds all 3
    assert grown.paged is None
    same_kv(grown, plain.extend(plain.encode(x[:10], ts[:10]), x[10:14], ts[10:14]))


def test_a_pool_that_fills_in_the_middle_of_a_batch_answers_as_the_unpaged_engine(monkeypatch):
    """Three users extended in one pass while the pool has room for only the first one's new pages,
    on_full evicting another history meanwhile: the rest stay unpaged, every answer unchanged; scoring
    the mixed batch, the fused CPU kernel reads the paged users' K/V where they lie."""
    plain = make_engine(num_heads=2)
    engine = paged_twin(plain, pages=10, page_size=4)
    users = [tokens(14, 0, seed=s) for s in range(3)]
    bases = [engine.encode(x[:8], t[:8]) for x, t in users]  # 2 pages each: 6 used
    other = [engine.encode(users[0][0][:4], users[0][1][:4])]  # 1 page, dropped when the pool is full
    engine.pool.on_full = lambda: bool(other) and (other.clear() or True)
    grown = engine.extend_batch(bases, [x[8:14] for x, _ in users], [t[8:14] for _, t in users])
    assert [g.paged is not None for g, _ in grown] == [True, True, False] and not other
    plain_bases = [plain.encode(x[:8], t[:8]) for x, t in users]
    want = plain.extend_batch(plain_bases, [x[8:14] for x, _ in users], [t[8:14] for _, t in users])
    for (got, got_hidden), (ref, ref_hidden) in zip(grown, want):
        same_kv(got, ref)
        torch.testing.assert_close(got_hidden, ref_hidden, rtol=0, atol=0)
    offsets = torch.tensor([0, 2, 3, 5])
    candidates, times = torch.randn(5, 16), torch.full((5,), REQUEST_TIME)
    expected = plain.score_batch([g for g, _ in want], candidates, offsets, times)
    if native_ops("gr_cpu_cached") is not None:
        monkeypatch.setattr(PagedCache, "read", lambda *_: pytest.fail("pages read into a tensor"))
    got = engine.score_batch([g for g, _ in grown], candidates, offsets, times)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_threads_extending_and_evicting_in_one_small_pool_never_see_a_page_reused_under_them():
    """Four threads extend one shared history with their own tokens and keep the results in a
    byte-bounded LRU that a full pool evicts from; each result, read after the others ran, still
    holds exactly its unpaged K/V."""
    plain = make_engine(num_heads=2)
    engine = paged_twin(plain, pages=12, page_size=4)
    lru = UserCache(6 * engine.pool.page_bytes)
    engine.pool.on_full = lru.evict_oldest
    x, ts = tokens(6, 0)
    base, plain_base = engine.encode(x, ts), plain.encode(x, ts)
    news = [torch.randn(3, 16, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    times = ts[-1] + torch.arange(1, 4)
    wants = [plain.extend(plain_base, new, times) for new in news]
    errors = []

    def work(i: int) -> None:
        try:
            for step in range(5):
                mine = engine.extend(base, news[i], times)
                lru.put((i, step), mine, 0)
                same_kv(mine, wants[i])
        except AssertionError as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    same_kv(base, plain_base)
    assert engine.pool.used <= engine.pool.pages


def test_page_tables_keep_a_bounded_number_of_layouts_and_read_the_same_rows_past_the_bound():
    """A history's page tables live as long as its cache entry: reads at ever new lengths keep at most
    LAYOUTS_KEPT layouts of each kind, and a layout computed again equals the first."""
    size, pages = 2, torch.tensor([5, 2, 9, 3, 7, 1, 8, 4, 6, 0] * 20)
    tables = PageTables([pages], size)
    lengths = range(size + 1, size + 2 * LAYOUTS_KEPT + 2)  # two pages or more: never consecutive here
    first = {n: (tables.read(0, n), tables.blocks([n])) for n in lengths}
    assert tables.layouts <= 2 * LAYOUTS_KEPT
    for n in lengths:
        (kind, rows), (starts, offsets) = tables.read(0, n), tables.blocks([n])
        assert kind == first[n][0][0] == "rows" and torch.equal(rows, first[n][0][1])
        want = (pages.view(-1, 1) * size + torch.arange(size)).flatten()[:n]
        assert torch.equal(rows, want)
        assert torch.equal(starts, first[n][1][0]) and offsets == first[n][1][1]
    assert tables.layouts <= 2 * LAYOUTS_KEPT
