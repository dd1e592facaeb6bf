"""The KV-cache HSTU engine: cached scoring and incremental appends equal the one-pass forward."""

import pytest
import torch

from gr.hstu import HSTU, HSTUConfig
from gr.hstu.cache import CachedHSTU, cache_bytes_per_token

CASES = [
    dict(num_heads=2, attn_norm="max_seq_len", time_bucketing="log"),
    dict(num_heads=1, attn_norm="seq_len", time_bucketing="sqrt", contextual_len=3),
    dict(num_heads=2, max_attn_len=7, contextual_len=2),
    dict(num_heads=2, position_buckets=0, time_buckets=0, position_embedding=False, scale_input=False),
    dict(num_heads=2, query_time="next_event", contextual_len=2),
]
REQUEST_TIME = 10**7 + 123  # the candidates' timestamp


def make_engine(**overrides) -> CachedHSTU:
    cfg = HSTUConfig(
        **{
            **dict(
                hidden_dim=16,
                num_layers=2,
                attention_dim=8,
                linear_dim=6,
                max_seq_len=48,
                dropout=0.0,
                input_dropout=0.0,
            ),
            **overrides,
        }
    )
    model = HSTU(cfg)
    with torch.no_grad():
        for p in model.parameters():  # non-trivial biases and norms
            p.add_(torch.randn_like(p) * 0.2)
    return CachedHSTU(model)


def tokens(history: int, candidates: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(history + candidates, 16, generator=g)
    hist_ts = torch.sort(torch.randint(0, 10**7, (history,), generator=g)).values
    ts = torch.cat([hist_ts, torch.full((candidates,), REQUEST_TIME)])
    return x, ts


def one_pass(engine: CachedHSTU, x, ts, history: int, request_time: int = REQUEST_TIME, rows: str = "candidates"):
    """Rows of the candidates (or of the history) in one target-aware HSTU.forward over history +
    candidates; query times (read by "next_event" models): the next history token's timestamp,
    then the request time, then the candidates' own."""
    total = x.shape[0]
    query_ts = torch.cat([ts[1:history], torch.tensor([request_time]), ts[history:]])[-total:]
    with torch.no_grad():
        out = engine.hstu(x, torch.tensor([0, total]), total, ts, torch.tensor([total - history]), query_ts)
    return out[history:] if rows == "candidates" else out[:history]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_cached_scores_equal_the_one_pass_target_aware_forward_for_any_micro_batch(case):
    engine = make_engine(**case)
    history, n = 37, 11
    x, ts = tokens(history, n)
    want = one_pass(engine, x, ts, history)
    cache = engine.encode(x[:history], ts[:history])
    for micro_batch in (1, 4, n, 1000):
        got = engine.score(cache, x[history:], ts[history:], micro_batch=micro_batch, request_time=REQUEST_TIME)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_incremental_appends_equal_encoding_the_longer_history(case):
    engine = make_engine(**case)
    history, n = 40, 6
    x, ts = tokens(history, n, seed=1)
    full = engine.encode(x[:history], ts[:history])
    cache = engine.encode(x[:20], ts[:20])
    for start, end in ((20, 21), (21, 26), (26, 40)):
        cache = engine.extend(cache, x[start:end], ts[start:end])
    assert cache.length == history
    for mine, ref in zip(cache.keys + cache.values, full.keys + full.values):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(cache.timestamps, ts[:history])
    got = engine.score(cache, x[history:], ts[history:], micro_batch=4, request_time=REQUEST_TIME)
    torch.testing.assert_close(got, one_pass(engine, x, ts, history), rtol=0, atol=1e-5)


def test_candidates_of_a_user_without_history_see_only_themselves():
    engine = make_engine(num_heads=2)
    x, ts = tokens(0, 5)
    got = engine.score(engine.encode(x[:0], ts[:0]), x, ts, micro_batch=2)
    torch.testing.assert_close(got, one_pass(engine, x, ts, 0), rtol=0, atol=1e-5)


def test_a_history_shorter_than_contextual_len_is_re_encoded_not_extended():
    engine = make_engine(contextual_len=4)
    x, ts = tokens(6, 0)
    short = engine.encode(x[:3], ts[:3])
    assert not engine.can_extend(short) and engine.can_extend(engine.encode(x[:4], ts[:4]))
    with pytest.raises(ValueError, match="contextual_len"):
        engine.extend(short, x[3:6], ts[3:6])


def test_cache_memory_per_history_token_is_k_and_v_of_every_layer_plus_the_timestamp():
    engine = make_engine(num_heads=2, num_layers=3, attention_dim=8, linear_dim=6)
    per_token = cache_bytes_per_token(engine.config)
    assert per_token == 3 * 2 * (8 + 6) * 4 + 8
    x, ts = tokens(25, 0)
    cache = engine.encode(x, ts)
    assert cache.nbytes == 25 * per_token
    assert engine.extend(cache, *tokens(5, 0, seed=3)).nbytes == 30 * per_token


def test_histories_beyond_max_seq_len_and_bad_shapes_are_refused():
    engine = make_engine(max_seq_len=10)
    x, ts = tokens(12, 0)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.encode(x, ts)
    cache = engine.encode(x[:8], ts[:8])
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.extend(cache, x[8:11], ts[8:11])
    with pytest.raises(ValueError, match="timestamps"):
        engine.score(cache, x[:2], None)
    with pytest.raises(ValueError, match=r"\[n, 16\]"):
        engine.score(cache, x[:2, :8], ts[:2])


def test_next_event_query_time_keeps_the_last_history_token_pending_until_the_request():
    """With query_time "next_event" the last history token's output depends on when the request
    comes: the cache keeps its input only, and each request settles it at its own time."""
    engine = make_engine(num_heads=2, query_time="next_event")
    history, n = 30, 5
    x, ts = tokens(history, n, seed=4)
    cache = engine.encode(x[:history], ts[:history])
    assert (cache.length, cache.committed, tuple(cache.pending.shape)) == (history, history - 1, (1, 16))
    with pytest.raises(ValueError, match="request_time"):
        engine.score(cache, x[history:], ts[history:])
    scores = {}
    for when in (REQUEST_TIME, REQUEST_TIME + 10**6):
        cands_ts = torch.full((n,), when)
        all_ts = torch.cat([ts[:history], cands_ts])
        scores[when] = engine.score(cache, x[history:], cands_ts, request_time=when)
        torch.testing.assert_close(scores[when], one_pass(engine, x, all_ts, history, when), rtol=0, atol=1e-5)
        settled, hidden = engine.settle(cache, when)
        assert settled.pending is None and settled.committed == history
        want_last = one_pass(engine, x, all_ts, history, when, rows="history")[-1:]
        torch.testing.assert_close(hidden, want_last, rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="settle"):
            engine.run_block(
                cache, x[history : history + 1], cands_ts[:1], torch.tensor([1]), torch.ones(1, 1, dtype=torch.bool)
            )
    assert not torch.allclose(scores[REQUEST_TIME], scores[REQUEST_TIME + 10**6], atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_encoding_and_extending_users_in_one_pass_equals_one_user_at_a_time(case):
    """Histories of 0..30 tokens (1 and 0: nothing, or only a pending token, to run) encoded together,
    then extended together by 0..4 tokens: caches and outputs as user by user."""
    engine = make_engine(**case)
    lengths, added = [30, 1, 0, 12, 5], [4, 2, 0, 1, 3]
    users = [tokens(n + k, 0, seed=s) for s, (n, k) in enumerate(zip(lengths, added))]
    encoded = engine.encode_batch(
        [x[:n] for (x, _), n in zip(users, lengths)], [t[:n] for (_, t), n in zip(users, lengths)]
    )
    grown = [
        engine.extend_batch([cache], [x[n:]], [t[n:]]) if engine.can_extend(cache) else None
        for (cache, _), (x, t), n in zip(encoded, users, lengths)
    ]
    extendable = [b for b, g in enumerate(grown) if g is not None]
    together = engine.extend_batch(
        [encoded[b][0] for b in extendable],
        [users[b][0][lengths[b] :] for b in extendable],
        [users[b][1][lengths[b] :] for b in extendable],
    )
    for b, (x, t) in enumerate(users):
        alone = engine.encode(x[: lengths[b]], t[: lengths[b]])
        cache, hidden = encoded[b]
        if lengths[b]:
            want = one_pass(engine, x[: lengths[b]], t[: lengths[b]], lengths[b], rows="history")
            torch.testing.assert_close(hidden, want[: cache.committed], rtol=0, atol=1e-5)
        for got, ref in zip((*cache.keys, *cache.values), (*alone.keys, *alone.values)):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    for (cache, hidden), b in zip(together, extendable):
        ((one_cache, one_hidden),) = grown[b]
        assert cache.length == one_cache.length == lengths[b] + added[b]
        torch.testing.assert_close(hidden, one_hidden, rtol=0, atol=1e-5)
        for got, ref in zip((*cache.keys, *cache.values), (*one_cache.keys, *one_cache.values)):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_every_tokens_output_in_one_cacheless_pass_equals_encoding_then_settling_each_user(case):
    """outputs_batch over histories of 30, 1, 12 and 5 tokens: each user's outputs are those its
    encode (then settle at its request time, for "next_event" models) gives, user by user."""
    engine = make_engine(**case)
    lengths = [30, 1, 12, 5]
    users = [tokens(n, 0, seed=s) for s, n in enumerate(lengths)]
    request_times = torch.tensor([REQUEST_TIME + 10**5 * b for b in range(len(lengths))])
    got = engine.outputs_batch(
        torch.cat([x for x, _ in users]),
        torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        torch.cat([t for _, t in users]),
        request_times,
    )
    want = []
    for (x, t), when in zip(users, request_times.tolist()):
        ((cache, hidden),) = engine.encode_batch([x], [t])
        if engine.defers_last:
            hidden = torch.cat([hidden, engine.settle(cache, when)[1]])
        want.append(hidden)
    torch.testing.assert_close(got, torch.cat(want), rtol=0, atol=1e-5)
    if engine.defers_last:
        with pytest.raises(ValueError, match="request_times"):
            engine.outputs_batch(users[0][0], torch.tensor([0, lengths[0]]), users[0][1])


def test_a_cacheless_pass_refuses_histories_beyond_max_seq_len_and_missing_timestamps():
    engine = make_engine()
    x, ts = tokens(49, 0)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.outputs_batch(x, torch.tensor([0, 49]), ts)
    with pytest.raises(ValueError, match="timestamps are required"):
        engine.outputs_batch(x[:5], torch.tensor([0, 5]), None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_extending_and_settling_in_one_pass_equals_extending_then_settling(case):
    """extend_settled_batch over users gaining 0..4 tokens, each at its own request time: the extended
    caches (the last token still pending for "next_event" models) and the settled ones equal
    extend_batch then settle_batch, the scores on them the one-pass forward, and the batch each
    user alone, to the bit."""
    engine = make_engine(**case)
    lengths, added = [30, 12, 5, 9], [4, 1, 0, 2]
    users = [tokens(n + k, 4, seed=s) for s, (n, k) in enumerate(zip(lengths, added))]
    bases = [engine.encode(x[:n], t[:n]) for (x, t), n in zip(users, lengths)]
    new_x = [x[n : n + k] for (x, _), n, k in zip(users, lengths, added)]
    new_t = [t[n : n + k] for (_, t), n, k in zip(users, lengths, added)]
    request_times = [REQUEST_TIME + 1000 * b for b in range(len(users))]
    together = engine.extend_settled_batch(bases, new_x, new_t, request_times)
    apart = engine.extend_batch(bases, new_x, new_t)
    settled_apart = engine.settle_batch([c for c, _ in apart], request_times)
    for b, (((extended, hidden), (settled, last)), (want, want_hidden), (want_settled, want_last)) in enumerate(
        zip(together, apart, settled_apart)
    ):
        assert (extended.length, extended.committed) == (want.length, want.committed)
        assert settled.pending is None and settled.length == lengths[b] + added[b]
        torch.testing.assert_close(extended.pending, want.pending, rtol=0, atol=0)
        torch.testing.assert_close(hidden, want_hidden, rtol=0, atol=1e-5)
        torch.testing.assert_close(last, want_last, rtol=0, atol=1e-5)
        for got, ref in zip((*extended.keys, *settled.keys), (*want.keys, *want_settled.keys)):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        (x, t), end = users[b], lengths[b] + added[b]
        cands_ts = torch.full((4,), request_times[b])
        scores = engine.score(settled, x[end:], cands_ts, request_time=request_times[b])
        all_ts = torch.cat([t[:end], cands_ts])
        torch.testing.assert_close(scores, one_pass(engine, x, all_ts, end, request_times[b]), rtol=0, atol=1e-5)
        [((alone, alone_hidden), (alone_settled, alone_last))] = engine.extend_settled_batch(
            [bases[b]], [new_x[b]], [new_t[b]], [request_times[b]]
        )
        assert torch.equal(hidden, alone_hidden) and torch.equal(last, alone_last)
        for got, ref in zip((*extended.keys, *settled.values), (*alone.keys, *alone_settled.values)):
            assert torch.equal(got, ref)


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_encoding_and_settling_in_one_pass_equals_encoding_then_settling(case):
    """encode_settled_batch over histories of 0..30 tokens, each at its own request time: the encoded
    caches equal encode_batch's to the bit (the pending token run beside them changes none of
    theirs), the settled caches and outputs equal settle_batch's, and the batch each user alone."""
    engine = make_engine(**case)
    lengths = [30, 0, 1, 2, 3, 12]  # 1..3 tokens: up to and past contextual_len 2 or 3
    users = [tokens(n, 0, seed=s) for s, n in enumerate(lengths)]
    request_times = [REQUEST_TIME + 1000 * b for b in range(len(users))]
    together = engine.encode_settled_batch([x for x, _ in users], [t for _, t in users], request_times)
    apart = engine.encode_batch([x for x, _ in users], [t for _, t in users])
    settled_apart = engine.settle_batch([c for c, _ in apart], request_times)
    for b, (((cache, hidden), (settled, last)), (want, want_hidden), (want_settled, want_last)) in enumerate(
        zip(together, apart, settled_apart)
    ):
        assert (cache.length, cache.committed) == (want.length, want.committed) == (lengths[b], want.committed)
        assert settled.pending is None and settled.length == lengths[b]
        assert torch.equal(hidden, want_hidden)
        for i in range(engine.config.num_layers):
            assert all(torch.equal(got, ref) for got, ref in zip(cache.layer(i), want.layer(i)))
            for got, ref in zip(settled.layer(i), want_settled.layer(i)):
                torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(last, want_last, rtol=0, atol=1e-5)
        [((alone, alone_hidden), (alone_settled, alone_last))] = engine.encode_settled_batch(
            [users[b][0]], [users[b][1]], [request_times[b]]
        )
        assert torch.equal(hidden, alone_hidden) and torch.equal(last, alone_last)
        assert all(torch.equal(got, ref) for got, ref in zip(settled.layer(0), alone_settled.layer(0)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_encoding_and_scoring_in_one_pass_equals_the_one_pass_forward_and_keeps_the_encoded_caches(case):
    """encode_scored_batch over histories of 0..30 tokens with 0..5 candidates each: the encoded and
    settled caches are encode_settled_batch's (the encoded ones to the bit), each user's candidate
    outputs those of scoring its settled cache in a pass of their own and, past contextual_len, of
    the one-pass target-aware forward, and the batch each user alone, to the bit."""
    engine = make_engine(**case)
    lengths, counts = [30, 0, 2, 3, 12], [5, 2, 3, 0, 1]  # 2, 3 tokens: up to and past contextual_len
    users = [tokens(n, k, seed=s) for s, (n, k) in enumerate(zip(lengths, counts))]
    request_times = [REQUEST_TIME + 1000 * b for b in range(len(users))]
    histories = [(x[:n], t[:n]) for (x, t), n in zip(users, lengths)]
    candidates = [(x[n:], torch.full((k,), when)) for (x, _), n, k, when in zip(users, lengths, counts, request_times)]
    together = engine.encode_scored_batch(
        [x for x, _ in histories], [t for _, t in histories], request_times, candidates
    )
    settled_only = engine.encode_settled_batch([x for x, _ in histories], [t for _, t in histories], request_times)
    for b, ((encoded, settled, scored), (want_encoded, want_settled)) in enumerate(zip(together, settled_only)):
        (cache, hidden), (want, want_hidden) = encoded, want_encoded
        assert torch.equal(hidden, want_hidden) and cache.length == want.length == lengths[b]
        for i in range(engine.config.num_layers):
            assert all(torch.equal(got, ref) for got, ref in zip(cache.layer(i), want.layer(i)))
        torch.testing.assert_close(settled[1], want_settled[1], rtol=0, atol=1e-5)
        (x, t), (cx, ct) = histories[b], candidates[b]
        assert scored.shape == (counts[b], engine.config.hidden_dim)
        two_passes = engine.score(want_settled[0], cx, ct, request_time=request_times[b])
        torch.testing.assert_close(scored, two_passes, rtol=0, atol=1e-5)
        if lengths[b] > engine.config.contextual_len:  # shorter: its contextual tokens see the later ones in one pass
            reference = one_pass(engine, torch.cat([x, cx]), torch.cat([t, ct]), lengths[b], request_times[b])
            torch.testing.assert_close(scored, reference, rtol=0, atol=1e-5)
        [(_, _, alone)] = engine.encode_scored_batch([x], [t], [request_times[b]], [candidates[b]])
        assert torch.equal(scored, alone)
