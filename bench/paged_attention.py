"""Cached attention over paged K/V: the fused CPU kernel reading through page tables, against gathering first.

One ``hstu_cached_attention`` call (one layer) of one user: ``--new`` new tokens (ranking candidates,
``targets``) over a history of L cached tokens, with the position and time bias, at two shapes: the
ML-1M recipe's (``configs/ml1m_hstu.yaml``: 1 head of 50 + 50, next-event query times) and a
production-like one (4 heads of 128 + 128: hidden 512's per-head dims). Five ways, timed in turns
call by call so that a change of load skews them alike:

  torch: the PyTorch matmuls over K/V in tensors of their own (the path without the fused kernel);
  unpaged: the fused kernel over the same tensors;
  paged: the fused kernel over the same K/V in a fragmented page pool (pages of ``--page-size`` in
      random order), read through the page table;
  gather: the page table's rows gathered into tensors (``PagedCache.read``), then the fused kernel;
  torch_paged: the PyTorch matmuls over the paged cache (they gather it).

Every paged answer is checked equal to the unpaged one, bit for bit. Printed: median ms per call,
and the ratios unpaged / torch (the fused kernel against the PyTorch path on tensors, < 1: faster)
and gather / paged (> 1: reading through the table beats gathering first).

Run: ``.venv/bin/python bench/paged_attention.py`` (a few minutes on 2 cores); ``--clock thread``
(the default) times this thread's CPU time with torch on one thread. ``--smoke``: tiny sizes.
Last line: one JSON object with keys bench, clock, cpu, load_average, shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402
from _host import load_average  # noqa: E402
from serving_state import measuring  # noqa: E402

from gr.hstu.kernels.attention import RelativeBias
from gr.hstu.kernels.cached_attention import PagedCache, PageTables, hstu_cached_attention
from gr.ops.native import native_ops

RECIPE = Path(__file__).resolve().parents[1] / "configs/ml1m_hstu.yaml"
SHAPES = {"ml1m": dict(heads=1, da=50, dl=50), "production": dict(heads=4, da=128, dl=128)}
TIME_BUCKETS = 128


def problem(name: str, cached: int, new: int, page_size: int, seed: int = 0) -> Dict[str, object]:
    """One user's call at shape ``name``: tensors, bias, and the cache both in tensors and paged."""
    shape = SHAPES[name]
    heads, da, dl = shape["heads"], shape["da"], shape["dl"]
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(new, heads, da, generator=g) for _ in range(2))
    v = torch.randn(new, heads, dl, generator=g)
    cache_k, cache_v = torch.randn(heads, cached, da, generator=g), torch.randn(heads, cached, dl, generator=g)
    ts = torch.sort(torch.randint(0, 10**8, (cached,), generator=g)).values
    request_time = torch.full((new,), 10**8 + 600)  # every candidate at the request's time
    next_event = name == "ml1m" and yaml.safe_load(RECIPE.read_text())["model"]["hstu"]["query_time"] == "next_event"
    rab = RelativeBias(
        torch.randn(cached + new + 1, generator=g) * 0.1,
        torch.randn(TIME_BUCKETS, generator=g) * 0.1,
        request_time,
        "log",
        request_time if next_event else None,
    )
    pages = -(-cached // page_size)
    order = torch.randperm(2 * pages + 1, generator=g)[:pages]  # scattered among twice as many pages
    rows = (order.view(-1, 1) * page_size + torch.arange(page_size)).flatten()[:cached]
    pool_k = torch.randn(heads, (2 * pages + 1) * page_size, da, generator=g)
    pool_v = torch.randn(heads, (2 * pages + 1) * page_size, dl, generator=g)
    pool_k[:, rows], pool_v[:, rows] = cache_k, cache_v
    tables = PageTables([order], page_size)
    return dict(
        args=(q, k, v, torch.tensor([0, new])),
        offsets=torch.tensor([0, cached]),
        tensors=([cache_k], [cache_v]),
        paged=(PagedCache(pool_k, tables), PagedCache(pool_v, tables)),
        options=dict(new_tokens="targets", rab=rab, cache_timestamps=[ts], alpha=1.0),
    )


def ways(p: Dict[str, object]) -> Dict[str, Callable[[], torch.Tensor]]:
    args, offsets, options = p["args"], p["offsets"], p["options"]
    tensors, paged = p["tensors"], p["paged"]

    def call(keys, values) -> torch.Tensor:
        return hstu_cached_attention(*args, keys, values, offsets, backend="cpu", **options)  # type: ignore[misc]

    def unfused(keys, values) -> torch.Tensor:
        os.environ["GR_CPU_FUSED"] = "0"  # the fused kernels off: the PyTorch path
        try:
            return call(keys, values)
        finally:
            del os.environ["GR_CPU_FUSED"]

    def gather() -> torch.Tensor:
        length = int(offsets[1])  # type: ignore[index]
        return call([paged[0].read(0, length)], [paged[1].read(0, length)])  # type: ignore[index]

    return {
        "torch": lambda: unfused(*tensors),  # type: ignore[misc]
        "unpaged": lambda: call(*tensors),  # type: ignore[misc]
        "paged": lambda: call(*paged),  # type: ignore[misc]
        "gather": gather,
        "torch_paged": lambda: unfused(*paged),  # type: ignore[misc]
    }


def section(args: argparse.Namespace, name: str, clock: Callable[[], float]) -> Dict[str, object]:
    print(f"{name}: {SHAPES[name]}, page {args.page_size}; ms per call (one layer, one user)")
    print(f"{'L':>6} {'new':>4} " + " ".join(f"{w:>11}" for w in ("torch", "unpaged", "paged", "gather", "torch_paged"))
          + f" {'unpaged/torch':>14} {'gather/paged':>13}")  # fmt: skip
    rows: Dict[str, Dict[str, float]] = {}
    for cached in args.lengths:
        for new in args.new:
            p = problem(name, cached, new, args.page_size)
            calls = ways(p)
            answers = {w: f() for w, f in calls.items()}  # also the warm-up
            for w in ("paged", "gather"):
                assert torch.equal(answers[w], answers["unpaged"]), f"{w} differs from unpaged at L={cached}"
            assert torch.equal(answers["torch_paged"], answers["torch"]), "torch_paged differs from torch"
            times: Dict[str, List[float]] = {w: [] for w in calls}
            for _ in range(args.repeats):
                for w, f in calls.items():
                    start = clock()
                    f()
                    times[w].append(clock() - start)
            ms = {w: 1e3 * statistics.median(t) for w, t in times.items()}
            row = {f"{w}_ms": round(t, 4) for w, t in ms.items()}
            row["unpaged_over_torch"] = round(ms["unpaged"] / ms["torch"], 3)
            row["gather_over_paged"] = round(ms["gather"] / ms["paged"], 3)
            row["torch_paged_over_paged"] = round(ms["torch_paged"] / ms["paged"], 3)
            rows[f"L{cached}_new{new}"] = row
            print(
                f"{cached:>6} {new:>4} " + " ".join(f"{ms[w]:>11.3f}" for w in calls)
                + f" {row['unpaged_over_torch']:>14.2f} {row['gather_over_paged']:>13.2f}"
            )  # fmt: skip
    return {"shape": SHAPES[name], "page_size": args.page_size, "repeats": args.repeats, "per_case": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--new", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per way and case")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--clock", choices=("wall", "thread"), default="thread")
    args, _ = smoke.parse_args(
        parser, {"lengths": [40], "new": [1, 3], "repeats": 2, "page_size": 4, "shapes": ["ml1m"]}
    )
    if native_ops("gr_cpu_cached") is None:
        raise SystemExit("paged_attention: the fused CPU kernels are not built here (gr.ops.native)")
    clock, host = measuring(args.clock)
    shapes = {name: section(args, name, clock) for name in args.shapes}
    host["load_average"]["end"] = load_average()
    print(json.dumps({"bench": "paged_attention", **host, "shapes": shapes}))


if __name__ == "__main__":
    main()
