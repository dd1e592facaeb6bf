"""DejaVu (contextual sparsity) measured on trained HSTU models before building anything.

In an HSTU layer ``Y = X + W2 (LN(A V) * U)`` with ``U = silu(.)`` the gate: where ``|U_j|`` is
negligible for a token, column j of the output projection W2 (and, with a predictor that knows
it in advance, column j of the U part of the fused projection) is wasted work. The V rows are
not skippable exactly: ``LN`` normalises over all H*Dl dims of ``A V``, so each dim needs them all.

For each trained model (the generation bench's exports: ``ml100k`` = model (a), ``long`` = model
(b)) and each threshold t, on held-out users (target: their last event):

* gated share: the fraction of gate dims with ``|U_j| < t``, per token (mean, p10, p90), all layers;
* HR@10 / NDCG@10 when those dims are skipped (an oracle gate: the best any predictor can do),
  and the relative HR@10 change;
* work share: the fraction of a decode step's multiply-adds (projections + attention over the
  history) those dims would save with a perfect predictor (U columns + W2 columns);
* per head: the share of W2's output norm each head contributes, and HR@10 with the head dropped.

Run after ``bench/generate.py`` has trained its models (it reuses them), or with ``--smoke``
(a tiny synthetic model trained on the spot, in a temporary directory unless ``--runs-dir`` names
one: there a smoke model ``bench/generate.py --smoke --runs-dir`` left is reused). Last line: one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402
from generate import DATASETS, ROOT, ensure_export, user_data  # noqa: E402  (the bench's own models)

from gr.serving import Ranker  # noqa: E402
from gr.serving.generate import ServingGenerativeModel  # noqa: E402

THRESHOLDS = (0.01, 0.03, 0.1, 0.3, 1.0)
# the generation bench's tiny smoke model (runs_dir None: a temporary directory, nothing reused)
SMOKE = {"datasets": ["smoke"], "users": 20, "runs_dir": None}
Gate = Callable[[int, Tensor], Optional[Tensor]]  # (layer, u: [T, H*Dl]) -> keep mask [T, H*Dl] or None


def held_out(items: List[np.ndarray], times: List[np.ndarray], max_len: int, num_users: int) -> List[Dict]:
    """Users' last event as the target; the history is the events before it (at most max_len)."""
    rng = np.random.default_rng(0)
    chosen = sorted(rng.permutation(len(items))[:num_users].tolist())
    return [
        {
            "items": items[u][-max_len - 1 : -1],
            "times": times[u][-max_len - 1 : -1],
            "target": int(items[u][-1]),
            "target_time": int(times[u][-1]),
        }
        for u in chosen
        if len(items[u]) > 1
    ]


class GatedLayers:
    """Replaces each layer's ``combine`` by one that zeroes the gate dims ``gate`` drops, and
    records per token the share of dims dropped (``dropped``: [T] per call) and the output norm per head."""

    def __init__(self, ranker: Ranker, gate: Gate) -> None:
        self.layers = list(ranker.model.engine.hstu.layers)
        self.gate, self.dropped, self.head_norms = gate, [], []

    def __enter__(self) -> "GatedLayers":
        for i, layer in enumerate(self.layers):
            layer.combine = self._combine(i, layer)
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            del layer.combine

    def _combine(self, i: int, layer) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        heads = layer.config.num_heads

        def combine(x: Tensor, attn: Tensor, u: Tensor) -> Tensor:
            mixed = layer.attn_norm(attn.reshape(attn.shape[0], -1)) * u  # [T, H*Dl]
            keep = self.gate(i, u)
            if keep is not None:
                mixed = mixed * keep
                self.dropped.append(1.0 - keep.float().mean(1))
            per_head = mixed.view(mixed.shape[0], heads, -1)
            w = layer.output.weight.view(layer.output.weight.shape[0], heads, -1)  # [D, H, Dl]
            self.head_norms.append(torch.einsum("thl,dhl->thd", per_head, w).norm(dim=-1))  # [T, H]
            return x + layer.output(mixed)

        return combine


def queries(ranker: Ranker, users: Sequence[Dict], gate: Gate) -> tuple:
    """One full forward per user -> (queries [U, d], dropped share per token [N], head norms [N, H])."""
    catalogue, _ = ranker.catalogue()
    model = ServingGenerativeModel(catalogue, {})
    hstu = ranker.model.engine.hstu
    next_event = hstu.config.query_time == "next_event"
    out = []
    with torch.inference_mode(), GatedLayers(ranker, gate) as gated:
        for user in users:
            items, times = torch.from_numpy(user["items"]), torch.from_numpy(user["times"]).long()
            n = items.numel()
            query_times = torch.cat([times[1:], torch.tensor([user["target_time"]])]) if next_event else None
            hidden = hstu(catalogue.tokens[items], torch.tensor([0, n]), n, times, None, query_times)
            out.append(model.queries(hidden[-1:])[0])
    dropped = torch.cat(gated.dropped) if gated.dropped else torch.zeros(0)
    return torch.stack(out), dropped, torch.cat(gated.head_norms)


def hr_ndcg(ranker: Ranker, users: Sequence[Dict], q: Tensor, k: int = 10) -> tuple:
    """HR@k and NDCG@k of each user's target, history items excluded."""
    index = ranker.catalogue()[0].index
    scores = index.scores(q)
    hits, gains = [], []
    for row, user in enumerate(users):
        s = scores[row].clone()
        s[torch.from_numpy(user["items"])] = float("-inf")
        rank = int((s > s[user["target"]]).sum())
        hits.append(rank < k)
        gains.append(1.0 / math.log2(rank + 2) if rank < k else 0.0)
    return float(np.mean(hits)), float(np.mean(gains))


def work_share(config, history: float) -> float:
    """Share of a decode step's multiply-adds (one token over a ``history``-token cache) in the U
    columns of the fused projection plus the W2 columns (what a perfect gate predictor could skip)."""
    d, h, dl, da = config.hidden_dim, config.num_heads, config.linear_dim, config.attention_dim
    projections = d * h * (2 * dl + 2 * da) + h * dl * d
    attention = history * h * (da + dl)
    return (d * h * dl + h * dl * d) / (projections + attention)


def measure(name: str, export: Path, run: Path, data_path: str, num_users: int, thresholds: Sequence[float]) -> Dict:
    ranker = Ranker.load(export, threads=1)
    config = ranker.model.config
    items, times, _ = user_data(run, data_path)
    users = held_out(items, times, config.max_seq_len - 1, num_users)
    base_q, _, head_norms = queries(ranker, users, lambda i, u: None)
    base_hr, base_ndcg = hr_ndcg(ranker, users, base_q)
    history = float(np.mean([len(u["items"]) for u in users]))
    share = work_share(config, history)
    rows = []
    for t in thresholds:
        q, dropped, _ = queries(ranker, users, lambda i, u, t=t: u.abs() >= t)
        hr, ndcg = hr_ndcg(ranker, users, q)
        rows.append(
            {
                "threshold": t,
                "gated_mean": round(float(dropped.mean()), 4),
                "gated_p10": round(float(dropped.quantile(0.1)), 4),
                "gated_p90": round(float(dropped.quantile(0.9)), 4),
                "hr@10": round(hr, 4),
                "ndcg@10": round(ndcg, 4),
                "hr_rel_change": round((hr - base_hr) / base_hr, 4) if base_hr else None,
                "work_skipped": round(float(dropped.mean()) * share, 4),
            }
        )
    heads = []
    h, dl = config.num_heads, config.linear_dim
    norm_share = (head_norms / head_norms.sum(1, keepdim=True)).mean(0)
    for head in range(h if h > 1 else 0):
        keep = torch.ones(h * dl, dtype=torch.bool)
        keep[head * dl : (head + 1) * dl] = False
        q, _, _ = queries(ranker, users, lambda i, u, keep=keep: keep.expand_as(u))
        hr, ndcg = hr_ndcg(ranker, users, q)
        heads.append(
            {
                "head": head,
                "output_norm_share": round(float(norm_share[head]), 4),
                "hr@10_without": round(hr, 4),
                "ndcg@10_without": round(ndcg, 4),
            }
        )
    return {
        "model": {
            "hidden_dim": config.hidden_dim,
            "num_layers": config.num_layers,
            "num_heads": h,
            "linear_dim": dl,
            "attention_dim": config.attention_dim,
        },
        "users": len(users),
        "mean_history": round(history, 1),
        "hr@10": round(base_hr, 4),
        "ndcg@10": round(base_ndcg, 4),
        "max_work_share": round(share, 4),
        "thresholds": rows,
        "heads": heads,
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "bench_generate")
    parser.add_argument(
        "--data-path", default=str(smoke.ML_100K), help="MovieLens-100K (default: $GR_ML100K_DIR or data/ml-100k)"
    )
    parser.add_argument("--datasets", nargs="+", default=["ml100k", "long"], choices=list(DATASETS))
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    args, _ = smoke.parse_args(parser, SMOKE, argv)
    torch.set_num_threads(1)
    scratch = tempfile.TemporaryDirectory()
    runs_dir = args.runs_dir if args.runs_dir is not None else Path(scratch.name)
    results = {}
    for name in args.datasets:
        config, target_args, _ = DATASETS[name]
        export = ensure_export(runs_dir, f"{name}_target", config, target_args, args.data_path)
        results[name] = measure(name, export, runs_dir / f"{name}_target", args.data_path, args.users, args.thresholds)
        r = results[name]
        print(
            f"# {name}: {r['users']} users, history {r['mean_history']}, HR@10 {r['hr@10']}, NDCG@10 "
            f"{r['ndcg@10']}; U + W2 columns are {100 * r['max_work_share']:.1f}% of a decode step",
            flush=True,
        )
        for row in r["thresholds"]:
            print(
                f"{name} |U|<{row['threshold']:<5} gated {row['gated_mean']:.3f} (p10 {row['gated_p10']:.3f}, "
                f"p90 {row['gated_p90']:.3f})  HR@10 {row['hr@10']:.4f} ({100 * (row['hr_rel_change'] or 0):+.1f}%)"
                f"  NDCG@10 {row['ndcg@10']:.4f}  work skipped {100 * row['work_skipped']:.1f}%",
                flush=True,
            )
        for row in r["heads"]:
            print(
                f"{name} head {row['head']}: output norm share {row['output_norm_share']:.3f}, HR@10 without it "
                f"{row['hr@10_without']:.4f}",
                flush=True,
            )
    scratch.cleanup()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
