"""Serving speed of one ranking request, measured in one run through the exported model.

A request scores N candidates for a user with L history tokens. Modes:
  (a) pointwise: N separate forward passes of history + 1 candidate (what a pointwise ranker
      does). At large L*N this is too slow to run fully here, so it runs on a sample of
      candidates and is scaled per candidate (the output says how many were run);
  (b) one target-aware pass over history + all N candidates, no cache;
  (c) prefix caching with a cold user cache: encode the history once, then score the
      candidates against the cached K/V in micro-batches;
  (d) a warm user cache that lacks the user's k newest actions: extend by k tokens, then score.
The model is the ML-1M shape scaled up (hidden 256, 4 layers, 2 heads of 128), exported with
``gr.export`` and served by ``gr.serving.Ranker`` (sparse -> ONNX Runtime -> HSTU -> ONNX Runtime).

Three more sections:
  streaming: one user streams ``--stream-actions`` actions, one request (``--stream-candidates``
      candidates) per action, at max_seq_len ``--stream-max-len``: HSTU tokens encoded per request
      and p50 latency with ``--eviction-block`` against eviction by one token (the old path);
  batching: ``--batch-users`` users with histories of ``--batch-history`` and ``--batch-candidates``
      candidates each, caches warm: ``Ranker.rank`` of the list (users packed into shared passes) against a
      loop of ``rank``, and the batched path's FLOP rate as a fraction of the in-run matmul peak;
  retrieval: ``--retrieval-users`` users with histories of ``--retrieval-history`` ask a retrieval
      export (the same HSTU, queries at the next event, the paper recipes' setting) for their top
      ``--retrieval-k`` items: a loop of ``recommend`` against ``recommend`` of the list (shared HSTU passes,
      one postfix run, one matrix product against the exact index), with warm user caches (the
      last action settled at the request's time) and cold ones (every history encoded); the answers
      are checked equal.

FLOP bound of (a)/(c): per layer, a token costs its projections (2*D*H*(2*Dl+2*Da) + 2*H*Dl*D)
and a visible (query, key) pair costs 2*H*(Da+Dl). (a) = N * [(L+1) tokens + L(L+1)/2 + (L+1) pairs];
(c) = L tokens + L(L+1)/2 pairs + N * [1 token + (L+1) pairs].

Run: ``.venv/bin/python bench/serving.py [--clock thread]`` (a few minutes on 2 cores). ``--clock
thread`` runs on one thread and reports its CPU time: use it when other processes share the
machine. ``--smoke``: tiny sizes. Last line: one JSON object with keys bench, clock,
load_average_1min, model, cache_bytes_per_token, ratios, streaming, batching, retrieval.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402
from _peak import matmul_peak  # noqa: E402

from gr import GRModel, HSTUConfig, TableConfig
from gr.export import export_model
from gr.hstu.cache import cache_bytes_per_token
from gr.postfix_dnn import MMoERankingHead, RetrievalHead
from gr.prefix_dnn import MLPTokenEncoder
from gr.serving import Ranker, RecommendRequest

NUM_ITEMS = 3706  # ML-1M items
USER = "bench-user"


def build_model(max_len: int, eviction_block: int = 1, retrieval: bool = False) -> GRModel:
    """The ranking model; retrieval: a retrieval head instead, queries at the next event."""
    config = HSTUConfig(
        hidden_dim=256,
        num_layers=4,
        num_heads=2,
        attention_dim=128,
        linear_dim=128,
        max_seq_len=max_len,
        dropout=0.0,
        input_dropout=0.0,
        eviction_block=eviction_block,
        query_time="next_event" if retrieval else "token",
    )
    tables = [TableConfig("item", NUM_ITEMS, 256, ("item_id",), init_std=0.05)]
    prefix = MLPTokenEncoder({"item_id": 256}, 256)
    if retrieval:
        postfix = RetrievalHead(256, 256)
    else:
        postfix = MMoERankingHead(256, ["watch", "like"], num_experts=4, expert_dims=(128,), tower_dims=(64,))
    return GRModel(config, prefix, postfix, tables).eval()


def flops_per_layer(config: HSTUConfig, tokens: float, pairs: float) -> float:
    d, h, da, dl = config.hidden_dim, config.num_heads, config.attention_dim, config.linear_dim
    per_token = 2 * d * h * (2 * dl + 2 * da) + 2 * h * dl * d
    per_pair = 2 * h * (da + dl)
    return tokens * per_token + pairs * per_pair


def flop_bound(config: HSTUConfig, length: int, n: int) -> float:
    history_pairs = length * (length + 1) / 2
    pointwise = n * flops_per_layer(config, length + 1, history_pairs + length + 1)
    cached = flops_per_layer(config, length + n, history_pairs + n * (length + 1))
    return pointwise / cached


def best_time(
    clock: Callable[[], float], run: Callable[[], object], repeats: int, before: Callable[[], None] = lambda: None
) -> float:
    """Fastest of ``repeats`` runs timed by ``clock``, in seconds (``before`` runs untimed ahead of each)."""
    times = []
    for _ in range(repeats):
        before()
        start = clock()
        run()
        times.append(clock() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--candidates", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--new-actions", type=int, default=8, help="k of mode (d)")
    parser.add_argument("--micro-batch", type=int, default=512)
    parser.add_argument(
        "--pointwise-budget",
        type=float,
        default=4.0,
        help="seconds of pointwise forwards per (L, N) before scaling per candidate",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall: wall time with the default threads; thread: one thread (torch and ONNX "
        "Runtime) timed by its CPU time, which other processes on the machine barely skew",
    )
    parser.add_argument("--stream-actions", type=int, default=2000)
    parser.add_argument("--stream-max-len", type=int, default=1024)
    parser.add_argument("--stream-candidates", type=int, default=16)
    parser.add_argument("--eviction-block", type=int, default=128)
    parser.add_argument("--batch-users", type=int, default=64)
    parser.add_argument("--batch-history", type=int, default=1024)
    parser.add_argument("--batch-candidates", type=int, nargs="+", default=[512, 16])
    parser.add_argument("--retrieval-users", type=int, default=64)
    parser.add_argument("--retrieval-history", type=int, default=200)
    parser.add_argument("--retrieval-k", type=int, default=10)
    parser.add_argument(
        "--sections",
        default="main,streaming,batching,retrieval",
        help="which of main, streaming, batching, retrieval",
    )
    args, _ = smoke.parse_args(
        parser,
        {
            "lengths": [32],
            "candidates": [8],
            "new_actions": 2,
            "micro_batch": 8,
            "pointwise_budget": 0.2,
            "repeats": 1,
            "stream_actions": 40,
            "stream_max_len": 16,
            "stream_candidates": 4,
            "eviction_block": 4,
            "batch_users": 3,
            "batch_history": 16,
            "batch_candidates": [8],
            "retrieval_users": 3,
            "retrieval_history": 16,
            "retrieval_k": 2,
        },
    )
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    if args.clock == "thread":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    load_start = os.getloadavg()[0]  # other processes on the 2 cores skew every timing

    sections = set(args.sections.split(","))
    rows: Dict[str, Dict[str, float]] = {}
    config = build_model(8).hstu.config if "main" not in sections else None
    if "main" in sections:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            export_dir = export_model(build_model(max(args.lengths)), Path(tmp) / "export")
            print(f"export: {time.perf_counter() - start:.1f}s")
            ranker = Ranker.load(
                export_dir,
                micro_batch=args.micro_batch,
                cache_bytes=2**31,
                threads=1 if args.clock == "thread" else None,
            )
            config = ranker.model.config
            print(
                f"clock: {args.clock}; model: hidden {config.hidden_dim}, {config.num_layers} layers, "
                f"{config.num_heads} heads x {config.attention_dim}; cache {cache_bytes_per_token(config)} bytes "
                "per history token"
            )
            warm_up(ranker, rng, max(args.lengths))
            rows: Dict[str, Dict[str, float]] = {}
            header = (
                f"{'L':>5} {'N':>5} {'(a) ms':>10} {'(b) ms':>9} {'(c) ms':>8} {'(d) ms':>8} {'a/c':>7} "
                f"{'bound':>7} {'b/c':>6} {'a run':>6}"
            )
            print(header)
            for length in args.lengths:
                history = request_tokens(rng, length, start_time=0)
                for n in args.candidates:
                    candidates = {"item_id": rng.integers(0, NUM_ITEMS, n)}
                    row = measure(ranker, history, candidates, args, clock)
                    row["bound"] = flop_bound(config, length, n)
                    rows[f"L{length}_N{n}"] = row
                    print(
                        f"{length:>5} {n:>5} {row['a_ms']:>10.0f} {row['b_ms']:>9.1f} {row['c_ms']:>8.1f} "
                        f"{row['d_ms']:>8.1f} {row['a_over_c']:>7.1f} {row['bound']:>7.1f} {row['b_over_c']:>6.2f} "
                        f"{int(row['a_sampled']):>4}/{n}"
                    )
    key = "L1024_N512"
    summary = {
        "bench": "serving",
        "clock": args.clock,
        "load_average_1min": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
        "model": {"hidden_dim": 256, "num_layers": 4, "num_heads": 2, "head_dim": 128},
        "cache_bytes_per_token": cache_bytes_per_token(config),
        "a_is_sampled": "(a) runs a_sampled candidates and is scaled per candidate to N",
        "ratios": {k: {m: round(v, 3) for m, v in r.items()} for k, r in rows.items()},
    }
    if "streaming" in sections:
        summary["streaming"] = streaming(args, clock)
    if "batching" in sections:
        summary["batching"] = batching(args, clock)
    if "retrieval" in sections:
        summary["retrieval"] = retrieval_batching(args, clock)
    summary["load_average_1min"]["end"] = round(os.getloadavg()[0], 2)
    if key in rows:
        row = rows[key]
        summary["target_L1024_N512"] = {
            "a_over_c": round(row["a_over_c"], 1),
            "half_bound": round(row["bound"] / 2, 1),
            "met": row["a_over_c"] >= row["bound"] / 2,
        }
    print(json.dumps(summary))


def request_tokens(rng: np.random.Generator, length: int, start_time: int) -> Dict[str, np.ndarray]:
    return {
        "item_id": rng.integers(0, NUM_ITEMS, length),
        "timestamps": np.sort(rng.integers(start_time, start_time + 10**8, length)),
    }


def warm_up(ranker: Ranker, rng: np.random.Generator, length: int) -> None:
    """One request per mode at the longest history, so one-off costs (kernel compiles) are not timed."""
    history = request_tokens(rng, length, 0)
    candidates = {"item_id": rng.integers(0, NUM_ITEMS, 4)}
    ranker.rank("warm-up", history, candidates, use_cache=False)
    ranker.rank("warm-up", history, candidates)
    ranker.cache.invalidate()


def measure(
    ranker: Ranker,
    history: Dict[str, np.ndarray],
    candidates: Dict[str, np.ndarray],
    args: argparse.Namespace,
    clock: Callable[[], float],
) -> Dict[str, float]:
    n, length, k = len(candidates["item_id"]), len(history["item_id"]), args.new_actions
    request_time = int(history["timestamps"][-1]) + 60

    def rank(user: str, hist: Dict[str, np.ndarray], cands: Dict[str, np.ndarray], use_cache: bool = True):
        return ranker.rank(user, hist, cands, request_time=request_time, use_cache=use_cache)

    # (a) pointwise: one uncached pass per candidate, on as many candidates as fit the budget.
    sampled: List[float] = []
    while len(sampled) < n and sum(sampled) < args.pointwise_budget:
        one = {"item_id": candidates["item_id"][len(sampled) : len(sampled) + 1]}
        start = clock()
        rank(USER, history, one, use_cache=False)
        sampled.append(clock() - start)
    a = float(np.median(sampled)) * n
    b = best_time(clock, lambda: rank(USER, history, candidates, use_cache=False), args.repeats)
    c = best_time(clock, lambda: rank(USER, history, candidates), args.repeats, before=ranker.cache.invalidate)
    # (d): the cache holds the history without its k newest actions; the request brings them.
    older = {name: value[: length - k] for name, value in history.items()}
    rank(USER, older, candidates)
    stale = ranker.cache.get(USER)

    def restore() -> None:
        ranker.cache.put(USER, stale, ranker.cache.model_version)

    d = best_time(clock, lambda: rank(USER, history, candidates), args.repeats, before=restore)
    assert rank(USER, history, candidates).cache_status == "hit"
    restore()
    assert rank(USER, history, candidates).cache_status == "extend"
    return {
        "a_ms": a * 1e3,
        "b_ms": b * 1e3,
        "c_ms": c * 1e3,
        "d_ms": d * 1e3,
        "a_over_c": a / c,
        "b_over_c": b / c,
        "a_over_d": a / d,
        "a_sampled": float(len(sampled)),
    }


def streaming(args: argparse.Namespace, clock: Callable[[], float]) -> Dict[str, object]:
    """One user streams actions, one request per action: tokens encoded and latency, with eviction in
    blocks against eviction by one token."""
    rng = np.random.default_rng(1)
    history = request_tokens(rng, args.stream_actions, start_time=0)
    candidates = {"item_id": rng.integers(0, NUM_ITEMS, args.stream_candidates)}
    out: Dict[str, object] = {"actions": args.stream_actions, "max_seq_len": args.stream_max_len}
    for name, block in (("block", args.eviction_block), ("one_token", 1)):
        with tempfile.TemporaryDirectory() as tmp:
            ranker = Ranker.load(
                export_model(build_model(args.stream_max_len, block), Path(tmp) / "e"),
                micro_batch=args.micro_batch,
                cache_bytes=2**31,
                threads=1 if args.clock == "thread" else None,
            )
            encoded = count_encoded_tokens(ranker)
            times = []
            for n in range(1, args.stream_actions + 1):
                prefix = {k: v[:n] for k, v in history.items()}
                start = clock()
                ranker.rank(USER, prefix, candidates, request_time=int(prefix["timestamps"][-1]) + 60)
                times.append(clock() - start)
        full = [t for n, t in enumerate(times, start=1) if n > args.stream_max_len]  # once the window is full
        out[name] = {
            "eviction_block": block,
            "tokens_encoded_per_request": sum(encoded) / len(encoded),
            "tokens_encoded_per_request_when_full": statistics.mean(encoded[args.stream_max_len :] or [0]),
            "p50_ms_when_full": 1e3 * statistics.median(full or times),
        }
        print(f"streaming {name:9s} (block {block}): {out[name]}", flush=True)
    out["p50_speedup_when_full"] = out["one_token"]["p50_ms_when_full"] / out["block"]["p50_ms_when_full"]
    return out


def count_encoded_tokens(ranker: Ranker) -> List[int]:
    """Per request, the history tokens the HSTU engine runs (encode and extend; candidates excluded)."""
    engine, counts = ranker.model.engine, []
    encode, extend = engine.encode_batch, engine.extend_batch

    def counted_encode(xs, timestamps):
        if xs:
            counts.append(sum(int(x.shape[0]) for x in xs))
        return encode(xs, timestamps)

    def counted_extend(caches, xs, timestamps):
        if xs:
            pending = sum(0 if c.pending is None else int(c.pending.shape[0]) for c in caches)
            counts.append(sum(int(x.shape[0]) for x in xs) + pending)
        return extend(caches, xs, timestamps)

    engine.encode_batch, engine.extend_batch = counted_encode, counted_extend
    original_rank = ranker.rank

    def rank(*a, **k):
        before = len(counts)
        result = original_rank(*a, **k)
        if len(counts) == before:
            counts.append(0)  # a cache hit encodes nothing
        return result

    ranker.rank = rank
    return counts


def batching(args: argparse.Namespace, clock: Callable[[], float]) -> Dict[str, object]:
    """Warm caches, then the same requests ranked by a loop of ``rank`` and by ``rank`` of the list, for
    each candidate count; FLOP rates against the in-run matmul peak."""
    from gr.serving import RankRequest

    rng = np.random.default_rng(2)
    users, length = args.batch_users, args.batch_history
    peak = matmul_peak(torch.float32, 1.0 if not args.smoke else 0.1)
    out: Dict[str, object] = {"users": users, "history": length, "matmul_peak_gflops": peak}
    with tempfile.TemporaryDirectory() as tmp:
        ranker = Ranker.load(
            export_model(build_model(length), Path(tmp) / "e"),
            micro_batch=args.micro_batch,
            cache_bytes=2**33,
            threads=1 if args.clock == "thread" else None,
        )
        histories = [request_tokens(rng, length, 0) for _ in range(users)]
        config = ranker.model.config
        for n in args.batch_candidates:
            requests = [
                RankRequest(f"u{u}", histories[u], {"item_id": rng.integers(0, NUM_ITEMS, n)}, request_time=10**8 + 60)
                for u in range(users)
            ]
            ranker.rank(requests)  # warm every user's cache
            loop = best_time(clock, lambda requests=requests: [ranker.rank(r) for r in requests], args.repeats)
            batched = best_time(clock, lambda requests=requests: ranker.rank(requests), args.repeats)
            flops = users * config.num_layers * flops_per_layer(config, n, n * (length + 1))
            out[f"N{n}"] = {
                "candidates": n,
                "loop_s": loop,
                "batched_s": batched,
                "speedup": loop / batched,
                "loop_fraction_of_peak": flops / loop / 1e9 / peak,
                "batched_fraction_of_peak": flops / batched / 1e9 / peak,
            }
            print(f"batching N={n}: {out[f'N{n}']}", flush=True)
    return out


def retrieval_batching(args: argparse.Namespace, clock: Callable[[], float]) -> Dict[str, object]:
    """The same recommend requests by a loop of ``recommend`` and by ``recommend`` of the list, with warm
    and with cold user caches; the loop's and the batch's answers must agree."""
    rng = np.random.default_rng(3)
    users, length, k = args.retrieval_users, args.retrieval_history, args.retrieval_k
    out: Dict[str, object] = {"users": users, "history": length, "k": k, "index": "exact"}
    with tempfile.TemporaryDirectory() as tmp:
        ranker = Ranker.load(
            export_model(build_model(length, retrieval=True), Path(tmp) / "e"),
            cache_bytes=2**33,
            threads=1 if args.clock == "thread" else None,
        )
        requests = [
            RecommendRequest(f"u{u}", request_tokens(rng, length, 0), k, request_time=10**8 + 60) for u in range(users)
        ]
        batched = ranker.recommend(requests)  # builds the catalogue and warms every cache
        loop = [ranker.recommend(r) for r in requests]
        assert [b.items for b in batched] == [r.items for r in loop], "the batch must answer as the loop"
        for name, before in (("warm", lambda: None), ("cold", ranker.cache.invalidate)):
            loop_s = best_time(clock, lambda: [ranker.recommend(r) for r in requests], args.repeats, before)
            batch_s = best_time(clock, lambda: ranker.recommend(requests), args.repeats, before)
            out[name] = {"loop_s": loop_s, "batched_s": batch_s, "speedup": loop_s / batch_s}
            print(f"retrieval {name}: {out[name]}", flush=True)
    out["target_2x_met"] = {name: out[name]["speedup"] >= 2.0 for name in ("warm", "cold")}
    return out


if __name__ == "__main__":
    main()
