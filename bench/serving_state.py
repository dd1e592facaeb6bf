"""Serving state: extending a cached history with paged K/V against today's copy, and memory per worker.

Two shapes: the ML-1M recipe's HSTU (``configs/ml1m_hstu.yaml``: hidden 50, 2 layers, 1 head,
next-event query times) and a production-like one (hidden 512, 8 layers, 4 heads of 128 + 128).

  extend: a user's history of L tokens is cached; each request brings 1..8 new actions (cycled)
      and extends the cache (``CachedHSTU.extend``), the next request extending the result, as the
      serving runtime does. "copy": caches in their own tensors (the whole prefix concatenated anew
      each request); "paged": caches in a page pool (``gr.hstu.paged``: only the new tokens written).
      Median ms per request at each L, the ratio copy / paged, and paged's flatness (its time at the
      longest L over the shortest).
  generate: a history of L tokens is encoded, then ``--steps`` generation steps each append one item
      (``gr.generation.decoding.step``: one HSTU pass over the new token, its K/V committed, the next
      query), as greedy decoding does between its catalogue searches. "tensors": the history's K/V in
      its own tensors (each step concatenates the whole prefix anew); "paged": in a page pool (each
      step writes the new token into the history's last page). Median ms per step at each L and the
      ratio tensors / paged.
  memory: a pool of ``--pool-mb`` behind a byte-bounded LRU (``gr.serving.user_cache.UserCache``,
      evicting when the pool is full, as ``Ranker`` wires them) caches ``--users`` users of
      ``--memory-history`` tokens, then 10x as many: the process's resident set after each, against
      the pool's size (production shape).

Run: ``.venv/bin/python bench/serving_state.py`` (a few minutes on 2 cores). ``--clock thread`` (the
default) runs torch on one thread and times its CPU time, which other processes barely skew.
``--smoke``: tiny sizes. Last line: one JSON object with keys bench, clock, cpu, load_average,
extend, generate, memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402
from _host import cpu, load_average  # noqa: E402

from gr.generation.decoding import start, step
from gr.hstu import HSTU, HSTUConfig
from gr.hstu.cache import CachedHSTU, HistoryCache
from gr.hstu.paged import PagePool
from gr.serving.user_cache import UserCache

RECIPE = Path(__file__).resolve().parents[1] / "configs/ml1m_hstu.yaml"
GENERATED_ITEMS = 1000  # the random item table's rows
PRODUCTION = dict(hidden_dim=512, num_layers=8, num_heads=4, attention_dim=128, linear_dim=128)


def shape(name: str, max_seq_len: int) -> HSTUConfig:
    """The HSTU of shape ``name`` ("ml1m" or "production"), eval-ready, holding ``max_seq_len`` tokens."""
    if name == "ml1m":
        hstu = yaml.safe_load(RECIPE.read_text())["model"]["hstu"]
        keys = ("hidden_dim", "num_layers", "num_heads", "attention_dim", "linear_dim", "attn_alpha", "query_time")
        values = {k: hstu[k] for k in keys}
    else:
        values = dict(PRODUCTION)
    return HSTUConfig(**values, max_seq_len=max_seq_len, dropout=0.0, input_dropout=0.0)


def history(length: int, dim: int, start: int = 0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(length, dim, generator=g), torch.arange(start, start + length, dtype=torch.long) * 60


def extend_times(
    engines: Sequence[CachedHSTU], bases: Sequence[HistoryCache], requests: int, clock: Callable[[], float]
) -> List[List[float]]:
    """Seconds of each of ``requests`` extensions by 1..8 tokens per engine, each extending that engine's
    previous result; the engines take turns request by request, so a change of load skews them alike."""
    caches, times = list(bases), [[] for _ in engines]
    dim = engines[0].config.hidden_dim
    for r in range(requests):
        x, ts = history(1 + r % 8, dim, start=caches[0].length, seed=r)
        for i, engine in enumerate(engines):
            start = clock()
            caches[i] = engine.extend(caches[i], x, ts)
            times[i].append(clock() - start)
    return times


def paged_copy(engine: CachedHSTU, cache: HistoryCache) -> HistoryCache:
    """``cache`` (in its own tensors) written into ``engine``'s pool."""
    assert engine.pool is not None
    layers = [cache.layer(i) for i in range(engine.config.num_layers)]
    paged = engine.pool.store([k for k, _ in layers], [v for _, v in layers])
    assert paged is not None, "the pool is too small for the benchmark's history"
    return HistoryCache((), (), cache.timestamps, cache.pending, paged)


def extend_section(args: argparse.Namespace, name: str, clock: Callable[[], float]) -> Dict[str, object]:
    config = shape(name, max(args.lengths) + 8 * args.requests + 8)
    torch.manual_seed(0)
    hstu = HSTU(config)
    copy = CachedHSTU(hstu)
    pages = (max(args.lengths) + 8 * args.requests) // args.page_size + 4 * args.requests + 8
    paged = CachedHSTU(hstu, PagePool(config, pages, args.page_size))
    rows: Dict[str, Dict[str, float]] = {}
    print(
        f"{name}: hidden {config.hidden_dim}, {config.num_layers} layers, {config.num_heads} heads; "
        f"page {args.page_size}"
    )
    print(f"{'L':>6} {'copy ms':>9} {'paged ms':>9} {'copy/paged':>11}")
    for length in args.lengths:
        x, ts = history(length, config.hidden_dim)
        base = copy.encode(x, ts)
        paged_base = paged_copy(paged, base)
        extend_times([copy, paged], [base, paged_base], 2, clock)  # warm-up
        copy_ms, paged_ms = (
            1e3 * statistics.median(t) for t in extend_times([copy, paged], [base, paged_base], args.requests, clock)
        )
        rows[f"L{length}"] = {"copy_ms": copy_ms, "paged_ms": paged_ms, "copy_over_paged": copy_ms / paged_ms}
        print(f"{length:>6} {copy_ms:>9.2f} {paged_ms:>9.2f} {copy_ms / paged_ms:>11.1f}")
        del base, paged_base
    first, last = rows[f"L{args.lengths[0]}"], rows[f"L{args.lengths[-1]}"]
    return {
        "model": {k: getattr(config, k) for k in ("hidden_dim", "num_layers", "num_heads", "attention_dim")},
        "requests": args.requests,
        "per_length": {k: {m: round(v, 3) for m, v in r.items()} for k, r in rows.items()},
        "paged_longest_over_shortest": round(last["paged_ms"] / first["paged_ms"], 2),
        "copy_longest_over_shortest": round(last["copy_ms"] / first["copy_ms"], 2),
    }


@dataclass
class TableModel:
    """A generative model over a random item table (``gr.generation.decoding.GenerativeModel``): an
    item's token is its row, a query the normalised HSTU output."""

    engine: CachedHSTU
    table: torch.Tensor

    def item_tokens(self, items: torch.Tensor) -> torch.Tensor:
        return self.table[items]

    def queries(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.normalize(hidden, dim=-1)


def generate_section(args: argparse.Namespace, name: str, clock: Callable[[], float]) -> Dict[str, object]:
    config = shape(name, max(args.lengths) + args.steps + 8)
    torch.manual_seed(0)
    hstu = HSTU(config)
    table = torch.randn(GENERATED_ITEMS, config.hidden_dim)
    pages = 2 * (max(args.lengths) + args.steps) // args.page_size + 8
    models = [
        TableModel(CachedHSTU(hstu), table),
        TableModel(CachedHSTU(hstu, PagePool(config, pages, args.page_size)), table),
    ]
    rows: Dict[str, Dict[str, float]] = {}
    print(f"{name}: generation steps, page {args.page_size}")
    print(f"{'L':>6} {'tensors ms':>11} {'paged ms':>9} {'tensors/paged':>14}")
    for length in args.lengths:
        g = torch.Generator().manual_seed(length)
        items = torch.randint(0, GENERATED_ITEMS, (length + args.steps,), generator=g)
        timestamps = torch.arange(length, dtype=torch.long) * 60
        request_time = length * 60
        states = [start(model, items[:length], timestamps, request_time) for model in models]
        assert states[1].cache.paged is not None, "the pool is too small for the benchmark's history"
        times: List[List[float]] = [[], []]
        for s in range(args.steps):  # the two take turns step by step, so a change of load skews them alike
            for i, model in enumerate(models):
                began = clock()
                states[i] = step(model, states[i], int(items[length + s]), request_time)
                times[i].append(clock() - began)
        tensors_ms, paged_ms = (1e3 * statistics.median(t[1:]) for t in times)  # the first step warms up
        rows[f"L{length}"] = {
            "tensors_ms": tensors_ms,
            "paged_ms": paged_ms,
            "tensors_over_paged": tensors_ms / paged_ms,
        }
        print(f"{length:>6} {tensors_ms:>11.2f} {paged_ms:>9.2f} {tensors_ms / paged_ms:>14.2f}")
        del states
    return {
        "steps": args.steps,
        "per_length": {k: {m: round(v, 3) for m, v in r.items()} for k, r in rows.items()},
    }


def resident_bytes() -> int:
    """This process's resident set now (``VmRSS``)."""
    with open("/proc/self/status", encoding="ascii") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmRSS:"))


def memory_section(args: argparse.Namespace) -> Dict[str, object]:
    config = shape("production", args.memory_history + 8)
    torch.manual_seed(0)
    pool = PagePool.of_bytes(config, args.pool_mb * 2**20, args.page_size)
    engine = CachedHSTU(HSTU(config), pool)
    cache: UserCache[HistoryCache] = UserCache(args.pool_mb * 2**20)
    pool.on_full = cache.evict_oldest
    x, ts = history(args.memory_history, config.hidden_dim)
    rss = {}
    for users in (args.users, 10 * args.users):
        for user in range(users):
            cache.put(user, engine.encode(x, ts), 0)
        rss[users] = resident_bytes()
        print(
            f"memory: {users} users of {args.memory_history} tokens: RSS {rss[users] / 2**20:.0f} MB, "
            f"{len(cache)} cached, pages used {pool.used}/{pool.pages}"
        )
    small, large = rss[args.users], rss[10 * args.users]
    pool_bytes = pool.pages * pool.page_bytes
    return {
        "pool_mb": round(pool_bytes / 2**20, 1),
        "users": [args.users, 10 * args.users],
        "rss_mb": [round(small / 2**20, 1), round(large / 2**20, 1)],
        "growth_mb": round((large - small) / 2**20, 1),
        "growth_over_pool": round((large - small) / pool_bytes, 3),
    }


def measuring(clock_name: str) -> Tuple[Callable[[], float], Dict[str, Any]]:
    """The clock a run times with ("wall": ``time.perf_counter``; "thread": this thread's CPU time, torch
    on one thread) and the summary's host fields (clock, cpu, load_average at the start), printed as a line."""
    clock = time.perf_counter if clock_name == "wall" else time.thread_time
    if clock_name == "thread":
        torch.set_num_threads(1)
    load_start = load_average()
    model, flags = cpu()
    print(f"cpu: {model}; flags: {' '.join(flags)}; load average {load_start}; clock: {clock_name}")
    return clock, {"clock": clock_name, "cpu": {"model": model, "flags": flags}, "load_average": {"start": load_start}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--shapes", nargs="+", default=["ml1m", "production"], choices=["ml1m", "production"])
    parser.add_argument("--requests", type=int, default=24, help="extensions timed per history length")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--users", type=int, default=20, help="users cached first; then 10x as many")
    parser.add_argument("--memory-history", type=int, default=256)
    parser.add_argument("--pool-mb", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16, help="generation steps timed per history length")
    parser.add_argument("--clock", choices=("wall", "thread"), default="thread")
    args, _ = smoke.parse_args(
        parser,
        {
            "lengths": [16, 64],
            "requests": 3,
            "page_size": 4,
            "users": 2,
            "memory_history": 16,
            "pool_mb": 2,
            "steps": 3,
            "shapes": ["ml1m"],
        },
    )
    clock, host = measuring(args.clock)
    extend = {name: extend_section(args, name, clock) for name in args.shapes}
    generate = {name: generate_section(args, name, clock) for name in args.shapes}
    memory = memory_section(args)
    host["load_average"]["end"] = load_average()
    summary = {
        "bench": "serving_state",
        **host,
        "extend": extend,
        "generate": generate,
        "memory": memory,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
