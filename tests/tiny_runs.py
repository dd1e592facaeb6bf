"""A tiny retrieval recipe on synthetic data, and readers of a run's logged losses (shared by
the FSDP and mixed-precision tests)."""
import copy
import csv
from pathlib import Path
from typing import Any, Dict, List

from gr.train.config import TrainConfig, apply_override
from test_train_run import RETRIEVAL


def _with(values: Dict[str, Any], *overrides) -> Dict[str, Any]:
    values = copy.deepcopy(values)
    for dotted, value in overrides:
        apply_override(values, dotted, value)
    return values


# test_train_run's recipe with two layers of two heads, a few more users and two epochs.
RECIPE: Dict[str, Any] = _with(RETRIEVAL, ("model.hstu.num_layers", 2), ("model.hstu.num_heads", 2),
                               ("data.synthetic.num_users", 160), ("trainer.max_epochs", 2))


def recipe(*overrides) -> Dict[str, Any]:
    """RECIPE with (dotted.key, value) overrides, checked to be a valid TrainConfig."""
    values = _with(RECIPE, *overrides)
    TrainConfig.from_dict(copy.deepcopy(values))
    return values


def step_losses(run_dir: Path) -> List[float]:
    """Logged train/loss per step (rank 0's), from the run's metrics.csv."""
    with open(Path(run_dir) / "logs" / "metrics.csv") as handle:
        return [float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")]


def epoch_losses(run_dir: Path) -> List[float]:
    """Mean logged train/loss per epoch (rank 0's), from the run's metrics.csv."""
    per_epoch: Dict[int, List[float]] = {}
    with open(Path(run_dir) / "logs" / "metrics.csv") as handle:
        for row in csv.DictReader(handle):
            if row.get("train/loss"):
                per_epoch.setdefault(int(row["epoch"]), []).append(float(row["train/loss"]))
    return [sum(v) / len(v) for _, v in sorted(per_epoch.items())]
