"""The tiers behind each worker's user cache: encoded histories kept where other workers can fetch
them instead of encoding them again.

A worker looks for a user's encoded history in its own cache first (tier "local"), then in the
server's shared tier ("shared": an SQLite file in shared memory that every worker process of one
``gr serve`` opens, ``SqliteTier``), then in the remote tier ("remote": Redis, shared by servers on
several machines, ``gr.serving.redis_tier``). A fetched entry whose history is a prefix of the
request's is extended with the rest, as a cached one is: the answers equal encoding from scratch,
bit for bit (the entry holds the very K/V bytes the encoding computed).

An entry is one user's ``UserState`` in one blob (``pack_state``): a header (JSON: format, model
version, user, the digest of the history it encodes, its length and every array's dtype and
shape), the arrays' raw bytes (per layer K and V of the committed tokens, the pending inputs, the
output at the last token) and a CRC-32 of all that; no pickle. It is keyed by the model version
(``tier_version``: the export's MANIFEST digest, the device and the dtype) and the user; its header
names the digest of the history it encodes, checked against the request's history. A blob that is
short, corrupt (CRC), of another model or user, or of a history that is not a prefix of the
request's, is a miss (counted by reason), never an answer.

Policy (``TieredCache``): a fresh encoding of at least ``min_tokens`` tokens is written through to
every tier (another worker may get the user's next request), and an entry that the local cache
evicts is written back when it holds more tokens than the tiers do (the user's next request
fetches it); both are written by the worker's tier writer (``gr.serving.tier_writer``), never in
the request. Histories shorter than ``min_tokens`` are neither stored nor fetched: under that
length encoding costs less than fetching (``bench/serving_tier.py`` measures both). A reload that
invalidates the cache moves to a new model version and purges the old one from every tier.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import struct
import threading
import time
import warnings
import zlib
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, Hashable, Iterator, List, Optional, Protocol, Sequence, Tuple, Union, cast

import numpy as np
import torch
from torch import Tensor

from gr.hstu.cache import CachedHSTU, HistoryCache
from gr.hstu.user_state import Tokens, UserState
from gr.serving.options import DEFAULT_TIER_MIN_TOKENS
from gr.serving.tier_writer import BackgroundWriter
from gr.serving.user_cache import UserCache
from gr.timestamps import TIMESTAMPS

FORMAT = 1
MAGIC = b"GRKVTIER"
_HEAD = struct.Struct("<8sI")  # magic, header bytes
_CRC = struct.Struct("<I")  # CRC-32 of everything before it
BUSY_TIMEOUT_S = 5.0  # how long a shared-tier writer waits for another worker's transaction
# The shared tier's SQLite pages (entries of 0.1-100 MB: large pages make short overflow chains) and
# how much of its file a connection maps; bench/serving_tier.py's line section times fetches with them.
PAGE_BYTES = 65536
MMAP_BYTES = 2**31
MISS_REASONS = ("absent", "other_history", "corrupt", "unreachable")
CLOSE_TIMEOUT_S = 5.0  # how long closing a worker's cache writes what its writer has queued


class TierError(RuntimeError):
    """A tier could not be read or written (unreachable, locked past its timeout): the request goes on without it."""


class TierStore(ABC):
    """Blobs by key, bounded in bytes; ``name``: the tier ("shared" or "remote") in metrics."""

    name = "shared"

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the entries are kept (a file, a Redis URL without its password), for the start-up line."""

    @abstractmethod
    def get(self, version: str, user: str) -> Optional[bytes]:
        """The blob of ``user`` under model ``version`` (None: none); TierError when unreachable."""

    @abstractmethod
    def put(self, version: str, user: str, blob: bytes) -> None:
        """Store (replace) the blob of ``user`` under model ``version``; TierError when unreachable."""

    @abstractmethod
    def touch(self, version: str, user: str) -> None:
        """Mark the entry of ``user`` under model ``version`` used now (``get`` only reads: a fetch
        marks it from the tier writer's thread); TierError when unreachable."""

    @abstractmethod
    def purge(self, version: str) -> None:
        """Drop every entry of model ``version``; TierError when unreachable."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection (the entries stay)."""


class SqliteTier(TierStore):
    """The shared tier of one server: entries in one SQLite file (WAL), which every worker process
    opens (put it in shared memory: ``/dev/shm``). One transaction stores an entry, adds its bytes
    to the count the file keeps and evicts the least recently fetched or stored entries past
    ``max_bytes``, so the bound and the LRU order hold across processes without a lock protocol of
    ours, and a reader sees a whole entry or none (an entry larger than ``max_bytes`` is not
    stored). Each thread has a connection of its own: a read (WAL) never waits for a write, not
    even one of its own process."""

    name = "shared"

    def __init__(self, path: Union[str, Path], max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"SqliteTier.max_bytes: expected >= 1, got {max_bytes}")
        self.path, self.max_bytes = Path(path), int(max_bytes)
        self._lock = threading.Lock()  # guards the list of connections
        self._connections: List[sqlite3.Connection] = []
        self._local = threading.local()  # this thread's connection
        try:
            db = self._db()
            db.execute(f"PRAGMA page_size={PAGE_BYTES}")  # before the first table: a new file's pages
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(
                "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, version TEXT NOT NULL, "
                "bytes INTEGER NOT NULL, blob BLOB NOT NULL);"
                "CREATE INDEX IF NOT EXISTS entries_version ON entries (version);"
                # when each entry was last stored or fetched, apart: an UPDATE rewrites the whole row, blob included
                "CREATE TABLE IF NOT EXISTS used (key TEXT PRIMARY KEY, at INTEGER NOT NULL);"
                "CREATE INDEX IF NOT EXISTS used_at ON used (at);"
                "CREATE TABLE IF NOT EXISTS held (id INTEGER PRIMARY KEY CHECK (id = 0), bytes INTEGER NOT NULL);"
                "INSERT OR IGNORE INTO held VALUES (0, 0);"
            )
        except sqlite3.Error as exc:
            raise TierError(f"shared tier {self.path}: {exc}") from None

    @property
    def location(self) -> str:
        return str(self.path)

    def get(self, version: str, user: str) -> Optional[bytes]:
        """The blob (a read only: ``touch`` marks it used)."""
        row = self._run("get", "SELECT blob FROM entries WHERE key = ?", (_key(version, user),))
        return None if row is None else bytes(row[0])

    def touch(self, version: str, user: str) -> None:
        self._run("touch", "UPDATE used SET at = ? WHERE key = ?", (time.time_ns(), _key(version, user)))

    def put(self, version: str, user: str, blob: bytes) -> None:
        key, size = _key(version, user), len(blob)
        with self._transaction("put") as db:
            held = db.execute("SELECT bytes FROM held").fetchone()[0]
            old_size = db.execute("SELECT bytes FROM entries WHERE key = ?", (key,)).fetchone()
            if old_size is not None:
                db.execute("DELETE FROM entries WHERE key = ?", (key,))
                db.execute("DELETE FROM used WHERE key = ?", (key,))
                held -= old_size[0]
            if size <= self.max_bytes:
                dropped = []
                oldest = "SELECT used.key, bytes FROM used JOIN entries USING (key) ORDER BY at"
                for old, old_size in db.execute(oldest):
                    if held + size <= self.max_bytes:
                        break
                    dropped.append((old,))
                    held -= old_size
                db.executemany("DELETE FROM entries WHERE key = ?", dropped)
                db.executemany("DELETE FROM used WHERE key = ?", dropped)
                db.execute("INSERT INTO entries VALUES (?, ?, ?, ?)", (key, version, size, blob))
                db.execute("INSERT INTO used VALUES (?, ?)", (key, time.time_ns()))
                held += size
            db.execute("UPDATE held SET bytes = ?", (held,))

    def purge(self, version: str) -> None:
        with self._transaction("purge") as db:
            db.execute("DELETE FROM used WHERE key IN (SELECT key FROM entries WHERE version = ?)", (version,))
            db.execute("DELETE FROM entries WHERE version = ?", (version,))
            db.execute("UPDATE held SET bytes = (SELECT COALESCE(SUM(bytes), 0) FROM entries)")

    def nbytes(self) -> int:
        """Bytes of the entries held (counted as they are stored and evicted)."""
        row = self._run("size", "SELECT bytes FROM held", ())
        return 0 if row is None else int(row[0])

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for db in connections:
            db.close()

    def _db(self) -> sqlite3.Connection:
        """This thread's connection (opened on its first call)."""
        db: Optional[sqlite3.Connection] = getattr(self._local, "db", None)
        if db is None:
            # check_same_thread off: close() closes every thread's connection
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA synchronous=OFF")  # in memory, for the server's lifetime: nothing to make durable
            db.execute(f"PRAGMA mmap_size={MMAP_BYTES}")  # reads of the file map it instead of read() calls
            with self._lock:
                self._connections.append(db)
            self._local.db = db
        return db

    @contextmanager
    def _transaction(self, what: str) -> Iterator[sqlite3.Connection]:
        """This thread's connection in one write transaction (committed, or rolled back when the
        block fails); TierError naming ``what`` when SQLite fails (e.g. locked past its timeout)."""
        try:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise TierError(f"shared tier {self.path}: {what}: {exc}") from None

    def _run(self, what: str, sql: str, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
        try:
            return self._db().execute(sql, args).fetchone()
        except sqlite3.Error as exc:
            raise TierError(f"shared tier {self.path}: {what}: {exc}") from None


def _key(version: str, user: str) -> str:
    return f"{version}:{user}"


def user_key(user_id: Hashable) -> str:
    """A user's key: its JSON, so that the user 7 and the user "7" stay two users."""
    return json.dumps(user_id)


def tier_version(identity: str, engine: CachedHSTU) -> str:
    """The model version entries are keyed by: the export's identity, and the device type and dtype
    the engine computes K/V in (a CPU and a GPU encoding of one export differ in their last bits)."""
    dtype = str(next(engine.hstu.parameters()).dtype).removeprefix("torch.")
    return f"{identity}-{engine.device.type}-{dtype}"


def history_digest(tokens: Tokens, length: int) -> str:
    """The digest of a history's first ``length`` tokens: every feature's name, dtype, shape and values."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tokens):
        column = np.ascontiguousarray(tokens[name][:length])
        digest.update(f"{name}|{column.dtype.str}|{column.shape}|".encode())
        digest.update(column.tobytes())
    return digest.hexdigest()


# ---- one entry: a UserState as one blob ---------------------------------------------------
def pack_state(state: UserState, version: str, user: str) -> bytes:
    """``state`` as a tier entry (see the module docstring): its K/V read once from its tensors or pages."""
    cache = state.cache
    layers = len(cache.keys) if cache.paged is None else len(cache.paged.pool.keys)
    arrays: List[Tuple[str, Tensor]] = []
    for i in range(layers):
        k, v = cache.layer(i)
        arrays += [(f"k{i}", k[:, : cache.committed]), (f"v{i}", v[:, : cache.committed])]
    if cache.pending is not None:
        arrays.append(("pending", cache.pending))
    if state.last_hidden is not None:
        arrays.append(("last_hidden", state.last_hidden))
    flat = [t.detach().to("cpu").contiguous().reshape(-1) for _, t in arrays]
    header = {
        "format": FORMAT,
        "version": version,
        "user": user,
        "history": history_digest(state.tokens, state.length),
        "length": state.length,
        "committed": cache.committed,
        "arrays": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in arrays],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join([_HEAD.pack(MAGIC, len(head)), head, *(t.view(torch.uint8).numpy().tobytes() for t in flat)])
    return body + _CRC.pack(zlib.crc32(body))


def unpack_state(
    blob: bytes, version: str, user: str, tokens: Tokens, model_version: int, engine: CachedHSTU
) -> Tuple[Optional[UserState], str]:
    """The state a tier entry holds, for a request whose history is ``tokens`` -> (state, "") or
    (None, reason): "corrupt" (short, CRC, header or arrays not of ``engine``'s shape and dtype, or
    another model version or user) or "other_history" (its history is not a prefix of ``tokens``).
    The K/V go into ``engine``'s page pool when it has one (and room), else into their own tensors."""
    header = _header(blob, version, user)
    if header is None:
        return None, "corrupt"
    length, committed = header["length"], header["committed"]
    if not 0 <= length <= len(tokens[TIMESTAMPS]):
        return None, "other_history"
    if header["history"] != history_digest(tokens, length):
        return None, "other_history"
    arrays = _arrays(blob, header, _HEAD.size + header["_head"])
    if arrays is None or not _fits(engine, arrays, length, committed):
        return None, "corrupt"
    device, layers = engine.device, engine.config.num_layers

    def kept(name: str) -> Optional[Tensor]:  # an array the state keeps: a copy, never a view of the blob
        return None if name not in arrays else arrays[name].to(device, copy=True)

    timestamps = torch.from_numpy(tokens[TIMESTAMPS][:length]).to(device=device, dtype=torch.long)
    paged = None
    if engine.pool is not None:  # the pages take copies of the K/V
        keys = [arrays[f"k{i}"].to(device) for i in range(layers)]
        paged = engine.pool.store(keys, [arrays[f"v{i}"].to(device) for i in range(layers)])
    if paged is not None:
        cache = HistoryCache((), (), timestamps, kept("pending"), paged)
    else:
        own = [cast(Tensor, kept(f"{kind}{i}")) for kind in "kv" for i in range(layers)]
        cache = HistoryCache(tuple(own[:layers]), tuple(own[layers:]), timestamps, kept("pending"))
    prefix = {name: column[:length] for name, column in tokens.items()}
    return UserState(prefix, cache, model_version, kept("last_hidden")), ""


def _header(blob: bytes, version: str, user: str) -> Optional[Dict[str, Any]]:
    """The entry's header when its frame, CRC, format, version and user are right (else None)."""
    if len(blob) < _HEAD.size + _CRC.size:
        return None
    magic, size = _HEAD.unpack_from(blob)
    if magic != MAGIC or _HEAD.size + size + _CRC.size > len(blob):
        return None
    if zlib.crc32(memoryview(blob)[: -_CRC.size]) != _CRC.unpack_from(blob, len(blob) - _CRC.size)[0]:
        return None
    try:
        header = json.loads(blob[_HEAD.size : _HEAD.size + size])
    except ValueError:
        return None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        return None
    if header.get("version") != version or header.get("user") != user or not isinstance(header.get("arrays"), list):
        return None
    if not isinstance(header.get("history"), str) or not all(
        type(header.get(k)) is int for k in ("length", "committed")
    ):
        return None
    return {**header, "_head": size}


def _arrays(blob: bytes, header: Dict[str, Any], offset: int) -> Optional[Dict[str, Tensor]]:
    """The entry's arrays, or None when they do not fill it exactly: views of the blob itself (no
    copy of an entry of up to ~100 MB), which must not be written to; what a state keeps of them is
    copied (``unpack_state``)."""
    end = len(blob) - _CRC.size
    out: Dict[str, Tensor] = {}
    try:
        with warnings.catch_warnings():  # read only (torch cannot mark it): unpack_state copies what it keeps
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            for name, dtype_name, shape in header["arrays"]:
                dtype = getattr(torch, dtype_name)
                if not isinstance(dtype, torch.dtype) or not all(type(s) is int and s >= 0 for s in shape):
                    return None
                count = math.prod(shape)
                size = count * dtype.itemsize
                if offset + size > end:
                    return None
                flat = (
                    torch.frombuffer(blob, dtype=dtype, count=count, offset=offset)
                    if count
                    else torch.empty(0, dtype=dtype)
                )
                out[name] = flat.reshape(shape)
                offset += size
    except (TypeError, ValueError, AttributeError):
        return None
    return out if offset == end else None


def _fits(engine: CachedHSTU, arrays: Dict[str, Tensor], length: int, committed: int) -> bool:
    """Whether the arrays are a state of ``length`` tokens that ``engine`` computes: its layers, heads,
    dims and dtype, and as many committed tokens as it commits."""
    c = engine.config
    dtype = next(engine.hstu.parameters()).dtype
    want = length - 1 if engine.defers_last and length else length
    if committed != want:
        return False
    shapes: Dict[str, Tuple[int, ...]] = {f"k{i}": (c.num_heads, want, c.attention_dim) for i in range(c.num_layers)}
    shapes.update({f"v{i}": (c.num_heads, want, c.linear_dim) for i in range(c.num_layers)})
    if length > want:
        shapes["pending"] = (length - want, c.hidden_dim)
    if length and not engine.defers_last:
        shapes["last_hidden"] = (c.hidden_dim,)
    return set(arrays) == set(shapes) and all(
        tuple(arrays[name].shape) == shape and arrays[name].dtype == dtype for name, shape in shapes.items()
    )


# ---- the user cache in front of the tiers ---------------------------------------------------
class TierObserver(Protocol):
    """What the server's metrics count (``gr.serving.metrics.ServerMetrics``); the writes' calls
    come from the tier writer's thread."""

    def tier_fetched(self, tier: str, seconds: float, reason: str) -> None:
        """One fetch from ``tier``: reason "" (a hit) or a miss's (``MISS_REASONS``)."""

    def tier_stored(self, tier: str, seconds: float, failed: bool) -> None:
        """One entry written to ``tier``."""

    def tier_write_dropped(self, reason: str, count: int) -> None:
        """``count`` writes dropped before reaching the tiers (``gr.serving.tier_writer.DROP_REASONS``)."""

    def encoded(self, tier: Optional[str], recomputed: int) -> None:
        """One request's history: the tier its state came from (None: encoded from scratch) and the
        tokens it encoded."""


@dataclass(frozen=True, eq=False)
class _Write:
    """One write the tier writer does: ``state`` (packed there) or ``blob`` to ``tiers`` under
    ``version`` (the tiers' key) and ``model_version`` (the cache's), or with ``touch`` the mark
    that ``user``'s entry in ``tiers[0]`` was used."""

    tiers: Tuple[TierStore, ...]
    version: str
    user: str
    model_version: int
    state: Optional[UserState] = None
    blob: Optional[bytes] = None
    touch: bool = False


class TieredCache(UserCache[UserState]):
    """A worker's user cache (``UserCache``, the "local" tier) in front of ``tiers`` (nearest first):
    ``fetch`` looks a history up in them, ``share`` writes an entry to them, and an entry the LRU
    evicts is written back (see the module docstring). ``version``: the model version entries are
    keyed by; after ``invalidate``, ``purge_retired`` purges the old one from every tier. A tier
    that fails is a miss, never a failed request.

    Every write goes through a ``BackgroundWriter`` (a thread of the worker's, started by the first
    write), so no request waits for one; its queue holds at most ``queue_bytes`` (default half of
    ``max_bytes``) of the entries' bytes, past which a write is dropped and counted (a dropped fresh
    entry is written back when the LRU evicts it). An evicted
    entry's K/V are copied out of the page pool before they are queued (the pool gets its pages at
    once); a queued fresh one keeps its pages until written. A write queued before a reload that
    invalidates is never written (``invalidate`` drops the queue, and the writer checks the model
    version again under the lock ``purge_retired`` takes). ``flush`` waits for the writes queued;
    ``close`` writes what it can in ``CLOSE_TIMEOUT_S`` and drops the rest."""

    def __init__(
        self,
        max_bytes: int,
        tiers: Sequence[TierStore] = (),
        min_tokens: int = DEFAULT_TIER_MIN_TOKENS,
        version: str = "",
        queue_bytes: Optional[int] = None,
    ) -> None:
        super().__init__(max_bytes)
        if min_tokens < 1:
            raise ValueError(f"TieredCache.min_tokens: expected >= 1, got {min_tokens}")
        self.tiers = list(tiers)
        self.min_tokens = min_tokens
        self.observer: Optional[TierObserver] = None
        self._version = version
        self._shared: Dict[Hashable, int] = {}  # user -> tokens the tiers hold of it (users this worker saw)
        self._retired: List[str] = []  # keys of models replaced, their entries not yet purged
        self._writing = threading.Lock()  # held by a write from its version check to its end, and by purges
        self.writer: BackgroundWriter[_Write] = BackgroundWriter(
            self._write, self.max_bytes // 2 if queue_bytes is None else queue_bytes, self._observe_drop
        )

    @property
    def version(self) -> str:
        with self._lock:
            return self._version

    def fetch(
        self, user_id: Hashable, tokens: Tokens, model_version: int, engine: CachedHSTU
    ) -> Optional[Tuple[UserState, str]]:
        """The user's state from the nearest tier holding a prefix of ``tokens`` -> (state, tier
        name), or None (a history shorter than ``min_tokens``, or no tier holds one). An entry from
        a farther tier is copied into the nearer ones, and the tier it came from marks it used (both
        by the writer)."""
        if not self.tiers or len(tokens[TIMESTAMPS]) < self.min_tokens:
            return None
        with self._lock:
            if model_version != self._model_version:
                return None
            version = self._version
        user = user_key(user_id)
        for depth, tier in enumerate(self.tiers):
            started = time.perf_counter()
            try:
                blob = tier.get(version, user)
                state, reason = (
                    (None, "absent")
                    if blob is None
                    else unpack_state(blob, version, user, tokens, model_version, engine)
                )
            except TierError:
                state, reason = None, "unreachable"
            self._observe_fetch(tier.name, time.perf_counter() - started, reason)
            if state is not None:
                assert blob is not None  # a state comes from a blob
                self.writer.submit(_Write((tier,), version, user, model_version, touch=True), 0)
                if depth:
                    self.writer.submit(
                        _Write(tuple(self.tiers[:depth]), version, user, model_version, blob=blob), len(blob)
                    )
                with self._lock:
                    self._shared[user_id] = state.length
                return state, tier.name
        return None

    def share(self, user_id: Hashable, state: UserState, fresh: bool = False) -> None:
        """Queue ``state``'s write to every tier when it holds ``min_tokens`` or more, and more tokens
        than they hold of the user or ``fresh`` (a new encoding: what they hold did not serve),
        unless a reload made it stale."""
        self._share(user_id, state, fresh, copy=False)

    def encoded(self, tier: Optional[str], recomputed: int) -> None:
        """Count one request's history: the tier its state came from and the tokens it encoded."""
        if self.observer is not None:
            self.observer.encoded(tier, recomputed)

    def evicted(self, entries: List[Tuple[Hashable, UserState]]) -> None:
        for user_id, state in entries:
            self._share(user_id, state, fresh=False, copy=True)  # its pages go back to the pool now
            with self._lock:
                self._shared.pop(user_id, None)

    def discard(self, user: Hashable) -> None:
        super().discard(user)
        with self._lock:
            self._shared.pop(user, None)

    def invalidate(self, model_version: Optional[int] = None, version: Optional[str] = None) -> None:
        """Drop every entry and every queued write; the model version becomes ``model_version``
        (default: one more) and the tiers' key ``version`` (default: unchanged). The old key's
        entries are purged from every tier by the next ``purge_retired`` (outside the caller's
        locks: a purge of a large tier takes a while)."""
        with self._lock:
            self._retired.append(self._version)
            self._shared.clear()
            if version is not None:
                self._version = version
        super().invalidate(model_version)
        self.writer.discard()

    def purge_retired(self) -> None:
        """Purge the entries of every key ``invalidate`` retired from every tier."""
        with self._lock:
            retired, self._retired = self._retired, []
        with self._writing:  # a write that checked its version before the reload ends first
            for version in retired:
                for tier in self.tiers:
                    try:
                        tier.purge(version)
                    except TierError:
                        self._observe_store(tier.name, 0.0, True)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every write queued so far is done -> False when ``timeout`` seconds passed first."""
        return self.writer.flush(timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued (for at most ``timeout`` seconds; the rest is dropped), then close
        every tier's connection."""
        self.writer.close(timeout)
        for tier in self.tiers:
            tier.close()

    def _share(self, user_id: Hashable, state: UserState, fresh: bool, copy: bool) -> None:
        """``share``; copy: queue a copy of a paged state's K/V (its pages stay free to reuse)."""
        if not self.tiers or state.length < self.min_tokens:
            return
        with self._lock:
            stale = state.model_version != self._model_version
            if stale or (not fresh and self._shared.get(user_id, 0) >= state.length):
                return
            version = self._version
        if copy and state.cache.paged is not None:
            state = replace(state, cache=state.cache.unpaged())
        write = _Write(tuple(self.tiers), version, user_key(user_id), state.model_version, state=state)
        if self.writer.submit(write, state.nbytes):  # a dropped write leaves the entry to its write-back
            with self._lock:
                self._shared[user_id] = state.length

    def _write(self, write: _Write) -> None:
        """One queued write (in the writer's thread): dropped ("stale") when a reload came since."""
        if write.touch:
            try:
                write.tiers[0].touch(write.version, write.user)
            except TierError:
                pass  # the entry keeps its place in the LRU order: nothing to count
            return
        blob = write.blob
        if blob is None:
            assert write.state is not None  # a write holds a state or a blob
            blob = pack_state(write.state, write.version, write.user)
        with self._writing:
            with self._lock:
                stale = write.model_version != self._model_version or write.version != self._version
            if stale:
                self._observe_drop("stale", 1)
                return
            for tier in write.tiers:
                started, failed = time.perf_counter(), False
                try:
                    tier.put(write.version, write.user, blob)
                except TierError:
                    failed = True
                self._observe_store(tier.name, time.perf_counter() - started, failed)

    def _observe_fetch(self, tier: str, seconds: float, reason: str) -> None:
        if self.observer is not None:
            self.observer.tier_fetched(tier, seconds, reason)

    def _observe_store(self, tier: str, seconds: float, failed: bool) -> None:
        if self.observer is not None:
            self.observer.tier_stored(tier, seconds, failed)

    def _observe_drop(self, reason: str, count: int) -> None:
        if self.observer is not None:
            self.observer.tier_write_dropped(reason, count)
