"""kill -9 at each checkpoint phase, then ``--resume``: the run ends exactly like an
uninterrupted one and exports.

The crash comes from the ``GR_TEST_CRASH_AT`` hook (``gr.utils.crash_points``: ``os._exit``, no
cleanup) in a ``train.py`` process of its own (a child of a warm interpreter, ``helpers.warm``);
the resume runs in this process. The tiny recipe validates every epoch, so each epoch saves
``epoch=N`` (the best) and then ``last``: the 4th arrival at a save point is epoch 1's save of
``last``, right after the best checkpoint moved from ``epoch=0`` to ``epoch=1``, and the 1st
``replace_directory`` with something to replace is epoch 1's ``last`` too.
"""

import csv
import os
import re
import time
from pathlib import Path
from typing import Any, Dict

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gr.export import export_run
from gr.train import train
from gr.train.checkpoint import logged_steps, read_meta
from gr.train.config import TrainConfig
from gr.utils.crash_points import CRASH_EXIT_STATUS
from helpers.runs import recipe
from helpers.warm import WarmPython

ROOT = Path(__file__).resolve().parents[1]
RECIPE = recipe(("trainer.max_epochs", 3))
RESULT_KEYS = ("hr@5", "ndcg@5", "hr@10", "ndcg@10", "mrr", "best_val", "best_checkpoint", "epochs")

CRASHES = {
    "before_save": "checkpoint_before_save:4",
    "mid_save": "checkpoint_mid_save:4",
    "mid_rename": "replace_directory_mid_rename:1",
    "after_save": "checkpoint_after_save:4",
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return train(TrainConfig.from_dict(RECIPE), tmp_path_factory.mktemp("uninterrupted"))


def crash_run(warm_python: WarmPython, run_dir: Path, crash_at: str, values: Dict[str, Any] = RECIPE) -> None:
    """train.py on ``values`` (a recipe) in a process of its own that the hook kills at ``crash_at``."""
    config = run_dir.parent / f"{run_dir.name}.yaml"
    config.write_text(yaml.safe_dump(values))
    # Not this process's process-group address: Lightning left it in os.environ, and its port is taken.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update({"GR_TEST_CRASH_AT": crash_at, "PYTHONPATH": str(ROOT)})
    argv = [str(ROOT / "train.py"), "--config", str(config), "--out", str(run_dir)]
    done = warm_python.run(argv, cwd=Path.cwd(), env=env, timeout=300)
    assert done.returncode == CRASH_EXIT_STATUS, done.stderr[-3000:]


@pytest.mark.parametrize("phase", sorted(CRASHES))
def test_crash_at_checkpoint_phase_then_resume_ends_like_an_uninterrupted_run_and_exports(
    phase, uninterrupted, tmp_path, warm_python
):
    run_dir = tmp_path / "run"
    crash_run(warm_python, run_dir, CRASHES[phase])
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    if phase == "mid_rename":
        assert "last" not in checkpoints and {"last.old", "last.tmp"} <= set(checkpoints)
    export_run(run_dir, tmp_path / "export_after_crash")  # the crashed run exports as it is (read only)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints
    resumed = train(TrainConfig.from_dict(RECIPE), run_dir, resume=True)
    for key in RESULT_KEYS:
        assert resumed[key] == uninterrupted[key], (phase, key)
    export_run(run_dir, tmp_path / "export")
    assert (tmp_path / "export" / "default" / "slice_graph.ini").is_file()


# Learning too slow to move the validation metric: the best checkpoint stays at epoch 0.
STALLED = recipe(
    ("trainer.max_epochs", 4),
    ("optimizer.lr", 1e-12),
    ("sparse.optimizer.lr", 1e-12),
    ("trainer.enable_progress_bar", True),
)


def logged_train_steps(run_dir: Path) -> list:
    with open(run_dir / "logs" / "metrics.csv", newline="") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss")]


def tensorboard_train_steps(run_dir: Path) -> list:
    """The steps of train/loss as TensorBoard shows them (what a restart purged left out)."""
    events = EventAccumulator(str(run_dir / "logs"))
    events.Reload()
    return [event.step for event in events.Scalars("train/loss")]


def test_a_killed_run_resumes_from_its_newest_epoch_not_its_best_and_logs_each_step_once(tmp_path, capsys, warm_python):
    run_dir = tmp_path / "run"
    # Saves: epoch=0 and last at epoch 0 (arrivals 1-2), then last alone at epochs 1-2 (3-4): the
    # 5th arrival is epoch 3's save of last, killed before it writes anything.
    crash_run(warm_python, run_dir, "checkpoint_before_save:5", STALLED)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["epoch=0", "last"]
    assert read_meta(run_dir / "checkpoints" / "last")["epoch"] == 2
    batches_per_epoch = logged_steps(run_dir / "checkpoints" / "last") // 3
    capsys.readouterr()
    started = time.perf_counter()
    resumed = train(TrainConfig.from_dict(STALLED), run_dir, resume=True)
    took = time.perf_counter() - started
    lines = re.findall(r"^epoch (\d+)/4: .*\(([\d.]+)s\)$", capsys.readouterr().out, flags=re.MULTILINE)
    assert [int(epoch) for epoch, _ in lines] == [4]  # epochs 1-3 are not trained again
    assert all(float(seconds) <= took for _, seconds in lines)  # the downtime is no epoch's time
    assert resumed["epochs"] == 4 and resumed["best_checkpoint"] == "checkpoints/epoch=0"
    assert logged_train_steps(run_dir) == list(range(4 * batches_per_epoch))  # every step once, in order
    assert len(list((run_dir / "logs").glob("events.out.tfevents.*"))) >= 2  # the killed run's file stays
    assert tensorboard_train_steps(run_dir) == logged_train_steps(run_dir)
