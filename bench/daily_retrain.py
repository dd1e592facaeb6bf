"""A daily retrain on MovieLens-100K's real timestamps: warm start from yesterday's run against a cold run.

    python bench/daily_retrain.py [--seeds 0 1 2] [--warm-epochs 10] [--replay-from 80] [--data.path DIR]
                                      (ML-100K: $GR_ML100K_DIR or data/ml-100k)
    python bench/daily_retrain.py --smoke                              # 1 seed, 2 steps a run: checks it runs

Day 0 = the events before the 80th percentile of all timestamps (p80), day 1 = those in [p80, p90),
the test = the last 10%. Every run reads the whole file with ``data.split: time`` and
``data.test_events: all``, so the three are scored on the same targets: every event at or after
p90 of a user with history before p90, except the user's first (its validation target), each with
every earlier event as history; a user's targets are averaged first, so each user counts once:
  (a) cold: the recipe (configs/ml100k_hstu.yaml) from scratch on day 0 + day 1 (split_time p90);
  (b) warm: ``--init-from`` the day-0 run (c), trained on day 1 only (train_start p80, split_time p90)
      for ``--warm-epochs`` epochs without validation, its last checkpoint tested (the validation
      target, each user's first event after p90, is 90 users: too few to pick an epoch by);
      ``--replay-from P`` (P < 80) also replays day 0's events from its P-th time percentile on
      (train_start pP; 0: all of day 0), a variant outside the targets' definition of (b);
  (c) day 0: the recipe on day 0 (split_time p80), its best checkpoint tested with split_time p90
      (``gr evaluate`` RUN).
Reading the whole file, run (c)'s id maps know day 1's new items; their rows stay at their
initialisation, as a warm start's new rows would (tests/test_warm_start.py covers maps that grow).

Prints each run, then one JSON line: seeds, warm_epochs, replay_from, cuts, test_users, test_targets, per run
the mean test hr@10/ndcg@10 and wall seconds of training (a, b), se_hr10 (sqrt(p (1 - p) / n) of
(a)'s mean over the n test users: a bound on the standard error of a mean of n per-user hit rates),
warm_minus_cold_in_se, warm_minus_day0_in_se, warm_time_over_cold, targets (b within one SE of (a)
or better; (b) in at most a third of (a)'s time; (b) above (c) by more than one SE), paired, cpu,
load_average. ``paired`` compares runs user by user (``gr evaluate --per-user``): each user's
HR@10 averaged over the seeds, then per pair of runs the mean difference over the test users, its
standard error (the differences' sample standard deviation / sqrt(n)) and their ratio, and how
many users each run scores higher; ``se_hr10_per_user``: the sample standard error of (a)'s mean.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import smoke  # noqa: E402
from memory import cpu, load_average  # noqa: E402

from gr.commands.evaluate import evaluate_run  # noqa: E402
from gr.commands.train import parse_overrides  # noqa: E402
from gr.data.readers import read_source  # noqa: E402
from gr.train.config import load_config  # noqa: E402
from gr.train.run import train  # noqa: E402

RECIPE = "configs/ml100k_hstu.yaml"
METRICS = ("hr@10", "ndcg@10")
RUNS = ("cold", "warm", "day0")
PAIRS = (("warm", "day0"), ("warm", "cold"), ("cold", "day0"))


def user_hits(path: Path) -> Dict[str, float]:
    """{raw user id: HR@10} of a ``gr evaluate --per-user`` CSV."""
    with path.open(newline="") as f:
        return {row["user"]: float(row["hr@10"]) for row in csv.DictReader(f)}


def paired(hits: Dict[str, List[Dict[str, float]]]) -> Tuple[Dict[str, Any], float]:
    """hits: {run: [per seed {user: HR@10}]} -> ({"a_minus_b": mean difference, its standard error,
    their ratio, users a scores higher / lower}, the sample standard error of the cold run's mean),
    each user's HR@10 averaged over the seeds first."""
    users = sorted(hits["cold"][0])
    if any(sorted(seed) != users for runs in hits.values() for seed in runs):
        raise RuntimeError("daily_retrain: the runs were not scored on the same test users")
    mean = {run: np.mean([[seed[u] for u in users] for seed in seeds], axis=0) for run, seeds in hits.items()}
    out: Dict[str, Any] = {}
    for a, b in PAIRS:
        diff = mean[a] - mean[b]
        se = float(np.std(diff, ddof=1) / math.sqrt(len(users)))
        out[f"{a}_minus_{b}"] = {
            "mean": float(diff.mean()),
            "se": se,
            "in_se": float(diff.mean() / se) if se > 0 else 0.0,
            "users_higher": int((diff > 0).sum()),
            "users_lower": int((diff < 0).sum()),
        }
    return out, float(np.std(mean["cold"], ddof=1) / math.sqrt(len(users)))


def cuts(config_path: str, overrides: Sequence[Tuple[str, str]], replay_from: int) -> Dict[str, int]:
    """{"p80", "p90", "p<replay_from>"}: those percentiles of the source's timestamps (seconds)."""
    timestamps = read_source(load_config(config_path, overrides).data).timestamps
    return {f"p{q}": int(np.percentile(timestamps, q)) for q in sorted({replay_from, 80, 90})}


def run(
    out: Path, overrides: Sequence[Tuple[str, str]], extra: Sequence[Tuple[str, Any]], init_from: Path | None = None
) -> Tuple[Dict[str, Any], float]:
    """Train the recipe with ``overrides`` + ``extra`` into ``out`` -> (metrics.json, wall seconds)."""
    more = [(k, str(v)) for k, v in extra] + ([("trainer.init_from", str(init_from))] if init_from else [])
    config = load_config(RECIPE, [*overrides, *more])
    start = time.perf_counter()
    metrics = train(config, out)
    return metrics, time.perf_counter() - start


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warm-epochs", type=int, default=10, help="the warm run's epochs on day 1")
    parser.add_argument(
        "--replay-from",
        type=int,
        default=80,
        choices=range(81),
        metavar="0..80",
        help="the warm run trains on events from this time percentile on (default 80: day 1 only)",
    )
    args, rest = smoke.parse_args(parser, {"seeds": [0], "warm_epochs": 1}, argv, known=True)
    overrides = [("data.path", str(smoke.ML_100K)), ("trainer.enable_progress_bar", "false")]
    if args.smoke:
        overrides += [
            ("trainer.max_epochs", "1"),
            ("trainer.limit_train_batches", "2"),
            ("data.max_seq_len", "50"),
            ("model.hstu.max_seq_len", "50"),
        ]
    overrides += parse_overrides(parser, rest)
    at = cuts(RECIPE, overrides, args.replay_from)
    time_split = [("data.split", "time"), ("data.test_events", "all")]
    results: Dict[str, List[Dict[str, Any]]] = {name: [] for name in RUNS}
    hits: Dict[str, List[Dict[str, float]]] = {name: [] for name in RUNS}
    start_load = load_average()
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        for seed in args.seeds:
            seeded = [*overrides, ("trainer.seed", str(seed)), ("data.seed", str(seed))]
            day0, _ = run(root / f"day0-{seed}", seeded, [*time_split, ("data.split_time", at["p80"])])
            tested = evaluate_run(
                root / f"day0-{seed}",
                [("data.split_time", str(at["p90"])), *time_split[1:]],
                per_user=root / f"day0-{seed}.csv",
            )
            counts = {f"test_{k}": tested["data"][f"evaluated_{k}"]["test"] for k in ("users", "targets")}
            results["day0"].append({**{m: tested[m] for m in METRICS}, **counts})
            cold, cold_s = run(root / f"cold-{seed}", seeded, [*time_split, ("data.split_time", at["p90"])])
            warm, warm_s = run(
                root / f"warm-{seed}",
                seeded,
                [
                    *time_split,
                    ("data.split_time", at["p90"]),
                    ("data.train_start", at[f"p{args.replay_from}"]),
                    ("trainer.max_epochs", args.warm_epochs),
                    ("trainer.check_val_every_n_epoch", args.warm_epochs + 1),  # never: the last is tested
                    ("trainer.early_stopping_patience", 0),
                ],
                init_from=root / f"day0-{seed}",
            )
            for name, metrics in (("cold", cold), ("warm", warm), ("day0", tested)):
                if name != "day0":  # the run's own test again, now per user
                    evaluate_run(root / f"{name}-{seed}", per_user=root / f"{name}-{seed}.csv")
                hits[name].append(user_hits(root / f"{name}-{seed}.csv"))
                if not math.isclose(np.mean(list(hits[name][-1].values())), metrics["hr@10"], abs_tol=1e-9):
                    raise RuntimeError(f"daily_retrain: {name}'s per-user HR@10 does not average to its test HR@10")
            for name, metrics, seconds in (("cold", cold, cold_s), ("warm", warm, warm_s)):
                results[name].append(
                    {**{m: metrics[m] for m in METRICS}, "seconds": seconds, "epochs": metrics["epochs"]}
                )
            print(
                f"seed {seed}: hr@10 cold {cold['hr@10']:.4f} ({cold_s:.1f} s, {cold['epochs']} epochs), warm "
                f"{warm['hr@10']:.4f} ({warm_s:.1f} s, {warm['epochs']} epochs), day 0 {tested['hr@10']:.4f}",
                flush=True,
            )
            test_users = cold["data"]["evaluated_users"]["test"]
            test_targets = cold["data"]["evaluated_targets"]["test"]
    means = {name: {k: float(np.mean([r[k] for r in rows])) for k in rows[0]} for name, rows in results.items()}
    p = means["cold"]["hr@10"]
    se = math.sqrt(p * (1 - p) / test_users)
    warm_vs_cold = (means["warm"]["hr@10"] - p) / se
    warm_vs_day0 = (means["warm"]["hr@10"] - means["day0"]["hr@10"]) / se
    time_ratio = means["warm"]["seconds"] / means["cold"]["seconds"]
    pairs, se_per_user = paired(hits)
    model, flags = cpu()
    summary = {
        "bench": "daily_retrain",
        "seeds": args.seeds,
        "warm_epochs": args.warm_epochs,
        "replay_from": args.replay_from,
        "cuts": at,
        "test_users": test_users,
        "test_targets": test_targets,
        "runs": means,
        "se_hr10": se,
        "warm_minus_cold_in_se": warm_vs_cold,
        "warm_minus_day0_in_se": warm_vs_day0,
        "warm_time_over_cold": time_ratio,
        "se_hr10_per_user": se_per_user,
        "paired": pairs,
        "targets": {
            "warm_within_one_se_of_cold_or_better": warm_vs_cold >= -1.0,
            "warm_at_most_a_third_of_cold_time": time_ratio <= 1 / 3,
            "warm_above_day0_by_more_than_one_se": warm_vs_day0 > 1.0,
        },
        "cpu": model,
        "cpu_flags": flags,
        "load_average": {"start": start_load, "end": load_average()},
    }
    print(
        f"mean hr@10: cold {p:.4f}, warm {means['warm']['hr@10']:.4f}, day 0 {means['day0']['hr@10']:.4f} "
        f"(SE {se:.4f}); warm/cold time {time_ratio:.2f}"
    )
    for pair, d in pairs.items():
        print(
            f"paired {pair.replace('_', ' ')}: {d['mean']:+.4f} (SE {d['se']:.4f}, {d['in_se']:+.2f} SE; "
            f"higher for {d['users_higher']} users, lower for {d['users_lower']})"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
