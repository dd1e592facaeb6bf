"""A daily retrain on MovieLens-100K's real timestamps: warm starts from yesterday's run against a cold run.

    python bench/daily_retrain.py [--seeds 0 1 2] [--variants SPEC ...] [--cuts 80 90] [--data.path DIR]
                                      (ML-100K: $GR_ML100K_DIR or data/ml-100k)
    python bench/daily_retrain.py --cuts 70 80 90 ...                  # one day earlier: choose levers here
    python bench/daily_retrain.py --smoke                              # 1 seed, 2 steps a run: checks it runs

``--cuts D T [E]`` (time percentiles, default 80 90): day 0 = the events before pD, day 1 = those in
[pD, pT), the test = the events from pT on (up to pE). Every run reads the whole file with
``data.split: time`` and ``data.test_events: all``, so all are scored on the same targets: every
event at or after pT (before pE) of a user with history before pT, except the user's first (its
validation target), each with every earlier event as history; a user's targets are averaged first,
so each user counts once:
  (a) cold: the recipe (configs/ml100k_hstu.yaml) from scratch on day 0 + day 1 (split_time pT);
  (b) warm: ``--init-from`` the day-0 run (c) on day 1 (train_start pD, split_time pT), with the
      warm-start recipe (config ``warm_start``: what ``gr train --init-from`` does by default), its
      last checkpoint tested (nothing validated: an epoch picked on the validation target, each
      user's first event after pT, about 90 events, tests worse: validate=1); and one warm run per variant
      ``--variants SPEC``: ``key=value[,key=value...]`` over the recipe, keys of ``warm_start``
      (replay, max_epochs, lr, warmup_steps, lr_decay, lr_floor, replay_days, validation_days,
      early_stopping_patience, table_optimizer_state, dense_optimizer_state, shrink) or ``replay_from=P``
      (replayed events from the P-th time percentile on: data.replay_start) or ``validate=1``
      (validates every epoch on the cold run's validation target and tests its best checkpoint,
      as the cold run does); a variant with validation_days validates on those last days of day 1
      and its best checkpoint is tested;
      ``--warm-epochs N`` and
      ``--replay-from P`` set those for every warm run;
  (c) day 0: the recipe on day 0 (split_time pD), its best checkpoint tested with split_time pT
      (``gr evaluate`` RUN).
Reading the whole file, run (c)'s id maps know day 1's new items; their rows stay at their
initialisation, as a warm start's new rows would (tests/test_warm_start.py covers maps that grow).

Prints each run, then one JSON line: seeds, variants, cuts, test_users, test_targets, per run the
mean test hr@10/ndcg@10 and the wall and CPU seconds of training (a, b: the process's CPU time,
which other jobs on a shared machine do not stretch), se_hr10 (sqrt(p (1 - p) / n) of
(a)'s mean over the n test users: a bound on the standard error of a mean of n per-user hit rates),
warm_time_over_cold and warm_cpu_time_over_cold, ``paired``: runs compared user by user
(``gr evaluate --per-user``): each user's HR@10 averaged over the seeds, then per pair of runs
(every warm run against the cold run and day 0, each variant against the recipe's warm run, and
the cold run against day 0) the mean difference over the test users, its standard error (the
differences' sample standard deviation / sqrt(n)), their ratio (in_se) and how many users each run
scores higher; ``se_hr10_per_user``: the sample standard error of (a)'s mean;
targets of the recipe's warm run (b): within one paired SE of (a) or better, in at most a third of
(a)'s time (wall, and CPU), above (c) by more than one paired SE; cpu, load_average.
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
from _stats import paired_difference  # noqa: E402
from memory import cpu, load_average  # noqa: E402

from gr.commands.evaluate import evaluate_run  # noqa: E402
from gr.commands.train import parse_overrides  # noqa: E402
from gr.data.readers import read_source  # noqa: E402
from gr.train.config import load_config  # noqa: E402
from gr.train.run import train  # noqa: E402

RECIPE = "configs/ml100k_hstu.yaml"
METRICS = ("hr@10", "ndcg@10")
WARM = "warm"  # the recipe's warm run; a variant's is warm[SPEC]
VARIANT_KEYS = (
    "replay",
    "max_epochs",
    "lr",
    "warmup_steps",
    "lr_decay",
    "lr_floor",
    "replay_days",
    "validation_days",
    "early_stopping_patience",
    "table_optimizer_state",
    "dense_optimizer_state",
    "shrink",
    "replay_from",
    "validate",
)
# One lever moved at a time from the recipe (warm_start's defaults).
VARIANTS = (
    "replay=0",
    "replay=0.5",
    "max_epochs=10",
    "lr=0.0003",
    "warmup_steps=50",
    "table_optimizer_state=reset",
)
NEVER = 10**6  # check_val_every_n_epoch of a warm run: nothing validated, its last checkpoint tested


def user_hits(path: Path) -> Dict[str, float]:
    """{raw user id: HR@10} of a ``gr evaluate --per-user`` CSV."""
    with path.open(newline="") as f:
        return {row["user"]: float(row["hr@10"]) for row in csv.DictReader(f)}


def paired(hits: Dict[str, List[Dict[str, float]]], pairs: Sequence[Tuple[str, str]]) -> Tuple[Dict[str, Any], float]:
    """hits: {run: [per seed {user: HR@10}]} -> ({"a_minus_b" of each of ``pairs``: mean difference,
    its standard error, their ratio (in_se), users a scores higher / lower}, the sample standard
    error of the cold run's mean), each user's HR@10 averaged over the seeds first."""
    users = sorted(hits["cold"][0])
    if any(sorted(seed) != users for runs in hits.values() for seed in runs):
        raise RuntimeError("daily_retrain: the runs were not scored on the same test users")
    mean = {run: np.mean([[seed[u] for u in users] for seed in seeds], axis=0) for run, seeds in hits.items()}
    out: Dict[str, Any] = {}
    for a, b in pairs:
        out[f"{a}_minus_{b}"] = paired_difference(mean[a], mean[b])
    return out, float(np.std(mean["cold"], ddof=1) / math.sqrt(len(users)))


def variant(spec: str) -> Dict[str, str]:
    """``key=value[,key=value...]`` -> {key: value}; argparse's error for an unknown key or no value."""
    values: Dict[str, str] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        if not sep or not value or key not in VARIANT_KEYS:
            raise argparse.ArgumentTypeError(f"{item!r}: expected key=value with a key of {list(VARIANT_KEYS)}")
        values[key] = value
    return values


def cuts(config_path: str, overrides: Sequence[Tuple[str, str]], percentiles: Sequence[int]) -> Dict[str, int]:
    """{"p<q>": that percentile of the source's timestamps (seconds)} for each of ``percentiles``."""
    timestamps = read_source(load_config(config_path, overrides).data).timestamps
    return {f"p{q}": int(np.percentile(timestamps, q)) for q in sorted(set(percentiles))}


def run(
    out: Path, overrides: Sequence[Tuple[str, str]], extra: Sequence[Tuple[str, Any]], init_from: Path | None = None
) -> Tuple[Dict[str, Any], float, float]:
    """Train the recipe with ``overrides`` + ``extra`` into ``out`` -> (metrics.json, wall seconds, CPU seconds)."""
    more = [(k, str(v)) for k, v in extra] + ([("trainer.init_from", str(init_from))] if init_from else [])
    config = load_config(RECIPE, [*overrides, *more])
    start, cpu_start = time.perf_counter(), time.process_time()
    metrics = train(config, out)
    return metrics, time.perf_counter() - start, time.process_time() - cpu_start


def warm_overrides(spec: Dict[str, str], at: Dict[str, int]) -> List[Tuple[str, Any]]:
    """A variant's overrides: its warm_start keys, replay_from as data.replay_start (none when it replays nothing)."""
    extra: List[Tuple[str, Any]] = []
    for key, value in spec.items():
        if key == "validate":
            continue  # the run's validation: main
        if key == "replay_from":
            if float(spec.get("replay", 1)) > 0:
                extra.append(("data.replay_start", at[f"p{value}"]))
        else:
            extra.append((f"warm_start.{key}", value))
    return extra


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--variants",
        type=variant,
        nargs="*",
        default=[variant(v) for v in VARIANTS],
        metavar="SPEC",
        help=f"warm runs next to the recipe's, each key=value[,...] over it (default: {' '.join(VARIANTS)})",
    )
    parser.add_argument("--warm-epochs", type=int, help="every warm run's epochs (warm_start.max_epochs)")
    parser.add_argument(
        "--replay-from",
        type=int,
        choices=range(81),
        metavar="0..80",
        help="every warm run replays day 0's events from this time percentile on (data.replay_start)",
    )
    parser.add_argument(
        "--cuts", type=int, nargs="+", default=[80, 90], metavar="P", help="day 1's start, the test's start [and end]"
    )
    smoke_defaults = {"seeds": [0], "warm_epochs": 1, "variants": [variant("replay=0")]}
    args, rest = smoke.parse_args(parser, smoke_defaults, argv, known=True)
    if len(args.cuts) not in (2, 3) or sorted(set(args.cuts)) != args.cuts or not 0 < args.cuts[0]:
        parser.error(f"--cuts: expected 2 or 3 increasing percentiles above 0, got {args.cuts}")
    overrides = [("data.path", str(smoke.ML_100K)), ("trainer.enable_progress_bar", "false")]
    if args.smoke:
        overrides += [("trainer.max_epochs", "1"), *smoke.ML_100K_SMOKE_TRAINING]
    overrides += parse_overrides(parser, rest)
    shared: Dict[str, str] = {}
    if args.warm_epochs is not None:
        shared["max_epochs"] = str(args.warm_epochs)
    if args.replay_from is not None:
        shared["replay_from"] = str(args.replay_from)
    if args.replay_from is not None and args.replay_from >= args.cuts[0]:
        parser.error(f"--replay-from: expected below day 1's start (--cuts {args.cuts[0]}), got {args.replay_from}")
    warm_runs = {WARM: shared, **{f"{WARM}[{spec_text(v)}]": {**shared, **v} for v in args.variants}}
    percentiles = [*args.cuts, *(int(v["replay_from"]) for v in warm_runs.values() if "replay_from" in v)]
    at = cuts(RECIPE, overrides, percentiles)
    day1, test_start = at[f"p{args.cuts[0]}"], at[f"p{args.cuts[1]}"]
    time_split = [("data.split", "time"), ("data.test_events", "all")]
    if len(args.cuts) == 3:
        time_split.append(("data.split_end", at[f"p{args.cuts[2]}"]))
    tested_split = [("data.split_time", test_start), *time_split]
    names = ("cold", "day0", *warm_runs)
    results: Dict[str, List[Dict[str, Any]]] = {name: [] for name in names}
    hits: Dict[str, List[Dict[str, float]]] = {name: [] for name in names}
    start_load = load_average()
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        for seed in args.seeds:
            seeded = [*overrides, ("trainer.seed", str(seed)), ("data.seed", str(seed))]
            run(root / f"day0-{seed}", seeded, [*time_split, ("data.split_time", day1)])
            tested = evaluate_run(
                root / f"day0-{seed}",
                [(k, str(v)) for k, v in tested_split[:1] + time_split[1:]],
                per_user=root / f"day0-{seed}.csv",
            )
            counts = {f"test_{k}": tested["data"][f"evaluated_{k}"]["test"] for k in ("users", "targets")}
            results["day0"].append({**{m: tested[m] for m in METRICS}, **counts})
            trained = {"cold": run(root / f"cold-{seed}", seeded, tested_split)}
            for i, (name, spec) in enumerate(warm_runs.items()):
                extra = [*tested_split, ("data.train_start", day1)]
                if "validation_days" not in spec and spec.get("validate", "0") == "0":
                    extra.append(("trainer.check_val_every_n_epoch", NEVER))
                trained[name] = run(
                    root / f"warm{i}-{seed}",
                    seeded,
                    [*extra, *warm_overrides(spec, at)],
                    init_from=root / f"day0-{seed}",
                )
            line = [f"seed {seed}: hr@10 day 0 {tested['hr@10']:.4f}"]
            for i, (name, (metrics, seconds, cpu_seconds)) in enumerate(trained.items()):
                directory = root / (f"cold-{seed}" if name == "cold" else f"warm{i - 1}-{seed}")
                evaluate_run(directory, per_user=directory.with_suffix(".csv"))  # the run's own test, per user
                hits[name].append(user_hits(directory.with_suffix(".csv")))
                results[name].append(
                    {**{m: metrics[m] for m in METRICS}, "seconds": seconds, "cpu_seconds": cpu_seconds}
                    | {"epochs": metrics["epochs"]}
                )
                timing = f"{seconds:.1f} s, CPU {cpu_seconds:.1f} s"
                line.append(f"{name} {metrics['hr@10']:.4f} ({timing}, {metrics['epochs']} epochs)")
            hits["day0"].append(user_hits(root / f"day0-{seed}.csv"))
            for name, rows in results.items():
                if not math.isclose(np.mean(list(hits[name][-1].values())), rows[-1]["hr@10"], abs_tol=1e-9):
                    raise RuntimeError(f"daily_retrain: {name}'s per-user HR@10 does not average to its test HR@10")
            print(", ".join(line), flush=True)
            test_users = trained["cold"][0]["data"]["evaluated_users"]["test"]
            test_targets = trained["cold"][0]["data"]["evaluated_targets"]["test"]
    means = {name: {k: float(np.mean([r[k] for r in rows])) for k in rows[0]} for name, rows in results.items()}
    p = means["cold"]["hr@10"]
    pairs_list = [*((w, other) for w in warm_runs for other in ("cold", "day0")), ("cold", "day0")]
    pairs_list += [(w, WARM) for w in warm_runs if w != WARM]
    pairs, se_per_user = paired(hits, pairs_list)
    for name in warm_runs:
        means[name]["time_over_cold"] = means[name]["seconds"] / means["cold"]["seconds"]
        means[name]["cpu_time_over_cold"] = means[name]["cpu_seconds"] / means["cold"]["cpu_seconds"]
    recipe = means[WARM]
    model, flags = cpu()
    summary = {
        "bench": "daily_retrain",
        "seeds": args.seeds,
        "warm_epochs": args.warm_epochs,
        "replay_from": args.replay_from,
        "variants": {name: spec for name, spec in warm_runs.items()},
        "cuts": at,
        "test_users": test_users,
        "test_targets": test_targets,
        "runs": means,
        "se_hr10": math.sqrt(p * (1 - p) / test_users),
        "warm_time_over_cold": recipe["time_over_cold"],
        "warm_cpu_time_over_cold": recipe["cpu_time_over_cold"],
        "se_hr10_per_user": se_per_user,
        "paired": pairs,
        "targets": {
            "warm_within_one_se_of_cold_or_better": pairs[f"{WARM}_minus_cold"]["in_se"] >= -1.0,
            "warm_at_most_a_third_of_cold_time": recipe["time_over_cold"] <= 1 / 3,
            "warm_at_most_a_third_of_cold_cpu_time": recipe["cpu_time_over_cold"] <= 1 / 3,
            "warm_above_day0_by_more_than_one_se": pairs[f"{WARM}_minus_day0"]["in_se"] > 1.0,
        },
        "cpu": model,
        "cpu_flags": flags,
        "load_average": {"start": start_load, "end": load_average()},
    }
    print(f"mean hr@10: cold {p:.4f} ({means['cold']['seconds']:.1f} s), day 0 {means['day0']['hr@10']:.4f}")
    for name in warm_runs:
        vs_cold, vs_day0 = pairs[f"{name}_minus_cold"], pairs[f"{name}_minus_day0"]
        print(
            f"{name}: hr@10 {means[name]['hr@10']:.4f}, time/cold {means[name]['time_over_cold']:.2f} "
            f"(CPU {means[name]['cpu_time_over_cold']:.2f}); "
            f"- cold {vs_cold['mean']:+.4f} (SE {vs_cold['se']:.4f}, {vs_cold['in_se']:+.2f} SE, "
            f"{vs_cold['users_higher']}/{vs_cold['users_lower']} users); - day 0 {vs_day0['mean']:+.4f} "
            f"(SE {vs_day0['se']:.4f}, {vs_day0['in_se']:+.2f} SE, {vs_day0['users_higher']}/{vs_day0['users_lower']})"
        )
    d = pairs["cold_minus_day0"]
    print(f"cold - day 0: {d['mean']:+.4f} (SE {d['se']:.4f}, {d['in_se']:+.2f} SE)")
    print(json.dumps(summary))


def spec_text(spec: Dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in spec.items())


if __name__ == "__main__":
    main()
