"""The shared tier: fetching an encoded history against encoding it, and Zipf traffic over two workers.

The ML-1M recipe's HSTU shape (``configs/ml1m_hstu.yaml``: hidden 50, 2 layers, 1 head, next-event
query times), K/V in pages of ``--page-size`` tokens. Two in-process workers (not two server
processes: on 2 shared cores their scheduling would swamp the numbers), each its own engine, page
pool and user cache (``gr.serving.shared_tier.TieredCache``), run the serving runtime's encoding
path (``gr.serving.encode.encode``) and score ``--candidates`` candidates a request as ranking
does (in the pass that encodes a missed history, else ``CachedHSTU.score_batch``); tokens are
embedded by a table lookup instead of the export's ONNX slices, which cost the same with or without
the tier.

  line: per shape (the recipe's; a production-like one: hidden 512, 8 layers, 4 heads of 128 + 128)
      and history length L, a request bringing 4 new actions to a history of L tokens: encoded whole
      (a miss) against fetched from the shared tier (``SqliteTier`` in /dev/shm: read, check, unpack
      into the page pool) and extended, each settled at the request's time as the serving runtime
      settles it; the shortest L from which fetching is cheaper is where ``--tier-min-tokens``
      belongs for that shape.
  zipf: ``--zipf-shape``'s HSTU (the recipe's by default), ``--users`` users, histories of
      ``--min-history``..``--max-history`` tokens, each user's history encoded once first (a
      server that has run a while); then ``--requests`` requests,
      users drawn from Zipf(1.0), each bringing 1-4 new actions and landing on a random worker; each
      worker's pool (and cache bound) a quarter of the working set (every user's encoded history);
      the tier takes histories of ``--tier-min-tokens`` or more (default auto: the line measured on
      the first worker's engine and tier as ``gr serve`` measures it, ``gr.serving.tier_line``).
      Without the tier against with it (the same requests, taking turns request by request): history
      tokens encoded per request, p50/p99 latency per request, where each history came from, and
      the CPU time each worker's tier writer thread spent a request (its writes are waited for
      between requests, outside the timing: they run beside requests, not in them).

Run: ``.venv/bin/python bench/serving_tier.py`` (several minutes on 2 cores). ``--clock thread`` (the
default) runs torch on one thread and times its CPU time (the tier's SQLite runs in that thread too),
which other processes barely skew. ``--smoke``: tiny sizes. Last line: one JSON object with keys
bench, clock, cpu, load_average, line, zipf.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402
from _host import load_average  # noqa: E402
from serving_state import measuring, shape  # noqa: E402

from gr.hstu import HSTU
from gr.hstu.cache import CachedHSTU, HistoryCache, cache_bytes_per_token
from gr.hstu.paged import PagePool
from gr.serving import encode
from gr.serving.history import History
from gr.serving.options import DEFAULT_MICRO_BATCH
from gr.serving.shared_tier import SqliteTier, TieredCache
from gr.serving.tier_line import TierLine, measure_tier_line
from gr.serving.tier_spec import tier_directory
from gr.serving.user_cache import kept_bytes
from gr.timestamps import TIMESTAMPS

ITEMS = 10_000
STEP_S = 60  # seconds between a user's actions


class Tally:
    """A TierObserver: where each history came from and the tokens each request encoded."""

    def __init__(self) -> None:
        self.sources: Counter = Counter()
        self.recomputed: List[int] = []
        self.misses: Counter = Counter()

    def tier_fetched(self, tier: str, seconds: float, reason: str) -> None:
        if reason:
            self.misses[reason] += 1

    def tier_stored(self, tier: str, seconds: float, failed: bool) -> None:
        pass

    def tier_write_dropped(self, reason: str, count: int) -> None:
        self.misses[f"write_dropped_{reason}"] += count

    def encoded(self, tier: Optional[str], recomputed: int) -> None:
        self.sources[tier or "encoded"] += 1
        self.recomputed.append(recomputed)


class Worker:
    """One worker: its engine (the shared HSTU weights, a page pool of its own) and user cache."""

    def __init__(self, hstu: HSTU, table: torch.Tensor, max_bytes: int, page_size: int, tiers, min_tokens: int):
        pool = PagePool.of_bytes(hstu.config, max_bytes, page_size)
        self.engine = CachedHSTU(hstu, pool)
        self.cache = TieredCache(max_bytes, tiers, min_tokens, version="bench")
        pool.on_full = self.cache.evict_oldest
        self.tally = Tally()
        self.cache.observer = self.tally
        self.model = SimpleNamespace(
            engine=self.engine, embed_tokens=lambda tokens: table[torch.from_numpy(tokens["item_id"])]
        )

    def history(self, user: int, tokens: Dict[str, np.ndarray]) -> History:
        return History(self.model, 0, user, tokens, {}, 0, None, "error")  # type: ignore[arg-type]

    def settled(self, user: int, tokens: Dict[str, np.ndarray]) -> HistoryCache:
        """The user's history through the cache and tiers, settled at the request's time (a minute
        after its last action) as the serving runtime settles it."""
        request_time = int(tokens[TIMESTAMPS][-1]) + STEP_S
        [encoded] = encode.encode(self.cache, [self.history(user, tokens)], request_times=[request_time])
        [(settled, _)] = encode.settled([encoded], [request_time])
        return settled

    def serve(self, user: int, tokens: Dict[str, np.ndarray], candidates: torch.Tensor) -> None:
        """One request as the runtime ranks it: the user's history through the cache and tiers, its
        candidates run in the pass that encodes a missed history, else scored against the settled cache."""
        request_time = int(tokens[TIMESTAMPS][-1]) + STEP_S
        times = torch.full((len(candidates),), request_time, dtype=torch.long)
        history, aims = self.history(user, tokens), [(candidates, times)]
        [encoded] = encode.encode(
            self.cache, [history], request_times=[request_time], targets=aims, max_targets=DEFAULT_MICRO_BATCH
        )
        if encoded.scored is None:
            [(settled, _)] = encode.settled([encoded], [request_time])
            offsets = torch.tensor([0, len(candidates)])
            self.engine.score_batch([settled], candidates, offsets, times, DEFAULT_MICRO_BATCH, [request_time])

    def written(self) -> float:
        """Wait for the tier writes queued so far -> the CPU seconds the writer's thread has spent."""
        self.cache.flush()
        thread = self.cache.writer.thread
        return 0.0 if thread is None or thread.ident is None else thread_seconds(thread.ident)


def thread_seconds(ident: int) -> float:
    """The CPU seconds thread ``ident`` (``threading.Thread.ident``) has spent."""
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def user_tokens(user: int, length: int, seed: int) -> Dict[str, np.ndarray]:
    """User ``user``'s first ``length`` actions (the same every call)."""
    rng = np.random.default_rng([seed, user])
    items = rng.integers(1, ITEMS, size=length, dtype=np.int64)
    return {"item_id": items, TIMESTAMPS: 1_000_000 + np.arange(length, dtype=np.int64) * STEP_S}


def line_section(args: argparse.Namespace, name: str, directory: Path, clock: Callable[[], float]) -> Dict:
    """Per history length L, a request that brings 4 new actions to a history of L: encoded whole
    (a miss, the tier looked up first) against fetched from the shared tier and extended."""
    config = shape(name, max(args.line_lengths) + 8)
    torch.manual_seed(args.seed)
    hstu = HSTU(config).eval()
    table = torch.randn(ITEMS, config.hidden_dim)
    tier = SqliteTier(directory / f"line-{name}.sqlite", 2**34)
    room = 2 * (max(args.line_lengths) + 8) * cache_bytes_per_token(config) + 2**20
    writer = Worker(hstu, table, room, args.page_size, [tier], 1)
    reader = Worker(hstu, table, room, args.page_size, [tier], 1)
    rows = {}
    print(f"{name}: hidden {config.hidden_dim}, {config.num_layers} layers, {config.num_heads} heads")
    print(f"{'L':>6} {'encode ms':>10} {'fetch+extend ms':>16} {'ratio':>6}")
    for length in args.line_lengths:
        encode_s, fetch_s = [], []
        for rep in range(args.line_reps + 1):
            user = 2 * (length * 1000 + rep)
            tokens = user_tokens(user, length + 4, args.seed)
            encode.encode(writer.cache, [writer.history(user, {k: v[:length] for k, v in tokens.items()})])
            writer.cache.flush()  # written through to the tier
            writer.cache.discard(user)
            started = clock()
            reader.settled(user + 1, tokens)  # not in the tier: encoded
            encoded = clock() - started
            reader.cache.flush()  # its write-through, off the request's path
            started = clock()
            reader.settled(user, tokens)  # fetched, extended by 4
            fetched = clock() - started
            reader.cache.flush()
            reader.cache.discard(user)
            reader.cache.discard(user + 1)
            if rep:  # the first is a warm-up
                encode_s.append(encoded)
                fetch_s.append(fetched)
        enc, fet = 1e3 * statistics.median(encode_s), 1e3 * statistics.median(fetch_s)
        rows[length] = {"encode_ms": round(enc, 3), "fetch_extend_ms": round(fet, 3), "ratio": round(enc / fet, 2)}
        print(f"{length:>6} {enc:>10.3f} {fet:>16.3f} {enc / fet:>6.2f}")
    assert reader.tally.sources["shared"] == len(args.line_lengths) * (args.line_reps + 1)
    cheaper = [length for length, row in rows.items() if row["ratio"] > 1]
    tier.close()
    return {
        "model": {k: getattr(config, k) for k in ("hidden_dim", "num_layers", "num_heads", "attention_dim")},
        "per_length": {f"L{length}": row for length, row in rows.items()},
        "fetch_cheaper_from": min(cheaper) if cheaper else None,
    }


def line_costs(line: TierLine) -> Dict[str, Dict[str, float]]:
    """A measured tier line's costs in ms by history length, for the JSON line."""
    return {
        f"L{length}": {"encode_ms": round(1e3 * e, 3), "fetch_extend_ms": round(1e3 * f, 3)}
        for length, (e, f) in sorted(line.costs.items())
    }


def zipf_users(users: int, requests: int, rng: np.random.Generator) -> np.ndarray:
    """``requests`` user ids from Zipf(1.0) over ``users`` users (user 0 the most frequent)."""
    weights = 1.0 / np.arange(1, users + 1)
    return rng.choice(users, size=requests, p=weights / weights.sum())


def zipf_section(
    args: argparse.Namespace, hstu: HSTU, table: torch.Tensor, directory: Path, clock: Callable[[], float]
) -> Dict:
    config = hstu.config
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_history, args.max_history + 1, size=args.users)
    per_token = cache_bytes_per_token(config)
    pages = -(-lengths // args.page_size) * args.page_size
    entry = pages * (per_token - 8) + lengths * (8 + 16) + 4 * config.hidden_dim  # K/V pages, times, tokens, pending
    working_set = sum(kept_bytes(user, SimpleNamespace(nbytes=int(e))) for user, e in enumerate(entry))
    worker_bytes = working_set // 4
    tier_bytes = 2 * working_set
    systems = {
        "without_tier": [Worker(hstu, table, worker_bytes, args.page_size, [], 1) for _ in range(2)],
        "with_tier": [
            Worker(hstu, table, worker_bytes, args.page_size, [SqliteTier(directory / "tier.sqlite", tier_bytes)], 1)
            for _ in range(2)
        ],
    }
    line = None
    min_tokens = args.tier_min_tokens
    if min_tokens == "auto":  # as gr serve measures it, on the first worker's engine and tier
        first = systems["with_tier"][0]
        line = measure_tier_line(first.engine, first.cache.tiers[0], args.page_size)
        print(line.describe())
        min_tokens = line.tier_min_tokens
    for workers in systems.values():
        for worker in workers:
            worker.cache.min_tokens = min_tokens
    print(
        f"zipf: {args.users} users, histories {args.min_history}..{args.max_history}, working set "
        f"{working_set / 2**20:.0f} MB, each worker {worker_bytes / 2**20:.0f} MB, shared tier bound "
        f"{tier_bytes / 2**20:.0f} MB ({directory})"
    )
    current = lengths.copy()
    first = rng.permutation(args.users)
    home = rng.integers(0, 2, size=args.users)
    # every user's history encoded once, on a random worker, in batches whose writes its tier writer's queue holds
    size = max(1, min(64, systems["with_tier"][0].cache.writer.max_bytes // int(entry.max())))
    for start in range(0, args.users, size):
        batch = first[start : start + size]
        for workers in systems.values():
            for w in (0, 1):
                mine = [int(u) for u in batch if home[u] == w]
                histories = [workers[w].history(u, user_tokens(u, int(current[u]), args.seed)) for u in mine]
                encode.encode(workers[w].cache, histories)
                workers[w].cache.flush()
    for workers in systems.values():
        for worker in workers:
            worker.written()
            worker.tally.__init__()
    writer_before = {name: sum(w.written() for w in workers) for name, workers in systems.items()}
    users = zipf_users(args.users, args.requests, rng)
    routes = rng.integers(0, 2, size=args.requests)
    growth = rng.integers(1, 5, size=args.requests)
    candidates = table[torch.from_numpy(rng.integers(1, ITEMS, size=args.candidates))]
    seconds: Dict[str, List[float]] = {name: [] for name in systems}
    for user, route, grow in zip(users.tolist(), routes.tolist(), growth.tolist()):
        current[user] = min(current[user] + grow, config.max_seq_len)
        tokens = user_tokens(user, int(current[user]), args.seed)
        for name, workers in systems.items():
            started = clock()
            workers[route].serve(user, tokens, candidates)
            seconds[name].append(clock() - started)
            workers[route].cache.flush()  # its writes (in the writer's thread) never overlap the next request
    out: Dict[str, Dict] = {}
    for name, workers in systems.items():
        recomputed = [n for w in workers for n in w.tally.recomputed]
        sources = sum((w.tally.sources for w in workers), Counter())
        misses = sum((w.tally.misses for w in workers), Counter())
        times = sorted(seconds[name])
        writer_s = sum(w.written() for w in workers) - writer_before[name]
        out[name] = {
            "recomputed_per_request": round(statistics.mean(recomputed), 2),
            "writer_cpu_ms_per_request": round(1e3 * writer_s / len(times), 3),
            "p50_ms": round(1e3 * times[len(times) // 2], 3),
            "p99_ms": round(1e3 * times[min(len(times) - 1, int(0.99 * len(times)))], 3),
            "sources": dict(sources),
            "tier_misses": dict(misses),
        }
        print(f"{name}: {out[name]}")
    for workers in systems.values():
        for worker in workers:
            worker.cache.close()
    without, with_tier = out["without_tier"], out["with_tier"]
    return {
        "model": {k: getattr(config, k) for k in ("hidden_dim", "num_layers", "num_heads", "attention_dim")},
        "users": args.users,
        "requests": args.requests,
        "history": [args.min_history, args.max_history],
        "working_set_mb": round(working_set / 2**20, 1),
        "worker_mb": round(worker_bytes / 2**20, 1),
        "tier_min_tokens": min_tokens,
        "tier_line": None if line is None else {"min_tokens": line.min_tokens, "costs_ms": line_costs(line)},
        **out,
        "recomputed_ratio": round(
            without["recomputed_per_request"] / max(with_tier["recomputed_per_request"], 1e-9), 2
        ),
        "p50_ratio": round(without["p50_ms"] / with_tier["p50_ms"], 2),
        "p99_ratio": round(without["p99_ms"] / with_tier["p99_ms"], 2),
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=20_000, help="Zipf requests timed (after each user's first)")
    parser.add_argument("--min-history", type=int, default=32)
    parser.add_argument("--max-history", type=int, default=160)
    parser.add_argument(
        "--zipf-shape", choices=["ml1m", "production"], default="ml1m", help="the HSTU of the zipf section"
    )
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--tier-min-tokens",
        type=lambda value: value if value == "auto" else int(value),
        default="auto",
        help="the tiers' min_tokens in the zipf section; auto (default): measured as gr serve does",
    )
    parser.add_argument("--line-lengths", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--line-shapes", nargs="+", default=["ml1m", "production"], choices=["ml1m", "production"])
    parser.add_argument("--line-reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=("wall", "thread"), default="thread")
    args, _ = smoke.parse_args(
        parser,
        {
            "users": 100,
            "requests": 120,
            "min_history": 16,
            "max_history": 32,
            "candidates": 4,
            "page_size": 4,
            "line_lengths": [16],
            "line_shapes": ["ml1m"],
            "line_reps": 1,
        },
        argv,
    )
    clock, host = measuring(args.clock)
    scratch = tier_directory()  # the shared tiers' files, removed however the run ends
    try:
        line = {name: line_section(args, name, scratch.path, clock) for name in args.line_shapes}
        config = shape(args.zipf_shape, args.max_history + 64)
        torch.manual_seed(args.seed)
        zipf = zipf_section(args, HSTU(config).eval(), torch.randn(ITEMS, config.hidden_dim), scratch.path, clock)
    finally:
        scratch.close()
    host["load_average"]["end"] = load_average()
    summary = {
        "bench": "serving_tier",
        **host,
        "line": line,
        "zipf": zipf,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
