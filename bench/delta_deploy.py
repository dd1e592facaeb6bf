"""Incremental deployment: a delta export and its apply to a running service, against a full export
and a full reload, measured in one run.

    python bench/delta_deploy.py [--rows 10000000] [--dim 8] [--touched 0.01] [--data.path DIR]
    python bench/delta_deploy.py --smoke          # tiny sizes, 2 training steps a run: checks it runs

Two cases, each a day 0 export and the next day's model:
  ml100k: MovieLens-100K's real timestamps (ML-100K: $GR_ML100K_DIR or data/ml-100k): day 0 = the
      recipe (configs/ml100k_hstu.yaml, ``--epochs`` epochs) on the events before the 80th time
      percentile; day 1 = a warm start from it (``gr train --init-from``) on the events up to the
      90th, which grows the item vocabulary; both exported with ``gr export`` (``export_run``).
  synthetic: a ranking model whose item table has ``--rows`` rows of ``--dim`` (not trained: at
      10M rows training here is too slow, so day 0 is the seeded model, and day 1 is it with
      ``--touched`` of the item rows, drawn at random, and every dense weight changed, as a day's
      training would), exported with ``export_model``.
For each: full export bytes and seconds of day 1, its delta export (``--base`` day 0) bytes and
seconds, a full reload of day 1 on a service serving day 0 (``Ranker.reload``, warm-up included)
against the delta's apply, both without traffic, then the apply again while ``--clients`` client
threads rank (its seconds: apply_under_clients_s): answers that match neither day 0's scores nor
day 1's (atol 1e-5) are counted as mixing versions. A delta export
writes (and checks) the full export first and then compares every table with the base's, so its
time is above the full export's; the delta's win is its size and its apply.

Last line: one JSON object: bench, cpu, flags, load_average (start, end), and per case rows, dim,
touched_rows, full_bytes, delta_bytes, delta_over_full_bytes, full_export_s, delta_export_s,
delta_over_full_export_time, full_reload_s, apply_s, full_reload_over_apply, apply_under_clients_s,
answers, answers_of_each_version, mixed_answers;
targets (synthetic): delta <= 5% of the full export's bytes, apply >= 5x faster than a full reload.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import smoke  # noqa: E402
import torch  # noqa: E402
from _host import cpu, load_average  # noqa: E402
from daily_retrain import NEVER, cuts, run  # noqa: E402

from gr import GRModel, HSTUConfig, TableConfig  # noqa: E402
from gr.export.writer import export_model, export_run  # noqa: E402
from gr.postfix_dnn import MMoERankingHead  # noqa: E402
from gr.prefix_dnn import MLPTokenEncoder  # noqa: E402
from gr.serving import Ranker  # noqa: E402
from gr.serving.request import RankRequest  # noqa: E402
from gr.sparse.tables import sparse_backend  # noqa: E402

RECIPE = "configs/ml100k_hstu.yaml"
ATOL = 1e-5


def size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def timed(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def deploy(day0: Path, full: Path, delta: Path, requests: List[RankRequest], clients: int) -> Dict[str, Any]:
    """Reload ``full`` on a service of ``day0`` and apply ``delta`` to another, both without traffic,
    then apply ``delta`` to a third under ``clients`` client threads -> seconds of each and the
    answers that mix versions."""
    reloaded = Ranker.load(day0)
    want = {0: [reloaded.rank(r).scores for r in requests]}
    full_reload_s = timed(lambda: reloaded.reload(full))
    want[1] = [reloaded.rank(r).scores for r in requests]
    quiet = Ranker.load(day0)
    apply_s = timed(lambda: quiet.reload(delta))  # as the full reload: no traffic
    ranker = Ranker.load(day0)
    applied, answers = threading.Event(), []

    def client(number: int) -> None:
        after = 0
        for turn in range(10**9):
            asked_after = applied.is_set()
            i = (number + turn) % len(requests)
            result = ranker.rank(requests[i])
            answers.append((result.model_version, i, result.scores))
            after += asked_after
            if after == 3:
                return

    with ThreadPoolExecutor(clients) as pool:
        running = [pool.submit(client, n) for n in range(clients)]
        apply_under_clients_s = timed(lambda: ranker.reload(delta))
        applied.set()
        for done in running:
            done.result()
    mixed = sum(
        not all(np.allclose(scores[k], want[version][i][k], rtol=0, atol=ATOL) for k in scores)
        for version, i, scores in answers
    )
    return {
        "full_reload_s": round(full_reload_s, 3),
        "apply_s": round(apply_s, 3),
        "full_reload_over_apply": round(full_reload_s / apply_s, 2),
        "apply_under_clients_s": round(apply_under_clients_s, 3),
        "answers": len(answers),
        "answers_of_each_version": [sum(v == k for v, _, _ in answers) for k in (0, 1)],
        "mixed_answers": mixed,
    }


def report(full: Path, delta: Path, full_s: float, delta_s: float) -> Dict[str, Any]:
    summary = json.loads((delta / "delta.json").read_text())
    return {
        "touched_rows": {name: t["changed"] for name, t in summary["tables"].items()},
        "full_bytes": size(full),
        "delta_bytes": size(delta),
        "delta_over_full_bytes": round(size(delta) / size(full), 5),
        "full_export_s": round(full_s, 2),
        "delta_export_s": round(delta_s, 2),
        "delta_over_full_export_time": round(delta_s / full_s, 2),
    }


def ml100k(root: Path, args: argparse.Namespace) -> Dict[str, Any]:
    overrides = [("data.path", str(smoke.ML_100K)), ("trainer.enable_progress_bar", "false")]
    overrides += [("trainer.max_epochs", str(args.epochs))]
    if args.smoke:
        overrides += smoke.ML_100K_SMOKE_TRAINING
    at = cuts(RECIPE, overrides, [80, 90])
    split = [("data.split", "time"), ("data.test_events", "all")]
    run(root / "day0", overrides, [*split, ("data.split_time", at["p80"])])
    day1 = [*split, ("data.split_time", at["p90"]), ("data.train_start", at["p80"])]
    run(root / "day1", overrides, [*day1, ("trainer.check_val_every_n_epoch", NEVER)], init_from=root / "day0")
    export_run(root / "day0", root / "e0")
    full_s = timed(lambda: export_run(root / "day1", root / "e1"))
    delta_s = timed(lambda: export_run(root / "day1", root / "d1", base=root / "e0"))
    served = Ranker.load(root / "e0").model
    items = served.sparse.rows("item_id")
    requests = [
        RankRequest(
            f"u{u}",
            {"item_id": [1 + (u * 7 + j) % (items - 1) for j in range(20)], "timestamps": list(range(20))},
            {"item_id": [1 + (u + j) % (items - 1) for j in range(10)]},
        )
        for u in range(8)
    ]
    return {
        **report(root / "e1", root / "d1", full_s, delta_s),
        **deploy(root / "e0", root / "e1", root / "d1", requests, args.clients),
    }


def ranking_model(rows: int, dim: int) -> GRModel:
    with sparse_backend("torch"), torch.device("cpu"):
        cfg = HSTUConfig(hidden_dim=16, num_layers=2, num_heads=2, attention_dim=8, linear_dim=8, max_seq_len=64)
        head = MMoERankingHead(16, ["click"], num_experts=2, expert_dims=(16,), tower_dims=(8,))
        return GRModel(
            cfg, MLPTokenEncoder({"item_id": dim}, 16), head, [TableConfig("item", rows, dim, ("item_id",))]
        ).eval()


def synthetic(root: Path, args: argparse.Namespace) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = ranking_model(args.rows, args.dim)
    export_model(model, root / "s0")
    touched = np.random.default_rng(0).choice(args.rows, int(args.rows * args.touched), replace=False)
    with torch.no_grad():
        (weight,) = model.embeddings.parameters()
        weight[torch.from_numpy(touched)] += 0.1
        for name, p in model.named_parameters():
            if not name.startswith("embeddings."):
                p.add_(0.01 * torch.randn_like(p))
    full_s = timed(lambda: export_model(model, root / "s1"))
    delta_s = timed(lambda: export_model(model, root / "sd", base=root / "s0"))
    rng = np.random.default_rng(1)
    requests = [
        RankRequest(
            f"u{u}",
            {"item_id": rng.integers(0, args.rows, 30).tolist(), "timestamps": list(range(30))},
            {"item_id": np.concatenate([touched[u * 5 : u * 5 + 5], rng.integers(0, args.rows, 5)]).tolist()},
        )
        for u in range(8)
    ]
    return {
        "rows": args.rows,
        "dim": args.dim,
        **report(root / "s1", root / "sd", full_s, delta_s),
        **deploy(root / "s0", root / "s1", root / "sd", requests, args.clients),
    }


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="the synthetic item table's rows")
    parser.add_argument("--dim", type=int, default=8, help="the synthetic item table's dim")
    parser.add_argument("--touched", type=float, default=0.01, help="the fraction of synthetic rows day 1 changes")
    parser.add_argument("--epochs", type=int, default=1, help="epochs of each ML-100K run")
    parser.add_argument("--clients", type=int, default=16, help="client threads ranking during the apply")
    parser.add_argument("--cases", nargs="+", choices=("ml100k", "synthetic"), default=["ml100k", "synthetic"])
    args, _ = smoke.parse_args(parser, {"rows": 20_000}, argv)
    model, flags = cpu()
    summary: Dict[str, Any] = {
        "bench": "delta_deploy",
        "cpu": model,
        "flags": flags,
        "load_average": {"start": load_average()},
    }
    with tempfile.TemporaryDirectory() as work:
        for case in args.cases:
            root = Path(work) / case
            root.mkdir()
            summary[case] = (ml100k if case == "ml100k" else synthetic)(root, args)
            print(case, json.dumps(summary[case]), flush=True)
    summary["load_average"]["end"] = load_average()
    if "synthetic" in summary:
        s = summary["synthetic"]
        summary["targets"] = {
            "delta_at_most_5pct_of_full_bytes": s["delta_over_full_bytes"] <= 0.05,
            "apply_at_least_5x_faster_than_full_reload": s["full_reload_over_apply"] >= 5,
            "no_mixed_answers": s["mixed_answers"] == 0,
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
