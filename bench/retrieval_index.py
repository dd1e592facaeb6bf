"""Speculative retrieval (RaLMSpec) against a real index: a large catalogue (default 1M items,
synthetic clustered embeddings) where each nearest-neighbour search costs what it does in production.

A small HSTU (random weights, hidden = embedding dim; the item tokens are the embeddings)
generates K items greedily for each user (a history of ``--history`` items drawn from a few
clusters). Four modes, taking turns user by user:

* ``exact``: greedy, one exact search (``ExactIndex``, brute force over the catalogue) per item;
* ``exact-speculative``: ``greedy_speculative_retrieval`` over the exact index (local cache of
  the neighbours earlier exact queries returned, one batched exact check per ``--stride`` steps,
  rollback to the first mismatch): its slates must equal ``exact``'s;
* ``ivf``: greedy over ``IVFIndex`` (``--lists`` lists, ``--probes`` probed);
* ``ivf-speculative``: speculative retrieval over the IVF index: its slates must equal ``ivf``'s.

Reports items/s, the speedup of each speculative mode over its index's plain greedy, steps rolled
back per request, the share of search time, and the IVF slates' overlap with exact slates.
Last line: one JSON object. ``--smoke``: a 20k-item catalogue, a few users (seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402

from gr.generation.decoding import Generation, greedy, start
from gr.generation.speculative_retrieval import SpeculativeRetrieval, greedy_speculative_retrieval
from gr.hstu import HSTU, HSTUConfig
from gr.hstu.cache import CachedHSTU
from gr.index.exact import ExactIndex, ItemIndex
from gr.index.ivf import IVFIndex

REQUEST_TIME = 10**9
SMOKE = {"items": 20_000, "clusters": 200, "lists": 64, "probes": 8, "users": 4, "k": 8}


@dataclass
class EmbeddingModel:
    """A generative model whose item tokens are the catalogue embeddings: [M, D]; query = normalised output."""

    engine: CachedHSTU
    table: Tensor

    def item_tokens(self, items: Tensor) -> Tensor:
        return self.table[items]

    def queries(self, hidden: Tensor) -> Tensor:
        return F.normalize(hidden, dim=-1)


def catalogue(num_items: int, dim: int, clusters: int, seed: int) -> Tensor:
    """[M, dim] unit embeddings around ``clusters`` random centres (a cluster ~ a topic)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, dim, generator=g)
    out = torch.empty(num_items, dim)
    for lo in range(0, num_items, 1 << 18):
        hi = min(num_items, lo + (1 << 18))
        out[lo:hi] = F.normalize(
            centres[torch.randint(0, clusters, (hi - lo,), generator=g)] + 0.4 * torch.randn(hi - lo, dim, generator=g),
            dim=1,
        )
    return out


def run(
    model: EmbeddingModel, index: ItemIndex, users: Sequence, k: int, speculative: Optional[SpeculativeRetrieval]
) -> Generation:
    """One request: the decode state is built outside the timing."""
    items, ts = users
    state = start(model, items, ts, REQUEST_TIME)
    if speculative is None:
        return greedy(model, index, state, k, REQUEST_TIME)
    return greedy_speculative_retrieval(model, index, state, k, REQUEST_TIME, speculative)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--clusters", type=int, default=4096)
    parser.add_argument("--lists", type=int, default=1024)
    parser.add_argument("--probes", type=int, default=16)
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--history", type=int, default=20)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--cache-size", type=int, default=64)
    parser.add_argument("--stride", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args, _ = smoke.parse_args(parser, SMOKE, argv)
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    table = catalogue(args.items, args.dim, args.clusters, seed=0)
    torch.manual_seed(0)
    hstu = HSTU(
        HSTUConfig(
            hidden_dim=args.dim,
            num_layers=2,
            num_heads=2,
            attention_dim=32,
            linear_dim=32,
            max_seq_len=args.history + args.k + 8,
            dropout=0.0,
            input_dropout=0.0,
        )
    ).eval()
    model = EmbeddingModel(CachedHSTU(hstu), table)
    exact = ExactIndex(table)
    ivf = IVFIndex(table, num_lists=args.lists, probes=args.probes)
    print(
        f"# {args.items} items x {args.dim}, IVF {args.lists} lists / {args.probes} probes, built in "
        f"{time.perf_counter() - began:.1f}s",
        flush=True,
    )
    g = torch.Generator().manual_seed(1)
    users = []
    for _ in range(args.users):  # a history from the items nearest a few topics
        topics = F.normalize(torch.randn(3, args.dim, generator=g), dim=1)
        near = torch.topk(table @ topics.T, args.history, dim=0).indices.T.flatten()
        items = near[torch.randperm(near.numel(), generator=g)[: args.history]]
        users.append((items, torch.arange(args.history, dtype=torch.long) * 3600))
    spec = SpeculativeRetrieval(args.cache_size, args.stride)
    modes = {
        "exact": (exact, None),
        "exact-speculative": (exact, spec),
        "ivf": (ivf, None),
        "ivf-speculative": (ivf, spec),
    }
    totals: Dict[str, Dict] = {
        m: {"seconds": 0.0, "slates": [], "rollbacks": 0, "verifications": 0, "passes": 0} for m in modes
    }
    with torch.inference_mode():
        run(model, exact, users[0], 2, None)  # warm-up
        for u, user in enumerate(users):
            labels = list(modes)
            for label in labels[u % 4 :] + labels[: u % 4]:
                index, speculative = modes[label]
                t0 = time.perf_counter()
                out = run(model, index, user, args.k, speculative)
                t = totals[label]
                t["seconds"] += time.perf_counter() - t0
                t["slates"].append(out.items)
                t["passes"] += out.stats.passes
                t["rollbacks"] += getattr(out.stats, "rollbacks", 0)
                t["verifications"] += getattr(out.stats, "verifications", 0)
        queries = F.normalize(torch.randn(8, args.dim, generator=g), dim=1)
        none = torch.zeros(8, args.items, dtype=torch.bool)
        search_ms = {}
        for name, index in (("exact", exact), ("ivf", ivf)):
            t0 = time.perf_counter()
            for q in range(8):
                index.search(queries[q : q + 1], none[:1], 1)
            search_ms[f"{name}_1"] = 1e3 * (time.perf_counter() - t0) / 8
            t0 = time.perf_counter()
            index.search(queries[: args.stride], none[: args.stride], args.cache_size)
            search_ms[f"{name}_batch{args.stride}_top{args.cache_size}"] = 1e3 * (time.perf_counter() - t0)
    rate = {m: args.k * args.users / t["seconds"] for m, t in totals.items()}
    summary = {
        "items": args.items,
        "k": args.k,
        "users": args.users,
        "items_per_s": {m: round(r, 1) for m, r in rate.items()},
        "speedup_exact_speculative": round(rate["exact-speculative"] / rate["exact"], 3),
        "speedup_ivf_speculative": round(rate["ivf-speculative"] / rate["ivf"], 3),
        "speedup_ivf_over_exact": round(rate["ivf"] / rate["exact"], 3),
        "rollbacks_per_request": {
            m: totals[m]["rollbacks"] / args.users for m in ("exact-speculative", "ivf-speculative")
        },
        "verifications_per_request": {
            m: totals[m]["verifications"] / args.users for m in ("exact-speculative", "ivf-speculative")
        },
        "mismatches": {
            "exact-speculative": sum(
                a != b for a, b in zip(totals["exact-speculative"]["slates"], totals["exact"]["slates"])
            ),
            "ivf-speculative": sum(
                a != b for a, b in zip(totals["ivf-speculative"]["slates"], totals["ivf"]["slates"])
            ),
        },
        "ivf_slate_overlap_with_exact": round(
            sum(len(set(a) & set(b)) for a, b in zip(totals["ivf"]["slates"], totals["exact"]["slates"]))
            / (args.k * args.users),
            3,
        ),
        "search_ms": {name: round(v, 2) for name, v in search_ms.items()},
    }
    for m, r in rate.items():
        print(
            f"{m:<18} {r:8.1f} items/s  rollbacks/request {totals[m]['rollbacks'] / args.users:5.2f}  "
            f"verifications/request {totals[m]['verifications'] / args.users:5.2f}",
            flush=True,
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
