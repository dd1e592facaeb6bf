"""New users served from their features: the new-user query against global popularity on MovieLens-100K.

    python bench/new_users.py [--seed 0] [--holdout 0.1] [--epochs 30] [--new-user-weight 1.0] [--KEY VALUE ...]
                                      (ML-100K: $GR_ML100K_DIR or data/ml-100k)
    python bench/new_users.py --smoke                          # 1 epoch of 2 steps: checks it runs

The custom project (examples/custom_project/config.yaml: genres per item; age, gender and occupation
per user, read by its DemographicQueryHead; ``task.retrieval.new_user_query`` on, its default for a
head that reads user features) trains on ML-100K less a held-out ``--holdout`` share of its users
(drawn with ``--seed``; every rating of theirs is left out of the training data), for at most
``--epochs`` epochs (early stopping as the config says). Each held-out user's first event (its
earliest rating; the reader's order on ties) is then ranked over the whole catalogue, no item
excluded, from the user's features alone (``gr.commands.evaluate.first_event_ranks``, on the run's
export, as ``gr serve`` answers a new user): by the new-user query and by global popularity (the
training counts, the answer to a new user without features). A first event whose item the training
data never had is left out (the user then counts from its next event); ``unknown_items`` counts
the held-out ratings of such items.

Prints both scorers' HR@10 / NDCG@10, then one JSON line: seed, holdout, held_out_users, users
(held-out users scored), unknown_items, epochs (trained), train_seconds, scorers ({new_user, popularity}: hr@10,
ndcg@10 and each one's standard error, the sample standard deviation over users / sqrt(n)),
paired ({hr@10, ndcg@10}: the mean per-user difference new_user - popularity, its standard error
and their ratio, users where the new-user query scores higher and lower), new_user_over_popularity
(the ratios of the means), targets (the new-user query above popularity by more than one SE of the
paired difference, HR@10 and NDCG@10), cpu, cpu_flags, load_average.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import smoke  # noqa: E402
import torch  # noqa: E402
from _host import cpu, load_average  # noqa: E402
from _stats import paired_difference  # noqa: E402

from gr.commands.evaluate import first_event_ranks  # noqa: E402
from gr.commands.train import parse_overrides  # noqa: E402
from gr.train.config import load_config  # noqa: E402
from gr.train.metrics import target_metrics  # noqa: E402
from gr.train.run import train  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "custom_project" / "config.yaml"
METRICS = ("hr@10", "ndcg@10")
SCORERS = ("new_user", "popularity")


def split_users(source: Path, out: Path, holdout: float, seed: int) -> Tuple[Path, Path, int, int]:
    """Copy ML-100K ``source`` into ``out/train`` (the kept users' ratings) and ``out/held_out`` (the
    held-out users' ratings), each with the whole u.item and u.user -> (train dir, held-out dir,
    held-out users, held-out ratings of items no training rating has)."""
    lines = (source / "u.data").read_text().splitlines(keepends=True)
    users = np.array(sorted({int(line.split("\t", 1)[0]) for line in lines}))
    rng = np.random.default_rng(seed)
    held = set(rng.choice(users, size=max(1, round(holdout * len(users))), replace=False).tolist())
    dirs = []
    for name, keep in (("train", False), ("held_out", True)):
        target = out / name
        target.mkdir(parents=True)
        rows = [line for line in lines if (int(line.split("\t", 1)[0]) in held) == keep]
        (target / "u.data").write_text("".join(rows))
        for side in ("u.item", "u.user"):
            (target / side).write_bytes((source / side).read_bytes())
        dirs.append(target)
    item = [line.split("\t", 2)[1] for line in lines]
    trained = {i for line, i in zip(lines, item) if int(line.split("\t", 1)[0]) not in held}
    unknown = sum(1 for line, i in zip(lines, item) if int(line.split("\t", 1)[0]) in held and i not in trained)
    return dirs[0], dirs[1], len(held), unknown


def first_event_metrics(ranks: Dict[str, np.ndarray]) -> Dict[str, Any]:
    """``first_event_ranks``' ranks -> {users (scored), scorers ({new_user, popularity}: hr@10,
    ndcg@10, se_<metric>), paired ({metric: new_user - popularity}), new_user_over_popularity,
    targets} (the module docstring)."""
    users = len(ranks["user"])
    values = {s: target_metrics(torch.from_numpy(ranks[s]), [10]) for s in SCORERS}
    per_user = {s: {m: values[s][m].numpy() for m in METRICS} for s in SCORERS}
    scorers = {
        s: {
            **{m: float(per_user[s][m].mean()) for m in METRICS},
            **{f"se_{m}": float(per_user[s][m].std(ddof=1) / math.sqrt(users)) for m in METRICS},
        }
        for s in SCORERS
    }
    pairs = {m: paired_difference(per_user["new_user"][m], per_user["popularity"][m]) for m in METRICS}
    return {
        "users": users,
        "scorers": scorers,
        "paired": pairs,
        "new_user_over_popularity": {
            m: scorers["new_user"][m] / scorers["popularity"][m] if scorers["popularity"][m] else float("nan")
            for m in METRICS
        },
        "targets": {f"new_user_above_popularity_by_more_than_one_se_{m}": pairs[m]["in_se"] > 1.0 for m in METRICS},
    }


def print_first_event_metrics(measured: Dict[str, Any]) -> None:
    """Each scorer's HR@10 / NDCG@10 and the paired differences of ``first_event_metrics``."""
    for s in SCORERS:
        scorer = measured["scorers"][s]
        line = ", ".join(f"{m} {scorer[m]:.4f} (SE {scorer[f'se_{m}']:.4f})" for m in METRICS)
        print(f"{s}: {line} over {measured['users']} held-out users' first events")
    for m, d in measured["paired"].items():
        print(f"paired {m} new_user - popularity: {d['mean']:+.4f} (SE {d['se']:.4f}, {d['in_se']:+.2f} SE)")


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="draws the held-out users and seeds training")
    parser.add_argument("--holdout", type=float, default=0.1, help="the share of users held out of training")
    parser.add_argument("--epochs", type=int, default=30, help="trainer.max_epochs")
    parser.add_argument("--new-user-weight", type=float, default=1.0, help="task.retrieval.new_user_weight")
    args, rest = smoke.parse_args(parser, {"epochs": 1}, argv, known=True)
    overrides: List[Tuple[str, str]] = [
        ("trainer.enable_progress_bar", "false"),
        ("trainer.max_epochs", str(args.epochs)),
        ("trainer.seed", str(args.seed)),
        ("data.seed", str(args.seed)),
        ("task.retrieval.new_user_weight", str(args.new_user_weight)),
    ]
    if args.smoke:
        overrides += smoke.ML_100K_SMOKE_TRAINING
    overrides += parse_overrides(parser, rest)
    start_load = load_average()
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        train_dir, held_dir, held, unknown = split_users(smoke.ML_100K, root / "data", args.holdout, args.seed)
        config = load_config(RECIPE, [*overrides, ("data.path", str(train_dir))])
        started = time.perf_counter()
        metrics = train(config, root / "run")
        train_seconds = time.perf_counter() - started
        held_out = load_config(RECIPE, [*overrides, ("data.path", str(held_dir))]).data
        ranks = first_event_ranks(root / "run", held_out)
    measured = first_event_metrics(ranks)
    model, flags = cpu()
    summary = {
        "bench": "new_users",
        "seed": args.seed,
        "holdout": args.holdout,
        "held_out_users": held,
        "users": measured["users"],
        "unknown_items": unknown,
        "epochs": metrics["epochs"],
        "train_seconds": train_seconds,
        **{k: v for k, v in measured.items() if k != "users"},
        "cpu": model,
        "cpu_flags": flags,
        "load_average": {"start": start_load, "end": load_average()},
    }
    print_first_event_metrics(measured)
    print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
