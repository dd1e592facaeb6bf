"""Tiny training recipes on synthetic data, and readers of a run (shared by the training, FSDP,
mixed-precision, fault, plan and device tests)."""

import copy
import csv
from pathlib import Path
from typing import Any, Dict, List

import torch

from gr.data.config import SyntheticConfig
from gr.data.datamodule import SequenceDataModule
from gr.data.synthetic import generate_synthetic
from gr.train import load_trained_model
from gr.train.config import TrainConfig, apply_override
from gr.train.tasks import RetrievalTask

# The smallest valid retrieval config (no trainer settings): for config-level tests.
BASE = {
    "data": {
        "source": "synthetic",
        "task": "retrieval",
        "max_seq_len": 20,
        "item_features": False,
        "user_features": False,
    },
    "model": {
        "hstu": {
            "hidden_dim": 16,
            "num_layers": 1,
            "num_heads": 2,
            "attention_dim": 8,
            "linear_dim": 8,
            "max_seq_len": 20,
        },
        "tables": [{"name": "item", "embedding_dim": 16, "features": ["item_id"]}],
    },
}

# A tiny retrieval run on synthetic data that trains in seconds.
RETRIEVAL = {
    "data": {
        "source": "synthetic",
        "task": "retrieval",
        "max_seq_len": 20,
        "batch_size": 32,
        "eval_batch_size": 64,
        "item_features": False,
        "user_features": False,
        "synthetic": {"num_users": 120, "num_items": 100, "min_len": 8, "max_len": 20},
    },
    "model": {
        "hstu": {
            "hidden_dim": 16,
            "num_layers": 1,
            "num_heads": 1,
            "attention_dim": 8,
            "linear_dim": 8,
            "max_seq_len": 20,
            "dropout": 0.1,
            "input_dropout": 0.1,
        },
        "tables": [{"name": "item", "embedding_dim": 16, "features": ["item_id"], "init_std": 0.02}],
    },
    "sparse": {"optimizer": {"type": "rowwise_adagrad", "lr": 0.05}},
    "task": {"retrieval": {"num_negatives": 16, "top_k": [5, 10]}},
    "optimizer": {"lr": 0.005},
    "trainer": {"max_epochs": 3, "enable_progress_bar": False, "log_every_n_steps": 1},
}


# RETRIEVAL's data as a one-task ranking run with item and user side features.
RANKING: Dict[str, Any] = copy.deepcopy(RETRIEVAL)
RANKING["data"].update(
    task="ranking",
    item_features=True,
    user_features=True,
    ranking={
        "positives_per_sample": 2,
        "samples_per_user": 2,
        "num_negatives": 4,
        "eval_num_negatives": 9,
        "tasks": [{"name": "watch"}],
    },
)
RANKING["task"] = {"ranking": {"task_weights": {"watch": 1.0}}}
RANKING["model"]["tables"] += [
    {"name": "category", "embedding_dim": 8, "features": ["item_category"]},
    {"name": "age", "embedding_dim": 4, "features": ["user_age"], "kind": "common"},
    {"name": "gender", "embedding_dim": 4, "features": ["user_gender"], "kind": "common", "pooling": "mean"},
]


def with_overrides(values: Dict[str, Any], *overrides) -> Dict[str, Any]:
    values = copy.deepcopy(values)
    for dotted, value in overrides:
        apply_override(values, dotted, value)
    return values


# RETRIEVAL with two layers of two heads, a few more users and two epochs.
RECIPE: Dict[str, Any] = with_overrides(
    RETRIEVAL,
    ("model.hstu.num_layers", 2),
    ("model.hstu.num_heads", 2),
    ("data.synthetic.num_users", 160),
    ("trainer.max_epochs", 2),
)


def recipe(*overrides) -> Dict[str, Any]:
    """RECIPE with (dotted.key, value) overrides, checked to be a valid TrainConfig."""
    values = with_overrides(RECIPE, *overrides)
    TrainConfig.from_dict(copy.deepcopy(values))
    return values


def ratings_csv(path: Path, copies: int = 1) -> Path:
    """The tiny recipe's synthetic events as a CSV (user_id,item_id,timestamp,rating), every row ``copies`` times."""
    data = generate_synthetic(SyntheticConfig(**recipe()["data"]["synthetic"]), seed=0)
    rows = [f"{u},{i},{t},{r}" for u, i, t, r in zip(data.users, data.items, data.timestamps, data.ratings)]
    path.write_text("user_id,item_id,timestamp,rating\n" + "\n".join(rows * copies) + "\n")
    return path


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


def config(base: Dict[str, Any], *overrides) -> TrainConfig:
    """``base`` with (dotted.key, value) overrides, as a TrainConfig."""
    return TrainConfig.from_dict(with_overrides(base, *overrides))


def evaluate_loaded(run_dir):
    """Test metrics of ``load_trained_model(run_dir)``, computed in this process without sharding."""
    model, cfg = load_trained_model(run_dir)
    assert not model.training and "sampled_item_id" not in model.embeddings.tables["item"].features
    data = SequenceDataModule(cfg.data)
    data.setup()
    task = RetrievalTask(cfg.task.retrieval, data.num_items, model.postfix_dnn.item_embedding)
    task.start_evaluation(model.embeddings)
    with torch.no_grad():
        for batch in data.test_dataloader():
            task.evaluation_step(model(batch), batch)
    return model, task.finish_evaluation()
